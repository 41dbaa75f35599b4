"""LoRA adapters on the decoder's projections: attach (``nnx.LoRA``), merge, inspect.

An adapter on projection W (ours [in..., out...], HF ``weight`` [out, in]) adds
``scale * x @ A @ B`` with A [in, r], B [r, out] and ``scale = alpha / r`` (PEFT's
scaling). A and B are ``nnx.LoRAParam`` (a subclass of ``nnx.Param``), so an optimizer built
with ``wrt=nnx.LoRAParam`` (or a split on it) trains only them. B starts at zero, so a fresh
adapter leaves the model's output unchanged.

    model, cfg = load_hf(path)
    add_lora(model, LoraConfig(rank=8, alpha=16), rngs=nnx.Rngs(0))
    merged = merge_lora(model)     # a plain CausalLM with W + scale * A @ B
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from model_defs.config import ConfigError
from model_defs.model import MLP, Attention, CausalLM

# PEFT module name -> (owner in a decoder layer, kernel attribute, leading kernel dims that
# form the input, logical axis of the input, logical axis of the output).
LORA_TARGETS: dict[str, tuple[str, str, int, str, str]] = {
    "q_proj": ("attn", "q_kernel_dhk", 1, "embed", "heads"),
    "k_proj": ("attn", "k_kernel_dkh", 1, "embed", "kv_heads"),
    "v_proj": ("attn", "v_kernel_dkh", 1, "embed", "kv_heads"),
    "o_proj": ("attn", "o_kernel_hkd", 2, "heads", "embed"),
    "gate_proj": ("mlp", "gate_kernel_df", 1, "embed", "mlp"),
    "up_proj": ("mlp", "up_kernel_df", 1, "embed", "mlp"),
    "down_proj": ("mlp", "down_kernel_fd", 1, "mlp", "embed"),
}
# The HF module path of each owner inside HF's ``model.layers.{i}``.
HF_OWNER = {"attn": "self_attn", "mlp": "mlp"}


@dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (scale = alpha / r), the PEFT module names adapted, dropout.

    ``dropout`` is kept for the PEFT config; the forward pass applies none (see
    ``areal_jax.config.LoraSection`` for why training requires 0)."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = tuple(LORA_TARGETS)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"lora rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"lora alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        targets = tuple(self.target_modules)
        if not targets:
            raise ConfigError(f"lora target_modules is empty; choose from {list(LORA_TARGETS)}")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ConfigError(f"lora target_modules {unknown} are not projections of this "
                              f"model; choose from {list(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ConfigError(f"lora target_modules {list(targets)} has duplicates")
        object.__setattr__(self, "target_modules", targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _owner(model: CausalLM, name: str) -> tuple[Attention | MLP, nnx.Param]:
    """The module holding projection ``name`` in the stacked decoder layers, and its
    stacked kernel [L, in..., out...]."""
    owner_attr, kernel_attr = LORA_TARGETS[name][:2]
    owner = getattr(model.layers, owner_attr)
    return owner, getattr(owner, kernel_attr)


def add_lora(model: CausalLM, lora: LoraConfig, *, rngs: nnx.Rngs) -> CausalLM:
    """Attaches fresh adapters (A he-uniform per layer, B zero) to ``lora.target_modules``
    of every layer, in place; returns ``model``. Like the layers' own variables, the
    adapters are stacked: A [L, in, r], B [L, r, out]. Adapter params have the kernels'
    dtype."""
    if not isinstance(lora, LoraConfig):
        raise TypeError(f"lora must be a LoraConfig, got {type(lora).__name__}")
    if lora_config(model) is not None:
        raise ValueError("the model already has LoRA adapters")
    n_layers = model.num_layers
    init_a = jax.nn.initializers.he_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
    for name in lora.target_modules:
        owner, kernel = _owner(model, name)
        _, _, n_in, in_axis, out_axis = LORA_TARGETS[name]
        shape = tuple(kernel.get_value().shape)[1:]  # one layer's kernel
        dtype = kernel.get_value().dtype
        d_in, d_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
        adapter = nnx.LoRA(d_in, lora.rank, d_out, dtype=model.dtype, param_dtype=dtype,
                           rngs=rngs)
        adapter.lora_a = nnx.LoRAParam(init_a(rngs.params(), (n_layers, d_in, lora.rank), dtype),
                                       logical_axes=("layers", in_axis, None))
        adapter.lora_b = nnx.LoRAParam(jnp.zeros((n_layers, lora.rank, d_out), dtype),
                                       logical_axes=("layers", None, out_axis))
        setattr(adapter, "scale", lora.scale)  # noqa: B010 (nnx.LoRA declares no scale)
        if owner.lora is None:
            owner.lora = nnx.Dict()
        owner.lora[name] = adapter
    setattr(model, "lora_config", lora)  # noqa: B010 (a plain model has none: lora_config())
    return model


def lora_config(model: CausalLM) -> LoraConfig | None:
    """The ``LoraConfig`` of a model's adapters, or None for a plain model."""
    return getattr(model, "lora_config", None)


def lora_adapters(model: CausalLM) -> Iterator[tuple[str, nnx.LoRA]]:
    """(PEFT module name, adapter) for every adapted projection; the adapter's
    ``lora_a`` [L, in, r] and ``lora_b`` [L, r, out] hold every layer's matrices."""
    lora = lora_config(model)
    if lora is None:
        return
    for name in lora.target_modules:
        owner, _ = _owner(model, name)
        assert owner.lora is not None  # add_lora attached one for every target
        yield name, owner.lora[name]


def merged_kernel(kernel: Any, lora_a: Any, lora_b: Any, scale: float) -> Any:
    """``kernel + scale * A @ B`` in the kernel's shape and dtype, computed in fp32 (stacked
    layers: A [L, in, r] and B [L, r, out] multiply layer by layer)."""
    delta = (jnp.asarray(lora_a, jnp.float32) @ jnp.asarray(lora_b, jnp.float32)) * scale
    return (jnp.asarray(kernel, jnp.float32) + delta.reshape(kernel.shape)).astype(kernel.dtype)


def merge_lora(model: CausalLM) -> CausalLM:
    """A plain ``CausalLM`` (no adapters) whose adapted kernels are W + scale * A @ B; the
    other params are shared with ``model``, which is left unchanged. A plain model is
    returned as it is."""
    lora = lora_config(model)
    if lora is None:
        return model
    merged_values = {}
    for name, adapter in lora_adapters(model):
        _, kernel = _owner(model, name)
        merged_values[name] = merged_kernel(kernel.get_value(), adapter.lora_a.get_value(),
                                            adapter.lora_b.get_value(), getattr(adapter, "scale"))  # noqa: B009
    graphdef, state = nnx.split(model)
    plain = nnx.merge(graphdef, state, copy=False)  # a new module tree sharing the arrays
    for owner_attr in HF_OWNER:
        getattr(plain.layers, owner_attr).lora = None
    for name, value in merged_values.items():
        owner_attr, kernel_attr = LORA_TARGETS[name][:2]
        owner = getattr(plain.layers, owner_attr)
        setattr(owner, kernel_attr, nnx.Param(value, **_metadata(getattr(owner, kernel_attr))))
    delattr(plain, "lora_config")
    return plain


def _metadata(variable: nnx.Variable) -> dict[str, Any]:
    meta = dict(variable.get_metadata())
    return {k: v for k, v in meta.items() if k == "logical_axes"}
