"""What the benchmarks share: the result table and JSON, timing, tiny random models, and
training runs of a checkout's ``scripts/train.py`` in their own processes.

The contract of a benchmark module (``areal_jax.bench.<name>``):

- ``add_arguments(parser: argparse.ArgumentParser) -> None`` adds its options;
- ``run(args: argparse.Namespace) -> dict`` runs it and returns ``title``, ``columns``,
  ``rows`` (a list of lists, one per table row) and ``summary`` (a flat dict), plus
  whatever else belongs in the JSON.

Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Benchmark(Protocol):
    """What a benchmark module provides (the contract above)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> dict[str, Any]: ...


# The checkout that holds this package (areal_jax/bench/common.py -> the repo root): its
# scripts/ and configs/ are beside areal_jax/ in a source (or editable) install.
REPO = Path(__file__).resolve().parents[2]


def repo_file(relative: str, repo: Path = REPO) -> Path:
    """``repo/relative``, which must exist (benchmarks that run scripts/train.py need a
    source checkout, not a wheel)."""
    path = repo / relative
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: this benchmark runs a source checkout's {relative} "
            f"(clone the repo and pip install -e . there)")
    return path


# ----------------------------------------------------------------------------- results
def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats are shown with 4 significant digits."""

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    text_rows = [[cell(v) for v in r] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in text_rows)) if text_rows else len(c)
              for i, c in enumerate(columns)]
    line = " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    sep = "-+-".join("-" * w for w in widths)
    body = "\n".join(" | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
                     for r in text_rows)
    return f"{line}\n{sep}\n{body}"


def format_summary(summary: dict[str, Any], prefix: str = "") -> list[str]:
    """One ``key: value`` line per summary entry (floats with 4 significant digits)."""
    return [f"{prefix}{k}: {v:.4g}" if isinstance(v, float) else f"{prefix}{k}: {v}"
            for k, v in summary.items()]


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(),
                            "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_devices"] = [str(d) for d in jax.devices()]
    except Exception:  # noqa: BLE001 - info only
        pass
    return info


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return path


# ----------------------------------------------------------------------------- timing
def time_calls(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` (which must block until it is done)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def interleaved_times(systems: dict[str, Callable[[], Any]], repeats: int
                      ) -> dict[str, list[float]]:
    """Wall seconds per call of each system, the systems called in turn ``repeats`` times,
    so noise from other processes hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            times[name].extend(time_calls(fn, 1))
    return times


# ----------------------------------------------------------------------------- models
def save_random_hf(cfg: Any, out_dir: Path, name: str) -> Path:
    """A transformers model of ``cfg`` (a ``model_defs.ModelConfig``) with random weights
    (torch seed 0), saved as an HF checkpoint ``out_dir/name``. Needs torch and
    transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dict = cfg.to_hf_dict()
    hf_config = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    path = out_dir / name
    model.save_pretrained(path, safe_serialization=True)
    return path


# ----------------------------------------------------------------------------- train runs
@dataclass
class TrainRun:
    """One finished ``scripts/train.py`` process."""

    rows: list[dict[str, Any]]  # metrics.jsonl, one dict per line
    t_launch: float  # time.time() just before the process started
    total_s: float  # the whole command, start to exit


def kill_all(procs: Sequence[Any]) -> None:
    """Kills and reaps every process of ``procs`` (``subprocess.Popen``) still running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def script_env(repo: Path = REPO, **extra: str) -> dict[str, str]:
    """This process's environment for a script of ``repo``: ``repo`` first on PYTHONPATH
    (so that checkout's areal_jax is the one imported), no XLA_FLAGS (one CPU device, as a
    user would have), plus ``extra``."""
    env = dict(os.environ, **extra)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
    return env


def run_train(config: str, overrides: Sequence[str], run_dir: Path, *, repo: Path = REPO,
              flags: Sequence[str] = (), log_path: Path | None = None,
              timeout_s: float | None = None, **env: str) -> TrainRun:
    """Runs ``repo``'s ``scripts/train.py --config config *flags run_dir=run_dir
    *overrides`` in its own process (cwd ``repo``, environment ``script_env(repo, **env)``);
    output goes to ``log_path`` (else it is kept for the error message). Raises
    RuntimeError, with the output's tail, when it fails."""
    train_py = repo_file("scripts/train.py", repo)
    cmd = [sys.executable, str(train_py), "--config", config, *flags, f"run_dir={run_dir}",
           *overrides]
    t0 = time.time()
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 env=script_env(repo, **env), cwd=repo, timeout=timeout_s)
        where, tail = f"log {log_path}", log_path.read_text()[-3000:]
    else:
        res = subprocess.run(cmd, capture_output=True, text=True, env=script_env(repo, **env),
                             cwd=repo, timeout=timeout_s)
        where, tail = "stderr", res.stderr[-3000:]
    total = time.time() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{train_py} failed (exit {res.returncode}); {where}:\n{tail}")
    return TrainRun(read_metrics(run_dir), t0, total)
