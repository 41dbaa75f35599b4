"""memory-run: peak RSS of real training runs, one device per process, fsdp=1 vs fsdp=2.

    python -m areal_jax.bench memory-run [--preset qwen2.5-0.5b --layers 24 --dtype float32]
                                         [--seq-len 512 --rows 2 --versions 3] [key=value ...]

A random model of the preset's shape (vocabulary included) is written locally as an HF
directory, with the demo's arithmetic tokenizer (20 tokens; the extra embedding rows are
never in a prompt, and what the random policy generates past them decodes to nothing and
scores 0). ``scripts/train.py --config configs/tiny_demo.yaml`` then trains it
for ``--versions`` versions (batches of ``--batch-size`` prompts x ``--n-samples``, no
evals, the one checkpoint at the end that every run writes, ``model.remat=full``), twice:

* ``fsdp=1``: one process with one XLA CPU device, ``--mesh data=1,fsdp=1,tensor=1``;
* ``fsdp=2``: two JAX processes of one CPU device each (``JAX_COORDINATOR_ADDRESS`` on
  127.0.0.1), ``--mesh data=1,fsdp=2,tensor=1``,

so that each trainer process's RSS is one device's memory. Process 0 of each run starts
the embedded rollout server (a process of its own; its peak is reported apart).

Peak RSS is the kernel's high-water mark (``VmHWM`` in ``/proc/PID/status``), read every
``--interval-s`` while the process lives; ``at exit`` is the last reading, taken at most
one interval before the process ended. ``peak RSS`` (``training``) is the reading taken
when the row of version ``--versions - 1`` appears in ``metrics.jsonl``: every process is
then training the last version, so it covers loading, compiling, full versions and their
publishes, but not the final Orbax checkpoint and the shutdown that ``at exit`` adds.
``bytes/param`` divides by the parameter count of the whole model.

Next to them, the compiled figures for the same shape and micro-batch
(``--rows x --seq-len`` tokens, split over fsdp), as ``python -m areal_jax.bench memory``
computes them: fp32 params + AdamW moments + gradient accumulator (16 B/param / fsdp) plus
the larger of the gradient and optimizer programs' ``memory_analysis`` temporaries
(compiled in this process over 2 XLA CPU devices; compile only).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_jax.bench.common import REPO, kill_all, read_metrics, repo_file, script_env

GIB = 2**30
RUNS = (("fsdp=1", 1, "data=1,fsdp=1,tensor=1"), ("fsdp=2", 2, "data=1,fsdp=2,tensor=1"))
ONE_CPU_DEVICE = "--xla_force_host_platform_device_count=1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_demo.yaml"))
    parser.add_argument("--preset", default="qwen2.5-0.5b",
                        help="model_defs ModelConfig preset of the random model")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the preset's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model.dtype (and the saved weights' dtype)")
    parser.add_argument("--seq-len", type=int, default=512, help="train.seq_len")
    parser.add_argument("--rows", type=int, default=2,
                        help="train.rows_per_micro_batch (a multiple of 2, for fsdp=2)")
    parser.add_argument("--versions", type=int, default=3, help="train.total_versions (>= 2)")
    parser.add_argument("--batch-size", type=int, default=2, help="train.batch_size (prompts)")
    parser.add_argument("--n-samples", type=int, default=2, help="rollout.n_samples")
    parser.add_argument("--max-new-tokens", type=int, default=16,
                        help="rollout.max_new_tokens")
    parser.add_argument("--interval-s", type=float, default=0.2, help="RSS sampling interval")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per run")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the compiled (memory_analysis) figures")
    parser.add_argument("--work-dir", default=None,
                        help="model dir, run dirs and logs (default: a temp dir, removed)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")


# ----------------------------------------------------------------------------- the model
def model_config(preset: str, layers: int | None = None) -> Any:
    """The preset's shape with the demo tokenizer's bos/eos ids (vocabulary unchanged)."""
    from areal_jax.data import builtin_task as bt
    from model_defs import ModelConfig

    overrides: dict[str, Any] = {"bos_token_id": bt.BOS_ID, "eos_token_id": bt.EOS_ID}
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    return ModelConfig.preset(preset, **overrides)


def write_model_dir(preset: str, layers: int | None, dtype: str, out: str) -> None:
    """A random model of ``model_config(preset, layers)`` (seed 0) saved as an HF directory
    in ``dtype``, with the built-in arithmetic tokenizer."""
    from flax import nnx

    from areal_jax.data import builtin_task as bt
    from model_defs import CausalLM, save_hf

    cfg = model_config(preset, layers)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    save_hf(model, cfg, out, dtype=dtype)
    bt.save_tokenizer(out)


def _write_model_dir_in_child(args: argparse.Namespace, out: Path) -> None:
    """In its own process, so this one never holds the weights while the runs are measured."""
    code = ("from areal_jax.bench.memory_run import write_model_dir; "
            f"write_model_dir({args.preset!r}, {args.layers!r}, {args.dtype!r}, {str(out)!r})")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=script_env(REPO, JAX_PLATFORMS="cpu"), cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"writing the random model to {out} failed:\n{res.stderr[-3000:]}")


# ----------------------------------------------------------------------------- RSS
def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak RSS so far (``VmHWM``), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None  # a zombie: no memory lines left


@dataclass
class _Watched:
    """Peak-RSS readings of one process: the latest, and the one at the training mark."""

    pid: int
    peak: int = 0
    at_mark: int | None = None

    def read(self) -> None:
        value = peak_rss_bytes(self.pid)
        if value is not None:
            self.peak = max(self.peak, value)


@dataclass
class RunResult:
    name: str
    mesh: str
    processes: int
    versions: list[int]
    trainers: list[_Watched]
    server: _Watched | None
    logs: list[str] = field(default_factory=list)


def _engine_server_pid(trainer_pid: int) -> int | None:
    import psutil

    try:
        for child in psutil.Process(trainer_pid).children(recursive=True):
            if "areal_jax.engine.server" in " ".join(child.cmdline()):
                return child.pid
    except psutil.Error:
        pass
    return None


def _rows_so_far(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, ValueError):  # not there yet, or a line half written
        return []


def train_run(name: str, n_procs: int, mesh: str, config: str, overrides: list[str],
              run_dir: Path, logs: Path, *, mark_version: int, interval_s: float,
              timeout_s: float) -> RunResult:
    """``n_procs`` ``scripts/train.py`` processes of one CPU device each (a JAX job on
    127.0.0.1 when there are several), their peak RSS and their engine server's, read
    until they exit. Raises RuntimeError, with a log's tail, when one fails."""
    train_py = repo_file("scripts/train.py")
    from areal_jax.engine.launch import free_port

    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs, log_paths = [], []
    for pid in range(n_procs):
        env = script_env(REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=ONE_CPU_DEVICE)
        if n_procs > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAX_NUM_PROCESSES=str(n_procs), JAX_PROCESS_ID=str(pid))
        log_path = logs / f"{name.replace('=', '')}.process{pid}.log"
        log_paths.append(str(log_path))
        with log_path.open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(train_py), "--config", config, "--mesh", mesh,
                 f"run_dir={run_dir}", *overrides],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO))
    trainers = [_Watched(p.pid) for p in procs]
    server: _Watched | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if server is None and (spid := _engine_server_pid(procs[0].pid)) is not None:
                server = _Watched(spid)
            for w in trainers + ([server] if server else []):
                w.read()  # before poll(): a reaped process has no /proc entry left
            if trainers[0].at_mark is None and any(
                    r.get("version") == mark_version for r in _rows_so_far(run_dir)):
                for w in trainers + ([server] if server else []):
                    w.at_mark = w.peak
            if all(p.poll() is not None for p in procs):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not done after {timeout_s:.0f}s; logs {log_paths}")
            time.sleep(interval_s)
    finally:
        kill_all(procs)
    for i, p in enumerate(procs):
        if p.returncode != 0:
            tail = Path(log_paths[i]).read_text()[-3000:]
            raise RuntimeError(f"{name}: {train_py} process {i} failed (exit {p.returncode}); "
                               f"log {log_paths[i]}:\n{tail}")
    versions = [r["version"] for r in read_metrics(run_dir) if "train/loss" in r]
    return RunResult(name, mesh, n_procs, versions, trainers, server, log_paths)


def _run_overrides(args: argparse.Namespace, model_dir: Path) -> list[str]:
    return [
        f"model.path={model_dir}", f"model.dtype={args.dtype}", "model.remat=full",
        f"train.total_versions={args.versions}", f"train.batch_size={args.batch_size}",
        f"train.seq_len={args.seq_len}", f"train.rows_per_micro_batch={args.rows}",
        f"rollout.n_samples={args.n_samples}", f"rollout.max_new_tokens={args.max_new_tokens}",
        # The built-in prompts are under 32 tokens; every slot of the engine is this long.
        f"rollout.max_seq_len={args.max_new_tokens + 64}", "rollout.max_slots=8",
        "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null",
        "eval.at_start=false", "eval.every_versions=0", "eval.at_end=false",
        "checkpoint.every_versions=0", "checkpoint.keep=1",
        # Every program compiled in its process, in both runs (no cache filled by the first).
        "compilation_cache_dir=null", "progress_bar=false", *args.overrides,
    ]


# ----------------------------------------------------------------------------- compiled
def compiled_figures(cfg: Any, args: argparse.Namespace, mesh_spec: str, n_devices: int
                     ) -> dict[str, Any]:
    """``plan.memory``'s compiled bytes/param per device (and its formula's prediction) for
    this shape and micro-batch on ``mesh_spec`` over this process's first devices."""
    import jax

    from areal_jax.parallel.mesh import make_mesh
    from areal_jax.plan import memory

    mesh = make_mesh(mesh_spec, devices=jax.devices()[:n_devices])
    shards = mesh.shape["fsdp"] * mesh.shape["tensor"]
    ns = argparse.Namespace(dtype=args.dtype, learner_seq=args.seq_len, learner_rows=args.rows)
    got = memory.learner_bytes(cfg, ns, True, mesh, shards, lora_rank=0)
    tokens = args.rows * args.seq_len // (mesh.shape["data"] * mesh.shape["fsdp"])
    predicted = memory.predicted_learner_bytes(cfg, got["n_params"], tokens, args.dtype, shards)
    return {**got, "predicted_peak": round(predicted["peak"] / got["n_params"], 2)}


# ----------------------------------------------------------------------------- run
def _gib(n: float | None) -> float | str:
    return round(n / GIB, 2) if n else "-"


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.versions < 2:
        raise SystemExit("--versions must be >= 2 (the training peak is read during the last)")
    if args.rows % 2:
        raise SystemExit("--rows must be a multiple of 2 (fsdp=2 splits each micro-batch)")
    if not args.no_compiled:  # two XLA CPU devices in this process, before JAX starts
        from areal_jax.engine.config import request_cpu_devices

        request_cpu_devices(2)
    from areal_jax.plan.memory import _abstract_model

    cfg = model_config(args.preset, args.layers)
    n_params = _abstract_model(cfg, args.dtype, False)[3]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="areal-memory-run-"))
    try:
        model_dir = work / "model"
        _write_model_dir_in_child(args, model_dir)
        overrides = _run_overrides(args, model_dir)
        results = [train_run(name, n, mesh, args.config, overrides, work / name.replace("=", ""),
                             work / "logs", mark_version=args.versions - 1,
                             interval_s=args.interval_s, timeout_s=args.timeout_s)
                   for name, n, mesh in RUNS]
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    compiled = {} if args.no_compiled else {
        name: compiled_figures(cfg, args, mesh, n) for name, n, mesh in RUNS}

    one_device = results[0].trainers[0].at_mark
    rows, runs_json = [], []
    for res in results:
        per_process = []
        for i, w in enumerate(res.trainers):
            server = res.server if i == 0 else None
            rows.append([
                res.name, f"{i} of {res.processes}", len(res.versions), _gib(w.at_mark),
                round(w.at_mark / n_params, 2) if w.at_mark else "-",
                round(w.at_mark / one_device, 3) if w.at_mark and one_device else "-",
                _gib(w.peak), _gib(server.peak) if server else "-",
                compiled[res.name]["peak"] if compiled else "-",
            ])
            per_process.append({"process": i, "peak_rss_training_bytes": w.at_mark,
                                "peak_rss_at_exit_bytes": w.peak})
        runs_json.append({
            "run": res.name, "mesh": res.mesh, "processes": res.processes,
            "versions_completed": res.versions, "trainers": per_process,
            "server_peak_rss_bytes": res.server.peak if res.server else None,
            "server_peak_rss_training_bytes": res.server.at_mark if res.server else None,
            "compiled": compiled.get(res.name), "logs": res.logs if args.work_dir else None,
        })

    two_device = max((w.at_mark or 0) for w in results[1].trainers)
    summary: dict[str, Any] = {
        "model": f"{args.preset} shape, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, "
                 f"{n_params / 1e6:.0f}M params, {args.dtype}, remat full (random weights)",
        "micro-batch": f"{args.rows} x {args.seq_len} tokens (per device: fsdp=1 "
                       f"{args.rows} rows, fsdp=2 {args.rows // 2})",
        "versions per run": args.versions,
        "peak RSS per device, fsdp=2 / fsdp=1 (training, larger process)":
            round(two_device / one_device, 3) if one_device and two_device else "-",
    }
    if compiled:
        summary.update({
            "compiled peak B/param, fsdp=2 / fsdp=1":
                round(compiled["fsdp=2"]["peak"] / compiled["fsdp=1"]["peak"], 3),
            **{f"compiled {k}: held / peak B/param, grad / apply temp MiB, predicted peak":
               f"{c['held']} / {c['peak']}, {c['grad_temp_mib']} / {c['apply_temp_mib']}, "
               f"{c['predicted_peak']}" for k, c in compiled.items()},
        })
    return {"title": "learner memory in real train.py runs: peak RSS per trainer process "
                     "(one CPU device each)",
            "columns": ["run", "process", "versions", "peak RSS GiB", "B/param", "x fsdp=1",
                        "at exit GiB", "server GiB", "compiled B/param"],
            "rows": rows, "summary": summary, "n_params": n_params, "runs": runs_json,
            "settings": {"preset": args.preset, "layers": cfg.num_hidden_layers,
                         "dtype": args.dtype, "seq_len": args.seq_len, "rows": args.rows,
                         "versions": args.versions, "batch_size": args.batch_size,
                         "n_samples": args.n_samples, "max_new_tokens": args.max_new_tokens,
                         "overrides": _run_overrides(args, Path("MODEL"))}}
