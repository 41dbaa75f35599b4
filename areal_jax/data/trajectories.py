"""The trajectory stream: executor groups -> packed static-shape micro-batches, as grain.

    stream = TrajectoryBatchDataset(executor, batch_size=B, seq_len=512, rows_per_micro_batch=8)
    it = iter(stream)
    batch = next(it)     # a TrainBatch: the B oldest groups, packed for one training step
    batch.micro_batches  # list[PackedBatch], every array [rows_per_micro_batch, seq_len]

Each element is one training step's worth of data: ``executor.prepare_batch(B)`` (the B
oldest accepted groups, generation going on meanwhile), flattened group by group and
packed by the learner's :func:`~areal_jax.learner.packing.pack_trajectories`
(first-fit-decreasing, token-balanced over data shards and minibatches).

``it.get_state()`` / ``it.set_state()`` are the executor's :meth:`state_dict` /
:meth:`load_state_dict` (which include the prompt iterator's state), so checkpointing the
stream checkpoints the whole rollout side. The stream ends when the executor's prompts
run out (:class:`~areal_jax.rollout.executor.PromptsExhausted`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grain
import numpy as np

from areal_jax.learner.packing import PackedBatch, pack_trajectories
from areal_jax.rollout.executor import PromptsExhausted, RolloutExecutor
from areal_jax.rollout.types import Trajectory

AdvantagesFn = Callable[[list[list[Trajectory]]], Sequence[float | np.ndarray]]


@dataclass
class TrainBatch:
    """One training step's data."""

    micro_batches: list[PackedBatch]
    groups: list[list[Trajectory]]
    version: int  # the executor's version when the batch was taken
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[Trajectory]:
        """Flattened group by group: the order of ``Placement.traj_index``."""
        return [t for g in self.groups for t in g]


def batch_stats(groups: list[list[Trajectory]], version: int) -> dict[str, float]:
    trajs = [t for g in groups for t in g]
    rewards = np.array([t.reward for t in trajs], np.float64)
    gen_lens = np.array([t.num_generated for t in trajs], np.float64)
    staleness = np.array([version - t.start_version for t in trajs], np.float64)
    return {
        "n_groups": float(len(groups)), "n_trajectories": float(len(trajs)),
        "reward_mean": float(rewards.mean()) if len(trajs) else 0.0,
        "gen_len_mean": float(gen_lens.mean()) if len(trajs) else 0.0,
        "gen_len_max": float(gen_lens.max()) if len(trajs) else 0.0,
        "staleness_mean": float(staleness.mean()) if len(trajs) else 0.0,
        "staleness_max": float(staleness.max()) if len(trajs) else 0.0,
    }


class TrajectoryBatchIterator(grain.DatasetIterator):
    """Iterator of :class:`TrajectoryBatchDataset` (state = the executor's state)."""

    def __init__(self, stream: TrajectoryBatchDataset) -> None:
        super().__init__()
        self._stream = stream

    def __next__(self) -> TrainBatch:
        s = self._stream
        try:
            groups = s.executor.prepare_batch(s.batch_size, timeout=s.timeout)
        except PromptsExhausted:
            raise StopIteration from None
        version = s.executor.version
        trajs = [t for g in groups for t in g]
        advantages = None if s.advantages_fn is None else list(s.advantages_fn(groups))
        if advantages is not None and len(advantages) != len(trajs):
            raise ValueError(f"advantages_fn returned {len(advantages)} values for "
                             f"{len(trajs)} trajectories")
        micro_batches = pack_trajectories(trajs, advantages, **s.pack_kwargs)
        return TrainBatch(micro_batches, groups, version, batch_stats(groups, version))

    def get_state(self) -> dict[str, Any]:
        return self._stream.executor.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        self._stream.executor.load_state_dict(state)


class TrajectoryBatchDataset(grain.IterDataset):
    """A grain IterDataset of :class:`TrainBatch`, pulled from a :class:`RolloutExecutor`.

    Args:
        executor: the (started or not) executor; ``prepare_batch`` starts it.
        batch_size: groups per step (default: the executor's B).
        seq_len, rows_per_micro_batch, n_shards, n_minibatches, max_segments_per_row,
        min_micro_batches: passed to ``pack_trajectories``.
        advantages_fn: groups -> one advantage (scalar or [T] array) per trajectory, in
            flattened order; None packs zeros (the learner fills them in later).
        timeout: seconds ``prepare_batch`` may wait (None: forever).
    """

    def __init__(self, executor: RolloutExecutor, *, seq_len: int, rows_per_micro_batch: int,
                 batch_size: int | None = None, n_shards: int = 1, n_minibatches: int = 1,
                 max_segments_per_row: int | None = None, min_micro_batches: int = 1,
                 advantages_fn: AdvantagesFn | None = None, timeout: float | None = None) -> None:
        super().__init__()
        self.executor = executor
        self.batch_size = executor.batch_size if batch_size is None else batch_size
        self.advantages_fn = advantages_fn
        self.timeout = timeout
        self.pack_kwargs = dict(seq_len=seq_len, rows_per_micro_batch=rows_per_micro_batch,
                                n_shards=n_shards, n_minibatches=n_minibatches,
                                max_segments_per_row=max_segments_per_row,
                                min_micro_batches=min_micro_batches)

    def __iter__(self) -> TrajectoryBatchIterator:
        return TrajectoryBatchIterator(self)

    def __str__(self) -> str:
        return f"TrajectoryBatchDataset(batch_size={self.batch_size}, {self.pack_kwargs})"
