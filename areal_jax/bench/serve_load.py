"""serve-load: bursts of concurrent short completions on ``scripts/serve.py``, 200 vs 1,000.

    python -m areal_jax.bench serve-load [--model-path builtin:arith_sft] [--bursts 200,1000]
                                         [--repeats 3] [--route completions] [--peer-repo DIR]

A server is started as a user starts it (``scripts/serve.py --model-path DIR``, its default
slots and decode settings) and warmed up with one small burst. Then each burst size
sends that many requests at once (``max_tokens`` 8, greedy, prompts of the built-in task)
and waits for all of them; bursts are interleaved size by size, ``--repeats`` times. The
figure is the wall time of a burst (median), and its ratio to the smallest burst's: with
N times the requests a server that only queues them should take about N times as long
(5x for 1,000 vs 200), and more means some cost grows faster than the queue.

The client is aiohttp (one session, no connection limit), as the rollout client is; with
``--client httpx`` one ``httpx.AsyncClient`` sends the burst instead, whose connection
pool scans every connection for every request (quadratic in the burst: at 1,000 that
client, not the server, takes most of the time). ``--stream`` sends streamed completions
(server-sent events, read to the final ``[DONE]``). ``--peer-repo DIR`` serves the same
model from another checkout (e.g. the commit before a change) side by side.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.bench.common import REPO, kill_all, repo_file, script_env

WARMUP_BURST = 32


def add_arguments(p) -> None:
    p.add_argument("--model-path", default="builtin:arith_sft",
                   help="a model directory, or builtin:NAME (the demo's packaged checkpoints)")
    p.add_argument("--bursts", default="200,1000", help="comma-separated burst sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed bursts per size (median)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--route", choices=["completions", "generate"], default="completions",
                   help="/v1/completions (OpenAI) or /generate (SGLang's)")
    p.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp")
    p.add_argument("--stream", action="store_true",
                   help="completions as server-sent events (read to the final [DONE])")
    p.add_argument("--peer-repo", default=None, help="another checkout to serve side by side")
    p.add_argument("--serve-args", default="", help="more scripts/serve.py flags, one string")


def _model_dir(spec: str) -> Path:
    if spec.startswith("builtin:"):
        return REPO / "areal_jax" / "data" / "assets" / spec.split(":", 1)[1]
    return Path(spec)


def _start(repo: Path, model: Path, port: int, extra: list[str], log: Path
           ) -> subprocess.Popen:
    cmd = [sys.executable, str(repo_file("scripts/serve.py", repo)), "--model-path", str(model),
           "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=script_env(repo))
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; log {log}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    kill_all([proc])
    raise RuntimeError(f"the server did not become healthy in 600 s; log {log}")


def _request(route: str, i: int, max_tokens: int, stream: bool = False
             ) -> tuple[str, dict[str, Any]]:
    prompt = f"Q:{i % 50}+{i % 7}="
    if route == "completions":
        return "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                   "temperature": 0, "stream": stream}
    return "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens,
                                                             "temperature": 0}}


async def _burst_aiohttp(url: str, n: int, route: str, max_tokens: int, stream: bool
                         ) -> list[float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(i: int) -> float:
            path, body = _request(route, i, max_tokens, stream)
            async with session.post(path, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{path} answered {r.status}: {await r.text()}")
                text = await r.text()
                if stream and not text.rstrip().endswith("data: [DONE]"):
                    raise RuntimeError(f"{path}: the stream ended without [DONE]: {text[-300:]}")
            return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _burst_httpx(url: str, n: int, route: str, max_tokens: int, stream: bool
                       ) -> list[float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> float:
            path, body = _request(route, i, max_tokens, stream)
            r = await client.post(path, json=body)
            r.raise_for_status()
            return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def burst(url: str, n: int, *, route: str = "completions", max_tokens: int = 8,
          client: str = "aiohttp", stream: bool = False) -> dict[str, float]:
    """Sends ``n`` requests at once; the burst's wall time and completion quantiles."""
    fn = _burst_aiohttp if client == "aiohttp" else _burst_httpx
    t0 = time.perf_counter()
    done = sorted(asyncio.run(fn(url, n, route, max_tokens, stream)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "first_s": done[0], "p50_s": done[len(done) // 2],
            "last_s": done[-1]}


def run(args) -> dict:
    from areal_jax.engine.launch import free_port

    sizes = sorted({int(s) for s in args.bursts.split(",") if s.strip()})
    if args.stream and args.route != "completions":
        raise SystemExit("--stream needs --route completions (/generate does not stream here)")
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--bursts needs positive sizes, got {args.bursts!r}")
    model = _model_dir(args.model_path)
    repos = {"this": REPO}
    if args.peer_repo:
        repos["peer"] = Path(args.peer_repo).resolve()
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-load-"))
    urls, procs = {}, []
    try:
        for name, repo in repos.items():
            port = free_port()
            procs.append(_start(repo, model, port, args.serve_args.split(),
                                logs / f"{name}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
            burst(urls[name], WARMUP_BURST, route=args.route, max_tokens=args.max_tokens,
                  client=args.client, stream=args.stream)
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        for rep in range(args.repeats):
            for n in sizes:
                for name, url in urls.items():  # interleaved: this, peer, this, ...
                    m = burst(url, n, route=args.route, max_tokens=args.max_tokens,
                              client=args.client, stream=args.stream)
                    results.setdefault((name, n), []).append(m)
                    print(f"{name} burst {n} #{rep}: " +
                          " ".join(f"{k}={v:.2f}" for k, v in m.items()), flush=True)
    finally:
        kill_all(procs)
    columns = ["checkout", "burst", "wall s (median)", f"x the {sizes[0]}-burst",
               "requests/s", "first done s", "median done s", "bursts"]
    rows, summary = [], {}
    for name in repos:
        base = float(np.median([m["wall_s"] for m in results[(name, sizes[0])]]))
        for n in sizes:
            ms = results[(name, n)]
            wall = float(np.median([m["wall_s"] for m in ms]))
            rows.append([name, n, wall, wall / base, n / wall,
                         float(np.median([m["first_s"] for m in ms])),
                         float(np.median([m["p50_s"] for m in ms])), len(ms)])
            summary[f"{name}_wall_s_{n}"] = wall
            if n != sizes[0]:
                summary[f"{name}_ratio_{n}_vs_{sizes[0]}"] = wall / base
    kind = f"streamed {args.route}" if args.stream else args.route
    return {"title": f"serve-load: bursts of {kind} on scripts/serve.py "
                     f"({args.client} client, {model.name})",
            "columns": columns, "rows": rows, "summary": summary,
            "bursts": {f"{name}/{n}": v for (name, n), v in results.items()}}
