"""Serving a LoRA adapter (PEFT layout) merged onto the engine's base weights.

The engine keeps the params it started with (or last loaded with
``/update_weights_from_disk``) as its base. ``/load_lora_adapter`` reads a PEFT adapter
directory (``adapter_config.json`` + ``adapter_model.safetensors``), attaches it to a model
holding the base params, merges it (``W + scale * A @ B``, ``model_defs.merge_lora``) and
returns the merged params, cast and placed like the served ones, for the engine to swap in.
The checks are those of a weight update (``weight_check``): floating tensors only, and no
NaN or Inf in the adapter or in the merged params.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx

from areal_jax.engine.model_dir import ModelPathError, check_model_dir
from areal_jax.engine.weight_check import (
    WeightCheckError,
    check_file_dtypes,
    check_finite,
    ready_to_serve,
)
from model_defs import load_peft_adapter, merge_lora
from model_defs.peft_io import ADAPTER_CONFIG

if TYPE_CHECKING:
    from areal_jax.engine.runner import ModelRunner


def load_adapter_update(adapter_path: str, base_state: nnx.State, runner: ModelRunner,
                        check: bool = True) -> nnx.State:
    """The base params with the adapter in ``adapter_path`` merged in, ready to swap in.

    Raises ModelPathError (missing directory, an adapter that does not fit the served
    model) or WeightCheckError (with ``check``: a non-floating tensor, a NaN or Inf).
    """
    path = check_model_dir(adapter_path, required_file=ADAPTER_CONFIG, field="lora_path")
    if check:
        check_file_dtypes(path)
    # the base arrays, not copies
    model = nnx.merge(runner.graphdef, base_state, copy=False)
    try:
        load_peft_adapter(model, path)
    except (ValueError, KeyError) as e:  # ConfigError, CheckpointError
        raise ModelPathError(f"lora_path {path} does not fit the served model: {e}") from None
    if check:
        try:
            check_finite(nnx.state(model, nnx.LoRAParam))
        except WeightCheckError as e:
            raise WeightCheckError(f"lora_path {path}: adapter {e}") from None
    _, state = nnx.split(merge_lora(model))
    return ready_to_serve(state, runner, check, where=f"lora_path {path} (merged)")
