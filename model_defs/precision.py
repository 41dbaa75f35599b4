"""fp32 means fp32 on every platform.

XLA runs fp32 matrix products at reduced precision on accelerators unless told otherwise:
TF32 on NVIDIA GPUs (XLA's GEMMs and the Triton attention kernel alike; a GPU check saw fp32
attention 8.6e-4 from an fp32 reference on the same GPU, against 6e-7 on a CPU), one bf16
pass on TPUs. A program whose compute dtype is fp32 is traced under
``jax.default_matmul_precision("highest")`` on those platforms, so a config that promises
fp32 (``model.dtype: float32``, an fp32 engine) computes in fp32 wherever it runs, and the
learner–engine agreement measured on CPU holds there too. bf16/fp16 programs are left alone
(their products already run at the dtype's precision), and CPU programs are unchanged (XLA's
CPU backend computes fp32 products in fp32 anyway).

The precision is part of the traced program (every ``dot_general`` records it; its
transposes in the backward pass inherit it), so the planner, which lowers the same step
functions under a compile-only mesh of the target, compiles what the chip runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from model_defs.fused_attention import _normalize_platform, active_platform


def fp32_matmul_precision(dtype: Any, platform: str) -> str | None:
    """``"highest"`` when a program of compute ``dtype`` (None: the fp32 params' own) on
    ``platform`` needs it to compute fp32 products in fp32, else None."""
    if dtype is not None and jnp.dtype(dtype) != jnp.float32:
        return None
    return None if _normalize_platform(platform) == "cpu" else "highest"


@contextlib.contextmanager
def fp32_matmuls(dtype: Any) -> Iterator[None]:
    """Trace what runs inside at fp32 precision when ``dtype`` is fp32 and the active
    platform (the mesh's devices, compile-only ones included, else jax's default backend)
    is an accelerator; otherwise changes nothing."""
    precision = fp32_matmul_precision(dtype, active_platform())
    if precision is None:
        yield
        return
    with jax.default_matmul_precision(precision):
        yield
