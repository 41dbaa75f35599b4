"""Serve an HF checkpoint with the embedded JAX engine (SGLang protocol).

    python scripts/serve.py --model-path DIR --host 127.0.0.1 --port 30000 [--warmup]

See ``python scripts/serve.py --help`` for all options.
"""

from __future__ import annotations

import sys

from areal_jax.engine.server import main

if __name__ == "__main__":
    sys.exit(main())
