"""Train a policy with asynchronous (or synchronous) RL.

    python scripts/train.py --config configs/tiny_demo.yaml [--mesh data=1,fsdp=2,tensor=1] \
        [--resume | --no-resume] [key=value ...]

Overrides use dotted keys of the config schema (``areal_jax/config.py``), e.g.
``train.total_versions=20 rollout.max_staleness=4 mode=sync``. The run directory
(``run_dir``) receives the resolved config, ``metrics.jsonl``, TensorBoard events,
checkpoints and the published serving weights. By default a run dir that already
holds a checkpoint is resumed from it; ``--no-resume`` refuses to touch it instead.

Exit status: 0 done; 1 unexpected crash; 2 bad config or input (found before training);
3 the run stopped because it could not go on (no progress, non-finite loss, failed weight
update); 4 shutdown exceeded ``watchdog.shutdown_timeout_s``; 130 / 143 after SIGINT /
SIGTERM (graceful shutdown; a second signal exits at once).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# This interpreter's start, for the start-up timings and the run summary's "done in": the
# process's creation time is its launcher's when a shell execs it (bash -c "...; python").
os.environ["AREAL_JAX_PROCESS_START"] = repr(time.time())


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--mesh", default=None,
                   help="learner mesh, e.g. data=1,fsdp=2,tensor=1 (overrides mesh=)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", dest="resume", action="store_true", default=None,
                   help="resume from the latest checkpoint in the run dir (error if there is none)")
    g.add_argument("--no-resume", dest="resume", action="store_false",
                   help="start fresh; error if the run dir already has checkpoints")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from areal_jax.process import install_signal_handlers

    install_signal_handlers()  # from now on SIGINT/SIGTERM stop the run gracefully
    from areal_jax.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.mesh:
        overrides.append(f"mesh={args.mesh}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    # Before JAX starts: SGLang present if the config starts it, the hardware it names
    # visible, and every process's devices (this one's environment set; the plan is printed
    # by the run, after the run directory line that opens every run's console).
    from areal_jax.parallel.placement import PlacementError, start_placement

    try:
        start_placement(cfg, announce=False)
    except PlacementError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if cfg.hardware == "cpu" and not os.environ.get("JAX_PLATFORMS"):
        # A CPU config: accelerator plugins that happen to be installed (libtpu, the CUDA
        # plugin of the aot extra) are never opened, so they print nothing and cost nothing.
        import jax

        jax.config.update("jax_platforms", "cpu")

    from areal_jax.run import main_guarded

    return main_guarded(cfg, args.resume)


if __name__ == "__main__":
    sys.exit(main())
