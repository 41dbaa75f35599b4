"""Serve an HF checkpoint with the embedded JAX engine (SGLang protocol).

    python scripts/serve.py --model-path DIR --host 127.0.0.1 --port 30000 [--warmup]

See ``python scripts/serve.py --help`` for all options.
"""

from __future__ import annotations

import argparse
import logging
import sys

from areal_jax.engine.server import build_arg_parser, main


def build_parser() -> argparse.ArgumentParser:
    """The server's own command line (tests/test_docs_commands.py parses the docs with it)."""
    return build_arg_parser()


def quiet_backend_probe() -> None:
    """On first use JAX tries every backend it knows (TPU, CUDA) and logs each one that is
    absent at INFO (``Unable to initialize backend 'tpu'``); the server logs at INFO, so
    every start on a CPU host printed it. Those lines say nothing about the server: JAX's
    backend discovery logs at WARNING and above only (its failures still show)."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


if __name__ == "__main__":
    quiet_backend_probe()
    sys.exit(main())
