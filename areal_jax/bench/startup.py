"""startup: seconds from process start to the first batch and the first learner step,
with a cold and a warm compilation cache; with ``--engine``, to a rollout server's ready.

    python -m areal_jax.bench startup [--config configs/tiny_demo.yaml] [--repeats 2]
                                      [--peer-repo DIR] [key=value ...]
    python -m areal_jax.bench startup --engine [--presets demo,longtail,qwen2.5-0.5b]
                                      [--repeats 3] [--peer-repo DIR]

``--engine``: a row per preset and cache state, each a ``serve.py --warmup`` process
started as the trainer starts its servers (``launch_server``) and timed until ``/health``
answers (``ready_s``), then one short request (``first_request_s``). ``cold`` starts
with an empty compilation cache, ``warm`` reuses it. Presets: ``demo``
(configs/tiny_demo.yaml's engine), ``longtail`` (configs/longtail_demo.yaml's), and a
``model_defs`` preset name such as ``qwen2.5-0.5b`` (random weights in bfloat16, 4 slots,
max_seq_len 128). The server's own breakdown (imports, model load, the programs'
compile, the update probe) and its program count come from ``/get_server_info`` when the
checkout reports them.

Each run is its own ``scripts/train.py`` process training ``--versions`` versions (no
evals, no periodic checkpoints). ``cold`` runs start with an empty compilation cache
(a fresh directory per run); ``warm`` runs reuse the directory a cold run just filled,
as a second run of the same config does. From the run's ``metrics.jsonl`` (so any
checkout's trainer can be timed the same way):

- ``first_batch_s``: process start to the learner's first batch of trajectories
  (``B`` groups ready), i.e. the first version's row minus its own training and publishing;
- ``first_step_s``: process start to the end of the first learner version;
- ``total_s``: the whole command.

``--peer-repo DIR`` times another checkout of areal-jax (e.g. the commit before a change)
side by side, interleaved run by run; a checkout without ``compilation_cache_dir`` runs
without the cache, so its cold and warm runs are alike.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.bench.common import REPO, run_train


def add_arguments(p) -> None:
    p.add_argument("--engine", action="store_true",
                   help="time a rollout server's start-up per --presets instead of a run's")
    p.add_argument("--presets", default="demo,longtail,qwen2.5-0.5b",
                   help="--engine: comma-separated demo, longtail, or a model_defs preset")
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_demo.yaml"))
    p.add_argument("--versions", type=int, default=2, help="train.total_versions per run")
    p.add_argument("--repeats", type=int, default=1, help="cold+warm pairs per checkout")
    p.add_argument("--peer-repo", default=None, help="another checkout to time side by side")
    p.add_argument("--work-dir", default=None, help="run dirs and caches (default: a temp dir)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")


def _knows_cache_key(repo: Path) -> bool:
    return "compilation_cache_dir" in (repo / "areal_jax" / "config.py").read_text()


def time_run(repo: Path, config: str, versions: int, run_dir: Path, cache_dir: Path,
             overrides: list[str]) -> dict[str, float]:
    """One train.py process of ``repo``; milestones in seconds from its start."""
    args = [f"train.total_versions={versions}", "eval.at_start=false",
            "eval.every_versions=0", "eval.at_end=false", "checkpoint.every_versions=0",
            "progress_bar=false", *overrides]
    if _knows_cache_key(repo):
        args.append(f"compilation_cache_dir={cache_dir}")
    done = run_train(config, args, run_dir, repo=repo, JAX_PLATFORMS="cpu")
    first = next(r for r in done.rows if r.get("version") == 1)
    # The row is written after the step and the publish; the batch arrived before both.
    t0 = done.t_launch
    first_batch = first["time"] - t0 - (first["step_time_s"] - first["rollout_wait_s"])
    out = {"first_batch_s": first_batch, "first_step_s": first["time"] - t0,
           "total_s": done.total_s}
    out.update({k: v for k, v in first.items() if k.startswith("startup/")})
    return out


ENGINE_CONFIGS = {"demo": "tiny_demo.yaml", "longtail": "longtail_demo.yaml"}


def engine_preset(name: str, work: Path) -> dict[str, Any]:
    """``launch_server`` arguments of a preset (see the module doc)."""
    if name in ENGINE_CONFIGS:
        from areal_jax.config import load_config
        from areal_jax.run import engine_tuning_args
        from areal_jax.run_inputs import resolve_model_path

        cfg = load_config(str(REPO / "configs" / ENGINE_CONFIGS[name]), [])
        ro = cfg.rollout
        return {"model_path": str(resolve_model_path(cfg.model.path)),
                "max_slots": ro.max_slots, "max_seq_len": ro.max_seq_len,
                "dtype": cfg.serving_dtype, "extra_args": engine_tuning_args(ro)}
    from areal_jax.bench.common import save_random_hf
    from model_defs import ModelConfig

    path = work / f"model-{name}"
    if not (path / name / "config.json").is_file():
        save_random_hf(ModelConfig.preset(name), path, name)
    return {"model_path": str(path / name), "max_slots": 4, "max_seq_len": 128,
            "dtype": "bfloat16", "extra_args": []}


def time_engine(repo: Path, preset: dict[str, Any], cache_dir: Path, log: Path
                ) -> dict[str, float]:
    """One ``serve.py --warmup`` of ``repo``: seconds to ready and to a first reply, and
    the server's own start-up breakdown."""
    import time

    import httpx

    from areal_jax.bench.common import script_env
    from areal_jax.engine.launch import launch_server

    t0 = time.perf_counter()
    # In repo: `python -m` puts the working directory first on sys.path, before PYTHONPATH.
    with contextlib.chdir(repo), launch_server(preset["model_path"], max_slots=preset["max_slots"],
                       max_seq_len=preset["max_seq_len"], dtype=preset["dtype"],
                       extra_args=preset["extra_args"], warmup=True,
                       compilation_cache_dir=cache_dir, log_path=log, startup_timeout=1800,
                       env={"PYTHONPATH": script_env(repo)["PYTHONPATH"]}) as server:
        ready = time.perf_counter() - t0
        t1 = time.perf_counter()
        reply = httpx.post(f"{server.url}/generate", timeout=600, json={
            "input_ids": [5, 6, 7, 8, 9], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})
        reply.raise_for_status()
        first = time.perf_counter() - t1
        info = httpx.get(f"{server.url}/get_server_info", timeout=60).json()
    out = {"ready_s": ready, "first_request_s": first,
           "programs": float(len(info.get("programs") or {}) + len(info.get(
               "programs_pending") or [])) if "programs" in info
           else float(len(info.get("compiled_functions") or [])),
           "compilations_at_ready_and_request": float(info.get("num_compilations", 0))}
    for key, value in (info.get("startup") or {}).items():
        out[f"server_{key}"] = float(value)
    for name, prog in (info.get("programs") or {}).items():
        out[f"compile_s/{name}"] = float(prog["compile_s"])
        if "lower_s" in prog:  # the tracing and lowering part of it
            out[f"lower_s/{name}"] = float(prog["lower_s"])
        if "hlo_chars" in prog:  # measured after start-up, off its path
            out[f"hlo_chars/{name}"] = float(prog["hlo_chars"])
    return out


def run_engine(args, work: Path) -> dict:
    repos = {"this": REPO}
    if args.peer_repo:
        repos["peer"] = Path(args.peer_repo).resolve()
    presets = {name: engine_preset(name, work) for name in args.presets.split(",")}
    results: dict[tuple[str, str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for preset_name, preset in presets.items():
            for name, repo in repos.items():  # interleaved: this, peer, this, peer, ...
                cache = work / f"cache-{preset_name}-{name}-{rep}"
                for kind in ("cold", "warm"):
                    log = work / f"server-{preset_name}-{name}-{kind}-{rep}.log"
                    m = time_engine(repo, preset, cache, log)
                    results.setdefault((preset_name, name, kind), []).append(m)
                    print(f"{preset_name} {name} {kind} #{rep}: " + " ".join(
                        f"{k}={v:.2f}" for k, v in m.items() if "/" not in k), flush=True)
    columns = ["preset", "checkout", "cache", "ready s (median)", "first request s",
               "imports s", "model load s", "programs s", "probe s", "programs", "runs"]
    rows, summary = [], {}
    for (preset_name, name, kind), ms in results.items():
        def med(key: str, ms: list[dict] = ms) -> float:
            values = [m[key] for m in ms if key in m]
            return float(np.median(values)) if values else float("nan")

        for m in ms:  # the update probe's compile and run, after the programs'
            if "server_compile_s" in m and "server_programs_s" in m:
                m["server_probe_s"] = m["server_compile_s"] - m["server_programs_s"]
        rows.append([preset_name, name, kind, med("ready_s"), med("first_request_s"),
                     med("server_imports_s"), med("server_load_s"), med("server_programs_s"),
                     med("server_probe_s"), med("programs"), len(ms)])
        summary[f"{preset_name}_{name}_{kind}_ready_s"] = med("ready_s")
    return {"title": "engine start-up: serve.py --warmup to /health, cold and warm cache",
            "columns": columns, "rows": rows, "summary": summary,
            "runs": {f"{p}/{n}/{k}": v for (p, n, k), v in results.items()}}


def run(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.engine:
        return run_engine(args, work)
    repos = {"this": REPO}
    if args.peer_repo:
        repos["peer"] = Path(args.peer_repo).resolve()
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for name, repo in repos.items():  # interleaved: this, peer, this, peer, ...
            cache = work / f"cache-{name}-{rep}"
            for kind in ("cold", "warm"):
                run_dir = work / f"run-{name}-{kind}-{rep}"
                m = time_run(repo, args.config, args.versions, run_dir, cache, args.overrides)
                results.setdefault((name, kind), []).append(m)
                print(f"{name} {kind} #{rep}: " + " ".join(f"{k}={v:.2f}" for k, v in m.items()),
                      flush=True)
    columns = ["checkout", "cache", "first batch s (median)", "first step s (median)",
               "whole command s (median)", "runs"]
    rows, summary = [], {}
    for (name, kind), ms in results.items():
        med = {k: float(np.median([m[k] for m in ms])) for k in ("first_batch_s", "first_step_s",
                                                                  "total_s")}
        rows.append([name, kind, med["first_batch_s"], med["first_step_s"], med["total_s"],
                     len(ms)])
        for k, v in med.items():
            summary[f"{name}_{kind}_{k}"] = v
    if "peer" in repos:
        for kind in ("cold", "warm"):
            summary[f"first_step_speedup_{kind}"] = (summary[f"peer_{kind}_first_step_s"]
                                                     / summary[f"this_{kind}_first_step_s"])
    return {"title": "start-up: process start to first batch / first learner step",
            "columns": columns, "rows": rows, "summary": summary,
            "runs": {f"{n}/{k}": v for (n, k), v in results.items()}}
