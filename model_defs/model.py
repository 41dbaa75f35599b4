"""A Flax NNX decoder-only causal LM covering Qwen2/Qwen2.5, Qwen3 and Llama 3.

Shape letters: B batch, T query tokens, S key tokens, D hidden, V vocab,
H query heads, K kv heads, G query heads per kv head (H = K*G), Dh head dim, F mlp, L layers.

Weights keep the HF layout up to a transpose/reshape (``q_proj.kernel_dhk`` is HF
``q_proj.weight`` transposed to [D, H, Dh]); see ``hf_io.HF_PARAM_TABLE``.

The decoder layers are one ``DecoderLayer`` whose variables are stacked on a leading
[L] axis (logical axis ``layers``, never sharded), and the forward pass is one
``lax.scan`` over them: the compiled program holds one layer whatever the depth, so
compile time and HLO size do not grow with L (the Qwen2.5-0.5B learner compiled 24
unrolled copies before). ``model.layer(i)`` / ``model.unstacked_layers()`` give single
layers (the engine unrolls them; see ``areal_jax.engine.forward``).

Attention and MLP hold an optional ``lora`` dict of ``nnx.LoRA`` adapters keyed by the
PEFT module name (``q_proj`` ... ``down_proj``); ``model_defs.lora.add_lora`` fills it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from model_defs.attention import attention
from model_defs.config import ModelConfig
from model_defs.fused_attention import ATTENTION_IMPLS
from model_defs.sharding import shard

Array = jax.Array


# --------------------------------------------------------------------------- rope
def rope_inv_freq(cfg: ModelConfig) -> Array:
    """Inverse frequencies [Dh/2], including Llama-3 scaling, as transformers computes them."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = ((old_context_len / wavelen - low_freq_factor)
                  / (high_freq_factor - low_freq_factor))
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = jnp.where(is_medium, smoothed, inv_freq_llama)
    return inv_freq


def rope_cos_sin(inv_freq: Array, positions_bt: Array, dtype: DTypeLike) -> tuple[Array, Array]:
    """cos, sin: [B, T, Dh] (the two halves repeated, HF convention)."""
    freqs_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    emb_btd = jnp.concatenate([freqs_btf, freqs_btf], axis=-1)
    return jnp.cos(emb_btd).astype(dtype), jnp.sin(emb_btd).astype(dtype)


def apply_rope(x_btnd: Array, cos_btd: Array, sin_btd: Array) -> Array:
    half = x_btnd.shape[-1] // 2
    rotated = jnp.concatenate([-x_btnd[..., half:], x_btnd[..., :half]], axis=-1)
    return x_btnd * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]


# --------------------------------------------------------------------------- layers
class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype: DTypeLike, param_dtype: DTypeLike):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * normed


def lora_delta(lora: nnx.Dict | None, name: str, x_bti: Array) -> Array | None:
    """``scale * x @ A @ B`` of the adapter ``name`` ([B, T, in] -> [B, T, out]), or None
    when that projection has no adapter."""
    if lora is None or name not in lora:
        return None
    adapter = lora[name]
    return adapter(x_bti) * jnp.asarray(adapter.scale, x_bti.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype: DTypeLike,
           std: float = 0.02) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), logical_axes=axes)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: DTypeLike,
                 param_dtype: DTypeLike):
        d, h, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        k = cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, dh
        self.dtype = dtype
        self.q_kernel_dhk = _param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), param_dtype)
        self.k_kernel_dkh = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_kernel_dkh = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_kernel_hkd = _param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), param_dtype)
        self.q_bias: nnx.Param | None
        self.k_bias: nnx.Param | None
        self.v_bias: nnx.Param | None
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, dh), param_dtype),
                                    logical_axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((k, dh), param_dtype),
                                    logical_axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((k, dh), param_dtype),
                                    logical_axes=("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.lora: nnx.Dict | None = nnx.data(None)  # adapters: model_defs.lora

    def _project(self, x_btd: Array, kernel: nnx.Param, bias: nnx.Param | None,
                 name: str) -> Array:
        out_btnh = _dot("btd,dnh->btnh", x_btd, kernel[...], self.dtype)
        delta_bto = lora_delta(self.lora, name, x_btd)
        if delta_bto is not None:
            out_btnh = out_btnh + delta_bto.reshape(out_btnh.shape)
        if bias is not None:
            out_btnh = out_btnh + bias[...].astype(self.dtype)
        return out_btnh

    def project_qkv(self, x_btd: Array, cos_sin: tuple[Array, Array]
                    ) -> tuple[Array, Array, Array]:
        """Head-major attention inputs of normed hidden states [B, T, D]: queries
        [B, K, G, T, Dh] scaled by Dh**-0.5, keys and values [B, K, T, Dh] (RoPE applied)."""
        b, t, _ = x_btd.shape
        q_bthd = self._project(x_btd, self.q_kernel_dhk, self.q_bias, "q_proj")
        k_btkd = self._project(x_btd, self.k_kernel_dkh, self.k_bias, "k_proj")
        v_btkd = self._project(x_btd, self.v_kernel_dkh, self.v_bias, "v_proj")
        if self.q_norm is not None and self.k_norm is not None:  # qk_norm: both or neither
            q_bthd = self.q_norm(q_bthd)
            k_btkd = self.k_norm(k_btkd)
        cos, sin = cos_sin
        q_bthd = shard(apply_rope(q_bthd, cos, sin), ("batch", "seq", "heads", "head_dim"))
        k_btkd = shard(apply_rope(k_btkd, cos, sin), ("batch", "seq", "kv_heads", "head_dim"))
        v_btkd = shard(v_btkd, ("batch", "seq", "kv_heads", "head_dim"))
        kv, dh = self.num_kv_heads, self.head_dim
        q_bkgtd = q_bthd.reshape(b, t, kv, self.num_heads // kv, dh).transpose(0, 2, 3, 1, 4)
        q_bkgtd = q_bkgtd * jnp.asarray(dh**-0.5, self.dtype)
        return q_bkgtd, k_btkd.transpose(0, 2, 1, 3), v_btkd.transpose(0, 2, 1, 3)

    def project_out(self, out_bkgtd: Array) -> Array:
        """Output projection of head-major attention outputs, -> [B, T, D]."""
        b, k, g, t, dh = out_bkgtd.shape
        out_bthd = out_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, dh)
        out_btd = _dot("bthd,hdD->btD", out_bthd, self.o_kernel_hkd[...], self.dtype)
        delta_btd = lora_delta(self.lora, "o_proj", out_bthd.reshape(b, t, k * g * dh))
        return out_btd if delta_btd is None else out_btd + delta_btd

    def __call__(self, x_btd: Array, cos_sin: tuple[Array, Array],
                 segment_ids_bt: Array | None, attention_impl: str = "xla") -> Array:
        q_bkgtd, k_bktd, v_bktd = self.project_qkv(x_btd, cos_sin)
        out_bkgtd = attention(q_bkgtd, k_bktd, v_bktd, segment_ids_bt=segment_ids_bt,
                              impl=attention_impl)
        return self.project_out(out_bkgtd)


def _dot(spec: str, x: Array, kernel: Array, dtype: DTypeLike) -> Array:
    """``einsum(spec, x, kernel)`` in ``dtype``, accumulated in fp32 and rounded once. For
    bf16 this is what accelerators do anyway; on the CPU it also lets XLA multiply the bf16
    kernel as it is, where a bf16 product would first convert the whole kernel to fp32 (a
    temporary as large as the weights, allocated on every call)."""
    return jnp.einsum(spec, x.astype(dtype), kernel.astype(dtype),
                      preferred_element_type=jnp.float32).astype(dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: DTypeLike,
                 param_dtype: DTypeLike):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype
        self.gate_kernel_df = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.up_kernel_df = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.down_kernel_fd = _param(rngs, (f, d), ("mlp", "embed"), param_dtype)
        self.lora: nnx.Dict | None = nnx.data(None)  # adapters: model_defs.lora

    def _matmul(self, x_bti: Array, kernel: nnx.Param, name: str) -> Array:
        out_bto = _dot("...i,io->...o", x_bti, kernel[...], self.dtype)
        delta_bto = lora_delta(self.lora, name, x_bti)
        return out_bto if delta_bto is None else out_bto + delta_bto

    def __call__(self, x_btd: Array) -> Array:
        gate_btf = self._matmul(x_btd, self.gate_kernel_df, "gate_proj")
        up_btf = self._matmul(x_btd, self.up_kernel_df, "up_proj")
        hidden_btf = shard(jax.nn.silu(gate_btf) * up_btf, ("batch", "seq", "mlp"))
        return self._matmul(hidden_btf, self.down_kernel_fd, "down_proj")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: DTypeLike,
                 param_dtype: DTypeLike):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, rngs=rngs, **kw)

    def attention_inputs(self, x_btd: Array, cos_sin: tuple[Array, Array]
                         ) -> tuple[Array, Array, Array]:
        """q [B, K, G, T, Dh] (pre-scaled), k, v [B, K, T, Dh] of the layer input [B, T, D]."""
        return self.attn.project_qkv(self.input_norm(x_btd), cos_sin)

    def finish(self, x_btd: Array, attn_out_bkgtd: Array) -> Array:
        """The rest of the layer after attention: residual, MLP, residual."""
        x_btd = shard(x_btd + self.attn.project_out(attn_out_bkgtd), ("batch", "seq", "act_embed"))
        x_btd = x_btd + self.mlp(self.post_attn_norm(x_btd))
        return shard(x_btd, ("batch", "seq", "act_embed"))

    def __call__(self, x_btd: Array, cos_sin: tuple[Array, Array],
                 segment_ids_bt: Array | None, attention_impl: str = "xla") -> Array:
        attn_btd = self.attn(self.input_norm(x_btd), cos_sin, segment_ids_bt, attention_impl)
        x_btd = shard(x_btd + attn_btd, ("batch", "seq", "act_embed"))
        x_btd = x_btd + self.mlp(self.post_attn_norm(x_btd))
        return shard(x_btd, ("batch", "seq", "act_embed"))


def _layer_leaves(layers: Any) -> tuple[Any, list[Array], Any]:
    """(state, its leaves, rebuild) of the stacked layer module: ``rebuild(leaves)`` -> a
    ``DecoderLayer`` holding the given arrays (stacked [L, ...] or one layer's slice)."""
    graphdef, state = nnx.split(layers)
    leaves, treedef = jax.tree.flatten(state)
    return state, leaves, lambda new: nnx.merge(graphdef, jax.tree.unflatten(treedef, new))


def _accumulators_for(state: Any, grad_acc: Any) -> list[Any]:
    """For each leaf of the stacked layers' ``state`` (``jax.tree.flatten`` order), the leaf
    of ``grad_acc`` (a tree of some of the same variables, e.g. the trainable ones) at the
    same path, or None."""
    if grad_acc is None:
        return [None] * len(jax.tree.leaves(state))
    by_path = dict(jax.tree_util.tree_flatten_with_path(grad_acc)[0])
    out = [by_path.pop(path, None) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if by_path:
        raise ValueError(f"layer_grad_acc has entries the layers do not: "
                         f"{[jax.tree_util.keystr(p) for p in by_path]}")
    for (path, leaf), acc in zip(jax.tree_util.tree_flatten_with_path(state)[0], out,
                                 strict=True):
        if acc is not None and tuple(acc.shape) != tuple(leaf.shape):
            raise ValueError(f"layer_grad_acc{jax.tree_util.keystr(path)} has shape "
                             f"{tuple(acc.shape)}, the layers' variable {tuple(leaf.shape)}")
    return out


@jax.custom_vjp
def _plus_gradient(value: Array, acc: Array) -> Array:
    """Identity in value; its gradient is ``acc`` plus the incoming one."""
    return value


_plus_gradient.defvjp(lambda value, acc: (value, acc), lambda acc, ct: (ct + acc, None))


def _scan_layers(rebuild: Any, leaves: list[Array], x_btd: Array, cos_sin: Any,
                 segment_ids_bt: Array | None, policy: Any, attention_impl: str) -> Array:
    """The layers as one ``lax.scan`` over the stacked leaves (each step one layer), the
    body under ``jax.checkpoint(policy)`` when a policy is given."""

    def body(x_, layer_leaves):
        return rebuild(layer_leaves)(x_, cos_sin, segment_ids_bt, attention_impl), None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy)
    return jax.lax.scan(body, x_btd, leaves)[0]


def _scan_layers_remat_full(rebuild: Any, leaves: list[Array], x_btd: Array, cos_sin: Any,
                            segment_ids_bt: Array | None, accs: list[Any],
                            attention_impl: str) -> Array:
    """``remat: full``: the layers as one scan whose backward pass is a reverse scan of
    per-layer backward steps (a ``custom_vjp`` over the whole stack).

    The forward scan keeps each layer's input only ([L, B, T, D]). Each step of the
    backward scan recomputes one layer from its input, takes its VJP, and adds the weight
    gradients into that layer's rows of the stacked gradient buffers, which the loop
    carries (an in-place update): a layer's recomputed activations, cotangents and fresh
    weight gradients are temporaries of its own loop iteration and end with it. (With
    ``jax.checkpoint`` over an unrolled stack, XLA's scheduler deferred every layer's
    weight-gradient work to the end of the backward pass and kept ~57 MiB a layer alive for
    a Qwen2.5-0.5B shape at 4096 tokens; a loop body is one unit to the scheduler.)

    ``accs``: per leaf, a gradient buffer of the leaf's stacked shape or None; the
    gradients of those leaves come out as buffer + gradient. Gradients are taken only for
    the leaves the caller differentiates (``symbolic_zeros`` says which): with LoRA the
    frozen base weights get none.
    """
    wanted: list[bool] = []  # set by the forward rule: which leaves (and x) are perturbed

    def layer_apply(layer_leaves, x_):
        return rebuild(layer_leaves)(x_, cos_sin, segment_ids_bt, attention_impl)

    def forward(leaves_, x_):
        def body(h, layer_leaves):
            return layer_apply(layer_leaves, h), h
        return jax.lax.scan(body, x_, leaves_)

    @jax.custom_vjp
    def run(leaves_, x_, accs_):
        return forward(leaves_, x_)[0]

    def fwd(leaves_, x_, accs_):
        wanted[:] = [p.perturbed for p in leaves_] + [x_.perturbed]
        values = [p.value for p in leaves_]
        out, inputs_lbtd = forward(values, x_.value)
        return out, (values, inputs_lbtd, [None if a is None else a.value for a in accs_])

    def bwd(residuals, ct_btd):
        values, inputs_lbtd, accs_ = residuals
        if isinstance(ct_btd, jax.custom_derivatives.SymbolicZero):
            ct_btd = jnp.zeros(ct_btd.shape, ct_btd.dtype)
        want_leaf, want_x = wanted[:-1], wanted[-1]
        picked = [i for i, w in enumerate(want_leaf) if w]
        bufs = [jnp.zeros_like(values[i]) if accs_[i] is None else accs_[i] for i in picked]
        n_layers = inputs_lbtd.shape[0]

        def step(carry, layer):
            ct_, bufs_ = carry
            layer_values = [jax.lax.dynamic_index_in_dim(v, layer, keepdims=False)
                            for v in values]
            x_in = jax.lax.dynamic_index_in_dim(inputs_lbtd, layer, keepdims=False)

            def f(diff_in, x_):
                full = list(layer_values)
                for i, v in zip(picked, diff_in, strict=True):
                    full[i] = v
                return layer_apply(full, x_)

            _, vjp = jax.vjp(f, [layer_values[i] for i in picked], x_in)
            d_diff, d_x = vjp(ct_)
            bufs_ = [jax.lax.dynamic_update_index_in_dim(
                         b, jax.lax.dynamic_index_in_dim(b, layer, keepdims=False)
                         + d.astype(b.dtype), layer, 0)
                     for b, d in zip(bufs_, d_diff, strict=True)]
            return (d_x.astype(ct_.dtype), bufs_), None

        (d_x, bufs), _ = jax.lax.scan(step, (ct_btd, bufs), jnp.arange(n_layers),
                                      reverse=True)
        d_leaves: list[Any] = [None] * len(values)
        for i, b in zip(picked, bufs, strict=True):
            d_leaves[i] = b
        return d_leaves, (d_x if want_x else None), None

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run(leaves, x_btd, accs)


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One ``DecoderLayer`` holding the variables of ``layers`` stacked on a new leading
    axis (logical axis ``"layers"``, never sharded). All must have the same structure."""
    if not layers:
        raise ValueError("stack_layers: no layers")
    graphdef, _ = nnx.split(layers[0])
    states = [nnx.split(layer)[1] for layer in layers]
    stacked = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
    for _, node in nnx.iter_graph(stacked):
        if isinstance(node, nnx.Variable):
            axes = node.get_metadata().get("logical_axes")
            if axes is not None:
                node.set_metadata("logical_axes", ("layers", *axes))
    return stacked


# --------------------------------------------------------------------------- remat
# What a rematerialised decoder layer keeps for the backward pass (jax.checkpoint policies).
REMAT_POLICIES = {
    "none": None,  # no rematerialisation: every activation is kept
    # only each layer's input (not jax.checkpoint: see _scan_layers_remat_full)
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,  # matmul outputs kept, the rest recomputed
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy_name(remat: bool | str) -> str:
    """Normalises ``remat`` (a bool, or a key of ``REMAT_POLICIES``) to a policy name."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; expected a bool or one of {sorted(REMAT_POLICIES)}")
    return remat


# --------------------------------------------------------------------------- model
class CausalLM(nnx.Module):
    """Decoder-only LM. ``model(ids)`` -> fp32 logits [B, T, V].

    Generation does not go through ``__call__``: the engine (``areal_jax.engine.forward``)
    keeps its own slot KV cache and drives the layers through their public pieces
    (``attention_inputs``, ``finish``) and the same attention function."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike = jnp.float32,
        param_dtype: DTypeLike = jnp.float32,
        remat: bool | str = False,
        attention_impl: str = "auto",
    ):
        self.cfg = cfg
        # Self-attention kernel (``model.attention``): resolved per call for the platform of
        # the active mesh; "auto" is the XLA path on CPU (see model_defs.fused_attention).
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_IMPLS)}; "
                             f"got {attention_impl!r}")
        self.attention_impl = attention_impl
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        remat_policy_name(remat)  # fails early on an unknown policy
        self.remat = remat
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.embed_vd = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                               self.param_dtype)
        # One DecoderLayer whose variables are stacked [L, ...] (logical axis "layers"):
        # the forward pass is one lax.scan over them, so the compiled program holds one
        # layer whatever the depth.
        self.layers = stack_layers(
            [DecoderLayer(cfg, rngs=rngs, **kw) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head_dv = None
        else:
            self.lm_head_dv = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                     self.param_dtype)

    # ------------------------------------------------------------------ helpers
    @property
    def num_layers(self) -> int:
        return self.cfg.num_hidden_layers

    def layer(self, i: int | Array) -> DecoderLayer:
        """Decoder layer ``i`` as a module of its own (its slices of the stacked variables;
        a static ``i`` in a traced function is a free slice)."""
        _, leaves, rebuild = _layer_leaves(self.layers)
        return rebuild([jax.lax.dynamic_index_in_dim(v, i, keepdims=False)
                        if not isinstance(i, int) else v[i] for v in leaves])

    def unstacked_layers(self) -> list[DecoderLayer]:
        """Every decoder layer as its own module (``layer(i)`` for i in order)."""
        _, leaves, rebuild = _layer_leaves(self.layers)
        return [rebuild([v[i] for v in leaves]) for i in range(self.num_layers)]

    def layers_of(self, per_layer: Sequence[Sequence[Array]]) -> list[DecoderLayer]:
        """The decoder layers holding the given arrays: ``per_layer[i]`` is layer i's
        variables, in the order ``jax.tree.leaves`` lists the stacked layers' state (e.g.
        arrays that alias the stacked ones' slices, which a traced slice would copy)."""
        _, leaves, rebuild = _layer_leaves(self.layers)
        if len(per_layer) != self.num_layers or any(len(x) != len(leaves) for x in per_layer):
            raise ValueError(f"layers_of needs {self.num_layers} layers of {len(leaves)} "
                             "arrays each")
        return [rebuild(list(x)) for x in per_layer]

    def unembed_dv(self) -> Array:
        """[D, V] output projection (the transposed embedding when tied)."""
        if self.lm_head_dv is None:
            return self.embed_vd[...].T
        return self.lm_head_dv[...]

    def unembed_weight(self) -> tuple[Array, int]:
        """The output projection as stored, and its vocabulary axis: the [V, D] embedding
        table when tied (axis 0), else lm_head [D, V] (axis 1). Unlike ``unembed_dv`` it
        never makes a transposed copy."""
        if self.lm_head_dv is None:
            return self.embed_vd[...], 0
        return self.lm_head_dv[...], 1

    def embed(self, input_ids_bt: Array) -> Array:
        """Token embeddings [B, T, D] in the compute dtype. Out-of-range ids (e.g. -1
        padding) are clipped, so they never turn into NaN."""
        return jnp.take(self.embed_vd[...], input_ids_bt, axis=0, mode="clip").astype(self.dtype)

    def rope(self, positions_bt: Array) -> tuple[Array, Array]:
        """RoPE cos, sin [B, T, Dh] for integer positions, in the compute dtype."""
        return rope_cos_sin(rope_inv_freq(self.cfg), positions_bt, self.dtype)

    def hidden_states(
        self,
        input_ids_bt: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        layer_grad_acc: Any = None,
    ) -> Array:
        """Hidden states after the final norm, [B, T, D].

        ``layer_grad_acc`` (for a learner that accumulates gradients over micro-batches):
        a tree of gradient buffers for some of the stacked layers' variables, at the same
        paths and [L, ...] shapes as in ``nnx.split(model.layers)``'s state, e.g. the
        ``layers`` part of the gradient accumulator. A gradient of this function then comes
        out, for those variables, as buffer + gradient. With ``remat: full`` the sum is
        taken inside each layer's backward step, so no layer's fresh gradient outlives it."""
        input_ids_bt = jnp.asarray(input_ids_bt)
        if input_ids_bt.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids_bt.shape}")
        b, t = input_ids_bt.shape
        if positions is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        else:
            positions_bt = jnp.asarray(positions, jnp.int32)
            if positions_bt.shape != (b, t):
                raise ValueError(f"positions has shape {positions_bt.shape}, expected {(b, t)}")
        seg_bt = None
        if segment_ids is not None:
            seg_bt = jnp.asarray(segment_ids, jnp.int32)
            if seg_bt.shape != (b, t):
                raise ValueError(f"segment_ids has shape {seg_bt.shape}, expected {(b, t)}")

        x_btd = shard(self.embed(input_ids_bt), ("batch", "seq", "act_embed"))
        cos_sin = self.rope(positions_bt)
        policy = remat_policy_name(self.remat)
        state, leaves, rebuild = _layer_leaves(self.layers)
        accs = _accumulators_for(state, layer_grad_acc)
        if policy == "full":  # adds into accs itself, inside each layer's backward step
            x_btd = _scan_layers_remat_full(rebuild, leaves, x_btd, cos_sin, seg_bt, accs,
                                            self.attention_impl)
        else:
            leaves = [v if a is None else _plus_gradient(v, a)
                      for v, a in zip(leaves, accs, strict=True)]
            x_btd = _scan_layers(rebuild, leaves, x_btd, cos_sin, seg_bt,
                                 REMAT_POLICIES[policy], self.attention_impl)
        return self.final_norm(x_btd)

    def logits_from_hidden(self, hidden_btd: Array) -> Array:
        """fp32 logits [B, T, V] = hidden @ unembed_dv (from the weight as stored: a tied
        embedding is not transposed, which on the CPU would copy it on every call)."""
        w, vocab_axis = self.unembed_weight()
        spec = "btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv"
        if self.dtype == jnp.float32 and w.dtype == jnp.float32:
            logits_btv = jnp.einsum(spec, hidden_btd, w)
        else:
            logits_btv = jnp.einsum(spec, hidden_btd, w.astype(self.dtype),
                                    preferred_element_type=jnp.float32)
        return shard(logits_btv.astype(jnp.float32), ("batch", "seq", "vocab"))

    def __call__(
        self,
        input_ids_bt: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
    ) -> Array:
        """fp32 logits [B, T, V]. ``segment_ids`` [B, T]: tokens attend only to earlier
        tokens of the same segment (0 marks padding)."""
        return self.logits_from_hidden(self.hidden_states(input_ids_bt, positions, segment_ids))
