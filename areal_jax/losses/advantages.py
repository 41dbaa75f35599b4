"""Advantage estimators and reward shaping.

- :func:`group_advantages`: GRPO (group mean and std), RLOO (leave-one-out mean) and
  Dr.GRPO (mean only) advantages of one scalar reward per sample.
- :func:`gae`: generalised advantage estimation over tokens (actor-critic), via ``lax.scan``.
- :func:`packed_gae`: the same over packed rows (several sequences a row), restarting at
  every sequence boundary.
- :func:`normalize_advantages`: masked whole-batch normalisation.
- :func:`shape_rewards`: bias, scale, then clip.
- :func:`overlong_penalty`: DAPO's soft overlong punishment, counted in tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from areal_jax.losses import _checks

GROUP_MODES = {
    "grpo": (False, True),  # (mean_leave_one_out, std_normalize)
    "rloo": (True, False),
    "drgrpo": (False, False),
    "gspo": (False, True),  # GSPO's advantages are GRPO's; its ratio is per sequence
}


def _numeric_input(fn: str, name: str, x: ArrayLike) -> jax.Array:
    arr = _checks.as_array(fn, name, x)
    if not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)
            or arr.dtype == jnp.bool_):
        raise TypeError(f"{fn}: {name} has dtype {arr.dtype}; expected numbers")
    return arr.astype(jnp.float32)


def group_advantages(
    rewards: ArrayLike,
    group_size: int,
    mean_leave_one_out: bool = False,
    std_normalize: bool = True,
    eps: float = 1e-5,
    *,
    mode: str | None = None,
) -> jax.Array:
    """Per-sample advantages from rewards ordered group by group.

    Args:
        rewards: [N] one reward per sample; samples ``[g*G, (g+1)*G)`` form group g,
            G = ``group_size``. N must be a multiple of G.
        group_size: samples per prompt (G >= 1; G >= 2 for leave-one-out).
        mean_leave_one_out: baseline is the mean of the *other* G-1 rewards of the group
            (RLOO) instead of the group mean.
        std_normalize: divide by (unbiased group std of the rewards + eps), as AReaL's
            GRPO. A group of one has std 0.
        eps: added to the std.
        mode: shortcut that sets both flags: "grpo" (mean, std), "rloo" (leave-one-out
            mean, no std), "drgrpo" (mean only), "gspo" (as grpo). Overrides the two flags
            when given.

    Returns:
        fp32 [N] advantages. A group of equal rewards gets exactly 0 in every mode, at any
        group size and magnitude (each group is centred on its first reward before any
        sum); otherwise the fp32 error is a few roundoffs of the group's spread.
    """
    fn = "group_advantages"
    if mode is not None:
        _checks.choice(fn, "mode", mode, tuple(GROUP_MODES))
        mean_leave_one_out, std_normalize = GROUP_MODES[mode]
    rewards_n = _numeric_input(fn, "rewards", rewards)
    _checks.ndim(fn, "rewards", rewards_n, 1, "[N], ordered group by group")
    if (isinstance(group_size, bool) or not isinstance(group_size, int | np.integer)
            or group_size < 1):
        raise ValueError(f"{fn}: group_size={group_size!r}; expected an int >= 1")
    group_size = int(group_size)
    n = rewards_n.shape[0]
    if n % group_size:
        raise ValueError(
            f"{fn}: {n} rewards do not split into groups of group_size={group_size}; "
            "N must be a multiple of group_size"
        )
    if mean_leave_one_out and group_size < 2:
        raise ValueError(f"{fn}: mean_leave_one_out needs group_size >= 2, got {group_size}")
    _checks.in_range(fn, "eps", eps, 0.0, float("inf"))

    # Centre every group on one of its own members before any sum: r - r_0 is exact for
    # equal rewards (and for rewards within a factor 2 of each other, Sterbenz), so a group
    # of equal rewards gets exactly 0 in every mode, and the fp32 error of the rest is
    # relative to the group's spread, not to the rewards' size. The mean of the rewards
    # is r_0 + mean(d), and (r - mean) = d - mean(d).
    rewards_gk = rewards_n.reshape(n // group_size, group_size)
    dev_gk = rewards_gk - rewards_gk[:, :1]
    dev_sum_g1 = dev_gk.sum(axis=1, keepdims=True)
    centred_gk = dev_gk - dev_sum_g1 / group_size  # r - group mean
    if mean_leave_one_out:
        # r_k - mean of the others = (G r_k - sum) / (G - 1) = (d_k - mean(d)) G / (G - 1)
        adv_gk = centred_gk * (group_size / (group_size - 1))
    else:
        adv_gk = centred_gk
    if std_normalize:
        if group_size > 1:
            sq_dev_g1 = jnp.sum(centred_gk ** 2, axis=1, keepdims=True)
            std_g1 = jnp.sqrt(sq_dev_g1 / (group_size - 1))
        else:
            std_g1 = jnp.zeros_like(dev_sum_g1)
        adv_gk = adv_gk / (std_g1 + eps)
    return adv_gk.reshape(n)


def gae(
    rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, gamma: float, lam: float, *,
    truncated: ArrayLike | None = None, bootstrap_values: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over tokens, by a reverse ``lax.scan`` over T.

    For valid tokens (``mask != 0``), walking backwards:
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    where ``V_next`` / ``A_next`` are those of the next *valid* token of the row. After the
    last one, A_next = 0 and V_next = 0 (the episode ended: a terminal state) or, for a row
    whose sequence was truncated (``truncated``: cut at the length limit, no EOS), the
    critic's value of the state after its last token, ``bootstrap_values`` (the return
    goes on past the cut). Masked tokens (padding, prompt, environment turns) are skipped
    as if absent; their rewards and values are ignored.

    Every row is one sequence: this is :func:`packed_gae` with one segment per row.

    Args:
        rewards, values, mask: [B, T]. Put each sequence's reward on a valid token
            (usually the last generated one).
        gamma, lam: discount and GAE lambda in [0, 1].
        truncated: optional [B] bool, the rows cut short; needs ``bootstrap_values``.
        bootstrap_values: [B] V(state after the row's last token); used where
            ``truncated``.

    Returns:
        ``(advantages, returns)``, fp32 [B, T], 0 on masked tokens; returns = A + V.
    """
    fn = "gae"
    rewards_bt, values_bt, mask_bt = _gae_inputs(fn, rewards, values, mask, gamma, lam)
    tail = _bootstrap_inputs(fn, truncated, bootstrap_values, (rewards_bt.shape[0],), "[B]")
    return _reverse_gae(rewards_bt, values_bt, mask_bt, None, tail, gamma, lam)


def packed_gae(
    rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, segment_ids: ArrayLike,
    gamma: float, lam: float, *, truncated: ArrayLike | None = None,
    bootstrap_values: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`gae` over packed rows: several sequences one after another in each row.

    ``segment_ids`` numbers the sequences of a row (1, 2, ...; 0 = padding), as the
    learner's packing lays them out. The reverse scan restarts wherever the segment id
    changes: after a sequence's last token the advantage is 0 and the value is 0, or, for
    a truncated sequence, ``bootstrap_values`` at its last token (the critic's value of the
    state after it), so every sequence gets exactly what :func:`gae` gives it in a row of
    its own. Within a sequence, masked tokens (prompt, environment turns) are skipped as in
    :func:`gae`; padding is never valid.

    Args:
        rewards, values, mask, segment_ids: [B, T]. Put each sequence's reward on one of
            its valid tokens (usually its last generated one).
        gamma, lam: discount and GAE lambda in [0, 1].
        truncated: optional [B, T], nonzero on the tokens of truncated sequences (read at
            each sequence's last token); needs ``bootstrap_values``.
        bootstrap_values: [B, T], at each sequence's last token t: V(state after t).

    Returns:
        ``(advantages, returns)``, fp32 [B, T], 0 on masked tokens and padding;
        returns = A + V.
    """
    fn = "packed_gae"
    rewards_bt, values_bt, mask_bt = _gae_inputs(fn, rewards, values, mask, gamma, lam)
    segment_ids_bt = _checks.int_input(fn, "segment_ids", segment_ids)
    _checks.same_shape(fn, "rewards", rewards_bt, segment_ids=segment_ids_bt)
    tail = _bootstrap_inputs(fn, truncated, bootstrap_values, rewards_bt.shape, "[B, T]")
    return _reverse_gae(rewards_bt, values_bt, mask_bt & (segment_ids_bt > 0), segment_ids_bt,
                        tail, gamma, lam)


def _gae_inputs(fn: str, rewards: ArrayLike, values: ArrayLike, mask: ArrayLike, gamma: float,
                lam: float
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rewards, values) as fp32 and the mask as bool, all [B, T]; gamma and lam in [0, 1]."""
    rewards_bt = _checks.float_input(fn, "rewards", rewards)
    _checks.ndim(fn, "rewards", rewards_bt, 2, "[B, T]")
    values_bt = _checks.float_input(fn, "values", values)
    mask_bt = _checks.mask_input(fn, "mask", mask)
    _checks.same_shape(fn, "rewards", rewards_bt, values=values_bt, mask=mask_bt)
    _checks.in_range(fn, "gamma", gamma, 0.0, 1.0)
    _checks.in_range(fn, "lam", lam, 0.0, 1.0)
    return rewards_bt, values_bt, mask_bt


def _bootstrap_inputs(fn: str, truncated: ArrayLike | None, bootstrap_values: ArrayLike | None,
                      shape: tuple[int, ...], layout: str) -> jax.Array | None:
    """The value after each sequence's end: ``bootstrap_values`` where ``truncated``, else
    0 (fp32 of ``shape``); None without truncation."""
    if truncated is None:
        if bootstrap_values is not None:
            raise ValueError(f"{fn}: bootstrap_values given without truncated (which "
                             "sequences were cut short)")
        return None
    if bootstrap_values is None:
        raise ValueError(f"{fn}: truncated needs bootstrap_values, the critic's value of the "
                         "state after each truncated sequence's last token")
    trunc = _checks.mask_input(fn, "truncated", truncated)
    boot = _checks.float_input(fn, "bootstrap_values", bootstrap_values)
    for name, arr in (("truncated", trunc), ("bootstrap_values", boot)):
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{fn}: {name} has shape {tuple(arr.shape)}; expected "
                             f"{tuple(shape)} {layout}")
    # Where not truncated the value is never read: a NaN or inf there cannot leak.
    return jnp.where(trunc, boot, 0.0)


def _reverse_gae(rewards_bt: jax.Array, values_bt: jax.Array, valid_bt: jax.Array,
                 segment_ids_bt: jax.Array | None, tail: jax.Array | None, gamma: float,
                 lam: float) -> tuple[jax.Array, jax.Array]:
    """The reverse scan of :func:`gae`. With ``segment_ids_bt`` its carry restarts where a
    segment ends; without, a row is one sequence (``gae``'s own scan). ``tail`` is the value
    after a sequence's end ([B] per row, or [B, T] read at each segment's last token; None:
    0 everywhere, every sequence terminal)."""
    batch = rewards_bt.shape[0]
    xs: tuple[jax.Array, ...] = (rewards_bt.T, values_bt.T, valid_bt.T)
    if segment_ids_bt is not None:
        # ends_bt[b, t]: token t is the last of its segment (the next token is another
        # segment's, or t ends the row): after it, as after a row's last token, A = 0 and
        # V = the tail value (0 unless truncated).
        ends_bt = jnp.concatenate([segment_ids_bt[:, :-1] != segment_ids_bt[:, 1:],
                                   jnp.ones((batch, 1), bool)], axis=1)
        tail_bt = jnp.zeros_like(values_bt) if tail is None else tail
        xs = (*xs, ends_bt.T, tail_bt.T)

    def step(carry, xs_t):
        next_value_b, next_adv_b = carry
        reward_b, value_b, valid_b = xs_t[:3]
        if segment_ids_bt is not None:
            end_b, tail_b = xs_t[3], xs_t[4]
            next_value_b = jnp.where(end_b, tail_b, next_value_b)
            next_adv_b = jnp.where(end_b, 0.0, next_adv_b)
        delta_b = reward_b + gamma * next_value_b - value_b
        adv_b = delta_b + gamma * lam * next_adv_b
        carry = (jnp.where(valid_b, value_b, next_value_b), jnp.where(valid_b, adv_b, next_adv_b))
        return carry, jnp.where(valid_b, adv_b, 0.0)

    init_value = (jnp.zeros((batch,), jnp.float32) if tail is None or segment_ids_bt is not None
                  else tail)
    init = (init_value, jnp.zeros((batch,), jnp.float32))
    _, adv_tb = jax.lax.scan(step, init, xs, reverse=True)
    advantages_bt = adv_tb.T
    returns_bt = jnp.where(valid_bt, advantages_bt + values_bt, 0.0)
    return advantages_bt, returns_bt


def normalize_advantages(
    advantages: ArrayLike, mask: ArrayLike, *, eps: float = 1e-5, center: bool = True,
    unbiased: bool = False
) -> jax.Array:
    """Whole-batch normalisation over valid tokens: (A - mean) / (std + eps).

    ``center=False`` only divides by the std (no mean shift). ``unbiased`` uses n - 1.
    Masked tokens come out 0. Inside a jit over sharded arrays the mean and std are
    global. Returns fp32 with the input's shape.
    """
    fn = "normalize_advantages"
    adv = _checks.float_input(fn, "advantages", advantages)
    mask_b = _checks.mask_input(fn, "mask", mask)
    _checks.same_shape(fn, "advantages", adv, mask=mask_b)
    _checks.in_range(fn, "eps", eps, 0.0, float("inf"))
    count = jnp.sum(mask_b).astype(jnp.float32)
    # Centred on one valid advantage before any sum (as group_advantages): equal advantages
    # have std exactly 0 and, centred, come out exactly 0; the error of the mean and std is
    # relative to the advantages' spread, not to their size.
    pivot = _first_valid(adv, mask_b)
    dev = jnp.where(mask_b, adv - pivot, 0.0)
    mean_dev = jnp.sum(dev) / jnp.maximum(count, 1.0)
    centred = dev - mean_dev  # A - mean(A)
    sq_dev = jnp.where(mask_b, centred ** 2, 0.0)
    dof = jnp.maximum(count - 1.0, 1.0) if unbiased else jnp.maximum(count, 1.0)
    std = jnp.sqrt(jnp.sum(sq_dev) / dof)
    shifted = centred if center else adv
    return jnp.where(mask_b, shifted / (std + eps), 0.0)


def _first_valid(x: jax.Array, mask: jax.Array) -> jax.Array:
    """The first element of ``x`` where ``mask`` is set (row-major), or 0 when none is."""
    flat_mask = mask.reshape(-1)
    first = jnp.argmax(flat_mask)
    return jnp.where(flat_mask[first], x.reshape(-1)[first], 0.0)


def shape_rewards(
    rewards: ArrayLike, *, scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> jax.Array:
    """``clip((rewards + bias) * scale, -clip, clip)`` (AReaL's order), fp32."""
    fn = "shape_rewards"
    rewards_n = _numeric_input(fn, "rewards", rewards)
    _checks.in_range(fn, "scale", scale, -float("inf"), float("inf"))
    _checks.in_range(fn, "bias", bias, -float("inf"), float("inf"))
    _checks.positive(fn, "clip", clip, allow_none=True)
    shaped = (rewards_n + bias) * scale
    if clip is not None:
        shaped = jnp.clip(shaped, -clip, clip)
    return shaped


def overlong_penalty(
    response_lengths: ArrayLike,
    *,
    max_response_length: int,
    overlong_tokens: int,
    penalty_factor: float = 1.0,
) -> jax.Array:
    """DAPO's soft overlong punishment, to add to the rewards (fp32, <= 0).

    With L_max = ``max_response_length`` and L_cache = ``overlong_tokens``:
    0 for lengths <= L_max - L_cache, then falling linearly to -penalty_factor at
    L_max, and -penalty_factor beyond. Lengths count generated tokens, e.g.
    ``loss_mask.sum(-1)``.
    """
    fn = "overlong_penalty"
    lengths = _numeric_input(fn, "response_lengths", response_lengths)
    _checks.positive(fn, "max_response_length", max_response_length)
    _checks.in_range(fn, "overlong_tokens", overlong_tokens, 0, max_response_length, lo_open=True)
    _checks.in_range(fn, "penalty_factor", penalty_factor, 0.0, float("inf"))
    excess = lengths - (max_response_length - overlong_tokens)
    return jnp.clip(-excess / overlong_tokens * penalty_factor, -penalty_factor, 0.0)
