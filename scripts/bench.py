"""Benchmarks. Each prints a table and writes JSON; figures are ratios against a peer
measured side by side in the same run.

    python scripts/bench.py forward   [options]   # model forward tokens/s vs transformers
    python scripts/bench.py train     [options]   # train-step tokens/s vs transformers + torch AdamW
    python scripts/bench.py generate  [options]   # engine decode tokens/s vs transformers generate
    python scripts/bench.py async-vs-sync --config configs/X.yaml
    python scripts/bench.py staleness --config configs/X.yaml
    python scripts/bench.py losses    [options]   # chunked log-probs/entropy vs full logits
    python scripts/bench.py memory    [options]   # learner compiled memory vs T, bytes/param
    python scripts/bench.py startup   [options]   # process start to first batch / first step
    python scripts/bench.py trl       [options]   # areal-jax vs TRL GRPOTrainer on the demo

Each subcommand lives in scripts/bench_<name>.py and defines
``add_arguments(parser)`` and ``run(args) -> dict`` where the dict has
``title``, ``columns``, ``rows`` (list of lists) and ``summary`` (dict).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS_DIR))
sys.path.insert(0, str(SCRIPTS_DIR.parent))

SUBCOMMANDS = {
    "forward": "bench_forward",
    "train": "bench_train",
    "generate": "bench_generate",
    "async-vs-sync": "bench_async",
    "staleness": "bench_staleness",
    "losses": "bench_losses",
    "executor": "bench_executor",
    "memory": "bench_memory",
    "startup": "bench_startup",
    "trl": "bench_trl",
}


def format_table(columns: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    text_rows = [[cell(v) for v in r] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in text_rows)) if text_rows else len(c)
              for i, c in enumerate(columns)]
    line = " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    sep = "-+-".join("-" * w for w in widths)
    body = "\n".join(" | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in text_rows)
    return f"{line}\n{sep}\n{body}"


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count()}
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_devices"] = [str(d) for d in jax.devices()]
    except Exception:  # noqa: BLE001 - info only
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    modules = {}
    for name, modname in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            continue
        modules[name] = mod
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else None)
        p.add_argument("--out", default=None, help=f"JSON output path (default bench_results/{name}.json)")
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    t0 = time.time()
    result = modules[args.cmd].run(args)
    result.setdefault("summary", {})
    result["wall_s"] = round(time.time() - t0, 2)
    result["machine"] = machine_info()
    result["argv"] = sys.argv[1:] if argv is None else argv
    print(f"\n== {result.get('title', args.cmd)} ==")
    print(format_table(result["columns"], result["rows"]))
    for k, v in result["summary"].items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    out = Path(args.out or f"bench_results/{args.cmd}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
