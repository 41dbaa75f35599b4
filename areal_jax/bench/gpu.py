"""The GPU check: everything a lent GPU should show, in one call, most important first.

    python scripts/bench.py gpu --out-dir $OUT            # on a GPU machine (about 9 minutes)
    python scripts/bench.py gpu --small --out-dir /tmp/g  # the same steps, tiny, on a CPU

Each step is its own process under its own time limit (a step that hangs or fails costs
its limit and is reported, never the whole check), and every step's limit is cut to what
is left of ``--budget-s``. In order of importance:

1. ``demo``: the README's demo end to end on one GPU, learner and engine sharing it
   (``rollout.engine_platform=null``: the engine takes the learner's platform; half the
   card's memory to the learner, 0.3 to the engine).
2. ``train-0.5b``, ``train-1.5b``: the learner step against transformers + torch on the
   same GPU (fp32 master weights, bf16 autocast, SDPA, fused AdamW; eager and
   ``torch.compile``), 2 x 4,096 tokens, bf16 (``bench train``).
3. ``generate-cold``, ``generate-warm``: the engine against transformers ``generate`` on
   the same GPU, with the engine's start-up (warm-up compiles included) on a cold and then
   a warm persistent compilation cache (``bench generate``); ``generate-scan``: the same,
   cold, with the layers scanned (``--layer-loop scan``), whose compile time does not grow
   with depth but whose decode reads each step's weight slice through a copy on a GPU.
4. ``attention``: each attention kernel against the fp32 reference, and its speed
   (``bench attention``).

Writes ``gpu.json`` (every step's status, wall time, command and JSON result) and each
step's log and JSON under ``--out-dir``, and prints one table. ``--small`` runs the same
steps at tiny shapes so the check itself is tested on a CPU (tests/test_bench_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from areal_jax.bench.common import REPO, read_metrics, script_env

# name -> (seconds on a GPU, the step's purpose)
STEP_LIMITS = {"demo": 120, "train-0.5b": 110, "train-1.5b": 110, "generate-cold": 90,
               "generate-warm": 45, "generate-scan": 60, "attention": 60}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="bench_results/gpu",
                        help="where gpu.json and each step's log and JSON go")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="the whole check's time; each step's limit is cut to what is "
                             "left (a device call is at most 600 s)")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes, CPU time limits: the check's own test on a CPU")
    parser.add_argument("--steps", default=",".join(STEP_LIMITS),
                        help="comma-separated subset of: " + ", ".join(STEP_LIMITS))


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi (no JAX or CUDA context in this process, so the
    steps get the whole device), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return names[0] if out.returncode == 0 and names else None


def hardware_target(name: str | None) -> str:
    """The config's ``hardware`` value for this machine's GPU (cpu without one)."""
    if name is None:
        return "cpu"
    return "h200:1" if "H200" in name.upper() else "h100:1"


def steps(out_dir: Path, small: bool, hardware: str) -> dict[str, tuple[list[str], float]]:
    """Step name -> (argv, time limit in seconds)."""
    py, bench = sys.executable, [sys.executable, "-m", "areal_jax.bench"]
    demo = [py, str(REPO / "scripts" / "train.py"), "--config",
            str(REPO / "configs" / "tiny_demo.yaml"), f"run_dir={out_dir / 'demo'}",
            f"hardware={hardware}"]
    if hardware != "cpu":  # the engine on the learner's GPU (each its share), no CPU pinning
        demo += ["rollout.engine_platform=null", "rollout.server_cpu_cores=null",
                 "rollout.learner_cpu_cores=null", "placement.learner_mem_fraction=0.5",
                 "rollout.engine_mem_fraction=0.3", "train.total_versions=30",
                 "eval.every_versions=10"]
    else:
        demo += ["train.total_versions=2", "eval.every_versions=2", "data.max_eval_prompts=8",
                 "checkpoint.every_versions=2"]
    cache = str(out_dir / "compile_cache")
    if small:
        train = ["--layers", "1", "--tokens", "128", "--rows", "2", "--repeats", "1",
                 "--dtype", "bfloat16", "--no-torch"]
        trains = {"train-0.5b": train, "train-1.5b": train}
        generate = ["--batch", "2", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1",
                    "--data-parallel", "1", "--torch-threads", "1"]
        attention = ["--t", "64", "--repeats", "1", "--check-t", "64", "--heads", "4",
                     "--dtypes", "float32", "--pallas-blocks", "32/16"]
        limits = dict.fromkeys(STEP_LIMITS, 240.0) | {"demo": 420.0}
    else:
        big = ["--dtype", "bfloat16", "--tokens", "8192", "--rows", "2", "--repeats", "5",
               "--torch-compile", "--independent-init"]
        trains = {"train-0.5b": ["--preset", "qwen2.5-0.5b", *big],
                  "train-1.5b": ["--preset", "qwen2.5-1.5b", *big]}
        generate = ["--preset", "qwen2.5-0.5b", "--dtype", "bfloat16", "--batch", "32",
                    "--new-tokens", "128", "--prompt-len", "64", "--repeats", "2",
                    "--data-parallel", "1"]
        attention = ["--t", "4096,16384", "--repeats", "5"]
        limits = dict(STEP_LIMITS)
    argv = {"demo": demo}
    for name, args in trains.items():
        argv[name] = [*bench, "train", *args, "--out", str(out_dir / f"{name}.json")]
    for name in ("generate-cold", "generate-warm"):
        argv[name] = [*bench, "generate", *generate, "--compile-cache", cache,
                      "--layer-loop", "unrolled", "--out", str(out_dir / f"{name}.json")]
    argv["generate-scan"] = [*bench, "generate", *generate, "--compile-cache", cache,
                             "--layer-loop", "scan", "--out", str(out_dir / "generate-scan.json")]
    argv["attention"] = [*bench, "attention", *attention, "--out",
                         str(out_dir / "attention.json")]
    return {name: (argv[name], limits[name]) for name in STEP_LIMITS}


def _step_result(name: str, out_dir: Path) -> dict[str, Any] | None:
    if name == "demo":
        try:
            rows = read_metrics(out_dir / "demo")
        except (OSError, json.JSONDecodeError):
            return None
        evals = [(r["version"], r["eval_accuracy"]) for r in rows
                 if r.get("eval_accuracy") is not None and "version" in r]
        startup = {k: v for r in rows[:1] for k, v in r.items() if k.startswith("startup")}
        return {"versions": max((r.get("version", 0) for r in rows), default=0),
                "eval_accuracy": evals, **startup}
    path = out_dir / f"{name}.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result.get("summary", {})


def _headline(name: str, result: dict[str, Any] | None) -> str:
    if not result:
        return "-"
    if name == "demo":
        acc = result.get("eval_accuracy") or []
        return (f"eval accuracy {acc[0][1]:.3f} -> {acc[-1][1]:.3f} by v{acc[-1][0]}"
                if acc else f"{result.get('versions')} versions, no eval")
    if name.startswith("train"):
        text = f"{result.get('ours_tokens_per_s', 0):.0f} tok/s"
        for key, label in (("ratio", "x eager torch"), ("ratio_vs_compile", "x compiled"),
                           ("mfu", "MFU")):
            if key in result:
                value = result[key]
                text += f", {100 * value:.1f}% {label}" if key == "mfu" else (
                    f", {value:.2f}{label}")
        return text
    if name.startswith("generate"):
        return (f"{result.get('engine_tokens_per_s', 0):.0f} tok/s, "
                f"{result.get('speedup_vs_transformers', 0):.2f}x transformers, start-up "
                f"{result.get('engine_startup_s', 0):.1f} s")
    if name == "attention":
        return f"all within bound: {result.get('all_within_bound')}"
    return "-"


def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    name = gpu_name()
    if name is None and not args.small:
        raise SystemExit("bench gpu: no GPU here (nvidia-smi finds none); --small runs the "
                         "check's steps at tiny shapes on this CPU")
    hardware = hardware_target(name) if not args.small or name else "cpu"
    wanted = args.steps.split(",")
    bad = [s for s in wanted if s not in STEP_LIMITS]
    if bad:
        raise SystemExit(f"--steps {bad}: choose from {', '.join(STEP_LIMITS)}")
    plan = steps(out_dir, args.small, hardware)
    env = script_env()
    if hardware == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    t_start = time.time()
    results, rows = {}, []
    for step in wanted:
        argv, limit = plan[step]
        limit = min(limit, args.budget_s - (time.time() - t_start))
        if limit < 10:
            results[step] = {"status": "skipped", "reason": "no budget left", "argv": argv}
            rows.append([step, "skipped", "-", "-", "no budget left"])
            continue
        print(f"[gpu check] {step} (limit {limit:.0f} s): {' '.join(argv)}", flush=True)
        log = out_dir / f"{step}.log"
        t0 = time.time()
        try:
            with log.open("w") as f:
                proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                      cwd=REPO, timeout=limit)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        wall = time.time() - t0
        result = _step_result(step, out_dir)
        tail = log.read_text(errors="replace")[-2000:] if status != "ok" else ""
        results[step] = {"status": status, "wall_s": round(wall, 1), "limit_s": round(limit),
                         "argv": argv, "result": result, "log_tail": tail}
        rows.append([step, status, round(wall, 1), round(limit), _headline(step, result)])
        print(f"[gpu check] {step}: {status} in {wall:.1f} s", flush=True)
    (out_dir / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
    return {
        "title": f"GPU check on {name or 'this CPU (--small)'}",
        "columns": ["step", "status", "wall s", "limit s", "result"],
        "rows": rows,
        "steps": results,
        "summary": {"gpu": name, "hardware": hardware, "out_dir": str(out_dir),
                    "all_ok": all(r["status"] == "ok" for r in results.values()),
                    "total_s": round(time.time() - t_start, 1)},
    }
