"""staleness: final accuracy and throughput vs the staleness bound eta, naive PPO vs decoupled PPO.

    python -m areal_jax.bench staleness --config configs/tiny_demo.yaml \
        [--etas 0,1,2,4,8] [--seeds 0,1] [--versions 30] [key=value ...]

For each eta, each objective and each seed, one asynchronous training run:

- ``naive``: ``algo.decoupled=false``: prox = behav, no behaviour importance weight, so
  stale samples are treated as on-policy;
- ``decoupled``: the decoupled PPO objective (prox recomputed by the learner, importance
  weights w = exp(prox - behav), capped by ``algo.behav_imp_weight_cap``).

So that eta is actually reached, ``rollout.max_concurrent`` is set to (eta + 1) * B: the
gate may then hold up to eta + 1 batches of prompts in flight. Writes a Markdown table
``docs/staleness.md`` and a plot ``docs/staleness.png`` (accuracy vs eta, mean over seeds,
error bars = std over seeds), plus the JSON of every run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from areal_jax.bench.async_vs_sync import summarize, train_run


def add_arguments(p) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--etas", default="0,1,2,4,8")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--versions", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None,
                   help="train.batch_size (default: config)")
    p.add_argument("--work-dir", default="bench_results/staleness")
    p.add_argument("--docs-dir", default="docs")
    p.add_argument("overrides", nargs="*")


def run(args) -> dict:
    from areal_jax.config import load_config

    etas = [int(x) for x in args.etas.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    base = list(args.overrides)
    if args.versions:
        base.append(f"train.total_versions={args.versions}")
    if args.batch_size:
        base.append(f"train.batch_size={args.batch_size}")
    batch = load_config(args.config, base).train.batch_size
    work = Path(args.work_dir)
    results: dict[str, dict] = {}
    for eta in etas:
        for objective in ("naive", "decoupled"):
            for seed in seeds:
                name = f"eta{eta}-{objective}-s{seed}"
                overrides = base + [
                    "mode=async", f"rollout.max_staleness={eta}",
                    f"rollout.max_concurrent={(eta + 1) * batch}",
                    f"algo.decoupled={'true' if objective == 'decoupled' else 'false'}",
                    f"seed={seed}", "eval.every_versions=0", "eval.at_end=true",
                ]
                print(f"running {name} ...", flush=True)
                results[name] = summarize(train_run(args.config, overrides, work / name,
                                                    work / f"{name}.log"))
    columns = ["eta", "objective", "final eval acc (mean)", "std", "tokens/s", "staleness mean",
               "seeds"]
    rows, curves = [], {"naive": [], "decoupled": []}
    for eta in etas:
        for objective in ("naive", "decoupled"):
            rs = [results[f"eta{eta}-{objective}-s{s}"] for s in seeds]
            acc = np.array([r["final_eval_accuracy"] for r in rs])
            tps = float(np.mean([r["tokens_per_s"] for r in rs]))
            stale = float(np.mean([r["staleness_mean"] for r in rs]))
            rows.append([eta, objective, float(acc.mean()), float(acc.std()), tps, stale,
                         len(seeds)])
            curves[objective].append((eta, float(acc.mean()), float(acc.std())))
    initial = float(np.mean([r["initial_eval_accuracy"] for r in results.values()]))
    docs = Path(args.docs_dir)
    docs.mkdir(parents=True, exist_ok=True)
    _write_markdown(docs / "staleness.md", columns, rows, initial, args)
    _plot(docs / "staleness.png", curves, initial)
    gap = {eta: (dict((r[1], r[2]) for r in rows if r[0] == eta)) for eta in etas}
    summary = {
        "initial_eval_accuracy": initial,
        **{f"decoupled_minus_naive_eta{e}": g["decoupled"] - g["naive"] for e, g in gap.items()},
        "table": str(docs / "staleness.md"),
        "plot": str(docs / "staleness.png"),
    }
    return {"title": "staleness ablation: naive vs decoupled PPO", "columns": columns, "rows": rows,
            "summary": summary, "runs": results}


def _write_markdown(path: Path, columns, rows, initial: float, args) -> None:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in r]
        lines.append("| " + " | ".join(cells) + " |")
    cmd = (f"python scripts/bench.py staleness --config {args.config} --etas {args.etas} "
           f"--seeds {args.seeds}")
    if args.versions:
        cmd += f" --versions {args.versions}"
    if args.overrides:
        cmd += " " + " ".join(args.overrides)
    text = (f"# Staleness ablation\n\nCommand: `{cmd}`\n\nEval accuracy before training: "
            f"{initial:.3f}.\n\n" + "\n".join(lines) + "\n")
    path.write_text(text)


def _plot(path: Path, curves: dict, initial: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for objective, pts in curves.items():
        xs = [p[0] for p in pts]
        ax.errorbar(xs, [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3,
                    label=f"{objective} PPO")
    ax.axhline(initial, color="gray", linestyle=":", label="before RL")
    ax.set_xlabel("max staleness η")
    ax.set_ylabel("final eval accuracy (pass@1)")
    ax.set_xscale("symlog", base=2)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
