"""longtail: async vs sync vs TRL GRPOTrainer, and interruptible weight updates, on the
long-tail task.

    python scripts/bench.py longtail [--versions 20] [--repeats 2] [--target 0.6] \
        [--docs docs/longtail] [--out docs/longtail.json] [--skip-trl] \
        [--trl-versions N] [--trl-repeats N]

The task (``builtin:longtail_train``, ``configs/longtail_demo.yaml``) has answers of 10 to
~325 tokens, most short: a synchronous step waits for its longest sample. Systems, each
its own process, interleaved (each once, then again for ``--repeats``):

- ``async``: the config as it is (engine on core 0, learner on core 1, eta 2,
  interruptible weight updates);
- ``sync``: ``mode=sync``, unpinned (generation and training alternate, each may use
  both cores: the strongest synchronous run this machine allows);
- ``async-nointerrupt``: ``rollout.interruptible=false`` (a weight update waits for the
  requests in flight);
- ``TRL GRPOTrainer`` (unless ``--skip-trl``): the same model, prompts, reward and
  hyper-parameters, the knobs mapped as ``bench.py trl`` maps them
  (``areal_jax/bench/trl.py``), ``max_completion_length`` 352. A TRL step of this task
  takes 30-70 s on 2 busy CPU cores, so ``--trl-versions`` and ``--trl-repeats`` may
  shorten its part; its time to the target is then a lower bound when it is not reached.

Each run reports, measured from process start:

- **training tokens/s**: prompt + completion tokens trained on / (wall time to the end of
  the last step minus the evals), start-up included, as ``bench.py trl``; and in steady
  state (after ``--warmup-versions``), as ``bench.py async-vs-sync``;
- **time to accuracy**: wall time until an eval first reaches ``--target``;
- **learner s/version** and **wait s/version**: medians after ``--warmup-versions`` of the
  learner's step and of its wait for a batch (in sync mode, the generation itself); the
  1-minute load average before and after each run is in ``load``;
- **time shares** of that training time: areal-jax from its metrics rows (the learner's
  wait for a batch, ``rollout_wait_s``, which is generation in sync mode; training,
  ``train/step_time_s``; publishing, ``publish_s``; the rest of each version; start-up);
  TRL from timers around its generation (+ scoring) and its training steps.

Each system's row is its median run (tokens/s; of two, the slower), with the range over
repeats; the steady-state figure and the times are medians of their own. The table
goes to the JSON, and with ``--docs STEM`` to ``STEM.md`` with the task's length
histogram, and the accuracy-vs-wall-time plot to ``STEM.png``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from areal_jax.bench.async_vs_sync import summarize
from areal_jax.bench.common import REPO, format_summary, format_table, run_train
from areal_jax.bench.trl import (
    _check_trl,
    areal_eval_seconds,
    plot_accuracy_curves,
    run_trl,
    time_to,
)

AREAL_SYSTEMS = {
    "async": [],
    "sync": ["mode=sync", "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null"],
    "async-nointerrupt": ["rollout.interruptible=false"],
}
TRL = "TRL GRPOTrainer"
SHARES = ("waiting", "training", "publishing", "other", "start-up")


def add_arguments(p) -> None:
    p.add_argument("--config", default=str(REPO / "configs" / "longtail_demo.yaml"))
    p.add_argument("--versions", type=int, default=20, help="training steps of each system")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", type=float, default=0.6, help="accuracy for time-to-accuracy")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup-versions", type=int, default=3,
                   help="versions left out of the steady-state throughput")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--trl-versions", type=int, default=None,
                   help="TRL's steps (default --versions; on 2 CPU cores a TRL step of this "
                        "task takes 30-70 s)")
    p.add_argument("--trl-repeats", type=int, default=None,
                   help="TRL runs, in the first repeats (default --repeats)")
    p.add_argument("--docs", default=None, help="write <docs>.md and <docs>.png")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--from-json", default=None,
                   help="no runs: re-make the tables and docs from this JSON's runs")


def length_histogram(split: str = "longtail_train", bins: tuple[int, ...] = (
        16, 32, 64, 128, 256, 512)) -> list[dict]:
    """Completion lengths (solution + eos, in tokens) of a built-in split, binned."""
    from areal_jax.data.builtin_task import make_split

    lengths = np.array([len(r["solution"]) + 1 for r in make_split(split)])
    out, lo = [], 0
    for hi in bins:
        n = int(((lengths > lo) & (lengths <= hi)).sum())
        out.append({"tokens": f"{lo + 1}-{hi}", "count": n, "fraction": n / len(lengths)})
        lo = hi
    return out


def format_histogram(hist: list[dict], width: int = 40) -> str:
    lines = []
    for h in hist:
        bar = "#" * max(round(h["fraction"] * width), 1 if h["count"] else 0)
        lines.append(f"{h['tokens']:>8} tokens | {h['fraction']:6.1%} {bar}")
    return "\n".join(lines)


def areal_time_shares(rows: list[dict], train_s: float) -> dict[str, float]:
    """Seconds of a run's training time (wall to the last step minus evals) per phase."""
    trained = [r for r in rows if "step_time_s" in r]
    wait = sum(r["rollout_wait_s"] for r in trained)
    train = sum(r.get("train/step_time_s", 0.0) for r in trained)
    publish = sum(r.get("publish_s", 0.0) for r in trained)
    steps = sum(r["step_time_s"] for r in trained)
    return {"waiting": wait, "training": train, "publishing": publish,
            "other": max(steps - wait - train - publish, 0.0),
            "start-up": max(train_s - steps, 0.0)}


def run_areal_system(config: str, overrides: list[str], work: Path, versions: int,
                     eval_every: int, warmup: int) -> dict:
    args = [f"train.total_versions={versions}", f"eval.every_versions={eval_every}",
            "progress_bar=false", "checkpoint.every_versions=0", *overrides]
    load_before = os.getloadavg()[0]
    done = run_train(config, args, work / "run", log_path=work / "train.log",
                     JAX_PLATFORMS="cpu")
    rows, t_launch = done.rows, done.t_launch
    evals = [{"step": r["version"], "accuracy": r["eval_accuracy"], "time_s": r["time"] - t_launch}
             for r in rows if "eval_accuracy" in r]
    trained = [r for r in rows if "tokens_consumed" in r]
    train_end = trained[-1]["time"] - t_launch
    eval_s = areal_eval_seconds(rows)
    steady = summarize(rows, warmup)
    return {"evals": evals, "tokens": float(trained[-1]["tokens_consumed"]),
            "train_end_s": train_end, "eval_s": eval_s, "total_s": done.total_s,
            "tokens_per_s": trained[-1]["tokens_consumed"] / max(train_end - eval_s, 1e-9),
            "steady_tokens_per_s": steady["tokens_per_s"],
            "completion_tokens_mean": float(np.mean([r["completion_tokens_mean"]
                                                     for r in trained])),
            "time_shares": areal_time_shares(rows, train_end - eval_s),
            **per_version_seconds(rows, warmup),
            "load_1min": [load_before, os.getloadavg()[0]]}


def per_version_seconds(rows: list[dict], warmup: int) -> dict[str, float]:
    """Medians over the versions after ``warmup``: the learner's step (``train/step_time_s``)
    and the wait for a batch (``rollout_wait_s``: generation itself in sync mode)."""
    steady = [r for r in rows if "step_time_s" in r and r["version"] > warmup]
    return {"learner_s_per_version": _median([r.get("train/step_time_s", float("nan"))
                                              for r in steady] or [float("nan")]),
            "wait_s_per_version": _median([r["rollout_wait_s"] for r in steady]
                                          or [float("nan")])}


def _median_run(ms: list[dict]) -> dict:
    ordered = sorted(ms, key=lambda m: m["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def _median(values: list[float]) -> float:
    """The median; of an even count, the lower middle value (a run that happened)."""
    return sorted(values)[(len(values) - 1) // 2]


def _median_time_to(ms: list[dict], target: float, after_start: bool = False) -> float:
    """The median over runs of the time to ``target``: from process start, or (after_start)
    from the step-0 eval, i.e. with start-up (model load, compilation) left out."""
    times = [t - (m["evals"][0]["time_s"] if after_start else 0.0)
             for m in ms if (t := time_to(m["evals"], target)) is not None]
    return float(np.median(times)) if times else float("nan")


def _load_range(ms: list[dict]) -> str:
    loads = [v for x in ms for v in x.get("load_1min", [])]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"


def shares_text(shares: dict[str, float], total: float) -> str:
    return ", ".join(f"{k} {v / max(total, 1e-9):.0%}" for k, v in shares.items() if v > 0)


def summarise_runs(runs: dict[str, list[dict]], target: float) -> tuple[list, list, dict]:
    """The table (one row per system: its median run) and the ratios."""
    columns = ["system", "tokens/s", "range", "steady tokens/s", f"time to {target} s",
               "after start-up s", "reached", "final acc (step)", "learner s/version",
               "wait s/version", "load", "time shares (of training time)"]
    rows, med = [], {}
    for name, ms in runs.items():
        m = _median_run(ms)
        med[name] = {"tokens_per_s": m["tokens_per_s"],
                     "steady": _median([x.get("steady_tokens_per_s", float("nan")) for x in ms]),
                     "time_to": _median_time_to(ms, target),
                     "time_after": _median_time_to(ms, target, after_start=True),
                     "last_eval_s": max(x["evals"][-1]["time_s"] for x in ms)}
        tps = [x["tokens_per_s"] for x in ms]
        reached = sum(time_to(x["evals"], target) is not None for x in ms)
        rows.append([name, m["tokens_per_s"], f"{min(tps):.0f}-{max(tps):.0f}",
                     med[name]["steady"], med[name]["time_to"], med[name]["time_after"],
                     f"{reached}/{len(ms)}",
                     f"{m['evals'][-1]['accuracy']:.3f} ({m['evals'][-1]['step']})",
                     _median([x.get("learner_s_per_version", float("nan")) for x in ms]),
                     _median([x.get("wait_s_per_version", float("nan")) for x in ms]),
                     _load_range(ms),
                     shares_text(m.get("time_shares", {}), m["train_end_s"] - m["eval_s"])])
    summary: dict[str, float | str] = {}
    a = med["async"]
    for peer in ("sync", TRL):
        if peer in med:
            summary[f"tokens/s async / {peer}"] = a["tokens_per_s"] / med[peer]["tokens_per_s"]
            if peer != TRL:
                summary[f"steady tokens/s async / {peer}"] = a["steady"] / med[peer]["steady"]
            if np.isnan(med[peer]["time_to"]):  # not reached: its last eval is a lower bound
                summary[f"time to {target} async / {peer} (at most; {peer} did not reach it)"] = (
                    a["time_to"] / med[peer]["last_eval_s"])
            else:
                summary[f"time to {target} async / {peer}"] = a["time_to"] / med[peer]["time_to"]
                summary[f"time to {target} after start-up async / {peer}"] = (
                    a["time_after"] / med[peer]["time_after"])
    if "async-nointerrupt" in med:
        summary["tokens/s interruptible / not"] = (a["tokens_per_s"]
                                                   / med["async-nointerrupt"]["tokens_per_s"])
        summary["steady tokens/s interruptible / not"] = (a["steady"]
                                                          / med["async-nointerrupt"]["steady"])
    return columns, rows, summary


def run(args) -> dict:
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        result = finish(saved["runs"], saved["title"], args, saved.get("argv"))
        result["runs_made_by"] = {"argv": saved.get("argv"), "wall_s": saved.get("wall_s")}
        return result
    if not args.skip_trl:
        _check_trl()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-longtail-"))
    names = [*AREAL_SYSTEMS, *([] if args.skip_trl else [TRL])]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for k, name in enumerate(names):
            d = work / f"system{k}-run{rep}"  # a fresh run dir each (a reused one would resume)
            d.mkdir(parents=True, exist_ok=True)
            if name == TRL:
                if rep >= (args.trl_repeats or args.repeats):
                    continue
                m = run_trl(d, args.trl_versions or args.versions, args.eval_every,
                            task="longtail")
            else:
                m = run_areal_system(args.config, AREAL_SYSTEMS[name], d, args.versions,
                                     args.eval_every, args.warmup_versions)
            runs[name].append(m)
            print(f"{name} #{rep}: tokens/s {m['tokens_per_s']:.0f}, time to {args.target}: "
                  f"{time_to(m['evals'], args.target)}, shares "
                  f"{shares_text(m.get('time_shares', {}), m['train_end_s'] - m['eval_s'])}, "
                  "evals " + " ".join(f"{e['step']}:{e['accuracy']:.3f}@{e['time_s']:.1f}s"
                                      for e in m["evals"]), flush=True)
    return finish(runs, f"long-tail task: async vs sync vs TRL ({args.versions} steps, "
                        f"{args.repeats} repeats)", args)


def finish(runs: dict[str, list[dict]], title: str, args, argv: list[str] | None = None
           ) -> dict:
    """The result (table, ratios, histogram) of finished runs; the docs with ``--docs``.
    ``argv``: the command line that made the runs (default this one)."""
    columns, rows, summary = summarise_runs(runs, args.target)
    result = {"title": title, "columns": columns, "rows": rows, "summary": summary,
              "runs": runs, "length_histogram": length_histogram()}
    if args.docs:
        write_docs(Path(args.docs), result, args, argv or sys.argv[1:])
    return result


def write_docs(stem: Path, result: dict, args, argv: list[str]) -> None:
    """``<stem>.png``: accuracy against wall time for every run; ``<stem>.md``: the tables."""
    plot_accuracy_curves(result["runs"], args.target, stem.with_suffix(".png"),
                         {"async": "tab:blue", "sync": "tab:red",
                          "async-nointerrupt": "tab:green", TRL: "tab:orange"},
                         "eval accuracy (pass@1, T=1, 64 prompts)",
                         "long-tail task: async vs sync vs TRL GRPOTrainer")
    shown = [a for i, a in enumerate(argv)  # the work dir is this machine's business
             if a != "--work-dir" and (i == 0 or argv[i - 1] != "--work-dir")]
    cmd = "python scripts/bench.py " + " ".join(shown)
    lines = [f"# {result['title']}", "", f"Made by `{cmd}`.", "",
             "Completion lengths of `builtin:longtail_train` (solution + eos):", "", "```",
             format_histogram(result["length_histogram"]), "```", "", "```",
             format_table(result["columns"], result["rows"]), "```", ""]
    lines += format_summary(result["summary"], prefix="- ")
    lines += ["", "Accuracy at each eval (step: accuracy @ seconds since process start):", ""]
    for name, ms in result["runs"].items():
        for i, m in enumerate(ms):
            lines.append(f"- {name} run {i}: " + ", ".join(
                f"{e['step']}: {e['accuracy']:.3f} @ {e['time_s']:.1f}s" for e in m["evals"]))
    lines += ["", f"![accuracy vs wall time]({stem.with_suffix('.png').name})", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
