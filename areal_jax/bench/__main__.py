"""``python -m areal_jax.bench <name> [options]``: see :mod:`areal_jax.bench`."""

import sys

from areal_jax.bench import main

sys.exit(main())
