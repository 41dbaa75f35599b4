"""Checks a weight update must pass before the engine swaps it in.

A refused update leaves the served weights untouched. Shapes and the parameter tree are
checked by ``load_hf`` and ``ModelRunner.check_compatible``; this module adds the tensor
dtypes stored in the files (a weight is a floating-point tensor, never an integer or bool
one that would be silently cast) and finiteness of every value after the cast to the
served dtype (a NaN or Inf weight poisons every request, and an fp64 value beyond the
fp32 range becomes Inf only once cast).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from safetensors import safe_open

# safetensors dtype names that are weights.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


class WeightCheckError(ValueError):
    """A weight update that must not be served (wrong dtype, non-finite values)."""


def check_file_dtypes(path: Path) -> None:
    """Raises WeightCheckError if any tensor in ``path``'s safetensors files is not floating."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():
                    dtype = f.get_slice(key).get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        raise WeightCheckError(
                            f"{file.name}: tensor {key} has dtype {dtype}; weights must be one "
                            f"of {', '.join(FLOAT_DTYPES)}")
        except WeightCheckError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise WeightCheckError(f"{file.name} is not a readable safetensors file: {e}") from None


@jax.jit
def _finite_flags(leaves: list[jax.Array]) -> jax.Array:
    """[n_leaves] bool: leaf i has no NaN/Inf. One compiled call per parameter tree."""
    return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])


def check_finite(state: object) -> None:
    """Raises WeightCheckError naming the first parameter holding a NaN or Inf."""
    leaves = jax.tree_util.tree_leaves_with_path(state)
    flags = jax.device_get(_finite_flags([leaf for _, leaf in leaves]))
    for (path, leaf), ok in zip(leaves, flags, strict=True):
        if not bool(ok):
            n_bad = int(jax.device_get(jnp.sum(~jnp.isfinite(leaf))))
            raise WeightCheckError(
                f"parameter {jax.tree_util.keystr(path)} has {n_bad} non-finite value(s) "
                f"(NaN or Inf) in the served dtype {leaf.dtype}")
