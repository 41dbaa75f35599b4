"""startup: seconds from process start to the first batch and the first learner step,
with a cold and a warm compilation cache.

    python -m areal_jax.bench startup [--config configs/tiny_demo.yaml] [--repeats 2]
                                      [--peer-repo DIR] [key=value ...]

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

import tempfile
from pathlib import Path

import numpy as np

from areal_jax.bench.common import REPO, run_train


def add_arguments(p) -> None:
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


def run(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-startup-"))
    work.mkdir(parents=True, exist_ok=True)
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
