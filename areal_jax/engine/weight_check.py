"""Loading a weight update and the checks it must pass before the engine swaps it in.

A refused update leaves the served weights untouched. The config must match the served
one; shapes and the parameter tree are checked by ``load_hf`` and
``ModelRunner.check_compatible``; then the tensor dtypes stored in the files (a weight is
a floating-point tensor, never an integer or bool one that would be silently cast) and
finiteness of every value after the cast to the served dtype (a NaN or Inf weight
poisons every request, and an fp64 value beyond the fp32 range becomes Inf only once
cast). Finite weights can still overflow in use (weights near the fp32 limit, a LoRA
``lora_alpha`` of 1e38): a forward pass on a probe prompt must give finite log-probs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from areal_jax.engine.model_dir import ModelPathError, check_model_dir
from model_defs import ModelConfig, load_hf

if TYPE_CHECKING:
    from areal_jax.engine.runner import ModelRunner

# ModelConfig fields that may differ between the served model and a weight update.
UPDATE_IGNORED_CONFIG_KEYS = ("bos_token_id", "eos_token_id")
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


PROBE_TOKENS = 16  # length of the probe prompt, spread over the vocabulary


def probe_ids(runner: ModelRunner) -> list[int]:
    """The probe prompt: ``PROBE_TOKENS`` token ids spread over the vocabulary."""
    return np.linspace(0, runner.cfg.vocab_size - 1, PROBE_TOKENS).astype(np.int32).tolist()


PROBE_FAILED = ("a forward pass on a probe prompt gives non-finite log-probs: the values are "
                "finite but overflow float32 in use (weights too large, or a LoRA scale "
                "lora_alpha/r too large)")


def check_probe_forward(state: nnx.State, runner: ModelRunner) -> None:
    """Raises WeightCheckError unless a forward pass of ``state`` on a probe prompt (token
    ids spread over the vocabulary) gives a finite greedy log-prob (a NaN or infinite logit
    makes it NaN): finite weights that overflow would otherwise be served and fail every
    request. The engine's own prefill program runs it (``ModelRunner.probe_logprob``), so
    it compiles nothing and copies no weight. (A staged in-memory version is probed at its
    swap instead, in a row of the first prefill under it: ``GenerationEngine.swap_staged``.)"""
    if not np.isfinite(runner.probe_logprob(state, probe_ids(runner))):
        raise WeightCheckError(PROBE_FAILED)


def load_update(model_path: str, served: ModelConfig, dtype: str, runner: ModelRunner,
                check: bool = True) -> nnx.State:
    """The params of ``model_path``, cast and placed like ``runner``'s, ready to swap in.

    Raises ModelPathError (missing or incompatible checkpoint) or WeightCheckError (with
    ``check``: a non-floating tensor, a non-finite value).
    """
    path = check_model_dir(model_path)
    cfg = ModelConfig.from_pretrained_dir(path)
    old, new = dataclasses.asdict(served), dataclasses.asdict(cfg)
    diff = [k for k in old if k not in UPDATE_IGNORED_CONFIG_KEYS and old[k] != new[k]]
    if diff:
        k = diff[0]
        raise ModelPathError(
            f"{path / 'config.json'} is incompatible with the served model: {k}={new[k]!r} "
            f"but the server runs {k}={old[k]!r} (differing keys: {', '.join(diff)})")
    if check:
        check_file_dtypes(path)
    model, _ = load_hf(path, dtype=dtype)
    _, state = nnx.split(model)
    return ready_to_serve(state, runner, check, where=str(path))


def ready_to_serve(state: nnx.State, runner: ModelRunner, check: bool, where: str) -> nnx.State:
    """``state`` checked against the served model's structure, placed like ``runner``'s
    params and (with ``check``) free of NaN/Inf; errors start with ``where``."""
    problem = runner.check_compatible(state)
    if problem:
        raise ModelPathError(f"{where} is incompatible with the served model: {problem}")
    state = runner.place_like_current(state)
    if check:
        try:
            check_finite(state)
            check_probe_forward(state, runner)
        except WeightCheckError as e:
            raise WeightCheckError(f"{where}: {e}") from None
    return state
