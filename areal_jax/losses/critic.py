"""Clipped PPO value loss, for the actor-critic variant (with ``gae``).

Per token: ``v_clip = old_v + clip(v - old_v, -value_eps_clip, value_eps_clip)`` and
``l_t = 0.5 * max((v - R)^2, (v_clip - R)^2)``; loss = sum_t m_t l_t / sum_t m_t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from areal_jax.losses import _checks


def ppo_value_loss(
    values: ArrayLike,
    old_values: ArrayLike,
    returns: ArrayLike,
    loss_mask: ArrayLike,
    *,
    value_eps_clip: float | None = 0.2,
    normalizer: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss and its statistics.

    Args:
        values: [B, T] current critic predictions (carry the gradient).
        old_values: [B, T] predictions of the critic that produced the returns.
        returns: [B, T] targets, e.g. from :func:`gae`.
        loss_mask: [B, T] valid tokens.
        value_eps_clip: the clip range; None disables clipping (plain 0.5 * MSE).
        normalizer: the count to divide by instead of the local valid-token count (the
            global count under micro-batching; clamped to >= 1).

    Returns:
        ``(loss, stats)``; loss is an fp32 scalar; stats (no gradient, over valid tokens):
        ``value_clip_frac`` (clipped branch active), ``value_mean``, ``value_abs_error``
        (mean |v - R|).
    """
    fn = "ppo_value_loss"
    values_bt = _checks.float_input(fn, "values", values)
    old_bt = _checks.float_input(fn, "old_values", old_values)
    returns_bt = _checks.float_input(fn, "returns", returns)
    mask_bt = _checks.mask_input(fn, "loss_mask", loss_mask)
    _checks.same_shape(fn, "values", values_bt, old_values=old_bt, returns=returns_bt,
                       loss_mask=mask_bt)
    _checks.positive(fn, "value_eps_clip", value_eps_clip, allow_none=True)

    loss_plain = 0.5 * jnp.square(values_bt - returns_bt)
    if value_eps_clip is None:
        token_loss = loss_plain
        clipped = jnp.zeros_like(mask_bt)
    else:
        v_clip = old_bt + jnp.clip(values_bt - old_bt, -value_eps_clip, value_eps_clip)
        loss_clipped = 0.5 * jnp.square(v_clip - returns_bt)
        token_loss = jnp.maximum(loss_plain, loss_clipped)
        clipped = mask_bt & (loss_clipped > loss_plain)
    count = jnp.sum(mask_bt).astype(jnp.float32)
    if normalizer is None:
        denominator = jnp.maximum(count, 1.0)
    else:
        _checks.in_range(fn, "normalizer", normalizer, 0.0, float("inf"))
        denominator = jnp.maximum(jnp.asarray(normalizer, jnp.float32), 1.0)
    loss = jnp.sum(jnp.where(mask_bt, token_loss, 0.0)) / denominator

    safe_count = jnp.maximum(count, 1.0)
    sg_values = jax.lax.stop_gradient(values_bt)
    stats = {
        "value_clip_frac": jnp.sum(clipped).astype(jnp.float32) / safe_count,
        "value_mean": jnp.sum(jnp.where(mask_bt, sg_values, 0.0)) / safe_count,
        "value_abs_error": jnp.sum(jnp.where(mask_bt, jnp.abs(sg_values - returns_bt), 0.0))
        / safe_count,
    }
    return loss, stats
