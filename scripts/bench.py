"""Benchmarks: ``python scripts/bench.py <name> [options]`` is
``python -m areal_jax.bench <name> [options]`` (the modules are ``areal_jax/bench/``;
``python scripts/bench.py --help`` lists them)."""

import sys

from areal_jax.bench import main

if __name__ == "__main__":
    sys.exit(main())
