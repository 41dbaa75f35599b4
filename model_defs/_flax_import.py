"""Importing flax without IPython.

``flax.nnx`` asks IPython whether it runs in a notebook (to colour its reprs) when it is
imported: ``import IPython`` takes 0.6 s or more, a seventh of a server's imports. A process
that has not imported IPython is not inside it, so flax's answer is the same when the
import fails instead: importing this module imports flax with ``import IPython`` made to
fail, for flax's import only (``model_defs`` imports it first).
"""

from __future__ import annotations

import sys


def import_flax() -> None:
    """Imports ``flax.nnx``; without IPython unless this process already imported it."""
    if "flax.nnx" in sys.modules or "IPython" in sys.modules:
        import flax.nnx  # noqa: F401
        return
    sys.modules["IPython"] = None  # type: ignore[assignment]  # `import IPython` fails
    try:
        import flax.nnx  # noqa: F401
    finally:
        if sys.modules.get("IPython", 0) is None:
            del sys.modules["IPython"]


import_flax()
