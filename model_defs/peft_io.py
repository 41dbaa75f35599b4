"""LoRA adapters in PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors``.

The format ``peft.PeftModel.from_pretrained`` (and SGLang's ``/load_lora_adapter``, vLLM's
``--lora-modules``) read. Keys are
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]): torch's [out, in] layout, so ours (A [in, r], B [r, out])
are transposed. PEFT's scaling is ``lora_alpha / r``.

    save_peft_adapter(model, "adapter_dir", base_model_name_or_path="Qwen/Qwen2.5-0.5B")
    model, cfg = load_hf("base_dir"); load_peft_adapter(model, "adapter_dir")
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from model_defs.config import ConfigError, read_json_config
from model_defs.hf_io import CheckpointError
from model_defs.lora import HF_OWNER, LORA_TARGETS, LoraConfig, add_lora, lora_adapters, lora_config
from model_defs.model import CausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model.model.layers"


def peft_key(layer: int, name: str, which: str) -> str:
    """The PEFT tensor key of adapter ``name`` of ``layer``; ``which`` is "A" or "B"."""
    owner = HF_OWNER[LORA_TARGETS[name][0]]
    return f"{KEY_PREFIX}.{layer}.{owner}.{name}.lora_{which}.weight"


def _host(value: Any) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(jax.device_get(value))


def peft_adapter_config(lora: LoraConfig, base_model_name_or_path: str | None = None
                        ) -> dict[str, Any]:
    """The ``adapter_config.json`` dict of ``lora`` (the fields peft's LoraConfig reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


@dataclass(frozen=True)
class PeftAdapter:
    """A host copy of a model's adapters: PEFT tensor key -> [r, in] / [out, r] array."""

    lora: LoraConfig
    tensors: dict[str, np.ndarray]
    base_model_name_or_path: str | None = None

    def save(self, path: str | os.PathLike) -> Path:
        """Writes ``adapter_config.json`` + ``adapter_model.safetensors`` into ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (path / ADAPTER_CONFIG).write_text(json.dumps(
            peft_adapter_config(self.lora, self.base_model_name_or_path), indent=2))
        return path


def peft_adapter(model: CausalLM, base_model_name_or_path: str | None = None,
                 dtype: str | None = None) -> PeftAdapter:
    """The model's adapters as a :class:`PeftAdapter` on the host. ``dtype`` (e.g.
    "bfloat16") casts the tensors; default: the adapters' dtype. With several JAX
    processes every process must call this (sharded arrays are gathered)."""
    lora = lora_config(model)
    if lora is None:
        raise ValueError("the model has no LoRA adapters (see model_defs.add_lora)")
    tensors: dict[str, np.ndarray] = {}
    for name, adapter in lora_adapters(model):
        a_lir, b_lro = _host(adapter.lora_a.get_value()), _host(adapter.lora_b.get_value())
        if dtype is not None:
            a_lir, b_lro = a_lir.astype(jnp.dtype(dtype)), b_lro.astype(jnp.dtype(dtype))
        for i in range(a_lir.shape[0]):
            tensors[peft_key(i, name, "A")] = np.ascontiguousarray(a_lir[i].T)
            tensors[peft_key(i, name, "B")] = np.ascontiguousarray(b_lro[i].T)
    return PeftAdapter(lora, tensors, base_model_name_or_path)


def save_peft_adapter(model: CausalLM, path: str | os.PathLike,
                      base_model_name_or_path: str | None = None,
                      dtype: str | None = None) -> Path:
    """Writes the model's adapters as a PEFT adapter directory; returns it."""
    return peft_adapter(model, base_model_name_or_path, dtype).save(path)


def read_peft_config(path: str | os.PathLike) -> LoraConfig:
    """The ``LoraConfig`` of a PEFT adapter directory; refuses what ours cannot represent."""
    cfg_path = Path(path) / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise ConfigError(f"{path} is not a PEFT adapter directory: no {ADAPTER_CONFIG}")
    raw = read_json_config(cfg_path)
    if raw.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{cfg_path}: peft_type {raw.get('peft_type')!r}; only LORA is "
                          "supported")
    unsupported = {
        "use_dora": bool(raw.get("use_dora")),
        "use_rslora": bool(raw.get("use_rslora")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "bias": raw.get("bias", "none") != "none",
        "modules_to_save": bool(raw.get("modules_to_save")),
        "layers_to_transform": raw.get("layers_to_transform") is not None,
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "lora_bias": bool(raw.get("lora_bias")),
        "layer_replication": bool(raw.get("layer_replication")),
        "target_parameters": bool(raw.get("target_parameters")),
        "trainable_token_indices": bool(raw.get("trainable_token_indices")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ConfigError(f"{cfg_path}: {bad} are set; only plain LoRA (one r and lora_alpha "
                          "for all layers, no bias, DoRA or rsLoRA) is supported")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise ConfigError(f"{cfg_path}: target_modules is a regex ({targets!r}); give the "
                          f"module names as a list, from {list(LORA_TARGETS)}")
    try:
        return LoraConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                          target_modules=tuple(targets or ()),
                          dropout=float(raw.get("lora_dropout", 0.0)))
    except KeyError as e:
        raise ConfigError(f"{cfg_path} has no {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None


def load_peft_adapter(model: CausalLM, path: str | os.PathLike) -> CausalLM:
    """Attaches the PEFT adapter in ``path`` to a plain ``model`` (in place; returned).

    Every adapter tensor of the config must be present with the shape the model implies.
    Params take the model kernels' dtype and, under a mesh, are placed later by the learner.
    """
    lora = read_peft_config(path)
    weights = Path(path) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{path} has no {ADAPTER_WEIGHTS}")
    add_lora(model, lora, rngs=nnx.Rngs(0))
    with safe_open(str(weights), framework="numpy") as f:
        keys = set(f.keys())
        expected = {peft_key(i, n, w) for n, _ in lora_adapters(model)
                    for i in range(model.num_layers) for w in "AB"}
        extra = sorted(keys - expected)
        if extra:
            raise CheckpointError(f"{weights}: tensors {extra[:3]} do not belong to a LoRA "
                                  f"adapter of this model's {list(lora.target_modules)}")
        for name, adapter in lora_adapters(model):
            for which, var in (("A", adapter.lora_a), ("B", adapter.lora_b)):
                want = tuple(var.get_value().shape)[1:][::-1]  # one layer's, PEFT's [out, in]
                layers = []
                for i in range(model.num_layers):
                    key = peft_key(i, name, which)
                    if key not in keys:
                        raise CheckpointError(f"{weights}: missing tensor {key} "
                                              f"(shape {list(want)})")
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != want:
                        raise CheckpointError(f"{weights}: tensor {key} has shape "
                                              f"{list(tensor.shape)}, expected {list(want)}")
                    layers.append(tensor.T)
                var.set_value(jnp.asarray(np.stack(layers), var.get_value().dtype))
    return model
