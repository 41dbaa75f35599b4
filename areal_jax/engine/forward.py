"""The engine's forward passes over its slot KV cache.

They run the model_defs modules and parameters (embedding, norms, q/k/v/o projections,
q/k norms, RoPE, MLP, unembedding) and own only what serving needs differently from the
learner: the cache layout and how much of it attention reads.

* The slot cache is head-major: values ``[B_slots, K, S_max, Dh]`` and keys stored
  transposed, ``[B_slots, K, Dh, S_max]``, per layer. Decode attention is then two plain
  matrix products per (slot, kv-head), ``q[G, Dh] @ k[Dh, S]`` and ``p[G, S] @ v[S, Dh]``,
  each reading its operand in its natural layout. (With keys as ``[S, Dh]`` the score
  product contracts the minor axis of both operands, which XLA's CPU dot runs 2-3x
  slower on these shapes: it was the largest op of a decode step.)
* Decode attends to the first ``kv_len`` cache positions only (a static bucket that
  covers every active slot), so a step costs what the live sequences need, not S_max.
  A call runs several steps; it reads that prefix once and writes the cache once.
* Prefill computes a bucket of prompts without reading the cache (causal attention over
  the prompt, in query blocks) and writes their keys/values into their slots.

Exactness is tested against model_defs' full forward and transformers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from areal_jax.engine.sampling import first_argmax
from model_defs.model import apply_rope, rope_cos_sin, rope_inv_freq

Array = jax.Array
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
PREFILL_QUERY_BLOCK = 256


@struct.dataclass
class SlotCache:
    """Keys/values of every slot, one array per layer: ``k[l]`` [B_slots, K, Dh, S_max]
    (transposed, see the module doc) and ``v[l]`` [B_slots, K, S_max, Dh].

    Separate per-layer buffers let each layer's write happen in place and let attention
    over the whole cache read a buffer directly instead of a copied slice.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]


def init_slot_cache(cfg: Any, slots: int, max_len: int, dtype: Any) -> SlotCache:
    v_shape = (slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
    k_shape = (slots, cfg.num_key_value_heads, cfg.head_dim, max_len)
    layers = range(cfg.num_hidden_layers)
    return SlotCache(k=tuple(jnp.zeros(k_shape, dtype) for _ in layers),
                     v=tuple(jnp.zeros(v_shape, dtype) for _ in layers))


def _qkv(layer: Any, x_btd: Array, cos_btd: Array, sin_btd: Array
         ) -> tuple[Array, Array, Array]:
    """q [B,K,G,T,Dh] (pre-scaled), k and v [B,K,T,Dh] for one layer."""
    attn = layer.attn
    h_btd = layer.input_norm(x_btd)
    q_bthd = attn._project(h_btd, attn.q_kernel_dhk, attn.q_bias)
    k_btkd = attn._project(h_btd, attn.k_kernel_dkh, attn.k_bias)
    v_btkd = attn._project(h_btd, attn.v_kernel_dkh, attn.v_bias)
    if attn.q_norm is not None:
        q_bthd = attn.q_norm(q_bthd)
        k_btkd = attn.k_norm(k_btkd)
    q_bthd = apply_rope(q_bthd, cos_btd, sin_btd)
    k_btkd = apply_rope(k_btkd, cos_btd, sin_btd)
    b, t = x_btd.shape[:2]
    kv, dh = attn.num_kv_heads, attn.head_dim
    q_bkgtd = q_bthd.reshape(b, t, kv, attn.num_heads // kv, dh).transpose(0, 2, 3, 1, 4)
    q_bkgtd = q_bkgtd * jnp.asarray(dh**-0.5, attn.dtype)
    return q_bkgtd, k_btkd.transpose(0, 2, 1, 3), v_btkd.transpose(0, 2, 1, 3)


def _attend(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, mask_bts: Array) -> Array:
    """fp32 scores and softmax, as model_defs. Returns [B, K, G, T, Dh]."""
    scores_bkgts = jnp.einsum("bkgtd,bksd->bkgts", q_bkgtd, k_bksd,
                              preferred_element_type=jnp.float32)
    scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts, _MASK_VALUE)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(q_bkgtd.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", probs_bkgts, v_bksd)


def _attend_two(q_bkgtd: Array, keys_t: tuple[Array, Array], values: tuple[Array, Array],
                mask_bts: Array) -> Array:
    """``_attend`` over the concatenation of two key/value sets, without concatenating
    the (large) keys: scores are computed per set and only the scores are joined. Keys
    are transposed, [B, K, Dh, S] (the cache layout)."""
    scores_bkgts = jnp.concatenate(
        [jnp.einsum("bkgtd,bkds->bkgts", q_bkgtd, k, preferred_element_type=jnp.float32)
         for k in keys_t], axis=-1)
    scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts, _MASK_VALUE)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(q_bkgtd.dtype)
    split = keys_t[0].shape[3]
    return (jnp.einsum("bkgts,bksd->bkgtd", probs_bkgts[..., :split], values[0])
            + jnp.einsum("bkgts,bksd->bkgtd", probs_bkgts[..., split:], values[1]))


def _finish_layer(layer: Any, x_btd: Array, out_bkgtd: Array) -> Array:
    attn = layer.attn
    b, k, g, t, dh = out_bkgtd.shape
    out_bthd = out_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, dh)
    x_btd = x_btd + jnp.einsum("bthd,hdD->btD", out_bthd, attn.o_kernel_hkd[...].astype(attn.dtype))
    return x_btd + layer.mlp(layer.post_attn_norm(x_btd))


def _embed(model: Any, ids_bt: Array) -> Array:
    return jnp.take(model.embed_vd[...], ids_bt, axis=0, mode="clip").astype(model.dtype)


def prefill_forward(model: Any, prompt_pt: Array, prompt_len_p: Array, slot_p: Array,
                    cache: SlotCache) -> tuple[Array, SlotCache]:
    """Runs right-padded prompts [P, T] and stores their keys/values in slots ``slot_p``
    (out-of-range slots, used for padding rows, are dropped). Returns the fp32 logits at
    each prompt's last token [P, V] and the cache."""
    rows, bucket = prompt_pt.shape
    positions_pt = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (rows, bucket))
    cos_ptd, sin_ptd = rope_cos_sin(rope_inv_freq(model.cfg), positions_pt, model.dtype)
    idx_t = jnp.arange(bucket)
    x_ptd = _embed(model, prompt_pt)
    new_k, new_v = [], []
    for layer in model.layers:
        q_pkgtd, k_pktd, v_pktd = _qkv(layer, x_ptd, cos_ptd, sin_ptd)
        new_k.append(k_pktd)
        new_v.append(v_pktd)
        outs = []
        for start in range(0, bucket, PREFILL_QUERY_BLOCK):  # causal: a block reads [0, end)
            end = min(bucket, start + PREFILL_QUERY_BLOCK)
            mask_ts = idx_t[start:end, None] >= idx_t[None, :end]
            mask_pts = jnp.broadcast_to(mask_ts, (rows, end - start, end))
            outs.append(_attend(q_pkgtd[:, :, :, start:end], k_pktd[:, :, :end],
                                v_pktd[:, :, :end], mask_pts))
        out_pkgtd = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
        x_ptd = _finish_layer(layer, x_ptd, out_pkgtd)
    cache = SlotCache(
        k=tuple(c.at[slot_p, :, :, :bucket].set(n.swapaxes(2, 3).astype(c.dtype), mode="drop")
                for c, n in zip(cache.k, new_k, strict=True)),
        v=tuple(c.at[slot_p, :, :bucket].set(n.astype(c.dtype), mode="drop")
                for c, n in zip(cache.v, new_v, strict=True)),
    )
    last_pd = jnp.take_along_axis(x_ptd, (prompt_len_p - 1)[:, None, None], axis=1)[:, 0]
    hidden_p1d = model.final_norm(last_pd[:, None, :])
    return model.logits_from_hidden(hidden_p1d)[:, 0], cache


def decode_forward(model: Any, token_b: Array, position_b: Array, cache: SlotCache,
                   kv_len: int) -> tuple[Array, SlotCache]:
    """One token per slot at its own position (< kv_len). Returns logits [B, V], cache.
    (A one-step ``decode_chunk``; kept as the simple reference path.)"""
    logits_kbv, cache = decode_chunk(model, token_b, position_b, cache, kv_len, 1,
                                     lambda logits_bv, step, position_b: (
                                         first_argmax(logits_bv), logits_bv))
    return logits_kbv[0], cache


def decode_chunk(model: Any, token_b: Array, position_b: Array, cache: SlotCache, kv_len: int,
                 steps: int, choose: Any) -> tuple[Any, SlotCache]:
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
    prefix_mask_b1p = (jnp.arange(kv_len)[None, :] < start_b[:, None])[:, None, :]
    kv, dh = cache.v[0].shape[1], cache.v[0].shape[3]
    local_k0 = tuple(jnp.zeros((b, kv, dh, steps), model.dtype) for _ in model.layers)
    local_v0 = tuple(jnp.zeros((b, kv, steps, dh), model.dtype) for _ in model.layers)
    inv_freq = rope_inv_freq(model.cfg)

    def one_step(carry, step):
        local_k, local_v, token_b, position_b = carry
        cos_b1d, sin_b1d = rope_cos_sin(inv_freq, position_b[:, None], model.dtype)
        local_mask_b1c = jnp.broadcast_to(jnp.arange(steps)[None, None, :] <= step, (b, 1, steps))
        mask_b1s = jnp.concatenate([prefix_mask_b1p, local_mask_b1c], axis=-1)
        x_b1d = _embed(model, token_b[:, None])
        new_local_k, new_local_v = [], []
        for layer, pk, pv, lk, lv in zip(model.layers, prefix_k, prefix_v, local_k, local_v,
                                         strict=True):
            q_bkg1d, k_bk1d, v_bk1d = _qkv(layer, x_b1d, cos_b1d, sin_b1d)
            lk = jax.lax.dynamic_update_slice_in_dim(lk, k_bk1d.swapaxes(2, 3), step, axis=3)
            lv = jax.lax.dynamic_update_slice_in_dim(lv, v_bk1d, step, axis=2)
            new_local_k.append(lk)
            new_local_v.append(lv)
            out_bkg1d = _attend_two(q_bkg1d, (pk, lk), (pv, lv), mask_b1s)
            x_b1d = _finish_layer(layer, x_b1d, out_bkg1d)
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
