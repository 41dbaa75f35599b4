"""The trajectory stream: executor groups -> packed static-shape micro-batches (grain)."""

from __future__ import annotations

import asyncio
import json
import random

import grain
import numpy as np
import pytest

from areal_jax.data.prompts import prompt_items_from_list
from areal_jax.data.trajectories import TrainBatch, TrajectoryBatchDataset
from areal_jax.rollout.executor import RolloutExecutor
from areal_jax.trajectory import Trajectory
from tests.tolerance import UNIT_ROUNDOFF_F32

SEQ_LEN, ROWS = 48, 4


async def varied_length_workflow(client, item, ctx):
    """A user workflow without a server: n=3 samples of random length (a long tail)."""
    rng = random.Random(ctx.seed)
    await asyncio.sleep(rng.random() * 0.002)
    prompt = [5, 6, 7, 8]
    group = []
    for i in range(3):
        n_out = rng.choice([1, 2, 3, 5, 8, 13, 30])
        out = [rng.randrange(10, 30) for _ in range(n_out)]
        group.append(Trajectory(
            input_ids=prompt + out, loss_mask=[0] * 4 + [1] * n_out,
            behav_logp=[0.0] * 4 + [-0.5] * n_out,
            versions=[-1] * 4 + [ctx.start_version] * n_out, reward=float(i == 0),
            info={"sample_index": i}))
    return group


def make_executor(n_prompts=24, batch_size=4):
    items = [{"prompt_id": f"p{i}", "prompt": "x"} for i in range(n_prompts)]
    return RolloutExecutor(None, varied_length_workflow, prompt_items_from_list(items),
                           batch_size=batch_size, max_concurrent=8, max_staleness=1, seed=1)


def centered(groups):
    out = []
    for g in groups:
        r = np.array([t.reward for t in g])
        out += list(r - r.mean())
    return out


def check_batch(batch: TrainBatch, batch_size: int):
    assert isinstance(batch, TrainBatch) and len(batch.groups) == batch_size
    trajs = batch.trajectories
    assert len(trajs) == 3 * batch_size
    placed = {}
    for mb in batch.micro_batches:
        for name, arr in mb.arrays().items():
            assert arr.shape == (ROWS, SEQ_LEN), name  # static shapes
        for p in mb.placements:
            assert p.traj_index not in placed
            placed[p.traj_index] = (mb, p)
    assert sorted(placed) == list(range(len(trajs)))  # every trajectory exactly once
    adv = centered(batch.groups)
    for i, t in enumerate(trajs):
        mb, p = placed[i]
        sl = (p.row, slice(p.start, p.start + p.length))
        assert p.length == t.num_tokens
        np.testing.assert_array_equal(mb.input_ids[sl], t.input_ids)
        np.testing.assert_array_equal(mb.loss_mask[sl], t.loss_mask)
        np.testing.assert_array_equal(mb.versions[sl], t.versions)
        # the packed float32 advantages: one rounding of each
        np.testing.assert_allclose(mb.advantages[sl], t.loss_mask * adv[i],
                                   rtol=UNIT_ROUNDOFF_F32)


def test_stream_yields_packed_static_batches_of_the_oldest_groups():
    ex = make_executor()
    stream = TrajectoryBatchDataset(ex, seq_len=SEQ_LEN, rows_per_micro_batch=ROWS,
                                    advantages_fn=centered, timeout=30)
    assert isinstance(stream, grain.IterDataset)
    it = iter(stream)
    seen = []
    with ex:
        for v in range(3):
            batch = next(it)
            check_batch(batch, 4)
            assert batch.version == v and batch.stats["staleness_max"] <= 1
            assert batch.stats["n_trajectories"] == 12
            seen += [g[0].prompt_id for g in batch.groups]
            ex.set_version(v + 1)
    assert len(seen) == len(set(seen)) == 12


def test_stream_state_is_the_executor_state_and_resumes():
    ex = make_executor(n_prompts=20)
    it = iter(TrajectoryBatchDataset(ex, seq_len=SEQ_LEN, rows_per_micro_batch=ROWS, timeout=30))
    with ex:
        first = [g[0].prompt_id for _ in range(2) for g in next(it).groups]
        ex.set_version(2)
        state = json.loads(json.dumps(it.get_state()))
    assert state["prompt_iterator"] is not None and state["version"] == 2

    ex2 = make_executor(n_prompts=20)
    it2 = iter(TrajectoryBatchDataset(ex2, seq_len=SEQ_LEN, rows_per_micro_batch=ROWS,
                                      timeout=30))
    it2.set_state(state)
    rest = []
    with ex2:
        for batch in it2:  # ends when the prompts run out
            rest += [g[0].prompt_id for g in batch.groups]
            ex2.set_version(ex2.version + 1)
    assert sorted(first + rest) == sorted(f"p{i}" for i in range(20))


def test_stream_composes_with_grain_and_checks_advantages():
    ex = make_executor(n_prompts=8)
    stream = TrajectoryBatchDataset(ex, seq_len=SEQ_LEN, rows_per_micro_batch=ROWS, timeout=30)
    mapped = stream.map(lambda b: len(b.micro_batches))
    with ex:
        n_micro = next(iter(mapped))
        assert n_micro >= 1
    bad = TrajectoryBatchDataset(make_executor(), seq_len=SEQ_LEN, rows_per_micro_batch=ROWS,
                                 advantages_fn=lambda groups: [0.0], timeout=30)
    with bad.executor, pytest.raises(ValueError, match="advantages_fn returned 1 values for 12"):
        next(iter(bad))
    too_short = TrajectoryBatchDataset(make_executor(), seq_len=8, rows_per_micro_batch=ROWS,
                                       timeout=30)
    with too_short.executor, pytest.raises(ValueError, match="longer than seq_len=8"):
        next(iter(too_short))


def test_reward_section_shapes_rewards_by_its_known_numbers():
    """reward.scale/bias ((r + bias) * scale, AReaL's order) and the DAPO overlong penalty
    reach the advantages with their numbers: the penalty counts generated tokens only (a
    10-token prompt adds nothing). max_new_tokens 20, a penalty zone of 8 tokens, factor
    0.5: 4 and 12 generated tokens are free, 16 cost
    (20 - 8 - 16) / 8 * 0.5 = -0.25, 20 cost the whole 0.5."""
    from areal_jax.config import load_config
    from areal_jax.data.advantages import group_advantages_for, shaped_rewards

    cfg = load_config(None, ["model.path=unused", "rollout.max_new_tokens=20",
                             "reward.overlong_penalty_tokens=8",
                             "reward.overlong_penalty_factor=0.5", "reward.scale=2.0",
                             "reward.bias=0.5", "algo.name=grpo"])
    n_prompt = 10
    trajs = [Trajectory(input_ids=[3] * (n_prompt + n), loss_mask=[0] * n_prompt + [1] * n,
                        behav_logp=[0.0] * (n_prompt + n), versions=[-1] * n_prompt + [0] * n,
                        reward=1.0)
             for n in (4, 12, 16, 20)]
    want = np.float32((1.0 + 0.5) * 2.0) + np.float32([0.0, 0.0, -0.25, -0.5])
    # Exact in binary: the penalties are multiples of 1/8 and the shaped rewards of 1/4 (the
    # product, division and sums of small integers and powers of two round nothing).
    np.testing.assert_array_equal(shaped_rewards(cfg, trajs), want)
    r = want.astype(np.float64)
    adv = group_advantages_for(cfg, [trajs])
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std(ddof=1) + 1e-5),
                               rtol=0, atol=16 * UNIT_ROUNDOFF_F32)
