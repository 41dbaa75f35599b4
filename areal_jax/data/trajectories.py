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

With several JAX processes, :class:`ProcessRowsDataset` wraps the stream: the executor and
the packing run on process 0 only (one staleness authority for the global batch), and each
process receives the rows of every micro-batch that its own devices hold, in micro-batches of
the same count and shape on every process (the learner's ``process_local_batches`` input).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grain
import numpy as np

from areal_jax.learner.packing import PackedBatch, pack_trajectories
from areal_jax.rollout.executor import PromptsExhausted, RolloutExecutor
from areal_jax.trajectory import Trajectory

AdvantagesFn = Callable[[list[list[Trajectory]]], Sequence[float | np.ndarray] | np.ndarray]


@dataclass
class TrainBatch:
    """One training step's data."""

    micro_batches: list[PackedBatch]
    groups: list[list[Trajectory]]
    version: int  # the executor's version when the batch was taken
    stats: dict[str, float] = field(default_factory=dict)
    # With several processes, on process 0: every process's rows (``micro_batches`` are its own).
    global_micro_batches: list[PackedBatch] | None = None

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
        min_micro_batches, row_lengths: passed to ``pack_trajectories``.
        advantages_fn: groups -> one advantage (scalar or [T] array) per trajectory, in
            flattened order; None packs zeros (the learner fills them in later).
        timeout: seconds ``prepare_batch`` may wait (None: forever).
    """

    def __init__(self, executor: RolloutExecutor, *, seq_len: int, rows_per_micro_batch: int,
                 batch_size: int | None = None, n_shards: int = 1, n_minibatches: int = 1,
                 max_segments_per_row: int | None = None, min_micro_batches: int = 1,
                 row_lengths: Sequence[int] | None = None,
                 advantages_fn: AdvantagesFn | None = None, timeout: float | None = None) -> None:
        super().__init__()
        self.executor = executor
        self.batch_size = executor.batch_size if batch_size is None else batch_size
        self.advantages_fn = advantages_fn
        self.timeout = timeout
        self.pack_kwargs: dict[str, Any] = dict(
                                seq_len=seq_len, rows_per_micro_batch=rows_per_micro_batch,
                                n_shards=n_shards, n_minibatches=n_minibatches,
                                max_segments_per_row=max_segments_per_row,
                                min_micro_batches=min_micro_batches, row_lengths=row_lengths)

    def __iter__(self) -> TrajectoryBatchIterator:
        return TrajectoryBatchIterator(self)

    def __str__(self) -> str:
        return f"TrajectoryBatchDataset(batch_size={self.batch_size}, {self.pack_kwargs})"


# ----------------------------------------------------------------------------- several processes
def _rows_of(mb: PackedBatch, rows: slice) -> dict[str, Any]:
    """The arrays of ``mb`` (by field name) cut to ``rows``."""
    return {k: v[rows] for k, v in mb.arrays().items()}


def encode_rows(batch: TrainBatch, rows: slice) -> bytes:
    """``rows`` of every micro-batch of ``batch`` (plus what the learner needs) as npz bytes."""
    arrays: dict[str, np.ndarray] = {}
    micro_meta: list[dict[str, int]] = []
    header = {"version": batch.version, "stats": batch.stats, "micro_batches": micro_meta}
    for i, mb in enumerate(batch.micro_batches):
        micro_meta.append({"minibatch_id": mb.minibatch_id,
                           "minibatch_loss_tokens": mb.minibatch_loss_tokens,
                           "n_shards": mb.n_shards})
        for key, value in mb.arrays().items():
            arrays[f"{i}/{key}"] = np.ascontiguousarray(value[rows])
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub: a key may be allow_pickle
    return buf.getvalue()


def decode_rows(data: bytes) -> TrainBatch:
    """Inverse of :func:`encode_rows`: a TrainBatch of this process's rows, without groups."""
    with np.load(io.BytesIO(data)) as z:
        header = json.loads(z["header"].tobytes().decode())
        micro_batches = []
        for i, meta in enumerate(header["micro_batches"]):
            fields = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(f"{i}/")}
            micro_batches.append(PackedBatch(**fields, **meta))
    return TrainBatch(micro_batches, [], int(header["version"]), header["stats"])


def save_batch(path: str, batch: TrainBatch) -> None:
    """Writes a batch's (global) micro-batches as one npz file."""
    whole = TrainBatch(batch.global_micro_batches or batch.micro_batches, [], batch.version,
                       batch.stats)
    with open(path, "wb") as f:
        f.write(encode_rows(whole, slice(None)))


def load_batch(path: str) -> TrainBatch:
    """A batch written by :func:`save_batch` (micro-batches only, no trajectories)."""
    with open(path, "rb") as f:
        return decode_rows(f.read())


class ProcessRowsIterator(grain.DatasetIterator):
    """Iterator of :class:`ProcessRowsDataset`."""

    def __init__(self, ds: ProcessRowsDataset) -> None:
        super().__init__()
        self._ds = ds
        self._source = iter(ds.source) if ds.source is not None else None
        self._step = ds.start_step

    def __next__(self) -> TrainBatch:
        from areal_jax.parallel import scatter_from_main

        ds, key = self._ds, f"batch/{self._step}"
        if self._source is None:  # a receiving process
            data = scatter_from_main(key)
            if data is None:
                raise StopIteration
            self._step += 1
            return decode_rows(data)
        try:
            batch = next(self._source)
        except StopIteration:
            scatter_from_main(key, end=True)
            raise
        rows_of = ds.rows_of_batch(batch.micro_batches[0].shape[0])
        scatter_from_main(key, {pid: encode_rows(batch, rows) for pid, rows in rows_of.items()
                                if pid != ds.process_id})
        own = rows_of[ds.process_id]
        local = [PackedBatch(**_rows_of(mb, own),
                             minibatch_id=mb.minibatch_id,
                             minibatch_loss_tokens=mb.minibatch_loss_tokens, n_shards=mb.n_shards)
                 for mb in batch.micro_batches]
        self._step += 1
        return TrainBatch(local, batch.groups, batch.version, batch.stats, batch.micro_batches)

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self._step}
        if self._source is not None:
            state["source"] = self._source.get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])
        if self._source is not None and "source" in state:
            self._source.set_state(state["source"])


class ProcessRowsDataset(grain.IterDataset):
    """Each JAX process's rows of a trajectory stream that runs on one process.

    On the sending process (``source`` given: process 0, the one staleness authority), each
    :class:`TrainBatch` of ``source`` is split by rows: every other process is sent (in one
    collective, :func:`~areal_jax.parallel.scatter_from_main`) the rows its devices hold of
    every micro-batch (:func:`~areal_jax.parallel.process_batch_rows`), and this process keeps its
    own. On a receiving process (``source=None``) each element is those rows, with the
    batch's version and stats but no groups. Every process therefore gets micro-batches of
    the same count and shape, holding different rows; the learner takes them with
    ``process_local_batches=True``. ``start_step`` numbers the batches (a resumed run
    starts at its version, on every process).
    """

    def __init__(self, source: TrajectoryBatchDataset | None, mesh: Any, *,
                 start_step: int = 0) -> None:
        super().__init__()
        import jax

        self.source = source
        self.mesh = mesh
        self.start_step = start_step
        self.process_id = jax.process_index()
        self.rows_of = {d.process_index for d in mesh.devices.flat}
        self._rows_cache: dict[int, dict[int, slice]] = {}

    def rows_of_batch(self, global_rows: int) -> dict[int, slice]:
        from areal_jax.parallel import process_batch_rows

        if global_rows not in self._rows_cache:
            self._rows_cache[global_rows] = process_batch_rows(self.mesh, global_rows)
        return self._rows_cache[global_rows]

    def __iter__(self) -> ProcessRowsIterator:
        return ProcessRowsIterator(self)

    def __str__(self) -> str:
        return f"ProcessRowsDataset(process {self.process_id}, source={self.source})"
