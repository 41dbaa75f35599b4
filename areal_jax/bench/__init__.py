"""Benchmarks. Each prints a table and writes JSON; figures are ratios against a peer
measured side by side in the same run.

    python -m areal_jax.bench forward   [options]   # model forward tokens/s vs transformers
    python -m areal_jax.bench train     [options]   # train-step tokens/s vs transformers + AdamW
    python -m areal_jax.bench generate  [options]   # engine decode tokens/s vs HF generate
    python -m areal_jax.bench async-vs-sync --config configs/X.yaml
    python -m areal_jax.bench staleness --config configs/X.yaml
    python -m areal_jax.bench losses    [options]   # chunked log-probs/entropy vs full logits
    python -m areal_jax.bench executor  [options]   # executor and reward-pool overhead, the gate
    python -m areal_jax.bench memory    [options]   # learner compiled memory vs T, bytes/param
    python -m areal_jax.bench memory-run [options]  # peak RSS of real runs, fsdp=1 vs fsdp=2
    python -m areal_jax.bench startup   [options]   # process start to first batch / first step
    python -m areal_jax.bench process-rows [options] # process 0 -> each process's rows of a batch
    python -m areal_jax.bench trl       [options]   # areal-jax vs TRL GRPOTrainer on the demo
    python -m areal_jax.bench longtail  [options]   # async vs sync vs TRL on the long-tail task
    python -m areal_jax.bench attention [options]   # each attention kernel: error and speed
    python -m areal_jax.bench engine-compile [opts] # the engine's compile time per layer count
    python -m areal_jax.bench gpu       [options]   # the one-call GPU check: each step above
    python -m areal_jax.bench serve-load [options]  # 200 vs 1,000 concurrent requests on serve.py
    python -m areal_jax.bench weight-sync [options] # a version bump's phases vs memcpy, fsync

(``python scripts/bench.py ...`` is the same command.) Each benchmark is the module
``areal_jax.bench.<name>``; the contract it follows and what they share are in
``areal_jax.bench.common``. Importing this package imports no benchmark (nor torch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_jax.bench.common import Benchmark


def benchmarks() -> dict[str, Benchmark]:
    """Subcommand -> the module that implements it (imported here, not at package import)."""
    from areal_jax.bench import (
        async_vs_sync,
        attention,
        engine_compile,
        executor,
        forward,
        generate,
        gpu,
        longtail,
        losses,
        memory,
        memory_run,
        process_rows,
        serve_load,
        staleness,
        startup,
        train,
        trl,
        weight_sync,
    )

    return {"forward": forward, "train": train, "generate": generate,
            "async-vs-sync": async_vs_sync, "staleness": staleness, "losses": losses,
            "executor": executor, "memory": memory, "memory-run": memory_run,
            "startup": startup, "trl": trl, "longtail": longtail,
            "process-rows": process_rows, "attention": attention,
            "engine-compile": engine_compile, "gpu": gpu, "serve-load": serve_load,
            "weight-sync": weight_sync}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Benchmark]]:
    """The command line of every benchmark, and the module behind each subcommand."""
    parser = argparse.ArgumentParser(prog="python -m areal_jax.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    modules = benchmarks()
    for name, mod in modules.items():
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0],
                           description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", default=None,
                       help=f"JSON output path (default bench_results/{name}.json)")
        mod.add_arguments(p)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    from areal_jax.bench.common import format_summary, format_table, machine_info, write_json

    parser, modules = build_parser()
    args = parser.parse_args(argv)
    t0 = time.time()
    result = modules[args.cmd].run(args)
    result.setdefault("summary", {})
    result["wall_s"] = round(time.time() - t0, 2)
    result["machine"] = machine_info()
    result["argv"] = sys.argv[1:] if argv is None else argv
    print(f"\n== {result.get('title', args.cmd)} ==")
    print(format_table(result["columns"], result["rows"]))
    print("\n".join(format_summary(result["summary"])))
    out = write_json(result, Path(args.out or f"bench_results/{args.cmd}.json"))
    print(f"wrote {out}")
    return 0
