"""The one attention function: learner forward, engine prefill and engine decode.

Shapes are head-major: queries ``q_bkgtd`` [B, K, G, T, Dh] (K kv heads, G query heads per
kv head, already scaled by Dh**-0.5), keys ``k_bksd`` and values ``v_bksd`` [B, K, S, Dh];
keys may instead be stored transposed, [B, K, Dh, S] (``keys_transposed=True``, the
engine's cache layout). Scores, the softmax statistics and the output accumulator are
fp32 whatever the input dtype; the probabilities are cast to the values' dtype for the
second product (as flash attention does), and the output is returned in the queries'
dtype.

Two masks, both built per block and never as a [T, S] array in memory:

* **Self-attention over packed rows** (``kv_limit_bt`` None, S == T): token i reads tokens
  j <= i of the same segment (``segment_ids_bt``, 0 marks padding). Rows longer than
  ``BLOCK`` tokens run blockwise: query blocks in a ``lax.scan`` whose body is
  rematerialised (``jax.checkpoint``), each reading the key blocks at or before it
  with an online softmax (blocks after it are skipped by a ``lax.cond``). Nothing of
  size T x T is kept for the backward pass, so memory grows linearly with T.
* **Attention to a cache** (``kv_limit_bt`` [B, T] given): query (b, t) reads key indices
  j <= ``kv_limit_bt[b, t]`` (a limit of -1 reads nothing). One block: T is the handful of
  tokens of a decode step. ``return_lse=True`` also returns the log-sum-exp of the scores
  so that attention over two key sets (the engine's cache prefix and the keys of the
  current call) can be combined exactly with :func:`merge_attention`.

On every backend the blockwise XLA form is used: ``jax.nn.dot_product_attention``'s XLA
fallback materialises the full [B, N, T, S] scores (quadratic again), and the cuDNN /
Pallas kernels need an accelerator this code is not tested on.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Query (and key) rows per block of the blockwise path. Rows of at most BLOCK tokens are
# computed as a single block. Read at trace time, so tests can shrink it.
BLOCK = 256


def attention(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, *,
              segment_ids_bt: Array | None = None, kv_limit_bt: Array | None = None,
              keys_transposed: bool = False, return_lse: bool = False) -> Any:
    """Grouped-query attention; returns [B, K, G, T, Dh] in the queries' dtype, or with
    ``return_lse`` the fp32 output and the fp32 log-sum-exp [B, K, G, T].

    Args:
      q_bkgtd: queries, pre-scaled.
      k_bksd, v_bksd: keys ([B, K, Dh, S] if ``keys_transposed``) and values.
      segment_ids_bt: self-attention only: packed-segment ids (default: one segment).
      kv_limit_bt: cache attention: the last key index each query may read.
      keys_transposed: keys are [B, K, Dh, S].
      return_lse: also return the log-sum-exp of each query's scores (cache attention).
    """
    if kv_limit_bt is not None:
        if segment_ids_bt is not None:
            raise ValueError("attention: segment_ids_bt is for self-attention; "
                             "with kv_limit_bt the limit alone decides what a query reads")
        q_idx_bt = jnp.asarray(kv_limit_bt, jnp.int32)
        s = k_bksd.shape[3 if keys_transposed else 2]
        kv_idx_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q_idx_bt.shape[0], s))
        acc, m, l_sum = _block(q_bkgtd, k_bksd, v_bksd, q_idx_bt, kv_idx_bs, None, None,
                               keys_transposed)
        return _finish(acc, m, l_sum, q_bkgtd.dtype, return_lse)
    if return_lse:
        raise ValueError("attention: return_lse is only offered with kv_limit_bt")
    b, _, _, t, _ = q_bkgtd.shape
    if keys_transposed:
        k_bksd = k_bksd.swapaxes(2, 3)
    seg_bt = (jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None
              else jnp.asarray(segment_ids_bt, jnp.int32))
    if t <= BLOCK:
        idx_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        acc, m, l_sum = _block(q_bkgtd, k_bksd, v_bksd, idx_bt, idx_bt, seg_bt, seg_bt, False)
        return _finish(acc, m, l_sum, q_bkgtd.dtype, False)
    return _blockwise_self_attention(q_bkgtd, k_bksd, v_bksd, seg_bt, BLOCK)


def merge_attention(parts: list[tuple[Array, Array]], dtype: Any) -> Array:
    """Combines ``(out, lse)`` pairs of attention over disjoint key sets into attention
    over their union (exact: softmax weights are renormalised by the joint lse)."""
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = jnp.logaddexp(lse, part_lse)
    total = None
    for out, part_lse in parts:
        weighted = out.astype(jnp.float32) * jnp.exp(part_lse - lse)[..., None]
        total = weighted if total is None else total + weighted
    return total.astype(dtype)


def reference_attention(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, mask_bts: Array) -> Array:
    """Plain masked softmax attention with the full [T, S] scores (tests compare with it)."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", q_bkgtd.astype(jnp.float32),
                        k_bksd.astype(jnp.float32))
    scores = jnp.where(mask_bts[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, v_bksd.astype(jnp.float32))


# --------------------------------------------------------------------------- internals
def _block(q_bkgtd: Array, k: Array, v_bksd: Array, q_idx_bt: Array, kv_idx_bs: Array,
           q_seg_bt: Array | None, kv_seg_bs: Array | None, keys_transposed: bool,
           carry: tuple[Array, Array, Array] | None = None) -> tuple[Array, Array, Array]:
    """One online-softmax update: reads key block ``k``/``v_bksd`` for the queries and
    folds it into ``carry`` = (acc [B,K,G,T,Dh], running max m and sum l [B,K,G,T], fp32).
    Key j is visible to query i iff kv_idx[j] <= q_idx[i] (and the segments agree)."""
    spec = "bkgtd,bkds->bkgts" if keys_transposed else "bkgtd,bksd->bkgts"
    scores = jnp.einsum(spec, q_bkgtd, k, preferred_element_type=jnp.float32)
    mask_bts = kv_idx_bs[:, None, :] <= q_idx_bt[:, :, None]
    if q_seg_bt is not None:
        mask_bts = mask_bts & (q_seg_bt[:, :, None] == kv_seg_bs[:, None, :])
    mask = mask_bts[:, None, None]
    scores = jnp.where(mask, scores, MASK_VALUE)
    block_max = jnp.max(scores, axis=-1)
    if carry is None:
        m_new = block_max
    else:
        acc, m, l_sum = carry
        m_new = jnp.maximum(m, block_max)
    probs = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    pv = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v_bksd.dtype), v_bksd,
                    preferred_element_type=jnp.float32)
    if carry is None:
        return pv, m_new, jnp.sum(probs, axis=-1)
    scale = jnp.exp(m - m_new)
    return acc * scale[..., None] + pv, m_new, l_sum * scale + jnp.sum(probs, axis=-1)


def _finish(acc: Array, m: Array, l_sum: Array, dtype: Any, return_lse: bool) -> Any:
    safe_l = jnp.where(l_sum > 0, l_sum, 1.0)  # a query that reads nothing gets zeros
    out = acc / safe_l[..., None]
    if not return_lse:
        return out.astype(dtype)
    # Kept in fp32 for merge_attention, which rounds once, after combining.
    return out, jnp.where(l_sum > 0, m + jnp.log(safe_l), -jnp.inf)


def _blockwise_self_attention(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, seg_bt: Array,
                              block: int) -> Array:
    b, kv, g, t, dh = q_bkgtd.shape
    n = -(-t // block)
    pad = n * block - t
    if pad:  # padded tokens get segment -1: they read only each other and are sliced off
        q_bkgtd = jnp.pad(q_bkgtd, ((0, 0),) * 3 + ((0, pad), (0, 0)))
        k_bksd = jnp.pad(k_bksd, ((0, 0),) * 2 + ((0, pad), (0, 0)))
        v_bksd = jnp.pad(v_bksd, ((0, 0),) * 2 + ((0, pad), (0, 0)))
        seg_bt = jnp.pad(seg_bt, ((0, 0), (0, pad)), constant_values=-1)
    q_nbkgcd = q_bkgtd.reshape(b, kv, g, n, block, dh).transpose(3, 0, 1, 2, 4, 5)
    seg_nbc = seg_bt.reshape(b, n, block).transpose(1, 0, 2)
    arange_c = jnp.arange(block, dtype=jnp.int32)

    @jax.checkpoint
    def query_block(qi: Array, q_bkgcd: Array, q_seg_bc: Array) -> Array:
        q_idx_bc = jnp.broadcast_to(qi * block + arange_c, (b, block))

        def key_block(kj: Array) -> tuple[Array, Array, Array, Array]:
            start = kj * block
            k_blk = jax.lax.dynamic_slice_in_dim(k_bksd, start, block, axis=2)
            v_blk = jax.lax.dynamic_slice_in_dim(v_bksd, start, block, axis=2)
            kv_seg_bc = jax.lax.dynamic_slice_in_dim(seg_bt, start, block, axis=1)
            kv_idx_bc = jnp.broadcast_to(start + arange_c, (b, block))
            return k_blk, v_blk, kv_seg_bc, kv_idx_bc

        # The diagonal block first: every query reads at least itself, so the running
        # max is a real score from the start.
        k_blk, v_blk, kv_seg, kv_idx = key_block(qi)
        carry = _block(q_bkgcd, k_blk, v_blk, q_idx_bc, kv_idx, q_seg_bc, kv_seg, False)

        def step(carry, kj):
            def read(carry):
                k_blk, v_blk, kv_seg, kv_idx = key_block(kj)
                return _block(q_bkgcd, k_blk, v_blk, q_idx_bc, kv_idx, q_seg_bc, kv_seg,
                              False, carry)

            return jax.lax.cond(kj < qi, read, lambda c: c, carry), None

        carry, _ = jax.lax.scan(step, carry, jnp.arange(n - 1))
        return _finish(*carry, q_bkgtd.dtype, False)

    def outer(_, xs):
        return None, query_block(*xs)

    _, out_nbkgcd = jax.lax.scan(outer, None, (jnp.arange(n), q_nbkgcd, seg_nbc))
    out_bkgtd = out_nbkgcd.transpose(1, 2, 3, 0, 4, 5).reshape(b, kv, g, n * block, dh)
    return out_bkgtd[:, :, :, :t]
