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
  1.5 ``BLOCK`` tokens run as flash attention (FlashAttention-2's loop order, in plain JAX
  with a ``jax.custom_vjp``): query blocks in a ``lax.scan``, each reading with an online
  softmax only the key blocks its segments can reach: from the block holding the first
  token of its earliest query's segment up to its own (a loop of that many steps; the
  backward pass visits the same pairs, key blocks outer). A pair of blocks whose
  segments cannot meet costs nothing, so a row packed with short trajectories costs
  about the sum of their squared lengths, not the row's (:func:`_key_block_ranges`). The backward
  pass keeps only q, k, v, the output and each query's log-sum-exp (all O(T)) and
  recomputes each block's probabilities, so memory grows linearly with T. Against the
  earlier autodiff of the same loops (a rematerialised scan with a ``lax.cond`` per
  key block) it is 1.8-2.5x faster forward+backward on CPU at T = 1024-4096.
* **Attention to a cache** (``kv_limit_bt`` [B, T] given): query (b, t) reads key indices
  j <= ``kv_limit_bt[b, t]`` (a limit of -1 reads nothing). One block: T is the handful of
  tokens of a decode step. ``return_lse=True`` also returns the log-sum-exp of the scores
  so that attention over two key sets (the engine's cache prefix and the keys of the
  current call) can be combined exactly with :func:`merge_attention`.

The self-attention (learner and engine prefill) can instead run as a fused kernel,
``impl`` = ``model.attention``: ``auto`` (splash on TPU, cuDNN or Pallas-Triton on GPU, this
XLA form on CPU), ``xla``, ``splash``, ``cudnn``, ``pallas_gpu``; the kernels and their
sharding are in :mod:`model_defs.fused_attention`. ``jax.nn.dot_product_attention``'s XLA
implementation is not used anywhere: it materialises the full [B, N, T, S] scores.

Cache attention (the engine's decode) stays on this XLA form on every platform. The cache
keeps keys transposed per slot, [B_slots, K, Dh, S_max], and a decode call attends to the
cache prefix and to a small local buffer of its own steps, merged by lse. JAX's decode
kernels want other layouts: TPU ``paged_attention`` / ``ragged_paged_attention`` read a
paged cache ([pages, page_size, ...] with page tables), and the GPU ``decode_attention``
kernel keys [S, Dh] (head dim minor), one query token per row. A decode step is bound by
reading the cache once; the two plain matrix products per (slot, kv head) already read it
in its natural layout, so a kernel would first need a paged cache.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from model_defs.fused_attention import (
    active_platform,
    fused_self_attention,
    resolve_attention_impl,
)

Array = jax.Array
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Query (and key) rows per block of the blockwise path. Rows of at most 1.5 blocks are
# computed as a single block (cheaper than padding them to two). Read at trace time, so
# tests can shrink it. 64 on CPU: forward+backward of a packed [2, 448] row of long-tail
# segments took 0.95 s of learner CPU time a version at 64 against 1.24 s at 256 (more
# pairs skipped, and each block's scores stay in cache); 32 was no faster (docs/models.md).
BLOCK = 64


def attention(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, *,
              segment_ids_bt: Array | None = None, kv_limit_bt: Array | None = None,
              keys_transposed: bool = False, return_lse: bool = False,
              impl: str = "xla", interpret: bool = False) -> Any:
    """Grouped-query attention; returns [B, K, G, T, Dh] in the queries' dtype, or with
    ``return_lse`` the output (fp32 on the XLA path, the queries' dtype from a kernel) and
    the fp32 log-sum-exp [B, K, G, T].

    Args:
      q_bkgtd: queries, pre-scaled.
      k_bksd, v_bksd: keys ([B, K, Dh, S] if ``keys_transposed``) and values.
      segment_ids_bt: self-attention only: packed-segment ids (default: one segment).
      kv_limit_bt: cache attention: the last key index each query may read.
      keys_transposed: keys are [B, K, Dh, S].
      return_lse: also return the log-sum-exp of each query's scores (forward only).
      impl: self-attention kernel, a ``model.attention`` value (``auto``, ``xla``,
        ``splash``, ``cudnn``, ``pallas_gpu``; see :mod:`model_defs.fused_attention`),
        resolved for the active mesh's platform. Cache attention is always XLA.
      interpret: run a Pallas kernel in Pallas' interpreter (tests on CPU).
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
    b, _, _, t, _ = q_bkgtd.shape
    if keys_transposed:
        k_bksd = k_bksd.swapaxes(2, 3)
    kernel = resolve_attention_impl(impl, active_platform(), dtype=q_bkgtd.dtype,
                                    interpret=interpret)
    if kernel != "xla":
        seg_bt = None if segment_ids_bt is None else jnp.asarray(segment_ids_bt, jnp.int32)
        return fused_self_attention(kernel, q_bkgtd, k_bksd, v_bksd, seg_bt,
                                    return_lse=return_lse, interpret=interpret)
    seg_bt = (jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None
              else jnp.asarray(segment_ids_bt, jnp.int32))
    if t <= BLOCK + BLOCK // 2:
        idx_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        acc, m, l_sum = _block(q_bkgtd, k_bksd, v_bksd, idx_bt, idx_bt, seg_bt, seg_bt, False)
        return _finish(acc, m, l_sum, q_bkgtd.dtype, return_lse)
    if return_lse:  # forward only (the engine's prefill): no custom_vjp needed
        q_pad, k_pad, v_pad, seg_pad = _pad_to_block(q_bkgtd, k_bksd, v_bksd, seg_bt, BLOCK)
        out_bkgtd, lse_bkgt = _flash_forward(q_pad, k_pad, v_pad, seg_pad, BLOCK)
        return out_bkgtd[:, :, :, :t], lse_bkgt[..., :t]
    return _blockwise_self_attention(q_bkgtd, k_bksd, v_bksd, seg_bt, BLOCK)


def cache_attention(q_bkgtd: Array, k_cache: Array, v_bksd: Array, kv_limit_bt: Array,
                    kv_len: Array | int, *, block: int, keys_transposed: bool = True,
                    rows_b: Array | None = None, start: int = 0, pass_through: bool = False
                    ) -> Any:
    """Attention of the queries to the first ``kv_len`` keys of a cache, read ``block`` keys
    at a time in a loop that stops after the block holding key ``kv_len - 1``: one program
    serves every filled length (``kv_len`` is traced), and a call reads what the live
    sequences hold, not the whole cache. Returns the fp32 output and log-sum-exp (for
    ``merge_attention``; a query that reads nothing gets zeros and -inf).

    Args:
      q_bkgtd: queries, pre-scaled.
      k_cache: keys [B, K, Dh, S] if ``keys_transposed`` else [B, K, S, Dh]; v_bksd: values.
      kv_limit_bt: the last key index each query may read (also bounded by ``kv_len``).
      kv_len: keys [0, kv_len) may be read; a traced int32 scalar.
      block: keys per loop step. S need not be a multiple: the last block is read from
        ``S - block`` and its keys already read are skipped.
      rows_b: the cache row each query row reads (default: row b reads row b); indices
        out of range are clipped (give such rows a limit of -1).
      start: keys before it are skipped (read by the caller some other way); the blocks
        start there.
      pass_through: also return the cache (keys, values) as the loop's carry passed it on,
        for a caller that then writes into it (prefill). Written into the cache given
        here, the write would come after a loop that only read it, and XLA copied the
        whole cache to keep the loop's reads safe: at every call, for every layer (on the
        long-tail model 59 MB, 60% of a 4 x 256 prefill call). Carried through the loop
        (behind an optimization barrier, so the loop does not drop the unchanged element),
        the write follows the reads by data flow and is done in place.
    """
    s_axis = 3 if keys_transposed else 2
    s = k_cache.shape[s_axis]
    block = min(block, s)
    b, kh, g, t, dh = q_bkgtd.shape
    kv_len = jnp.minimum(jnp.asarray(kv_len, jnp.int32), s)
    n_blocks = (kv_len - start + block - 1) // block
    limit_bt = jnp.minimum(jnp.asarray(kv_limit_bt, jnp.int32), kv_len - 1)
    never = jnp.iinfo(jnp.int32).max  # a key index no query reaches

    def body(i, carry):
        keys, values = k_cache, v_bksd
        if pass_through:
            *carry, keys, values = carry
            keys, values = jax.lax.optimization_barrier((keys, values))
        nominal = start + i * block
        first = jnp.minimum(nominal, s - block)
        k_blk = jax.lax.dynamic_slice_in_dim(keys, first, block, axis=s_axis)
        v_blk = jax.lax.dynamic_slice_in_dim(values, first, block, axis=2)
        if rows_b is not None:
            k_blk = jnp.take(k_blk, rows_b, axis=0, mode="clip")
            v_blk = jnp.take(v_blk, rows_b, axis=0, mode="clip")
        idx_s = first + jnp.arange(block, dtype=jnp.int32)
        kv_idx_bs = jnp.broadcast_to(jnp.where(idx_s >= nominal, idx_s, never), (b, block))
        out = _block(q_bkgtd, k_blk.astype(q_bkgtd.dtype), v_blk.astype(q_bkgtd.dtype),
                     limit_bt, kv_idx_bs, None, None, keys_transposed, tuple(carry))
        return (*out, keys, values) if pass_through else out

    carry: tuple[Array, ...] = (jnp.zeros((b, kh, g, t, dh), jnp.float32),
                                jnp.full((b, kh, g, t), MASK_VALUE, jnp.float32),
                                jnp.zeros((b, kh, g, t), jnp.float32))
    if pass_through:
        carry = (*carry, k_cache, v_bksd)
    # Under a cond: a loop that runs no step still costs its set-up at every call on the CPU.
    acc, m, l_sum, *cache = jax.lax.cond(
        n_blocks > 0, lambda c: jax.lax.fori_loop(0, n_blocks, body, c), lambda c: c, carry)
    return (*_finish(acc, m, l_sum, q_bkgtd.dtype, return_lse=True), *cache)


def merge_attention(parts: list[tuple[Array, Array]], dtype: Any) -> Array:
    """Combines ``(out, lse)`` pairs of attention over disjoint key sets into attention
    over their union (exact: softmax weights are renormalised by the joint lse)."""
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = jnp.logaddexp(lse, part_lse)
    total = sum((out.astype(jnp.float32) * jnp.exp(part_lse - lse)[..., None]
                 for out, part_lse in parts[1:]),
                start=parts[0][0].astype(jnp.float32) * jnp.exp(parts[0][1] - lse)[..., None])
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
    if q_seg_bt is not None and kv_seg_bs is not None:
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


def _pad_to_block(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, seg_bt: Array,
                  block: int) -> tuple[Array, Array, Array, Array]:
    t = q_bkgtd.shape[3]
    pad = -(-t // block) * block - t
    if pad:  # padded tokens get segment -1: they read only each other and are sliced off
        q_bkgtd = jnp.pad(q_bkgtd, ((0, 0),) * 3 + ((0, pad), (0, 0)))
        k_bksd = jnp.pad(k_bksd, ((0, 0),) * 2 + ((0, pad), (0, 0)))
        v_bksd = jnp.pad(v_bksd, ((0, 0),) * 2 + ((0, pad), (0, 0)))
        seg_bt = jnp.pad(seg_bt, ((0, 0), (0, pad)), constant_values=-1)
    return q_bkgtd, k_bksd, v_bksd, seg_bt


def _blockwise_self_attention(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, seg_bt: Array,
                              block: int) -> Array:
    t = q_bkgtd.shape[3]
    return _flash(*_pad_to_block(q_bkgtd, k_bksd, v_bksd, seg_bt, block), block)[:, :, :, :t]


# Flash attention (Dao et al.; FlashAttention-2's loop order) in plain JAX. The forward pass
# keeps only its inputs, the output and the log-sum-exp of each query's scores (all O(T));
# the backward pass recomputes each block's probabilities from them. Plain autodiff of the
# blockwise loops would instead keep every block's probabilities for the backward pass,
# and under the learner's per-layer rematerialisation XLA kept one such O(T x block) set
# alive per layer (57 MiB a layer for a Qwen2.5-0.5B shape at T=4096).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, seg_bt: Array, block: int) -> Array:
    return _flash_forward(q_bkgtd, k_bksd, v_bksd, seg_bt, block)[0]


def _block_slices(x: Array, axis: int, block: int, i: Array) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _first_same_segment(seg_t: Array) -> Array:
    """[T]: for each token, the index of the first token of its segment id in the row
    (exact for any ids, contiguous or not: a stable sort groups each id's tokens in index
    order, so a group's first sorted entry is its smallest index)."""
    t = seg_t.shape[0]
    order_t = jnp.argsort(seg_t, stable=True)
    sorted_t = seg_t[order_t]
    starts_t = jnp.concatenate([jnp.ones((1,), bool), sorted_t[1:] != sorted_t[:-1]])
    group_start_t = jax.lax.cummax(jnp.where(starts_t, jnp.arange(t), 0))
    return jnp.zeros((t,), order_t.dtype).at[order_t].set(order_t[group_start_t])


def _key_block_ranges(seg_bt: Array, block: int) -> tuple[Array, Array]:
    """The block pairs the segments let meet, for every row of the batch at once.

    Returns ``first_n`` [n]: query block i reads key blocks first_n[i]..i (no key before
    the first token of any of its queries' segments is visible to it), and ``end_n`` [n]:
    key block j is read by query blocks j..end_n[j]-1 (1 + the last query block whose
    first_n is <= j). Both are bounds over the batch's rows (one loop serves them all);
    the per-element mask still decides what is read inside a visited pair, so the bounds
    change which pairs cost work, never a value."""
    b, t = seg_bt.shape
    n = t // block
    first_bt = jax.vmap(_first_same_segment)(seg_bt)
    first_n = (jnp.min(first_bt.reshape(b, n, block), axis=(0, 2)) // block).astype(jnp.int32)
    blocks_n = jnp.arange(n, dtype=jnp.int32)
    reads_nn = first_n[None, :] <= blocks_n[:, None]  # [key block j, query block i]
    end_n = jnp.max(jnp.where(reads_nn, blocks_n[None, :], -1), axis=1) + 1
    return first_n, jnp.maximum(end_n, blocks_n + 1)


def _block_mask(seg_bt: Array, qi: Array, kj: Array, block: int) -> Array:
    """[B, 1, 1, c, c]: key j of block kj visible to query i of block qi."""
    arange_c = jnp.arange(block, dtype=jnp.int32)
    causal_cc = (kj * block + arange_c)[None, :] <= (qi * block + arange_c)[:, None]
    q_seg_bc = _block_slices(seg_bt, 1, block, qi)
    k_seg_bc = _block_slices(seg_bt, 1, block, kj)
    same_bcc = q_seg_bc[:, :, None] == k_seg_bc[:, None, :]
    return (causal_cc[None] & same_bcc)[:, None, None]


def _flash_forward(q_bkgtd: Array, k_bksd: Array, v_bksd: Array, seg_bt: Array,
                   block: int) -> tuple[Array, Array]:
    """(out [B, K, G, T, Dh] in the queries' dtype, lse [B, K, G, T] fp32); T a multiple of
    ``block``. Query block i reads key blocks first[i]..i, where first[i] is the block of
    the earliest key any of its queries' segments holds (:func:`_key_block_ranges`)."""
    b, kv, g, t, dh = q_bkgtd.shape
    n = t // block
    first_n, _ = _key_block_ranges(seg_bt, block)

    def query_block(_, qi):
        q_bkgcd = _block_slices(q_bkgtd, 3, block, qi)

        def read(kj, carry):
            k_blk = _block_slices(k_bksd, 2, block, kj)
            v_blk = _block_slices(v_bksd, 2, block, kj)
            mask = _block_mask(seg_bt, qi, kj, block)
            scores = jnp.einsum("bkgtd,bksd->bkgts", q_bkgcd, k_blk,
                                preferred_element_type=jnp.float32)
            scores = jnp.where(mask, scores, MASK_VALUE)
            acc, m, l_sum = carry
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            probs = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
            pv = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v_blk.dtype), v_blk,
                            preferred_element_type=jnp.float32)
            scale = jnp.exp(m - m_new)
            return acc * scale[..., None] + pv, m_new, l_sum * scale + jnp.sum(probs, axis=-1)

        # MASK_VALUE as the starting max: every query reads at least itself (the diagonal
        # block), so the max is a real score once the loop ends, and exp(m - m_new)
        # underflows to 0 for the empty start.
        init = (jnp.zeros((b, kv, g, block, dh), jnp.float32),
                jnp.full((b, kv, g, block), MASK_VALUE, jnp.float32),
                jnp.zeros((b, kv, g, block), jnp.float32))
        acc, m, l_sum = jax.lax.fori_loop(first_n[qi], qi + 1, read, init)
        return None, (acc / l_sum[..., None], m + jnp.log(l_sum))

    _, (out_nbkgcd, lse_nbkgc) = jax.lax.scan(query_block, None, jnp.arange(n))
    out_bkgtd = out_nbkgcd.transpose(1, 2, 3, 0, 4, 5).reshape(b, kv, g, t, dh)
    lse_bkgt = lse_nbkgc.transpose(1, 2, 3, 0, 4).reshape(b, kv, g, t)
    return out_bkgtd.astype(q_bkgtd.dtype), lse_bkgt


def _flash_fwd(q_bkgtd, k_bksd, v_bksd, seg_bt, block):
    out_bkgtd, lse_bkgt = _flash_forward(q_bkgtd, k_bksd, v_bksd, seg_bt, block)
    return out_bkgtd, (q_bkgtd, k_bksd, v_bksd, seg_bt, out_bkgtd, lse_bkgt)


def _flash_bwd(block, residuals, d_out_bkgtd):
    """Key blocks outer (dK, dV of a block accumulate in the carry), query blocks
    j <= i < end[j] inner (the blocks whose segments reach back to key block j); dQ
    accumulates in one fp32 buffer. P = exp(S - lse), dS = P * (dP - delta) with
    delta = rowsum(dO * O); products in the inputs' dtype with fp32 accumulation."""
    q_bkgtd, k_bksd, v_bksd, seg_bt, out_bkgtd, lse_bkgt = residuals
    b, kv, g, t, dh = q_bkgtd.shape
    n = t // block
    _, end_n = _key_block_ranges(seg_bt, block)
    d_out_bkgtd = d_out_bkgtd.astype(q_bkgtd.dtype)
    delta_bkgt = jnp.sum(d_out_bkgtd.astype(jnp.float32) * out_bkgtd.astype(jnp.float32),
                         axis=-1)

    def key_block(dq_bkgtd, kj):
        k_blk = _block_slices(k_bksd, 2, block, kj)
        v_blk = _block_slices(v_bksd, 2, block, kj)

        def read(qi, carry):
            dk_bksd, dv_bksd, dq_bkgtd = carry
            q_blk = _block_slices(q_bkgtd, 3, block, qi)
            do_blk = _block_slices(d_out_bkgtd, 3, block, qi)
            lse_blk = _block_slices(lse_bkgt, 3, block, qi)
            delta_blk = _block_slices(delta_bkgt, 3, block, qi)
            mask = _block_mask(seg_bt, qi, kj, block)
            scores = jnp.einsum("bkgtd,bksd->bkgts", q_blk, k_blk,
                                preferred_element_type=jnp.float32)
            probs = jnp.where(mask, jnp.exp(scores - lse_blk[..., None]), 0.0)
            dv_bksd = dv_bksd + jnp.einsum("bkgts,bkgtd->bksd", probs.astype(do_blk.dtype),
                                           do_blk, preferred_element_type=jnp.float32)
            d_probs = jnp.einsum("bkgtd,bksd->bkgts", do_blk, v_blk,
                                 preferred_element_type=jnp.float32)
            d_scores = (probs * (d_probs - delta_blk[..., None])).astype(q_blk.dtype)
            dk_bksd = dk_bksd + jnp.einsum("bkgts,bkgtd->bksd", d_scores, q_blk,
                                           preferred_element_type=jnp.float32)
            dq_blk = jnp.einsum("bkgts,bksd->bkgtd", d_scores, k_blk,
                                preferred_element_type=jnp.float32)
            dq_bkgtd = jax.lax.dynamic_update_slice_in_dim(
                dq_bkgtd, _block_slices(dq_bkgtd, 3, block, qi) + dq_blk, qi * block, axis=3)
            return dk_bksd, dv_bksd, dq_bkgtd

        zeros = jnp.zeros((b, kv, block, dh), jnp.float32)
        dk_bksd, dv_bksd, dq_bkgtd = jax.lax.fori_loop(kj, end_n[kj], read,
                                                       (zeros, zeros, dq_bkgtd))
        return dq_bkgtd, (dk_bksd, dv_bksd)

    dq_bkgtd, (dk_nbkcd, dv_nbkcd) = jax.lax.scan(
        key_block, jnp.zeros((b, kv, g, t, dh), jnp.float32), jnp.arange(n))
    dk_bksd = dk_nbkcd.transpose(1, 2, 0, 3, 4).reshape(b, kv, t, dh)
    dv_bksd = dv_nbkcd.transpose(1, 2, 0, 3, 4).reshape(b, kv, t, dh)
    return (dq_bkgtd.astype(q_bkgtd.dtype), dk_bksd.astype(k_bksd.dtype),
            dv_bksd.astype(v_bksd.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
