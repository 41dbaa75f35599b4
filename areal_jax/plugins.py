"""User code named in a config as ``"package.module:function"`` (reward functions, agents)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """Imports ``module`` and returns its callable ``function`` for ``spec`` =
    ``"module:function"``; ValueError naming ``what`` (e.g. "agent") and what is wrong."""
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be a 'module:function' string")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn
