"""async-vs-sync: the same config trained synchronously and asynchronously, one after the other.

    python -m areal_jax.bench async-vs-sync --config configs/tiny_demo.yaml [--versions 40] \
        [key=value ...]

Runs, each as its own ``scripts/train.py`` process (fresh run dirs under ``--work-dir``):

1. ``sync``: mode=sync (eta = 0, no overlap), unpinned. Generation and training
   alternate, so each phase may use both CPU cores: the strongest synchronous run this
   machine allows.
2. ``sync-pinned``: mode=sync with the async runs' allocation (server on
   ``--server-cores``, learner on ``--learner-cores``). This is the disaggregated
   setting of AReaL, where generation and training own separate devices; a synchronous
   run leaves one side idle while the other works.
3. ``async``: mode=async with the config's eta, server and learner pinned as in 2, so
   the two overlap without competing.
4. ``async-nointerrupt`` (unless ``--skip-nointerrupt``): as 3 with
   ``rollout.interruptible=false``: a weight update waits for in-flight requests.

Effective throughput is trajectory tokens consumed by the learner per wall second,
measured in steady state: from the end of version ``--warmup-versions`` (start-up and
the compilations of the first versions are excluded equally) to the end of the last.
The overlap bound is computed from a synchronous run's measured components, T_gen (the
learner's wait for a batch) and T_train (the rest of a version):
bound = (T_gen + T_train) / max(T_gen, T_train).

``--repeats N`` runs the whole set N times, interleaved (sync, sync-pinned, async, ...,
then again), so slow drifts of the machine hit every kind alike. Each row is then the
run with the median tokens/s of its kind, and the table adds the min-max range.
Run-to-run spread on a 2-core machine is ~10-20%, so single runs decide little.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from areal_jax.bench.common import run_train


def add_arguments(p) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--versions", type=int, default=None,
                   help="train.total_versions (default: config)")
    p.add_argument("--work-dir", default="bench_results/async_vs_sync")
    p.add_argument("--skip-nointerrupt", action="store_true")
    p.add_argument("--warmup-versions", type=int, default=4,
                   help="versions excluded from the throughput window (compilation)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole set this many times, interleaved; rows are medians")
    p.add_argument("--server-cores", default="0", help="async runs: server cores, e.g. 0")
    p.add_argument("--learner-cores", default="1", help="async runs: learner cores, e.g. 1")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")


def train_run(config: str, overrides: list[str], run_dir: Path, log_path: Path,
              timeout_s: float = 7200) -> list[dict]:
    """One scripts/train.py run in a fresh run dir; returns its metrics rows."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    done = run_train(config, ["progress_bar=false", *overrides], run_dir,
                     flags=["--no-resume"], log_path=log_path, timeout_s=timeout_s)
    print(f"  {run_dir.name}: {len(done.rows)} rows in {done.total_s:.0f}s", flush=True)
    return done.rows


def summarize(rows: list[dict], warmup_versions: int = 1) -> dict:
    """Steady-state throughput (after ``warmup_versions``), final accuracy, phase times."""
    train_rows = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    skip = min(max(warmup_versions, 1), len(train_rows) - 2)
    if skip < 1:
        raise ValueError(f"need at least 3 versions for a throughput window, got {len(train_rows)}")
    first, last = train_rows[skip - 1], train_rows[-1]
    dt = last["wall_time_s"] - first["wall_time_s"]
    dtok = last["tokens_consumed"] - first["tokens_consumed"]
    steady = train_rows[skip:]
    wait = float(np.mean([r["rollout_wait_s"] for r in steady]))
    version_time = float(np.mean([r["step_time_s"] for r in steady]))
    return {
        "tokens_per_s": dtok / max(dt, 1e-9),
        "versions": len(train_rows),
        "wall_s": last["wall_time_s"],
        "final_eval_accuracy": evals[-1]["eval_accuracy"] if evals else float("nan"),
        "initial_eval_accuracy": evals[0]["eval_accuracy"] if evals else float("nan"),
        "reward_last5": float(np.mean([r["reward_mean"] for r in train_rows[-5:]])),
        "t_gen_s": wait,
        "t_train_s": max(version_time - wait, 0.0),
        "version_time_s": version_time,
        "staleness_mean": float(np.nanmean([r.get("staleness_mean", np.nan) for r in steady])),
    }


def run(args) -> dict:
    work = Path(args.work_dir)
    common = list(args.overrides)
    if args.versions:
        common.append(f"train.total_versions={args.versions}")
    pin = [f"rollout.server_cpu_cores=[{args.server_cores}]",
           f"rollout.learner_cpu_cores=[{args.learner_cores}]"]
    unpinned = ["rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null"]
    runs = {
        "sync": common + ["mode=sync", *unpinned],
        "sync-pinned": common + ["mode=sync", *pin],
        "async": common + ["mode=async", *pin],
    }
    if not args.skip_nointerrupt:
        runs["async-nointerrupt"] = common + ["mode=async", "rollout.interruptible=false", *pin]
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    every: dict[str, list[dict]] = {name: [] for name in runs}
    for rep in range(args.repeats):
        for name, overrides in runs.items():
            tag = name if args.repeats == 1 else f"{name}-r{rep}"
            print(f"running {tag} ...", flush=True)
            rows = train_run(args.config, overrides, work / tag, work / f"{tag}.log")
            every[name].append(summarize(rows, args.warmup_versions))
    results = {}
    for name, summaries in every.items():  # the median run of each kind
        ordered = sorted(summaries, key=lambda r: r["tokens_per_s"])
        results[name] = {**ordered[(len(ordered) - 1) // 2],
                         "tokens_per_s_all": [r["tokens_per_s"] for r in summaries]}
    sync = results["sync"]

    def bound_of(r: dict) -> float:
        return (r["t_gen_s"] + r["t_train_s"]) / max(r["t_gen_s"], r["t_train_s"], 1e-9)

    bound = bound_of(sync)
    pinned = results["sync-pinned"]
    columns = ["run", "tokens/s", "range", "vs sync", "vs sync-pinned", "final eval acc",
               "initial eval acc", "version time s", "T_gen s", "T_train s", "staleness mean"]
    table = []
    for name, r in results.items():
        spread = f"{min(r['tokens_per_s_all']):.0f}-{max(r['tokens_per_s_all']):.0f}"
        table.append([name, r["tokens_per_s"], spread, r["tokens_per_s"] / sync["tokens_per_s"],
                      r["tokens_per_s"] / pinned["tokens_per_s"],
                      r["final_eval_accuracy"], r["initial_eval_accuracy"], r["version_time_s"],
                      r["t_gen_s"], r["t_train_s"], r["staleness_mean"]])
    speedup = results["async"]["tokens_per_s"] / sync["tokens_per_s"]
    speedup_pinned = results["async"]["tokens_per_s"] / pinned["tokens_per_s"]
    summary = {
        "async_over_sync": speedup,
        "overlap_bound": bound,
        "async_fraction_of_bound": speedup / bound,
        "async_over_sync_same_cores": speedup_pinned,
        "overlap_bound_same_cores": bound_of(pinned),
        "async_fraction_of_bound_same_cores": speedup_pinned / bound_of(pinned),
        "accuracy_sync": sync["final_eval_accuracy"],
        "accuracy_async": results["async"]["final_eval_accuracy"],
        "core_allocation": f"sync: unpinned (phases alternate on both cores); sync-pinned and "
                           f"async: server cores [{args.server_cores}], learner cores "
                           f"[{args.learner_cores}]",
    }
    if "async-nointerrupt" in results:
        summary["interruption_gain"] = (results["async"]["tokens_per_s"]
                                        / results["async-nointerrupt"]["tokens_per_s"])
    summary["repeats"] = args.repeats
    return {"title": "async vs sync (effective training throughput)", "columns": columns,
            "rows": table, "summary": summary, "runs": results}
