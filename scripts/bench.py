"""Benchmarks: ``python scripts/bench.py <name> [options]`` is
``python -m areal_jax.bench <name> [options]`` (the modules are ``areal_jax/bench/``;
``python scripts/bench.py --help`` lists them)."""

import sys

from areal_jax.bench import build_parser, main  # noqa: F401 - build_parser: the docs test

if __name__ == "__main__":
    sys.exit(main())
