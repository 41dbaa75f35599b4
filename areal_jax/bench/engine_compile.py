"""The embedded engine's compile time against its depth, per layer loop, compiled ahead of
time for an accelerator on this CPU (the planner's own lowering of the engine's prefill and
decode programs).

    python -m areal_jax.bench engine-compile --target h100:1 --preset qwen2.5-0.5b \\
        --layers 12,24 --layouts scan,unrolled

A row per (layers, layout, program): compile seconds, the bytes the program moves, its
roofline floor and peak memory. The engine's warm-up compiles a prefill per prompt bucket
and a decode per attention-length bucket, so its start-up on a cold cache is a sum of such
compiles; depth-independent compile time is what a scanned layer loop buys, at the cost
of what the chip's compiler does with each step's slice of the stacked weights (the
bytes column). Timings are this host's CPU: compare rows of one run.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

LAYOUTS = ("scan", "unrolled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="h100:1", help="h100:1, h200:1, v5e:2x2, ...")
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="model_defs preset")
    parser.add_argument("--layers", default="12,24", help="comma-separated layer counts")
    parser.add_argument("--layouts", default="scan,unrolled",
                        help=f"comma-separated layer loops: {', '.join(LAYOUTS)}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--slots", type=int, default=32, help="rollout.max_slots")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="rollout.max_seq_len")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over every (layers, layout), interleaved so a change in "
                             "the machine's load hits each alike; the median is reported")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os

    if os.environ.get("JAX_PLATFORMS") != "cpu":
        raise SystemExit("bench engine-compile compiles for compile-only devices: run it "
                         "with JAX_PLATFORMS=cpu")
    from areal_jax.config import load_config
    from areal_jax.parallel.targets import compile_only_devices, target_chip, target_platform
    from areal_jax.plan.planner import PlanError, lower_engine, measure, model_config

    layouts = args.layouts.split(",")
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts {bad}: choose from {', '.join(LAYOUTS)}")
    cfg = load_config(None, ["model.path=builtin:arith_sft",  # shapes come from --preset
                             f"model.dtype={args.dtype}", f"rollout.max_slots={args.slots}",
                             f"rollout.max_seq_len={args.max_seq_len}"])
    try:
        base, source = model_config(cfg, args.preset)
    except PlanError as e:
        raise SystemExit(str(e)) from None
    chip, platform = target_chip(args.target), target_platform(args.target)
    device = compile_only_devices(args.target)[0]
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    depths = [int(x) for x in args.layers.split(",")]
    for round_ in range(args.repeats):
        for layers in depths:
            model_cfg = base.replace(num_hidden_layers=layers)
            for layout in layouts:
                # Lowered anew each round: a fresh module, compiled from scratch.
                prefill, decode, _ = lower_engine(cfg, model_cfg, device, scan=layout == "scan")
                for name, lowered in (("prefill", prefill), ("decode", decode)):
                    print(f"  [{round_ + 1}/{args.repeats}] compiling {name} for {args.target}, "
                          f"{layers} layers, {layout} ...", flush=True)
                    runs.setdefault((layers, layout, name), []).append(
                        measure(lowered, platform, chip, chip.hbm_bytes))
    rows, results = [], []
    for (layers, layout, name), outs in runs.items():
        out = outs[0]
        result = {"layers": layers, "layout": layout, "program": name,
                  "compile_s": statistics.median(o["compile_s"] for o in outs),
                  "compile_s_runs": [o["compile_s"] for o in outs],
                  "bytes_gb": out["bytes_accessed"] / 1e9,
                  "floor_ms": out["step_time_floor_s"] * 1000,
                  "peak_gib": out["peak_bytes"] / 2**30}
        results.append(result)
        rows.append([layers, layout, name, result["compile_s"],
                     " ".join(f"{s:g}" for s in result["compile_s_runs"]),
                     round(result["bytes_gb"], 2), round(result["floor_ms"], 3),
                     round(result["peak_gib"], 2)])
    summary: dict[str, Any] = {"target": args.target, "model": source, "dtype": args.dtype,
                               "slots": args.slots, "max_seq_len": args.max_seq_len}
    depths = sorted(depths)
    if len(depths) > 1:
        for layout in layouts:
            def total(n: int, layout: str = layout) -> float:
                return sum(r["compile_s"] for r in results
                           if r["layers"] == n and r["layout"] == layout)

            summary[f"{layout}_compile_ratio_{depths[-1]}_vs_{depths[0]}_layers"] = round(
                total(depths[-1]) / total(depths[0]), 3)
    return {
        "title": f"engine compile time vs depth for {args.target} ({source}, {args.dtype}, "
                 f"{args.slots} slots, max_seq_len {args.max_seq_len}), compiled on this CPU",
        "columns": ["layers", "layer loop", "program", "compile s (median)", "each run s",
                    "GB moved", "floor ms", "peak GiB"],
        "rows": rows,
        "results": results,
        "summary": summary,
    }
