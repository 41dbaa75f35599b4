"""Weight sync: one version bump, phase by phase, next to this machine's limits.

    python -m areal_jax.bench weight-sync --preset qwen2.5-0.5b --path memory [--bumps 5]
    python -m areal_jax.bench weight-sync --preset qwen2.5-0.5b --path disk
    python -m areal_jax.bench weight-sync --preset qwen2.5-0.5b --path delta --lr 1e-6
    python -m areal_jax.bench weight-sync --preset qwen2.5-0.5b --path distributed

A random model of the preset: the "learner" holds it in fp32, as the learner's master
weights; one embedded server (``serve.py``, warmed up) serves it in ``--dtype`` (bf16)
while a load generator keeps ``--concurrency`` greedy requests running on it. Each bump
moves every weight by an AdamW-like first step (``lr * sign(g)``, g random), then
publishes it as the run does:

* ``memory`` (``checkpoint.publish: memory``): the learner dispatches the cast
  (``serving_arrays``); ``StreamPublisher.send`` streams and stages; ``/weights/swap``.
* ``disk``: the learner's host copy (``host_params``); ``WeightPublisher.publish`` writes
  ``v{N}``; ``/pause_generation`` → ``/update_weights_from_disk`` → ``/continue_generation``.
* ``delta``: the learner's host copy; ``DeltaPublisher.publish`` writes ``v{N}`` as a
  compressed XOR delta against v{N-1} (full every ``--full-every``); the server applies it
  with ``/update_weights_from_delta`` (pause → apply → continue, as disk).
* ``distributed`` (``checkpoint.publish: distributed``): the same cast as ``memory``;
  ``DistributedPublisher.send`` broadcasts the HF-named tensors through SGLang's weight
  update group (gloo, the learner at rank 0; the group made before the first bump) while
  ``/update_weights_from_distributed`` announces each bucket; the server swaps the whole
  version in after the last (its pause is the one its reply's message reports).

Per bump: the learner's wait, the transfer (write or stream + stage), generation paused
(the server's own ``paused_s`` where it reports one, and the orchestrator's call), the bump
end to end (update sent → the server's first token under the new weights, and → the first
``/generate`` reply at the new version: a whole request of the load), bytes moved, and the
server's peak RSS (sampled every 10 ms) against the weight bytes, split at that peak into
the shared memory it maps (on the memory path the weight versions: two while a staged one
waits for its swap) and the rest (its own heap: runtime, compiled programs, KV cache; and
mapped libraries). The baseline is the server's RSS once every program is compiled, the
load running, before the first bump. The limits for the same
bytes, measured in the same run: a warm memcpy, a cold one (fresh pages), a page-cache
write and a write + fsync. The machine may be loaded: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="model_defs preset")
    parser.add_argument("--path", default="memory", choices=["memory", "disk", "delta",
                                                                 "distributed"])
    parser.add_argument("--bumps", type=int, default=5, help="version bumps (median)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the serving dtype")
    parser.add_argument("--lr", type=float, default=1e-6,
                        help="each bump moves every weight by lr * sign(g)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="memory: MiB per bucket")
    parser.add_argument("--full-every", type=int, default=10, help="delta: a full version "
                        "every this many")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="greedy requests kept running on the server during the bumps")
    parser.add_argument("--spare-file", action=argparse.BooleanOptionalAction, default=True,
                        help="memory: write each version into a shared-memory file whose "
                             "pages are allocated (the one no server holds any more, else a "
                             "spare made ahead) (checkpoint.publish_spare_file)")
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unrolled"],
                        help="the server's --layer-loop (scan: smaller compiled programs, "
                             "a slower decode on CPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="override the preset's layer count (a quicker run)")
    parser.add_argument("--delta-size", action=argparse.BooleanOptionalAction, default=True,
                        help="after each bump, also the size of its compressed bf16 XOR delta "
                             "against the previous version (off the timed phases)")
    parser.add_argument("--workdir", default=None, help="where the model and files go "
                        "(default: a temporary directory)")


def _rss_parts(pid: int) -> dict[str, int]:
    """The process's resident set (``VmRSS``) and its parts, bytes: ``anon`` (its own
    heap: the runtime, compiled programs, caches), ``shmem`` (mapped shared memory: on the
    memory path the weight versions it maps) and ``file`` (mapped files: libraries)."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssShmem": "shmem", "RssFile": "file"}
    parts = dict.fromkeys(keys.values(), 0)
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in keys:
                parts[keys[name]] = int(line.split()[1]) * 1024
    return parts


def _rss_bytes(pid: int) -> int:
    return _rss_parts(pid)["rss"]


class _RssSampler:
    """Peak RSS of a process, sampled every ``interval_s`` while running, and its parts
    (``_rss_parts``) at that peak."""

    def __init__(self, pid: int, interval_s: float = 0.01):
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        parts = _rss_parts(self.pid)
        if parts["rss"] >= self.peak:
            self.peak, self.at_peak = parts["rss"], parts

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except OSError:
                return
            time.sleep(self.interval_s)

    def __enter__(self) -> _RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _Load:
    """Keeps ``n`` greedy /generate requests running; records (finish time, version)."""

    def __init__(self, url: str, n: int, vocab: int):
        import httpx

        self.url, self.n, self.vocab = url, n, vocab
        self.replies: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=600)
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(n)]

    def _run(self, i: int) -> None:
        rng = np.random.default_rng(i)
        while not self._stop.is_set():
            ids = rng.integers(0, self.vocab, 8).tolist()
            try:
                r = self._client.post(f"{self.url}/generate", json={
                    "input_ids": ids, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 16, "temperature": 0.0,
                                        "ignore_eos": True}})
            except Exception:  # noqa: BLE001 - the server is gone: stop
                return
            if r.status_code == 200:
                meta = r.json()["meta_info"]
                self.replies.append((time.perf_counter(), str(meta["weight_version"]),
                                     int(meta["completion_tokens"])))

    def first_at(self, version: int, after: float, timeout: float = 600.0) -> float:
        """When the first reply at ``version`` finished (perf_counter)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            hits = [t for t, v, _ in self.replies if v == str(version) and t >= after]
            if hits:
                return min(hits)
            time.sleep(0.005)
        raise TimeoutError(f"no /generate reply at version {version} within {timeout}s")

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        self._client.close()


def _limits(nbytes: int, workdir: Path) -> dict[str, float]:
    """Seconds this machine takes to move ``nbytes``: memcpy warm and cold, a page-cache
    write, a write + fsync."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src
    t0 = time.perf_counter()
    dst[:] = src
    warm = time.perf_counter() - t0
    del dst
    t0 = time.perf_counter()
    fresh = np.empty_like(src)
    fresh[:] = src
    cold = time.perf_counter() - t0
    del fresh
    path = workdir / "limit.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(src))
    cache = time.perf_counter() - t0
    os.remove(path)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(src))
        f.flush()
        os.fsync(f.fileno())
    synced = time.perf_counter() - t0
    os.remove(path)
    return {"memcpy_s": warm, "memcpy_cold_s": cold, "page_cache_write_s": cache,
            "write_fsync_s": synced}


def _adamw_like_step(model: Any, lr: float, seed: int) -> None:
    """Every float param moves by lr * sign(g), g random (Adam's first step), in place."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(key, len(leaves))
    # Each leaf in place (its buffer donated): a stand-in for the learner's update that
    # does not hold the params twice (at the 1.5B shape that put the 24 GB host at its
    # limit, and the page reclaim it caused showed in the bumps' writes).
    step = jax.jit(lambda x, k: x - lr * jnp.sign(jax.random.normal(k, x.shape, x.dtype)),
                   donate_argnums=0)
    new = [step(x, k) if jnp.issubdtype(x.dtype, jnp.floating) else x
           for x, k in zip(leaves, keys, strict=True)]
    del leaves, state
    nnx.update(model, jax.tree.unflatten(treedef, new))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    import httpx
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from areal_jax.checkpoint.delta import named_host_arrays
    from areal_jax.checkpoint.publish import WeightPublisher, host_params
    from areal_jax.checkpoint.stream import (
        StreamPublisher,
        _available_memory,
        serving_arrays,
        serving_shapes,
        warm_serving_cast,
    )
    from areal_jax.engine.launch import launch_server
    from areal_jax.weight_wire import encode_delta
    from model_defs import CausalLM, ModelConfig, save_hf

    cfg = ModelConfig.preset(args.preset)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    tmp = tempfile.TemporaryDirectory(prefix="weight-sync-") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    weights_dir = workdir / "weights"
    weights_dir.mkdir(exist_ok=True)
    model = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    start = save_hf(model, cfg, workdir / "start", dtype=args.dtype)
    weight_bytes = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model))) * (
        2 if args.dtype == "bfloat16" else 4)
    limits = _limits(weight_bytes, workdir)

    server = launch_server(start, max_slots=max(4, args.concurrency), dtype=args.dtype,
                           max_seq_len=args.max_seq_len, warmup=True,
                           allowed_weight_dirs=[weights_dir], startup_timeout=1800,
                           extra_args=["--decode-steps", str(args.decode_steps),
                                       "--layer-loop", args.layer_loop],
                           log_path=workdir / "server.log")
    http = httpx.Client(base_url=server.url, timeout=1800)
    rows, bumps = [], []
    publisher = WeightPublisher(weights_dir, keep=2, dtype=args.dtype)
    delta = None
    if args.path == "delta":
        from areal_jax.checkpoint.delta import DeltaPublisher

        delta = DeltaPublisher(weights_dir, full_every=args.full_every, keep=3)
        delta.publish(host_params(model, args.dtype), 0)  # the base the server holds
    sender = StreamPublisher([server.url], bucket_bytes=args.bucket_mb << 20,
                             spare_file=args.spare_file)
    group = None
    if args.path == "distributed":
        from areal_jax.checkpoint.distributed import DistributedPublisher

        group = DistributedPublisher([server.url], cfg, bucket_bytes=args.bucket_mb << 20)
        group.send(serving_arrays(model, args.dtype), 0)  # makes the group; compiles the cast
    previous = named_host_arrays(host_params(model, args.dtype)) if args.delta_size else None
    arrays = last_cast = None
    if args.path == "memory":  # as the run does when it starts: the first file made ahead,
        sender.prepare(serving_shapes(model, args.dtype))  # and the cast warmed
        last_cast = warm_serving_cast(model, args.dtype)
    load_tokens_per_s = float("nan")
    try:
        with _Load(server.url, args.concurrency, cfg.vocab_size) as load:
            load.first_at(0, 0.0)  # generation is running
            # The server compiles its larger programs in the background after it is ready;
            # the bumps are measured once that is done (those compiles took the two cores
            # from the first bumps: a 1.5-2.1 s write where later ones took 0.12 s).
            t_wait = time.perf_counter()
            while http.get("/get_server_info").json().get("programs_pending"):
                if time.perf_counter() - t_wait > 1800:
                    raise TimeoutError("the server's background compiles did not finish")
                time.sleep(0.1)
            print(f"server programs compiled ({time.perf_counter() - t_wait:.1f} s after "
                  "the load started)", flush=True)
            # the server's resident set before any bump: every program compiled, the load on
            baseline_rss = _rss_bytes(server.pid)
            t_bumps = time.perf_counter()
            for v in range(1, args.bumps + 1):
                _adamw_like_step(model, args.lr, v)
                jax.block_until_ready(nnx.state(model))
                bump: dict[str, Any] = {"version": v}
                available = _available_memory()  # the host's, as the bump starts
                if available is not None:
                    bump["host_available_gb"] = round(available / 1e9, 2)
                with _RssSampler(server.pid) as rss:
                    t0, t0_wall = time.perf_counter(), time.time()
                    if args.path == "memory":
                        # as the run does: on CPU the cast writes into the last one's buffers
                        arrays = serving_arrays(model, args.dtype, reuse=last_cast)
                        bump["learner_wait_s"] = time.perf_counter() - t0
                        t1 = time.perf_counter()
                        transfer = sender.send(arrays, v)
                        bump["transfer_s"] = time.perf_counter() - t1
                        report = sender.last
                        assert report is not None
                        bump["server_apply_s"] = report.stage_s
                        bump["bytes_moved"] = report.nbytes
                        # the transfer's parts: the wait for the cast, the shared-memory
                        # write, the server's mapping + checksums, placing
                        bump.update(cast_s=report.host_s, shm_write_s=report.write_s,
                                    load_s=report.load_s, place_s=report.place_s,
                                    shm_file=report.shm_file,
                                    spare_wait_s=report.spare_wait_s)
                        t2 = time.perf_counter()
                        r = http.post("/weights/swap", json={
                            "transfer": transfer, "weight_version": str(v),
                            "abort_all_requests": True})
                        r.raise_for_status()
                        bump["paused_call_s"] = time.perf_counter() - t2
                        bump["paused_s"] = r.json()["paused_s"]
                        bump["swap_wait_s"] = r.json()["wait_s"]
                        # the probe rides in the first prefill after the swap (a server
                        # without the weight checks has none)
                        bump["verify_s"] = r.json().get("verify_s", 0.0)
                    elif group is not None:
                        arrays = serving_arrays(model, args.dtype)
                        bump["learner_wait_s"] = time.perf_counter() - t0
                        t1 = time.perf_counter()
                        group.send(arrays, v)
                        bump["transfer_s"] = time.perf_counter() - t1
                        report = group.last
                        assert report is not None
                        bump["bytes_moved"] = report.nbytes
                        # the learner's HF conversion (layer slices, transposes), and the
                        # rest of the send but the last bucket's reply (broadcasts, HTTP)
                        bump["convert_s"], bump["broadcast_s"] = report.host_s, report.stream_s
                        # the last bucket's request: receive, place + probe, swap
                        bump["server_apply_s"] = bump["paused_call_s"] = report.stage_s
                        paused = re.search(r"paused ([0-9.]+)s", " ".join(
                            str(r.get("message")) for r in group.last_replies.values()))
                        bump["paused_s"] = float(paused.group(1)) if paused else report.stage_s
                    else:
                        params = host_params(model, args.dtype)
                        bump["learner_wait_s"] = time.perf_counter() - t0
                        t1 = time.perf_counter()
                        if delta is not None:
                            path, nbytes = delta.publish(params, v)
                            route, body = "/update_weights_from_delta", {
                                "model_path": path, "weight_version": str(v)}
                        else:
                            path = publisher.publish(params, cfg, v)
                            nbytes = sum(p.stat().st_size for p in Path(path).glob("*"))
                            route, body = "/update_weights_from_disk", {
                                "model_path": path, "weight_version": str(v)}
                        bump["transfer_s"] = time.perf_counter() - t1
                        bump["bytes_moved"] = nbytes
                        del params
                        t2 = time.perf_counter()
                        http.post("/pause_generation", json={"mode": "abort"}).raise_for_status()
                        r = http.post(route, json=body)
                        if r.status_code != 200:
                            raise RuntimeError(f"{route}: {r.text[:500]}")
                        http.post("/continue_generation", json={}).raise_for_status()
                        bump["paused_call_s"] = time.perf_counter() - t2
                        bump["paused_s"] = bump["paused_call_s"]
                        bump["server_apply_s"] = bump["paused_call_s"]
                    bump["sent_to_first_reply_s"] = load.first_at(v, t0) - t0
                    info = http.get("/get_server_info").json()
                    # the server's first token under the new weights (same host: one clock)
                    bump["sent_to_generating_s"] = info["first_token_after_swap_at"] - t0_wall
                bump["server_peak_rss_gb"] = rss.peak / 1e9
                # at that peak: the server's own heap, and the weight versions it maps
                bump["server_peak_anon_gb"] = rss.at_peak["anon"] / 1e9
                bump["server_peak_shmem_gb"] = rss.at_peak["shmem"] / 1e9
                if previous is not None:  # untimed: the delta this bump would have shipped
                    current = named_host_arrays(host_params(model, args.dtype))
                    data = encode_delta(current, dict(previous), v, v - 1)
                    bump["delta_bytes_fraction"] = len(data) / weight_bytes
                    bump["bf16_changed_fraction"] = float(np.mean(np.concatenate([
                        (a.view(np.uint16) != b.view(np.uint16)).reshape(-1)
                        for (_, a), (_, b) in zip(current, previous, strict=True)])))
                    previous = current
                # A run keeps the version's cast for the next one to write into (on CPU;
                # elsewhere it is dropped once sent): here too, the rest dropped untimed.
                last_cast = arrays if arrays is not None and arrays.on_cpu else None
                arrays = None
                bumps.append(bump)
                print(f"bump {v}: " + ", ".join(
                    f"{k} {val:.3g}" if isinstance(val, float) else f"{k} {val}"
                    for k, val in bump.items() if k != "version"), flush=True)
            # the load's tokens per second over the bumps (pauses and re-prefills included)
            t_end = time.perf_counter()
            load_tokens_per_s = sum(n for t, _, n in load.replies if t >= t_bumps) / (
                t_end - t_bumps)
    finally:
        if group is not None:
            group.close()
        sender.close()
        http.close()
        server.terminate()
        if tmp is not None:
            tmp.cleanup()

    def med(key: str) -> float:
        return float(statistics.median(b[key] for b in bumps))

    gb = weight_bytes / 1e9
    phases = [("learner wait", "learner_wait_s", "memcpy_s"),
              ("transfer (write or stream + stage)", "transfer_s", "write_fsync_s"),
              ("server apply (stage / load)", "server_apply_s", "memcpy_s"),
              # the memory path's transfer, part by part
              ("- wait for the learner's cast", "cast_s", "memcpy_s"),
              ("- shared-memory write", "shm_write_s", "page_cache_write_s"),
              ("- server maps + checksums it", "load_s", "memcpy_s"),
              ("- server places it", "place_s", "memcpy_s"),
              ("generation paused (server)", "paused_s", "memcpy_s"),
              ("paused, orchestrator's call", "paused_call_s", "memcpy_s"),
              ("- its wait for the decode call in flight", "swap_wait_s", "memcpy_s"),
              ("- swap -> probe result (in the first prefill)", "verify_s", "memcpy_s"),
              ("update sent -> new version generating", "sent_to_generating_s", "memcpy_s"),
              ("update sent -> first reply at it", "sent_to_first_reply_s", "memcpy_s")]
    phases = [p for p in phases if all(p[1] in b for b in bumps)]
    for name, key, limit in phases:
        rows.append([name, round(med(key), 4), limit.replace("_s", ""),
                     round(limits[limit], 4), round(med(key) / limits[limit], 1)])
    top = max(bumps, key=lambda b: b["server_peak_rss_gb"])
    summary = {
        "preset": args.preset, "path": args.path, "dtype": args.dtype,
        "weight_gb": round(gb, 3), "bumps": len(bumps), "lr": args.lr,
        "bytes_moved_fraction": round(med("bytes_moved") / weight_bytes, 4),
        "load_tokens_per_s": round(load_tokens_per_s, 2), "layer_loop": args.layer_loop,
        "server_baseline_rss_gb": round(baseline_rss / 1e9, 3),
        "server_peak_rss_gb": round(max(b["server_peak_rss_gb"] for b in bumps), 3),
        "server_peak_rss_x_weights": round(max(b["server_peak_rss_gb"] for b in bumps) / gb, 2),
        # the highest bump's peak, split: the weight versions the server maps (memory path:
        # two while a staged one waits for the swap) and the rest (runtime, programs, cache)
        "server_peak_shmem_x_weights": round(top["server_peak_shmem_gb"] / gb, 2),
        "server_peak_rest_gb": round(top["server_peak_rss_gb"] - top["server_peak_shmem_gb"], 3),
        # what an update adds on top of the server's resident set before the bumps
        "server_update_rss_x_weights": round(
            (max(b["server_peak_rss_gb"] for b in bumps) - baseline_rss / 1e9) / gb, 2),
        **({"delta_bytes_fraction": round(med("delta_bytes_fraction"), 4),
            "bf16_changed_fraction": round(med("bf16_changed_fraction"), 4)}
           if args.delta_size else {}),
        **{f"limit_{k}": round(val, 4) for k, val in limits.items()},
    }
    return {"title": f"weight sync: {args.preset} {args.dtype}, path {args.path}, median of "
                     f"{len(bumps)} bumps",
            "columns": ["phase", "seconds", "limit", "limit seconds", "x limit"],
            "rows": rows, "summary": summary, "bumps": bumps}
