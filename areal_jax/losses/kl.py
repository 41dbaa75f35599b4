"""Per-token KL estimators between the policy and a reference policy.

With samples y ~ pi and x = ref_logp - logp = log(pi_ref(y) / pi(y)), each is an
estimator of KL(pi || pi_ref) (Schulman, "Approximating KL divergence", 2020):

- ``k1 = -x``: unbiased, high variance, can be negative;
- ``k2 = x**2 / 2``: biased, low variance, >= 0;
- ``k3 = exp(x) - 1 - x``: unbiased, low variance, >= 0;
- ``low_var_kl``: verl's k3 with x clamped to [-20, 20] and the estimate to [-10, 10].

The expected *value* of k1 and k3 is the KL, but the expected *gradient* of k1 and k3 in
the loss is not the KL's gradient; k2's is (its gradient, -x * d logp, is the score-function
estimate of grad KL). The ``+`` variants (verl's ``k1+``, ``k3+``, ``low_var_kl+``) are
straight-through: the value of the named estimator, the gradient of k2,
``sg(est) + k2 - sg(k2)``.

``clamp`` (> 0) clips each token's estimate to [-clamp, clamp]; for a ``+`` variant it
clips the value only (the gradient stays k2's), otherwise the clipped tokens carry no
gradient. All are differentiable, so they serve as a KL penalty in the loss (multiply by
a coefficient and aggregate like the PPO loss) or as a reward penalty.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from areal_jax.losses import _checks

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def _estimate(log_ref_ratio: jax.Array, estimator: str) -> jax.Array:
    x = log_ref_ratio
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * jnp.square(x)
    if estimator == "k3":
        return jnp.expm1(x) - x
    # low_var_kl (verl): k3 of x clamped to [-20, 20], clamped to [-10, 10]
    x = jnp.clip(x, -20.0, 20.0)
    return jnp.clip(jnp.expm1(x) - x, -10.0, 10.0)


def token_kl(logp: ArrayLike, ref_logp: ArrayLike, estimator: str = "k3",
             mask: ArrayLike | None = None, *, clamp: float | None = None) -> jax.Array:
    """Per-token KL estimate, fp32 with the inputs' shape (0 where ``mask`` is 0).

    ``estimator`` is one of ``KL_ESTIMATORS`` (module docstring); ``clamp`` clips each
    estimate to [-clamp, clamp] (None: no clip)."""
    fn = "token_kl"
    _checks.choice(fn, "estimator", estimator, KL_ESTIMATORS)
    _checks.positive(fn, "clamp", clamp, allow_none=True)
    logp_f = _checks.float_input(fn, "logp", logp)
    ref_f = _checks.float_input(fn, "ref_logp", ref_logp)
    mask_b = None if mask is None else _checks.mask_input(fn, "mask", mask)
    _checks.same_shape(fn, "logp", logp_f, ref_logp=ref_f, mask=mask_b)
    log_ref_ratio = ref_f - logp_f
    if mask_b is not None:
        log_ref_ratio = jnp.where(mask_b, log_ref_ratio, 0.0)  # before exp: no inf on padding
    straight_through = estimator.endswith("+")
    kl = _estimate(log_ref_ratio, estimator.rstrip("+"))
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    if straight_through:  # the value of kl, the gradient of k2
        k2 = 0.5 * jnp.square(log_ref_ratio)
        kl = jax.lax.stop_gradient(kl) + (k2 - jax.lax.stop_gradient(k2))
    return kl
