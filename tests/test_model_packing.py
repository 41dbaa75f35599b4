"""Packed sequences via segment_ids. (Incremental decoding is the engine's, with its own
slot cache: tests/test_engine*.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import jit_logits, make_tiny_hf_checkpoint

from model_defs import load_hf

TOL = 1e-4


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen3", tie=False)
    return load_hf(path)


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
    later = slice(lengths[0], sum(lengths))
    assert _max_diff(unmasked[:, later], packed[:, later]) > 1e-3


def test_padding_segment_is_finite_even_when_leading(qwen3_model):
    model, cfg = qwen3_model
    segment_ids = np.array([[0, 0, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0]], np.int32)
    ids = np.where(segment_ids == 0, -1, np.arange(12)[None] % cfg.vocab_size)  # -1: pad id
    logits = jit_logits(model, ids, segment_ids=segment_ids)
    assert np.isfinite(np.asarray(logits)).all()
