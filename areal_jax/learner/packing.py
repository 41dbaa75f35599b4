"""Sequence packing: trajectories of varied length -> micro-batches of static shape.

Pure numpy. Sequences are placed into rows of ``seq_len`` tokens by first-fit-decreasing;
rows are grouped into micro-batches of ``rows_per_micro_batch`` rows, and assigned to
(micro-batch, data shard) slots so that every shard of every micro-batch holds about the
same number of tokens. Shard ``s`` of a micro-batch is the contiguous block of rows
``[s * R / n_shards, (s + 1) * R / n_shards)``, which is how a batch dimension sharded over
the ("data", "fsdp") mesh axes is laid out.

**Row lengths** (``row_lengths``, e.g. 64, 128, 256 and ``seq_len``): each row is as long as
the smallest of these lengths that holds it, so short trajectories are not padded into long
rows, and micro-batches hold rows of one length each. First-fit-decreasing then opens a new
row at the smallest length that holds its first (longest) trajectory, and shorter ones fill
the room left in open rows first. A micro-batch of length L holds
``rows_per_micro_batch * seq_len // L`` rows (rounded down to a multiple of ``n_shards``), so
every micro-batch carries about as many token slots as before and the learner makes about
as many calls. The shapes stay static: at most one per length, each compiled once.

Alignment inside a packed row: ``positions`` restart at 0 for every segment, ``segment_ids``
number the segments of a row 1..k (0 = padding), and every per-token array keeps the
trajectory's own alignment (``behav_logp[t]`` is the logprob of ``input_ids[t]``). The learner
predicts token t from the hidden state at t-1 *of the same segment*, so the first token of a
segment never carries a logprob and must not be a loss token.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from areal_jax.trajectory import Trajectory

if TYPE_CHECKING:
    import jax

# Per-token arrays of a packed micro-batch, with their dtypes. All have shape [R, L].
PACKED_FIELDS: dict[str, type] = {
    "input_ids": np.int32,
    "positions": np.int32,
    "segment_ids": np.int32,
    "loss_mask": np.int32,
    "behav_logp": np.float32,
    "advantages": np.float32,
    "versions": np.int32,
}
# ``truncated``: 1 on every token of a trajectory cut short (``Trajectory.truncated``: no
# EOS, the token limit reached), 0 elsewhere; set by ``pack_trajectories``, read by the
# critic's GAE, which bootstraps such a sequence from the value after its last token.
OPTIONAL_FIELDS: dict[str, type] = {"prox_logp": np.float32, "ref_logp": np.float32,
                                    "truncated": np.int32}


@dataclass(frozen=True)
class Placement:
    """Where one trajectory sits: row ``row`` of a micro-batch, tokens [start, start+length)."""

    traj_index: int
    row: int
    start: int
    length: int


@dataclass
class PackedBatch:
    """One micro-batch of packed sequences. Every array is [R, L] (rows x seq_len)."""

    input_ids: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    behav_logp: np.ndarray
    # A device array in the micro-batches that Critic.gae_targets returns (PPO's GAE).
    advantages: np.ndarray | jax.Array
    versions: np.ndarray
    placements: list[Placement] = field(default_factory=list)
    minibatch_id: int = 0
    # Sum of loss_mask over every micro-batch (and every shard) of this minibatch: the
    # global normaliser of the token-mean loss.
    minibatch_loss_tokens: int = 0
    n_shards: int = 1
    prox_logp: np.ndarray | None = None  # in the copies Learner.recompute_prox_logp returns
    ref_logp: np.ndarray | None = None  # reference-model logprobs, for a KL penalty
    truncated: np.ndarray | None = None  # 1 on the tokens of truncated trajectories

    def __getitem__(self, key: str) -> np.ndarray | jax.Array:
        if key not in PACKED_FIELDS and key not in OPTIONAL_FIELDS:
            raise KeyError(f"PackedBatch has no array {key!r}; arrays: "
                           f"{list(PACKED_FIELDS) + list(OPTIONAL_FIELDS)}")
        value = getattr(self, key)
        if value is None:
            raise KeyError(f"PackedBatch[{key!r}] is not set yet "
                           "(compute it with Learner.compute_logp)")
        return value

    def __setitem__(self, key: str, value: np.ndarray) -> None:
        """Sets one array in place: for building a micro-batch by hand (tests, benchmarks).
        The learner and the trainer never change a batch they are given; they use
        :meth:`with_arrays`."""
        setattr(self, key, self._checked(key, value))

    def with_arrays(self, **arrays: np.ndarray) -> PackedBatch:
        """A new micro-batch with these arrays set (e.g. ``prox_logp=...``); this one is
        not modified, and the new one shares its other arrays."""
        checked = {k: self._checked(k, v) for k, v in arrays.items()}
        new = copy.copy(self)  # shallow: the arrays not named are shared, not copied
        for key, value in checked.items():
            setattr(new, key, value)
        return new

    def _checked(self, key: str, value: np.ndarray) -> np.ndarray:
        """``value`` as the host array of field ``key`` (its dtype, shape [R, L])."""
        if key not in PACKED_FIELDS and key not in OPTIONAL_FIELDS:
            raise KeyError(f"PackedBatch has no array {key!r}; arrays: "
                           f"{list(PACKED_FIELDS) + list(OPTIONAL_FIELDS)}")
        value = np.asarray(value, dtype={**PACKED_FIELDS, **OPTIONAL_FIELDS}[key])
        if value.shape != self.shape:
            raise ValueError(f"PackedBatch[{key!r}] must have shape {self.shape}, "
                             f"got {value.shape}")
        return value

    def __contains__(self, key: str) -> bool:
        return (key in PACKED_FIELDS or key in OPTIONAL_FIELDS) and getattr(self, key) is not None

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.input_ids.shape
        return rows, length

    @property
    def n_tokens(self) -> int:
        return int((self.segment_ids > 0).sum())

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-token arrays (prox_logp / ref_logp included once set)."""
        out = {k: getattr(self, k) for k in PACKED_FIELDS}
        for key in OPTIONAL_FIELDS:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def shard_tokens(self) -> list[int]:
        """Real tokens in each data shard's block of rows (for balance checks and metrics)."""
        blocks = np.split(self.segment_ids > 0, self.n_shards, axis=0)
        return [int(b.sum()) for b in blocks]


def _per_token_advantages(traj: Trajectory, adv: float | np.ndarray | None,
                          index: int) -> np.ndarray:
    n = traj.num_tokens
    if adv is None:
        return np.zeros(n, np.float32)
    arr = np.asarray(adv, dtype=np.float32)
    if arr.ndim == 0:  # a scalar: broadcast over the generated tokens
        return (traj.loss_mask * arr).astype(np.float32)
    if arr.shape != (n,):
        raise ValueError(f"advantages[{index}] has shape {arr.shape}; expected a scalar or ({n},) "
                         f"to match trajectory {index}'s input_ids")
    return arr


def _check_trajectories(trajs: Sequence[Trajectory], seq_len: int) -> np.ndarray:
    lengths = np.array([t.num_tokens for t in trajs], dtype=np.int64)
    for i, t in enumerate(trajs):
        if lengths[i] == 0:
            raise ValueError(f"trajectory {i} is empty (0 tokens)")
        if lengths[i] > seq_len:
            raise ValueError(f"trajectory {i} has {lengths[i]} tokens, longer than "
                             f"seq_len={seq_len}; raise seq_len or drop/truncate the trajectory "
                             "before packing")
        if t.loss_mask[0] != 0:
            raise ValueError(f"trajectory {i} has loss_mask=1 on its first token, which has no "
                             "logprob (nothing precedes it); the first token must be a prompt "
                             "token")
    return lengths


def first_fit_decreasing(lengths: Sequence[int], capacity: int,
                         max_items_per_bin: int | None = None,
                         capacities: Sequence[int] | None = None) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity, by first-fit-decreasing.

    With ``capacities`` (ascending, the last one ``capacity``), a new bin gets the smallest
    capacity that holds the item opening it."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    sizes = [capacity] if capacities is None else list(capacities)
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for b, room in enumerate(free):
            has_slot = max_items_per_bin is None or len(bins[b]) < max_items_per_bin
            if room >= lengths[i] and has_slot:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(next(c for c in sizes if c >= lengths[i]) - lengths[i])
    return bins


def row_length_for(tokens: int, row_lengths: Sequence[int]) -> int:
    """The smallest of ``row_lengths`` (ascending) that holds ``tokens``."""
    return next(n for n in row_lengths if n >= tokens)


def rows_for_length(length: int, *, seq_len: int, rows_per_micro_batch: int,
                    n_shards: int) -> int:
    """Rows of a micro-batch of ``length``-token rows: about the token slots of
    ``rows_per_micro_batch`` rows of ``seq_len``, a multiple of ``n_shards``."""
    rows = rows_per_micro_batch * seq_len // length
    return max(n_shards, rows // n_shards * n_shards)


def micro_batch_shapes(seq_len: int, rows_per_micro_batch: int, n_shards: int = 1,
                       row_lengths: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Every [rows, length] shape :func:`pack_trajectories` may make with these arguments
    (the learner compiles one program set per shape), longest rows first."""
    return [(rows_for_length(n, seq_len=seq_len, rows_per_micro_batch=rows_per_micro_batch,
                             n_shards=n_shards), n)
            for n in reversed(check_row_lengths(row_lengths, seq_len))]


def check_row_lengths(row_lengths: Sequence[int] | None, seq_len: int) -> tuple[int, ...]:
    """The allowed row lengths, ascending, ending with ``seq_len``; an error names a bad one."""
    if row_lengths is None:
        return (seq_len,)
    lengths = sorted({int(n) for n in row_lengths} | {seq_len})
    bad = [n for n in lengths if n <= 0 or n > seq_len]
    if bad:
        raise ValueError(f"row_lengths {list(row_lengths)}: each must be in [1, seq_len={seq_len}]"
                         f"; got {bad[0]}")
    return tuple(lengths)


def balanced_partition(weights: Sequence[int], n_groups: int, group_capacity: int | None = None
                       ) -> list[list[int]]:
    """Greedy longest-processing-time partition of item indices into ``n_groups`` groups.

    Heaviest item first, each into the lightest group that still has room (at most
    ``group_capacity`` items per group when given).
    """
    heap = [(0, g) for g in range(n_groups)]
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, g = heapq.heappop(heap)
        while group_capacity is not None and len(groups[g]) >= group_capacity:
            load, g = heapq.heappop(heap)  # full: drop it from the heap for good
        groups[g].append(i)
        heapq.heappush(heap, (load + int(weights[i]), g))
    return groups


def _pack_group(trajs: Sequence[Trajectory], advs: list[np.ndarray], indices: list[int],
                lengths: np.ndarray, *, seq_len: int, rows_per_micro_batch: int, n_shards: int,
                max_segments_per_row: int | None, min_micro_batches: int, minibatch_id: int,
                row_lengths: tuple[int, ...]) -> list[PackedBatch]:
    all_rows = [[indices[j] for j in b] for b in
                first_fit_decreasing([int(lengths[i]) for i in indices], seq_len,
                                     max_segments_per_row, capacities=row_lengths)]
    by_length: dict[int, list[list[int]]] = {}
    for r in all_rows:
        length = row_length_for(int(sum(lengths[i] for i in r)), row_lengths)
        by_length.setdefault(length, []).append(r)
    # min_micro_batches pads with micro-batches of the longest shape (seq_len rows).
    shorter = sum(math.ceil(len(by_length[n]) / rows_for_length(
        n, seq_len=seq_len, rows_per_micro_batch=rows_per_micro_batch, n_shards=n_shards))
        for n in by_length if n != seq_len)
    by_length.setdefault(seq_len, [])
    batches: list[PackedBatch] = []
    for length in sorted(by_length, reverse=True):
        rows = rows_for_length(length, seq_len=seq_len, rows_per_micro_batch=rows_per_micro_batch,
                               n_shards=n_shards)
        at_least = max(min_micro_batches - shorter, 0) if length == seq_len else 0
        batches += _micro_batches(trajs, advs, by_length[length], lengths, length=length,
                                  rows_per_micro_batch=rows, n_shards=n_shards,
                                  min_micro_batches=at_least, minibatch_id=minibatch_id)
    total = sum(b.n_loss_tokens for b in batches)
    for b in batches:
        b.minibatch_loss_tokens = total
    return batches


def _micro_batches(trajs: Sequence[Trajectory], advs: list[np.ndarray], rows: list[list[int]],
                   lengths: np.ndarray, *, length: int, rows_per_micro_batch: int, n_shards: int,
                   min_micro_batches: int, minibatch_id: int) -> list[PackedBatch]:
    """``rows`` (trajectory indices each) as micro-batches of [rows_per_micro_batch, length],
    token-balanced over micro-batches and data shards."""
    rows_per_shard = rows_per_micro_batch // n_shards
    n_micro = max(math.ceil(len(rows) / rows_per_micro_batch), min_micro_batches)
    row_tokens = [int(sum(lengths[i] for i in r)) for r in rows]
    slots = balanced_partition(row_tokens, n_micro * n_shards, group_capacity=rows_per_shard)

    shape = (rows_per_micro_batch, length)
    batches = []
    for m in range(n_micro):
        arrays: dict[str, np.ndarray] = {k: np.zeros(shape, dtype)
                                         for k, dtype in PACKED_FIELDS.items()}
        truncated = np.zeros(shape, np.int32)
        placements = []
        for s in range(n_shards):
            # Slot order within a shard: heaviest row first, for readability of dumps.
            slot_rows = sorted(slots[m * n_shards + s], key=lambda r: -row_tokens[r])
            for k, row_idx in enumerate(slot_rows):
                row = s * rows_per_shard + k
                start = 0
                for seg, ti in enumerate(rows[row_idx], start=1):
                    t, n = trajs[ti], int(lengths[ti])
                    span = slice(start, start + n)
                    arrays["input_ids"][row, span] = t.input_ids
                    arrays["positions"][row, span] = np.arange(n)
                    arrays["segment_ids"][row, span] = seg
                    arrays["loss_mask"][row, span] = t.loss_mask
                    arrays["behav_logp"][row, span] = t.behav_logp * (t.loss_mask != 0)
                    arrays["advantages"][row, span] = advs[ti]
                    arrays["versions"][row, span] = t.versions
                    truncated[row, span] = int(t.truncated)
                    placements.append(Placement(ti, row, start, n))
                    start += n
        batches.append(PackedBatch(
            input_ids=arrays["input_ids"], positions=arrays["positions"],
            segment_ids=arrays["segment_ids"], loss_mask=arrays["loss_mask"],
            behav_logp=arrays["behav_logp"], advantages=arrays["advantages"],
            versions=arrays["versions"], placements=placements, minibatch_id=minibatch_id,
            n_shards=n_shards, truncated=truncated))
    return batches


def pack_trajectories(
    trajs: Sequence[Trajectory],
    advantages: Sequence[float | np.ndarray] | None = None,
    *,
    seq_len: int,
    rows_per_micro_batch: int,
    n_shards: int = 1,
    n_minibatches: int = 1,
    max_segments_per_row: int | None = None,
    min_micro_batches: int = 1,
    row_lengths: Sequence[int] | None = None,
) -> list[PackedBatch]:
    """Pack trajectories into micro-batches of shape [rows_per_micro_batch, seq_len] (with
    ``row_lengths``, of [rows_for_length(L), L] for each row length L used).

    Args:
      trajs: the batch. A trajectory longer than ``seq_len`` is an error.
      advantages: one per trajectory, a scalar (broadcast over its loss tokens) or a [T]
        array aligned with its input_ids. None packs zeros (enough for ``compute_logp``).
      seq_len: tokens per row.
      rows_per_micro_batch: rows per micro-batch; a multiple of ``n_shards``.
      n_shards: number of batch shards (mesh data x fsdp size).
      n_minibatches: trajectories are first split into this many token-balanced
        minibatches (one optimizer step each), then each is packed on its own; the
        micro-batches of minibatch k carry ``minibatch_id == k``.
      max_segments_per_row: cap on sequences per row (1 = plain padding, no packing).
      min_micro_batches: pad each minibatch with empty micro-batches up to this count.
      row_lengths: allowed row lengths (``seq_len`` is always one): each row takes the
        smallest that holds it (see the module doc). None: every row is ``seq_len`` long.

    Returns:
      The micro-batches, minibatch by minibatch. ``placements`` map rows back to trajectories
      (see :func:`unpack_per_token`).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    if n_shards <= 0:
        raise ValueError(f"n_shards must be > 0, got {n_shards}")
    if rows_per_micro_batch <= 0 or rows_per_micro_batch % n_shards:
        raise ValueError(f"rows_per_micro_batch={rows_per_micro_batch} must be a positive multiple "
                         f"of n_shards={n_shards} (the data x fsdp size of the mesh)")
    if n_minibatches <= 0:
        raise ValueError(f"n_minibatches must be > 0, got {n_minibatches}")
    if max_segments_per_row is not None and max_segments_per_row <= 0:
        raise ValueError(f"max_segments_per_row must be None or > 0, got {max_segments_per_row}")
    if len(trajs) < n_minibatches:
        raise ValueError(f"cannot split {len(trajs)} trajectories into "
                         f"n_minibatches={n_minibatches}")
    if advantages is not None and len(advantages) != len(trajs):
        raise ValueError(f"got {len(advantages)} advantages for {len(trajs)} trajectories")
    allowed = check_row_lengths(row_lengths, seq_len)
    lengths = _check_trajectories(trajs, seq_len)
    advs = [_per_token_advantages(t, None if advantages is None else advantages[i], i)
            for i, t in enumerate(trajs)]

    groups = balanced_partition([int(n) for n in lengths], n_minibatches)
    batches: list[PackedBatch] = []
    for mb_id, group in enumerate(groups):
        batches += _pack_group(trajs, advs, sorted(group), lengths, seq_len=seq_len,
                               rows_per_micro_batch=rows_per_micro_batch, n_shards=n_shards,
                               max_segments_per_row=max_segments_per_row,
                               min_micro_batches=min_micro_batches, minibatch_id=mb_id,
                               row_lengths=allowed)
    return batches


def unpack_per_token(batches: Sequence[PackedBatch], values: Sequence[np.ndarray],
                     n_trajectories: int) -> list[np.ndarray]:
    """Map per-token values ([R, L] per micro-batch) back to per-trajectory [T_i] arrays."""
    if len(values) != len(batches):
        raise ValueError(f"got {len(values)} value arrays for {len(batches)} micro-batches")
    out: list[np.ndarray | None] = [None] * n_trajectories
    for b, v in zip(batches, values, strict=True):
        v = np.asarray(v)
        if v.shape != b.shape:
            raise ValueError(f"values of shape {v.shape} do not match micro-batch shape {b.shape}")
        for p in b.placements:
            if p.traj_index >= n_trajectories:
                raise ValueError(f"placement of trajectory {p.traj_index} but "
                                 f"n_trajectories={n_trajectories}")
            out[p.traj_index] = v[p.row, p.start:p.start + p.length].copy()
    missing = [i for i, o in enumerate(out) if o is None]
    if missing:
        raise ValueError(f"trajectories {missing[:10]} are in none of the micro-batches")
    return out  # type: ignore[return-value]
