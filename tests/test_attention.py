"""model_defs.attention against a plain full-matrix reference: packed causal rows with
several segments, fp32 and bf16, values and gradients; cache attention and the merge of
two key sets; and memory that grows linearly with the row length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model_defs.attention as attention_module
from model_defs.attention import attention, merge_attention, reference_attention

EPS32 = float(jnp.finfo(jnp.float32).eps)
EPS16 = float(jnp.finfo(jnp.bfloat16).eps)


def _qkv(b=2, kv=2, g=2, t=45, dh=16, seed=0, dtype=jnp.float32):
    rng = np.random.RandomState(seed)
    q = rng.randn(b, kv, g, t, dh).astype(np.float32) * dh**-0.5
    k = rng.randn(b, kv, t, dh).astype(np.float32)
    v = rng.randn(b, kv, t, dh).astype(np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _packed_segments(b: int, t: int) -> np.ndarray:
    """Row 0: segments of 9, 20, 11 tokens then 5 padding (0); row 1: 30 + 15 tokens."""
    seg = np.zeros((b, t), np.int32)
    seg[0, :9], seg[0, 9:29], seg[0, 29:40] = 1, 2, 3
    seg[1, :30], seg[1, 30:] = 1, 2
    return seg


def _self_mask(seg_bt: np.ndarray) -> jax.Array:
    t = seg_bt.shape[1]
    causal = np.tril(np.ones((t, t), bool))[None]
    return jnp.asarray(causal & (seg_bt[:, :, None] == seg_bt[:, None, :]))


def _fp32_tol(q, k, v) -> float:
    """Score rounding (eps * (|s| + sqrt(S))) moves probabilities by that relative amount;
    the output is a convex combination of values, so scale by max|v|; x4 for the exp,
    rescaling and division steps."""
    s_max = float(jnp.max(jnp.abs(jnp.einsum("bkgtd,bksd->bkgts", q, k))))
    return 4 * EPS32 * (s_max + np.sqrt(k.shape[2])) * float(jnp.max(jnp.abs(v)))


@pytest.mark.parametrize("block", [8, 256], ids=["blockwise", "one-block"])
def test_self_attention_matches_reference_fp32(monkeypatch, block):
    monkeypatch.setattr(attention_module, "BLOCK", block)  # 45 = 5 blocks of 8, padded
    q, k, v = _qkv()
    seg = _packed_segments(2, 45)
    out = jax.jit(lambda q, k, v, s: attention(q, k, v, segment_ids_bt=s))(q, k, v, seg)
    ref = reference_attention(q, k, v, _self_mask(seg))
    assert out.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(out - ref))) <= _fp32_tol(q, k, v)


@pytest.mark.parametrize("block", [8, 256], ids=["blockwise", "one-block"])
def test_self_attention_gradients_match_reference(monkeypatch, block):
    monkeypatch.setattr(attention_module, "BLOCK", block)
    q, k, v = _qkv(seed=1)
    seg = _packed_segments(2, 45)
    cot = jnp.asarray(np.random.RandomState(7).randn(*q.shape), jnp.float32)

    def ours(q, k, v):
        return jnp.sum(attention(q, k, v, segment_ids_bt=seg) * cot)

    def ref(q, k, v):
        return jnp.sum(reference_attention(q, k, v, _self_mask(seg)) * cot)

    g_ours = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
    # The gradient sums T products of probabilities, values and cotangents (|cot| <= ~4):
    # the forward tolerance scaled by the cotangent and the reduction length.
    tol = _fp32_tol(q, k, v) * float(jnp.max(jnp.abs(cot))) * np.sqrt(45)
    for name, a, b in zip("qkv", g_ours, g_ref, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= tol, name


@pytest.mark.parametrize("block", [8, 256], ids=["blockwise", "one-block"])
def test_self_attention_bf16_within_bf16_rounding(monkeypatch, block):
    monkeypatch.setattr(attention_module, "BLOCK", block)
    q, k, v = _qkv(seed=2, dtype=jnp.bfloat16)
    seg = _packed_segments(2, 45)
    out = attention(q, k, v, segment_ids_bt=seg)
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(q, k, v, _self_mask(seg))  # fp32 math on the same bf16 inputs
    # Probabilities rounded to bf16 (eps/2 each, a convex combination of |v| <= max|v|)
    # plus the output's own bf16 rounding (eps/2 * |out| <= eps/2 * max|v|).
    tol = EPS16 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) <= tol

    cot = jnp.asarray(np.random.RandomState(3).randn(*q.shape), jnp.float32)
    g = jax.grad(lambda v: jnp.sum(attention(q, k, v, segment_ids_bt=seg).astype(jnp.float32)
                                   * cot))(v)
    g_ref = jax.grad(lambda v: jnp.sum(reference_attention(q, k, v, _self_mask(seg)) * cot))(v)
    # dv_j = sum_i p_ij cot_i over <= T queries: bf16 rounding of p (eps/2) and of the
    # result (eps/2), bounded by sum_i p_ij |cot_i| <= max|g_ref| + eps-sized terms.
    g_tol = EPS16 * (float(jnp.max(jnp.abs(g_ref))) + float(jnp.max(jnp.abs(cot))))
    assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - g_ref))) <= g_tol


def _rows(*layouts: list[int], t: int) -> np.ndarray:
    """Rows of segments of the given lengths, numbered 1.. in order; the rest is padding."""
    seg = np.zeros((len(layouts), t), np.int32)
    for r, lengths in enumerate(layouts):
        starts = np.cumsum([0, *lengths])
        for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True), start=1):
            seg[r, a:b] = i
    return seg


# Rows of many short segments, one segment, ragged tails (a segment crossing block
# boundaries, padding that starts mid-block), and ids that recur out of order (the bound
# must still cover every key a query's segment holds).
SKIP_LAYOUTS = {
    "many-segments": _rows([3, 5, 2, 7, 4, 6, 1, 9, 3, 5, 8, 2, 6], [11, 13, 9, 12, 10, 8, 6],
                           t=69),
    "one-segment": _rows([69], [69], t=69),
    "ragged-tails": _rows([17, 30, 5], [8, 52], t=69),
    "recurring-ids": np.array([[1, 2, 3, 1, 2, 3, 0], [2, 2, 1, 1, 4, 4, 2]],
                              np.int32).repeat(10, axis=1)[:, :69],
}


@pytest.mark.parametrize("layout", sorted(SKIP_LAYOUTS))
def test_skipping_block_pairs_changes_no_value_or_gradient(monkeypatch, layout):
    """Blocks of 8 over 69 tokens (9 blocks, a padded tail): the loops that skip block pairs
    whose segments cannot meet give the reference's values and q/k/v gradients."""
    monkeypatch.setattr(attention_module, "BLOCK", 8)
    seg = SKIP_LAYOUTS[layout]
    q, k, v = _qkv(t=seg.shape[1], seed=5)
    cot = jnp.asarray(np.random.RandomState(8).randn(*q.shape), jnp.float32)
    mask = _self_mask(seg)
    out = jax.jit(lambda q, k, v: attention(q, k, v, segment_ids_bt=seg))(q, k, v)
    assert float(jnp.max(jnp.abs(out - reference_attention(q, k, v, mask)))) <= _fp32_tol(q, k, v)
    g_ours = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, segment_ids_bt=seg)
                                                      * cot), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(lambda q, k, v: jnp.sum(reference_attention(q, k, v, mask) * cot),
                     argnums=(0, 1, 2))(q, k, v)
    tol = _fp32_tol(q, k, v) * float(jnp.max(jnp.abs(cot))) * np.sqrt(seg.shape[1])
    for name, a, b in zip("qkv", g_ours, g_ref, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= tol, name


def _pairs_that_meet(seg_bt: np.ndarray, block: int) -> set[tuple[int, int]]:
    """(query block, key block) pairs holding at least one visible (query, key) pair."""
    mask = np.asarray(_self_mask(seg_bt)).any(axis=0)
    n = seg_bt.shape[1] // block
    return {(i, j) for i in range(n) for j in range(n)
            if mask[i * block:(i + 1) * block, j * block:(j + 1) * block].any()}


def test_block_ranges_cover_every_meeting_pair_and_skip_the_rest():
    """The loops' bounds: every pair that holds a visible key is visited, and for rows of
    contiguous segments (what packing makes) no other pair is: 64 tokens in blocks of 8
    with segments of 8-24 tokens visit 16 of the 36 causal pairs (the 8 diagonal ones and
    8 that a segment crossing a block boundary joins)."""
    block = 8
    seg = _rows([12, 20, 8, 16, 8], [16, 10, 14, 24], t=64)
    first_n, end_n = (np.asarray(x) for x in
                      attention_module._key_block_ranges(jnp.asarray(seg), block))
    visited_fwd = {(i, j) for i in range(8) for j in range(first_n[i], i + 1)}
    visited_bwd = {(i, j) for j in range(8) for i in range(j, end_n[j])}
    meet = _pairs_that_meet(seg, block)
    assert visited_fwd == visited_bwd == meet
    assert len(meet) == 16
    # Non-contiguous ids: still a superset of what meets (values stay exact).
    recurring = SKIP_LAYOUTS["recurring-ids"][:, :64]
    first_n, end_n = (np.asarray(x) for x in
                      attention_module._key_block_ranges(jnp.asarray(recurring), block))
    visited_fwd = {(i, j) for i in range(8) for j in range(first_n[i], i + 1)}
    visited_bwd = {(i, j) for j in range(8) for i in range(j, end_n[j])}
    assert _pairs_that_meet(recurring, block) <= visited_fwd
    assert _pairs_that_meet(recurring, block) <= visited_bwd


def test_cache_attention_and_merge_match_one_softmax():
    """Decode: a prefix (keys transposed, limit per row, one row reads nothing) and a
    local buffer, merged, equal one softmax over the union."""
    b, kv, g, dh, p, c = 3, 2, 2, 8, 20, 4
    q, k_all, v_all = _qkv(b=b, kv=kv, g=g, t=p + c, dh=dh, seed=4)
    q = q[:, :, :, :1]  # one query per row
    limit_prefix = np.array([[6], [19], [-1]], np.int32)
    limit_local = np.array([[2], [0], [3]], np.int32)
    parts = [
        attention(q, k_all[:, :, :p].swapaxes(2, 3), v_all[:, :, :p], kv_limit_bt=limit_prefix,
                  keys_transposed=True, return_lse=True),
        attention(q, k_all[:, :, p:], v_all[:, :, p:], kv_limit_bt=limit_local,
                  return_lse=True),
    ]
    out = merge_attention(parts, jnp.float32)
    idx = np.arange(p + c)
    mask = np.where(idx < p, idx <= limit_prefix, idx - p <= limit_local)[:, None, :]
    ref = reference_attention(q, k_all, v_all, jnp.asarray(mask))
    assert float(jnp.max(jnp.abs(out - ref))) <= _fp32_tol(q, k_all, v_all)
    # The row with limit -1 reads nothing from the prefix: weight 0, no NaN.
    assert bool(jnp.isneginf(parts[0][1][2]).all()) and bool(jnp.isfinite(out).all())


def test_segment_ids_with_kv_limit_is_an_error():
    q, k, v = _qkv(t=4)
    with pytest.raises(ValueError, match="segment_ids_bt is for self-attention"):
        attention(q, k, v, segment_ids_bt=np.ones((2, 4), np.int32),
                  kv_limit_bt=np.zeros((2, 4), np.int32))


def _grad_temp_bytes(t: int) -> int:
    q = jax.ShapeDtypeStruct((1, 1, 2, t, 32), jnp.float32)
    k = v = jax.ShapeDtypeStruct((1, 1, t, 32), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, k, v, s):
        return jnp.sum(attention(q, k, v, segment_ids_bt=s) ** 2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_forward_backward_memory_grows_linearly():
    """Doubling T from 2048 to 4096 at most ~doubles the compiled temporary memory of a
    forward+backward (a T x T score matrix would quadruple it: 16 MiB -> 64 MiB here)."""
    small, large = _grad_temp_bytes(2048), _grad_temp_bytes(4096)
    assert large <= 2.5 * small, (small, large)


def test_unknown_remat_policy_is_an_error():
    from flax import nnx

    from model_defs import CausalLM, ModelConfig

    with pytest.raises(ValueError, match=r"remat='every'; expected a bool or one of \['dots'"):
        CausalLM(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0), remat="every")
