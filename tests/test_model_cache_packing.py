"""Packed sequences via segment_ids, and incremental decoding through the KV cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import jit_logits, make_tiny_hf_checkpoint

from model_defs import KVCache, init_cache, load_hf

TOL = 1e-4
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen3", tie=False)
    return load_hf(path)


def _jitted_step(model):
    """The engine's shape of a cache step: jit, params as a state pytree, cache donated."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(state, ids_bt, cache, positions_bt, cache_rows=None):
        return nnx.merge(graphdef, state)(ids_bt, positions=positions_bt, cache=cache,
                                          cache_rows=cache_rows)

    return functools.partial(step, state)


def test_packed_segments_match_separate_runs(qwen3_model):
    model, cfg = qwen3_model
    rng = np.random.RandomState(0)
    lengths = [5, 7, 9]
    seqs = [rng.randint(0, cfg.vocab_size, n).astype(np.int32) for n in lengths]
    pad = 3
    ids = np.concatenate(seqs + [np.zeros(pad, np.int32)])[None]
    segment_ids = np.concatenate([np.full(n, s + 1) for s, n in enumerate(lengths)]
                                 + [np.zeros(pad)]).astype(np.int32)[None]
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.arange(pad)])[None]
    packed = jit_logits(model, ids, positions, segment_ids)
    assert np.isfinite(np.asarray(packed)).all()  # padding rows included
    # Each sequence alone, one per row (right padding cannot reach earlier tokens).
    alone_ids = np.zeros((len(seqs), ids.shape[1]), np.int32)
    for row, seq in enumerate(seqs):
        alone_ids[row, :len(seq)] = seq
    alone = jit_logits(model, alone_ids)
    start = 0
    for row, seq in enumerate(seqs):
        assert _max_diff(packed[0, start:start + len(seq)], alone[row, :len(seq)]) <= TOL
        start += len(seq)
    # Without segment_ids the later sequences see the earlier ones: results differ.
    unmasked = jit_logits(model, ids, positions)
    assert _max_diff(unmasked[:, lengths[0]:sum(lengths)], packed[:, lengths[0]:sum(lengths)]) > 1e-3


def test_padding_segment_is_finite_even_when_leading(qwen3_model):
    model, cfg = qwen3_model
    segment_ids = np.array([[0, 0, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0]], np.int32)
    ids = np.where(segment_ids == 0, -1, np.arange(12)[None] % cfg.vocab_size)  # -1: pad id
    logits = jit_logits(model, ids, segment_ids=segment_ids)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_kv_cache_decode_matches_full_forward(tmp_path, arch):
    """Bucketed prefill (right-padded), then 20 one-token steps under jit with the cache
    donated, give the logits of one full forward pass."""
    extra = {"rope_scaling": LLAMA3_SCALING} if arch == "llama" else {}
    model, cfg = load_hf(make_tiny_hf_checkpoint(tmp_path, arch=arch, tie=arch != "qwen3",
                                                 **extra))
    prompt_len, n_decode, bucket, max_len = 8, 20, 16, 32
    seq = np.random.RandomState(1).randint(0, cfg.vocab_size, prompt_len + n_decode)
    full = np.asarray(jit_logits(model, seq[None]))

    step = _jitted_step(model)
    cache = init_cache(cfg, batch_size=1, max_len=max_len)
    prefill_ids = np.zeros((1, bucket), np.int32)  # right padding: garbage past the prompt
    prefill_ids[0, :prompt_len] = seq[:prompt_len]
    prefill_ids[0, prompt_len:] = 7
    logits, cache = step(jnp.asarray(prefill_ids), cache,
                         jnp.arange(bucket, dtype=jnp.int32)[None])
    assert isinstance(cache, KVCache)
    assert _max_diff(logits[:, :prompt_len], full[:, :prompt_len]) <= TOL
    for k in range(n_decode):
        pos = prompt_len + k
        logits, cache = step(jnp.asarray([[seq[pos]]], jnp.int32), cache,
                             jnp.asarray([[pos]], jnp.int32))
        assert logits.shape == (1, 1, cfg.vocab_size)
        assert _max_diff(logits[:, 0], full[:, pos]) <= TOL, f"decode step {k}"


def test_kv_cache_slots_at_different_positions(qwen3_model):
    """Two slots prefilled one at a time (cache_rows), then decoded together with each
    slot at its own position, match each sequence's full forward."""
    model, cfg = qwen3_model
    rng = np.random.RandomState(2)
    lens = [5, 11]
    n_decode = 6
    seqs = [rng.randint(0, cfg.vocab_size, n + n_decode).astype(np.int32) for n in lens]
    fulls_padded = np.asarray(jit_logits(model, np.stack([np.pad(s, (0, 24 - len(s)))
                                                          for s in seqs])))
    fulls = [fulls_padded[i:i + 1] for i in range(len(seqs))]

    step = _jitted_step(model)
    cache = init_cache(cfg, batch_size=2, max_len=24)
    for slot in (1, 0):
        bucket = 16
        ids = np.full((1, bucket), 3, np.int32)
        ids[0, :lens[slot]] = seqs[slot][:lens[slot]]
        logits, cache = step(jnp.asarray(ids), cache, jnp.arange(bucket, dtype=jnp.int32)[None],
                             jnp.asarray([slot], jnp.int32))
        n = lens[slot]
        assert _max_diff(logits[:, :n], fulls[slot][:, :n]) <= TOL
    for k in range(n_decode):
        positions = np.array([[lens[0] + k], [lens[1] + k]], np.int32)
        ids = np.array([[seqs[0][lens[0] + k]], [seqs[1][lens[1] + k]]], np.int32)
        logits, cache = step(jnp.asarray(ids), cache, jnp.asarray(positions))
        for slot in (0, 1):
            assert _max_diff(logits[slot, 0], fulls[slot][0, positions[slot, 0]]) <= TOL


def test_cache_batch_mismatch_is_a_clear_error(qwen3_model):
    model, cfg = qwen3_model
    cache = init_cache(cfg, batch_size=3, max_len=8)
    with pytest.raises(ValueError, match="cache has 3 rows"):
        model(jnp.zeros((2, 1), jnp.int32), positions=jnp.zeros((2, 1), jnp.int32), cache=cache)
