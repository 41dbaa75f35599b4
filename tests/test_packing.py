"""Sequence packing: static shapes, first-fit-decreasing, shard balance, round trips, errors."""

import numpy as np
import pytest

from areal_jax.learner.packing import (
    PackedBatch,
    first_fit_decreasing,
    pack_trajectories,
    unpack_per_token,
)
from areal_jax.trajectory import Trajectory


def make_traj(rng: np.random.Generator, n_prompt: int, n_gen: int, vocab: int = 50) -> Trajectory:
    n = n_prompt + n_gen
    mask = np.r_[np.zeros(n_prompt), np.ones(n_gen)].astype(np.int32)
    return Trajectory(
        input_ids=rng.integers(1, vocab, n),
        loss_mask=mask,
        behav_logp=-rng.random(n).astype(np.float32) * mask,
        versions=np.where(mask == 1, rng.integers(0, 3), -1),
        reward=float(rng.random()),
    )


def random_batch(seed: int, n: int, max_len: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(rng.integers(1, max_len // 2))
        g = int(rng.integers(1, max_len - p + 1))
        out.append(make_traj(rng, p, g))
    return out


def test_pack_round_trip_and_layout():
    trajs = random_batch(0, 23, 40)
    advs = [float(i) - 10 for i in range(len(trajs))]
    advs[3] = np.linspace(-1, 1, trajs[3].num_tokens)  # per-token form
    batches = pack_trajectories(trajs, advs, seq_len=64, rows_per_micro_batch=4, n_shards=2)
    assert all(b.shape == (4, 64) for b in batches)
    # Every trajectory lands exactly once, and every array round-trips.
    for key, want in [("input_ids", [t.input_ids for t in trajs]),
                      ("loss_mask", [t.loss_mask for t in trajs]),
                      ("behav_logp", [t.behav_logp for t in trajs]),
                      ("versions", [t.versions for t in trajs])]:
        got = unpack_per_token(batches, [b[key] for b in batches], len(trajs))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    got_adv = unpack_per_token(batches, [b["advantages"] for b in batches], len(trajs))
    np.testing.assert_allclose(got_adv[0], trajs[0].loss_mask * -10.0)
    np.testing.assert_allclose(got_adv[3], np.linspace(-1, 1, trajs[3].num_tokens), rtol=1e-6)
    for b in batches:
        for p in b.placements:
            seg = b.segment_ids[p.row, p.start:p.start + p.length]
            assert len(set(seg.tolist())) == 1 and seg[0] > 0
            np.testing.assert_array_equal(b.positions[p.row, p.start:p.start + p.length],
                                          np.arange(p.length))
        # segment ids number segments 1..k left to right, then padding 0.
        for r in range(b.shape[0]):
            seg = b.segment_ids[r]
            k = seg.max()
            nz = seg[seg > 0]
            assert (np.diff(nz) >= 0).all() and set(nz.tolist()) == set(range(1, k + 1))
            assert (seg[len(nz):] == 0).all()
        assert b.minibatch_loss_tokens == sum(t.num_generated for t in trajs)
    # Padding is inert.
    for b in batches:
        pad = b.segment_ids == 0
        assert (b.loss_mask[pad] == 0).all() and (b.input_ids[pad] == 0).all()


def test_ffd_is_tight_and_balanced_across_shards():
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(5, 60, 200)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= int(np.ceil(1.25 * sum(lengths) / 64)) + 1  # FFD is within 11/9 OPT + 1

    trajs = random_batch(2, 64, 60)
    batches = pack_trajectories(trajs, None, seq_len=64, rows_per_micro_batch=8, n_shards=4)
    for b in batches[:-1]:  # the last micro-batch may be partly empty
        tokens = b.shard_tokens()
        assert max(tokens) - min(tokens) <= 64, tokens


def test_minibatches_and_padding_only_mode():
    trajs = random_batch(3, 17, 30)
    batches = pack_trajectories(trajs, None, seq_len=32, rows_per_micro_batch=2, n_minibatches=3)
    ids = sorted({b.minibatch_id for b in batches})
    assert ids == [0, 1, 2]
    per_mb = {i: sum(b.n_loss_tokens for b in batches if b.minibatch_id == i) for i in ids}
    for b in batches:
        assert b.minibatch_loss_tokens == per_mb[b.minibatch_id]
    assert sum(per_mb.values()) == sum(t.num_generated for t in trajs)
    padded = pack_trajectories(trajs, None, seq_len=32, rows_per_micro_batch=1,
                               max_segments_per_row=1)
    assert len(padded) == len(trajs) and all(b.segment_ids.max() == 1 for b in padded)


def test_prox_logp_slot():
    trajs = random_batch(4, 3, 10)
    (b, *_) = pack_trajectories(trajs, None, seq_len=32, rows_per_micro_batch=1)
    assert "prox_logp" not in b
    with pytest.raises(KeyError, match="not set yet"):
        b["prox_logp"]
    b["prox_logp"] = np.ones(b.shape)
    assert b["prox_logp"].dtype == np.float32 and "prox_logp" in b
    with pytest.raises(ValueError, match=r"must have shape \(1, 32\)"):
        b["prox_logp"] = np.ones((2, 32))
    with pytest.raises(KeyError, match="no array 'logits'"):
        b["logits"] = np.ones(b.shape)
    assert isinstance(b, PackedBatch)


def test_packing_errors_name_the_problem():
    rng = np.random.default_rng(5)
    long = make_traj(rng, 10, 30)
    with pytest.raises(ValueError, match=r"trajectory 1 has 40 tokens, longer than seq_len=32"):
        pack_trajectories([make_traj(rng, 2, 2), long], None, seq_len=32, rows_per_micro_batch=1)
    with pytest.raises(
            ValueError,
            match=r"rows_per_micro_batch=3 must be a positive multiple of n_shards=2"):
        pack_trajectories([long], None, seq_len=64, rows_per_micro_batch=3, n_shards=2)
    with pytest.raises(ValueError, match=r"advantages\[0\] has shape \(3,\)"):
        pack_trajectories([long], [np.ones(3)], seq_len=64, rows_per_micro_batch=1)
    bad = make_traj(rng, 0, 5)
    with pytest.raises(ValueError, match="trajectory 0 has loss_mask=1 on its first token"):
        pack_trajectories([bad], None, seq_len=64, rows_per_micro_batch=1)
    with pytest.raises(ValueError, match="cannot split 1 trajectories into n_minibatches=2"):
        pack_trajectories([long], None, seq_len=64, rows_per_micro_batch=1, n_minibatches=2)


def _long_tail_batch(seed: int, n: int = 64) -> list[Trajectory]:
    """Mostly short trajectories and a few long ones (8 to ~200 tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(8 + rng.pareto(1.3, n) * 12, 200).astype(int)
    return [make_traj(rng, max(1, n_tok // 4), n_tok - max(1, n_tok // 4)) for n_tok in lengths]


@pytest.mark.parametrize("n_shards", [1, 2])
def test_row_lengths_put_each_row_in_the_smallest_length_that_holds_it(n_shards):
    trajs = _long_tail_batch(3)
    advs = [float(i) for i in range(len(trajs))]
    lengths = (32, 64, 128)
    batches = pack_trajectories(trajs, advs, seq_len=256, rows_per_micro_batch=2 * n_shards,
                                n_shards=n_shards, row_lengths=lengths)
    allowed = (32, 64, 128, 256)
    shapes = {b.shape for b in batches}
    assert {length for _, length in shapes} > {256}  # short rows were made
    for rows, length in shapes:
        assert length in allowed
        assert rows == max(n_shards, 2 * n_shards * 256 // length // n_shards * n_shards)
    for b in batches:
        used = (b.segment_ids > 0).sum(axis=1)
        smaller = max([n for n in allowed if n < b.shape[1]], default=0)
        assert (used[used > 0] > smaller).all()  # no row fits a shorter length
    # Every trajectory once, intact; one loss-token total over the minibatch.
    back = unpack_per_token(batches, [b.input_ids for b in batches], len(trajs))
    for t, ids in zip(trajs, back, strict=True):
        np.testing.assert_array_equal(ids, t.input_ids)
    assert {b.minibatch_loss_tokens for b in batches} == {sum(int(t.loss_mask.sum())
                                                             for t in trajs)}
    plain = pack_trajectories(trajs, advs, seq_len=256, rows_per_micro_batch=2 * n_shards,
                              n_shards=n_shards)
    # What a kernel that computes whole rows pays, empty rows included: rows x length^2.
    def row_pairs(bs):
        return sum(b.shape[0] * b.shape[1] ** 2 for b in bs)

    assert row_pairs(batches) < row_pairs(plain)


def test_row_lengths_bad_values_are_errors():
    trajs = _long_tail_batch(4, n=4)
    with pytest.raises(ValueError, match=r"row_lengths \[64, 512\]: each must be in \[1, "
                                         r"seq_len=256\]; got 512"):
        pack_trajectories(trajs, seq_len=256, rows_per_micro_batch=2, row_lengths=[64, 512])
    with pytest.raises(ValueError, match="got 0"):
        pack_trajectories(trajs, seq_len=256, rows_per_micro_batch=2, row_lengths=[0])


def test_train_row_lengths_key_is_validated_and_parsed():
    from areal_jax.config import TrainConfig
    from areal_jax.config_io import from_dict

    def config(train):
        return from_dict(TrainConfig, {"model": {"path": "builtin:longtail_sft"},
                                       "train": train})

    cfg = config({"seq_len": 448, "row_lengths": [64, 128, 256]})
    assert cfg.train.row_lengths == [64, 128, 256]
    with pytest.raises(ValueError, match=r"train.row_lengths must be a list of ints in "
                                         r"\[2, train.seq_len=448\] \(a row holds at least a "
                                         r"prompt token and a generated one\), got \[64, 512\]"):
        config({"seq_len": 448, "row_lengths": [64, 512]})
