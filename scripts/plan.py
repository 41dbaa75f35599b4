"""Will a run fit its accelerators, and how fast can it go? Compiled ahead of time on a CPU.

    python scripts/plan.py --config configs/qwen2.5-1.5b_gsm8k.yaml \\
        [--target v5e:2x4|v5p:2x2x1|v6e:2x2|v4:2x2x1|h100:8|h200:8] [--mesh fsdp=8] \\
        [--preset qwen2.5-1.5b] [--search-rows 2] [--json plan.json] [key=value ...]

Compiles the learner's gradient and optimizer programs and the embedded engine's prefill
and decode steps for compile-only devices of the target (no accelerator, no weights) and
prints, per device: memory against HBM, whether it fits, FLOPs and bytes per step, the
roofline floor of each step's time and the best MFU it allows. ``--target`` defaults to
the config's ``hardware``. TPU targets need libtpu, GPU targets the CUDA plugin (the
``aot`` extra; see docs/accelerators.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The host is a CPU; accelerators are compile-only targets. Set before jax starts: with
# libtpu or the CUDA plugin installed, jax would otherwise try to open them.
os.environ["JAX_PLATFORMS"] = "cpu"


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML (configs/*.yaml)")
    parser.add_argument("--target", default=None,
                        help="v5e:2x2, v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x2, h100:N, h200:N "
                             "(default: the config's hardware)")
    parser.add_argument("--mesh", default=None, help="learner mesh (default: the config's mesh)")
    parser.add_argument("--preset", default=None,
                        help="model shapes from this model_defs preset instead of model.path")
    parser.add_argument("--search-rows", type=int, default=2,
                        help="doublings (or halvings) of the micro-batch's rows to find the "
                             "largest that fits; 0: only the config's")
    parser.add_argument("--json", default=None, help="write the plan as JSON here")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from areal_jax.config import ConfigError, load_config
    from areal_jax.parallel.targets import check_target
    from areal_jax.plan import PlanError, format_table, plan_run

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as e:
        print(f"plan.py: {e}", file=sys.stderr)
        return 2
    target = args.target or cfg.hardware
    if target is None or target == "cpu":
        print(f"plan.py: {args.config} names hardware {cfg.hardware!r}; pass --target, one of "
              "v5e:2x2, v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x2, h100:N, h200:N", file=sys.stderr)
        return 2
    try:
        check_target(target)
    except ValueError as e:
        print(f"plan.py: --target: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        result = plan_run(cfg, target, mesh_spec=args.mesh, preset=args.preset,
                          search_rows=args.search_rows,
                          log=lambda line: print(line, flush=True))
    except (PlanError, RuntimeError) as e:  # RuntimeError: libtpu / CUDA plugin missing
        print(f"plan.py: {e}", file=sys.stderr)
        return 2
    result["config"] = args.config
    result["plan_s"] = round(time.perf_counter() - t0, 1)
    print(format_table(result))
    print(f"planned in {result['plan_s']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
