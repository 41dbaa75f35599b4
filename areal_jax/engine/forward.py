"""The engine's forward passes over its slot KV cache.

They run the model through its public API (``embed``, ``rope``, each layer's
``attention_inputs`` and ``finish``, ``final_norm``, ``logits_from_hidden``) and the one
attention function, ``model_defs.attention.attention``, that the learner uses too. They
own only what serving needs differently from the learner: the cache layout and how much
of it attention reads.

* Layers are unrolled here (``model.unstacked_layers()``: static slices of the stacked
  variables), while the learner scans them. The cache stays one buffer per layer, so
  each layer's write is in place and decode reads each layer's prefix directly; a scan
  would carry the whole [L, ...] cache through every step of the layer loop. The cost
  is compile time that grows with depth, seconds for the engine's small programs.
  A slice of a stacked weight is a copy in XLA, and XLA does not hoist it out of a
  loop: ``decode_chunk`` slices once per call, before its step loop. Slicing inside
  the loop copied every layer's weights at every step (a 4-layer, 50 MB model's 8-step
  decode call moved 1.32 GB instead of 0.71 GB by ``bench/hlo_cost``).

* The slot cache is head-major: values ``[B_slots, K, S_max, Dh]`` and keys stored
  transposed, ``[B_slots, K, Dh, S_max]``, per layer. Decode attention is then two plain
  matrix products per (slot, kv-head), ``q[G, Dh] @ k[Dh, S]`` and ``p[G, S] @ v[S, Dh]``,
  each reading its operand in its natural layout. (With keys as ``[S, Dh]`` the score
  product contracts the minor axis of both operands, which XLA's CPU dot runs 2-3x
  slower on these shapes: it was the largest op of a decode step.)
* Decode attends to the first ``kv_len`` cache positions only (a static bucket that
  covers every active slot), so a step costs what the live sequences need, not S_max.
  A call runs several steps; it reads that prefix once and writes the cache once.
* Prefill computes a bucket of prompts without reading the cache (the learner's causal
  self-attention over the prompt, blockwise) and writes their keys/values into their slots.
* Decode attends to the cache prefix and to this call's keys separately and merges the
  two by their log-sum-exp (``merge_attention``), exactly equal to one softmax over both.

Exactness is tested against model_defs' full forward and transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from areal_jax.engine.sampling import first_argmax
from model_defs import CausalLM, ModelConfig, PyTree
from model_defs.attention import attention, merge_attention

Array = jax.Array


@struct.dataclass
class SlotCache:
    """Keys/values of every slot, one array per layer: ``k[l]`` [B_slots, K, Dh, S_max]
    (transposed, see the module doc) and ``v[l]`` [B_slots, K, S_max, Dh].

    Separate per-layer buffers let each layer's write happen in place and let attention
    over the whole cache read a buffer directly instead of a copied slice.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]


def init_slot_cache(cfg: ModelConfig, slots: int, max_len: int, dtype: DTypeLike) -> SlotCache:
    v_shape = (slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
    k_shape = (slots, cfg.num_key_value_heads, cfg.head_dim, max_len)
    layers = range(cfg.num_hidden_layers)
    return SlotCache(k=tuple(jnp.zeros(k_shape, dtype) for _ in layers),
                     v=tuple(jnp.zeros(v_shape, dtype) for _ in layers))


def prefill_forward(model: CausalLM, prompt_pt: Array, prompt_len_p: Array, slot_p: Array,
                    cache: SlotCache) -> tuple[Array, SlotCache]:
    """Runs right-padded prompts [P, T] and stores their keys/values in slots ``slot_p``
    (out-of-range slots, used for padding rows, are dropped). Returns the fp32 logits at
    each prompt's last token [P, V] and the cache."""
    rows, bucket = prompt_pt.shape
    positions_pt = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (rows, bucket))
    cos_sin = model.rope(positions_pt)
    x_ptd = model.embed(prompt_pt)
    new_k, new_v = [], []
    for layer in model.unstacked_layers():
        q_pkgtd, k_pktd, v_pktd = layer.attention_inputs(x_ptd, cos_sin)
        new_k.append(k_pktd)
        new_v.append(v_pktd)
        # Right padding comes after every real token, so causal attention alone keeps it
        # out of the real tokens' outputs.
        x_ptd = layer.finish(x_ptd, attention(q_pkgtd, k_pktd, v_pktd,
                                              impl=model.attention_impl))
    cache = SlotCache(
        k=tuple(c.at[slot_p, :, :, :bucket].set(n.swapaxes(2, 3).astype(c.dtype), mode="drop")
                for c, n in zip(cache.k, new_k, strict=True)),
        v=tuple(c.at[slot_p, :, :bucket].set(n.astype(c.dtype), mode="drop")
                for c, n in zip(cache.v, new_v, strict=True)),
    )
    last_pd = jnp.take_along_axis(x_ptd, (prompt_len_p - 1)[:, None, None], axis=1)[:, 0]
    hidden_p1d = model.final_norm(last_pd[:, None, :])
    return model.logits_from_hidden(hidden_p1d)[:, 0], cache


def decode_forward(model: CausalLM, token_b: Array, position_b: Array, cache: SlotCache,
                   kv_len: int) -> tuple[Array, SlotCache]:
    """One token per slot at its own position (< kv_len). Returns logits [B, V], cache.
    (A one-step ``decode_chunk``; kept as the simple reference path.)"""
    logits_kbv, cache = decode_chunk(model, token_b, position_b, cache, kv_len, 1,
                                     lambda logits_bv, step, position_b: (
                                         first_argmax(logits_bv), logits_bv))
    return logits_kbv[0], cache


def decode_chunk(model: CausalLM, token_b: Array, position_b: Array, cache: SlotCache, kv_len: int,
                 steps: int, choose: Callable[[Array, Array, Array], tuple[Array, PyTree]]
                 ) -> tuple[PyTree, SlotCache]:
    """``steps`` decode steps for every slot, feeding back ``choose``'s tokens.

    Slot b feeds ``token_b[b]`` at ``position_b[b]``, then its own choices at the next
    positions. Attention reads the cache prefix [0, kv_len) once per call (positions
    below each slot's start) plus the keys/values this call produced, kept in a small
    local buffer; the cache is written once, after the last step.

    ``choose(logits_bv, step, position_b) -> (token_b, extra)`` picks the next tokens
    (``position_b`` is where they will sit); the stacked ``extra`` [steps, ...] is returned.
    """
    b = token_b.shape[0]
    start_b = position_b
    prefix_k = [k[..., :kv_len].astype(model.dtype) for k in cache.k]  # [B, K, Dh, P]
    prefix_v = [v[:, :, :kv_len].astype(model.dtype) for v in cache.v]  # [B, K, P, Dh]
    kv, dh = cache.v[0].shape[1], cache.v[0].shape[3]
    local_k0 = tuple(jnp.zeros((b, kv, dh, steps), model.dtype) for _ in cache.k)
    local_v0 = tuple(jnp.zeros((b, kv, steps, dh), model.dtype) for _ in cache.v)
    # The prefix holds positions [0, start_b) of each slot; later indices are stale.
    prefix_limit_b1 = (start_b - 1)[:, None]
    layers = model.unstacked_layers()  # sliced once per call, outside the step loop

    def one_step(carry, step):
        local_k, local_v, token_b, position_b = carry
        cos_sin = model.rope(position_b[:, None])
        local_limit_b1 = jnp.full((b, 1), step, jnp.int32)  # this call's keys 0..step
        x_b1d = model.embed(token_b[:, None])
        new_local_k, new_local_v = [], []
        for layer, pk, pv, lk, lv in zip(layers, prefix_k, prefix_v,
                                         local_k, local_v, strict=True):
            q_bkg1d, k_bk1d, v_bk1d = layer.attention_inputs(x_b1d, cos_sin)
            lk = jax.lax.dynamic_update_slice_in_dim(lk, k_bk1d.swapaxes(2, 3), step, axis=3)
            lv = jax.lax.dynamic_update_slice_in_dim(lv, v_bk1d, step, axis=2)
            new_local_k.append(lk)
            new_local_v.append(lv)
            parts = [attention(q_bkg1d, keys, values, kv_limit_bt=limit, keys_transposed=True,
                               return_lse=True)
                     for keys, values, limit in ((pk, pv, prefix_limit_b1),
                                                 (lk, lv, local_limit_b1))]
            x_b1d = layer.finish(x_b1d, merge_attention(parts, model.dtype))
        logits_bv = model.logits_from_hidden(model.final_norm(x_b1d))[:, 0]
        next_token_b, extra = choose(logits_bv, step, position_b + 1)
        carry = (tuple(new_local_k), tuple(new_local_v), next_token_b, position_b + 1)
        return carry, extra

    (local_k, local_v, _, _), extras = jax.lax.scan(
        one_step, (local_k0, local_v0, token_b, position_b), jnp.arange(steps))
    # Write this call's keys/values at positions start_b + [0, steps); beyond S_max: dropped.
    rows_bc = jnp.broadcast_to(jnp.arange(b)[:, None], (b, steps))
    pos_bc = start_b[:, None] + jnp.arange(steps)[None, :]

    def commit_k(c, local_bkdc):
        return c.at[rows_bc, :, :, pos_bc].set(local_bkdc.transpose(0, 3, 1, 2).astype(c.dtype),
                                                mode="drop")

    def commit_v(c, local_bkcd):
        return c.at[rows_bc, :, pos_bc].set(local_bkcd.transpose(0, 2, 1, 3).astype(c.dtype),
                                             mode="drop")

    cache = SlotCache(k=tuple(commit_k(c, lk) for c, lk in zip(cache.k, local_k, strict=True)),
                      v=tuple(commit_v(c, lv) for c, lv in zip(cache.v, local_v, strict=True)))
    return extras, cache
