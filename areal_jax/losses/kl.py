"""Per-token KL estimators between the policy and a reference policy.

With samples y ~ pi and x = ref_logp - logp = log(pi_ref(y) / pi(y)), each is an
estimator of KL(pi || pi_ref) (Schulman, "Approximating KL divergence"):

- ``k1 = -x``: unbiased, high variance, can be negative;
- ``k2 = x**2 / 2``: biased, low variance, >= 0;
- ``k3 = exp(x) - 1 - x``: unbiased, low variance, >= 0.

All are differentiable, so they serve as a KL penalty in the loss (multiply by a
coefficient and aggregate like the PPO loss) or as a reward penalty.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from areal_jax.losses import _checks

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def token_kl(logp: ArrayLike, ref_logp: ArrayLike, estimator: str = "k3",
             mask: ArrayLike | None = None) -> jax.Array:
    """Per-token KL estimate, fp32 with the inputs' shape (0 where ``mask`` is 0)."""
    fn = "token_kl"
    _checks.choice(fn, "estimator", estimator, KL_ESTIMATORS)
    logp_f = _checks.float_input(fn, "logp", logp)
    ref_f = _checks.float_input(fn, "ref_logp", ref_logp)
    mask_b = None if mask is None else _checks.mask_input(fn, "mask", mask)
    _checks.same_shape(fn, "logp", logp_f, ref_logp=ref_f, mask=mask_b)
    log_ref_ratio = ref_f - logp_f
    if mask_b is not None:
        log_ref_ratio = jnp.where(mask_b, log_ref_ratio, 0.0)  # before exp: no inf on padding
    if estimator == "k1":
        kl = -log_ref_ratio
    elif estimator == "k2":
        kl = 0.5 * jnp.square(log_ref_ratio)
    else:
        kl = jnp.expm1(log_ref_ratio) - log_ref_ratio
    return kl
