"""Sequences inside [B, T] token arrays, and the loss denominators that count them.

By default each row of a [B, T] array is one sequence. A learner that packs several
sequences into one row passes ``segment_ids`` [B, T] instead: 0 marks padding and
1..max_segments number the sequences within a row (so sequence identity is the
pair (row, segment id); ids may repeat across rows). ``max_segments`` is a static
upper bound on the ids, which keeps every reduction jit-friendly: reductions are
``jax.ops.segment_sum`` over ``B * max_segments`` slots.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from areal_jax.losses import _checks

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


class SequenceLayout(NamedTuple):
    """Which sequence each token belongs to.

    ``slot_bt`` [B, T] int32 holds a sequence slot in ``[0, num_slots)`` for every
    token, or ``num_slots`` for padding (dropped by every reduction). ``in_sequence_bt``
    [B, T] bool is False on padding: the loss functions treat those tokens as masked.
    """

    slot_bt: jax.Array
    num_slots: int
    in_sequence_bt: jax.Array


def sequence_layout(
    shape: tuple[int, ...],
    segment_ids: ArrayLike | None = None,
    max_segments: int | None = None,
    *,
    fn: str = "sequence_layout",
) -> SequenceLayout:
    """Map each token of a [B, T] array to a sequence slot.

    Args:
        shape: (B, T).
        segment_ids: optional int [B, T]; 0 = padding, 1..max_segments = sequence
            number within the row. None: each row is one sequence.
        max_segments: static bound on segment ids. May be omitted when
            ``segment_ids`` is concrete (it is then inferred); required under jit.
    """
    if len(shape) != 2:
        raise ValueError(f"{fn}: per-token inputs have shape {tuple(shape)}; expected [B, T]")
    batch, length = shape
    if segment_ids is None:
        if max_segments not in (None, 1):
            raise ValueError(
                f"{fn}: max_segments={max_segments!r} given without segment_ids; "
                "pass segment_ids [B, T] for packed rows"
            )
        slot_bt = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, length))
        return SequenceLayout(slot_bt, batch, jnp.ones(shape, jnp.bool_))

    seg_bt = _checks.int_input(fn, "segment_ids", segment_ids)
    if seg_bt.shape != tuple(shape):
        raise ValueError(
            f"{fn}: segment_ids has shape {tuple(seg_bt.shape)} but the per-token inputs have "
            f"shape {tuple(shape)}"
        )
    concrete = _checks.is_concrete(seg_bt)
    if max_segments is None:
        if not concrete:
            raise ValueError(
                f"{fn}: segment_ids is traced (inside jit), so max_segments must be given "
                "as a static int (the most sequences packed into one row)"
            )
        max_segments = max(int(np.max(np.asarray(seg_bt))) if seg_bt.size else 0, 1)
    if (isinstance(max_segments, bool) or not isinstance(max_segments, int | np.integer)
            or max_segments < 1):
        raise ValueError(f"{fn}: max_segments={max_segments!r}; expected a static int >= 1")
    max_segments = int(max_segments)
    if concrete and seg_bt.size:
        seg_np = np.asarray(seg_bt)
        lo, hi = int(seg_np.min()), int(seg_np.max())
        if lo < 0 or hi > max_segments:
            raise ValueError(
                f"{fn}: segment_ids range over [{lo}, {hi}]; expected values in "
                f"[0, max_segments={max_segments}] (0 = padding)"
            )
    num_slots = batch * max_segments
    row_bt = jnp.arange(batch, dtype=jnp.int32)[:, None]
    seg_bt = seg_bt.astype(jnp.int32)
    valid = (seg_bt >= 1) & (seg_bt <= max_segments)
    slot_bt = jnp.where(valid, row_bt * max_segments + seg_bt - 1, num_slots)
    return SequenceLayout(slot_bt, num_slots, valid)


def sequence_sum(values_bt: jax.Array, layout: SequenceLayout) -> jax.Array:
    """Sum of a [B, T] array within each sequence -> [num_slots]."""
    return jax.ops.segment_sum(
        values_bt.reshape(-1), layout.slot_bt.reshape(-1), num_segments=layout.num_slots
    )


def to_tokens(values_s: jax.Array, layout: SequenceLayout, fill: float = 0.0) -> jax.Array:
    """Broadcast per-sequence values [num_slots] back to tokens [B, T] (padding gets ``fill``)."""
    padded = jnp.concatenate([values_s, jnp.full((1,), fill, values_s.dtype)])
    return padded[layout.slot_bt]


def sequence_count(mask_bt: jax.Array, layout: SequenceLayout) -> jax.Array:
    """Number of sequences with at least one valid token (fp32 scalar)."""
    tokens_s = sequence_sum(mask_bt.astype(jnp.float32), layout)
    return jnp.sum(tokens_s > 0).astype(jnp.float32)


def loss_denominator(
    loss_mask: ArrayLike,
    *,
    agg_mode: str = "token-mean",
    segment_ids: ArrayLike | None = None,
    max_segments: int | None = None,
) -> jax.Array:
    """The local count that normalises the loss, as an fp32 scalar.

    ``token-mean``: the number of valid tokens (``loss_mask != 0``).
    ``seq-mean-token-mean`` / ``seq-mean-token-sum``: the number of sequences with at
    least one valid token. With ``segment_ids``, padding tokens (id 0) are never valid.

    For gradient accumulation, add this up over all micro-batches (and data shards)
    of a minibatch and pass the total as ``normalizer=`` to the loss functions.
    """
    fn = "loss_denominator"
    _checks.choice(fn, "agg_mode", agg_mode, AGG_MODES)
    mask_bt = _checks.mask_input(fn, "loss_mask", loss_mask)
    if agg_mode == "token-mean" and segment_ids is None:
        return jnp.sum(mask_bt).astype(jnp.float32)
    _checks.ndim(fn, "loss_mask", mask_bt, 2, "[B, T]")
    layout = sequence_layout(mask_bt.shape, segment_ids, max_segments, fn=fn)
    mask_bt = mask_bt & layout.in_sequence_bt
    if agg_mode == "token-mean":
        return jnp.sum(mask_bt).astype(jnp.float32)
    return sequence_count(mask_bt, layout)
