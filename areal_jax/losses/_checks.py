"""Input validation shared by the loss functions.

Checks run on static information (shapes, dtypes, Python scalars), so they work
under ``jax.jit``. Each error names the function, the argument and the offending
value, so a user never sees a bare traceback from deep inside JAX first.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def is_concrete(x: ArrayLike) -> bool:
    """True when ``x`` holds actual values (not a tracer inside jit/grad/vmap)."""
    return not isinstance(x, jax.core.Tracer)


def as_array(fn: str, name: str, x: ArrayLike) -> jax.Array:
    """``jnp.asarray(x)`` with an error that names the argument."""
    if x is None:
        raise TypeError(f"{fn}: {name} is None; expected an array")
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{fn}: {name} is not convertible to an array ({type(x).__name__}): {e}") from None


def float_input(fn: str, name: str, x: ArrayLike) -> jax.Array:
    """A floating-point input (bf16, fp16, fp32, fp64), returned as fp32."""
    arr = as_array(fn, name, x)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(
            f"{fn}: {name} has dtype {arr.dtype}; expected a floating dtype (bfloat16 or float32)"
        )
    return arr.astype(jnp.float32)


def mask_input(fn: str, name: str, x: ArrayLike) -> jax.Array:
    """A 0/1 mask of bool, int or float dtype, returned as bool (nonzero = valid)."""
    arr = as_array(fn, name, x)
    if not (
        arr.dtype == jnp.bool_
        or jnp.issubdtype(arr.dtype, jnp.integer)
        or jnp.issubdtype(arr.dtype, jnp.floating)
    ):
        raise TypeError(f"{fn}: {name} has dtype {arr.dtype}; expected bool, int or float 0/1")
    return arr != 0


def int_input(fn: str, name: str, x: ArrayLike) -> jax.Array:
    arr = as_array(fn, name, x)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{fn}: {name} has dtype {arr.dtype}; expected an integer dtype")
    return arr


def same_shape(fn: str, ref_name: str, ref: jax.Array, **arrays: jax.Array | None) -> None:
    """Every array in ``arrays`` (None skipped) must have ``ref``'s shape."""
    for name, arr in arrays.items():
        if arr is not None and arr.shape != ref.shape:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(arr.shape)} but {ref_name} has shape "
                f"{tuple(ref.shape)}; all per-token inputs must have the same shape"
            )


def ndim(fn: str, name: str, x: jax.Array, expected: int, layout: str) -> None:
    if x.ndim != expected:
        raise ValueError(
            f"{fn}: {name} has shape {tuple(x.shape)}; expected {expected} dims {layout}"
        )


def positive(fn: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    in_range(fn, name, value, 0.0, float("inf"), allow_none=allow_none, lo_open=True)


def in_range(fn: str, name: str, value: Any, lo: float, hi: float, *, allow_none: bool = False,
             lo_open: bool = False, hi_open: bool = False) -> None:
    """A real scalar in the given interval. Traced scalars (inside jit) are not checked."""
    if value is None and allow_none:
        return
    if isinstance(value, jax.core.Tracer) and value.ndim == 0:
        return
    number = _real_scalar(value)
    ok = number is not None and ((number > lo if lo_open else number >= lo)
                                 and (number < hi if hi_open else number <= hi))
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        bound = "a number > 0" if (lo == 0 and lo_open and hi == float("inf")) else (
            f"a number in {left}{lo}, {hi}{right}")
        raise ValueError(f"{fn}: {name}={value!r}; expected {bound}")


def choice(fn: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{fn}: {name}={value!r}; expected one of {', '.join(map(repr, allowed))}")


def _real_scalar(value: Any) -> float | None:
    """The value as a finite float, or None if it is not a real scalar."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | float | np.integer | np.floating):
        number = float(value)
    elif isinstance(value, np.ndarray | jax.Array) and value.ndim == 0 and not isinstance(
        value, jax.core.Tracer
    ):
        if not (jnp.issubdtype(value.dtype, jnp.integer)
                or jnp.issubdtype(value.dtype, jnp.floating)):
            return None
        number = float(value)
    else:
        return None
    return number if np.isfinite(number) else None
