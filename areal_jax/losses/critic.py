"""Clipped PPO value loss, for the actor-critic variant (with ``gae``).

Per token: ``v_clip = old_v + clip(v - old_v, -value_eps_clip, value_eps_clip)`` and
``l_t = max(rho(v - R), rho(v_clip - R))``; loss = sum_t m_t l_t / sum_t m_t, where rho is

- ``mse``: rho(x) = x^2 / 2 (PPO, verl, OpenRLHF);
- ``huber``: rho(x) = x^2 / 2 for |x| <= delta, delta * (|x| - delta / 2) beyond (Huber
  1964; the value loss of DQN, Mnih et al. 2015): the same near the target, a gradient
  bounded by delta far from it, so a few large returns cannot dominate the update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from areal_jax.losses import _checks

VALUE_LOSSES = ("mse", "huber")


def _penalty(x: jax.Array, loss: str, delta: float) -> jax.Array:
    if loss == "mse":
        return 0.5 * jnp.square(x)
    abs_x = jnp.abs(x)
    return jnp.where(abs_x <= delta, 0.5 * jnp.square(x), delta * (abs_x - 0.5 * delta))


def ppo_value_loss(
    values: ArrayLike,
    old_values: ArrayLike,
    returns: ArrayLike,
    loss_mask: ArrayLike,
    *,
    value_eps_clip: float | None = 0.2,
    normalizer: ArrayLike | None = None,
    loss: str = "mse",
    huber_delta: float = 1.0,
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
        loss: "mse" or "huber" (module docstring).
        huber_delta: the Huber loss's delta (> 0): quadratic within it, linear beyond.

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
    _checks.choice(fn, "loss", loss, VALUE_LOSSES)
    _checks.positive(fn, "huber_delta", huber_delta)

    loss_plain = _penalty(values_bt - returns_bt, loss, huber_delta)
    if value_eps_clip is None:
        token_loss = loss_plain
        clipped = jnp.zeros_like(mask_bt)
    else:
        v_clip = old_bt + jnp.clip(values_bt - old_bt, -value_eps_clip, value_eps_clip)
        loss_clipped = _penalty(v_clip - returns_bt, loss, huber_delta)
        token_loss = jnp.maximum(loss_plain, loss_clipped)
        clipped = mask_bt & (loss_clipped > loss_plain)
    count = jnp.sum(mask_bt).astype(jnp.float32)
    if normalizer is None:
        denominator = jnp.maximum(count, 1.0)
    else:
        _checks.in_range(fn, "normalizer", normalizer, 0.0, float("inf"))
        denominator = jnp.maximum(jnp.asarray(normalizer, jnp.float32), 1.0)
    total = jnp.sum(jnp.where(mask_bt, token_loss, 0.0)) / denominator

    safe_count = jnp.maximum(count, 1.0)
    sg_values = jax.lax.stop_gradient(values_bt)
    stats = {
        "value_clip_frac": jnp.sum(clipped).astype(jnp.float32) / safe_count,
        "value_mean": jnp.sum(jnp.where(mask_bt, sg_values, 0.0)) / safe_count,
        "value_abs_error": jnp.sum(jnp.where(mask_bt, jnp.abs(sg_values - returns_bt), 0.0))
        / safe_count,
    }
    return total, stats
