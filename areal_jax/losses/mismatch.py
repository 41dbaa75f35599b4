"""Rollout-training mismatch, measured apart from policy lag.

A token generated under weight version v and trained by a learner holding version V has
lag V - v. Lag-0 tokens were sampled from the very weights the learner holds, so the gap
between the learner's logprob and the engine's (behaviour) logprob on them is pure
mismatch: precision, kernels, sampling details. For lag >= 1 the gap also holds the
honest policy change of the versions in between.

Per lag bucket (lag 0, 1, ..., ``n_buckets - 2``, and ``>= n_buckets - 1`` in the last),
over valid tokens, with d_t = logp_t - behav_logp_t:

- ``abs_diff``: sum of |d_t|, and ``abs_diff_max``: max |d_t| (0 for an empty bucket);
- ``kl``: sum of the k3 estimator exp(d_t) - 1 - d_t, an estimate of KL(behav || pi)
  from tokens the behaviour policy sampled (>= 0, 0 when the logprobs agree);
- ``count``: the number of tokens.

Sums and counts of several micro-batches add; maxima combine by maximum.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from areal_jax.losses import _checks

_FN = "mismatch_terms"
DEFAULT_LAG_BUCKETS = 4  # lag 0, 1, 2, >= 3


def lag_bucket_names(n_buckets: int = DEFAULT_LAG_BUCKETS) -> list[str]:
    """``["lag0", "lag1", "lag2", "lag3plus"]`` for 4 buckets."""
    if isinstance(n_buckets, bool) or not isinstance(n_buckets, int) or n_buckets < 1:
        raise ValueError(f"{_FN}: n_buckets={n_buckets!r}; expected an int >= 1")
    names = [f"lag{i}" for i in range(n_buckets - 1)]
    return [*names, f"lag{n_buckets - 1}plus"]


def mismatch_terms(
    logp: ArrayLike,
    behav_logp: ArrayLike,
    loss_mask: ArrayLike,
    versions: ArrayLike,
    current_version: ArrayLike,
    *,
    n_buckets: int = DEFAULT_LAG_BUCKETS,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Mismatch sums and maxima per lag bucket (module docstring), all fp32 scalars.

    Args:
        logp: [B, T] the learner's log-probs of the taken tokens under the weights it holds
            (the proximal log-probs of the decoupled loss).
        behav_logp: [B, T] the engine's log-probs recorded at generation time.
        loss_mask: [B, T] 1 on tokens to count.
        versions: int [B, T] the weight version that generated each token.
        current_version: the learner's version (a scalar, may be traced).
        n_buckets: static number of lag buckets; the last holds every lag >= n_buckets - 1.
            Tokens from a version newer than ``current_version`` (negative lag) count in
            no bucket.

    Returns:
        ``(sums, maxes)``: ``sums`` has ``{name}_abs_diff``, ``{name}_kl`` and
        ``{name}_count``; ``maxes`` has ``{name}_abs_diff_max``, for each bucket name of
        :func:`lag_bucket_names`.
    """
    names = lag_bucket_names(n_buckets)
    logp_bt = _checks.float_input(_FN, "logp", logp)
    _checks.ndim(_FN, "logp", logp_bt, 2, "[B, T]")
    behav_bt = _checks.float_input(_FN, "behav_logp", behav_logp)
    mask_bt = _checks.mask_input(_FN, "loss_mask", loss_mask)
    version_bt = _checks.int_input(_FN, "versions", versions)
    _checks.same_shape(_FN, "logp", logp_bt, behav_logp=behav_bt, loss_mask=mask_bt,
                       versions=version_bt)
    lag_bt = jnp.asarray(current_version, jnp.int32) - version_bt.astype(jnp.int32)
    # Masked before the exp: garbage on invalid tokens can never make inf or NaN.
    diff_bt = jax.lax.stop_gradient(jnp.where(mask_bt, logp_bt - behav_bt, 0.0))
    abs_bt = jnp.abs(diff_bt)
    k3_bt = jnp.expm1(diff_bt) - diff_bt
    sums: dict[str, jax.Array] = {}
    maxes: dict[str, jax.Array] = {}
    for i, name in enumerate(names):
        last = i == n_buckets - 1
        in_bt = mask_bt & ((lag_bt >= i) if last else (lag_bt == i))
        sums[f"{name}_abs_diff"] = jnp.sum(jnp.where(in_bt, abs_bt, 0.0))
        sums[f"{name}_kl"] = jnp.sum(jnp.where(in_bt, k3_bt, 0.0))
        sums[f"{name}_count"] = jnp.sum(in_bt).astype(jnp.float32)
        maxes[f"{name}_abs_diff_max"] = jnp.max(jnp.where(in_bt, abs_bt, 0.0), initial=0.0)
    return sums, maxes


def mismatch_stats(sums: dict[str, Any], maxes: dict[str, Any],
                   n_buckets: int = DEFAULT_LAG_BUCKETS) -> dict[str, float]:
    """Host floats from (combined) :func:`mismatch_terms`: per bucket ``{name}_frac`` (the
    bucket's share of all counted tokens) and, for a bucket with tokens,
    ``{name}_abs_diff_mean``, ``{name}_abs_diff_max`` and ``{name}_kl`` (means over the
    bucket's tokens). An empty bucket has no mean (not 0, which would read as agreement)."""
    names = lag_bucket_names(n_buckets)
    total = sum(float(sums[f"{n}_count"]) for n in names)
    out: dict[str, float] = {}
    for name in names:
        count = float(sums[f"{name}_count"])
        out[f"{name}_frac"] = count / total if total else 0.0
        if count:
            out[f"{name}_abs_diff_mean"] = float(sums[f"{name}_abs_diff"]) / count
            out[f"{name}_abs_diff_max"] = float(maxes[f"{name}_abs_diff_max"])
            out[f"{name}_kl"] = float(sums[f"{name}_kl"]) / count
    return out
