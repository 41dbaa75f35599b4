"""One training step's metrics: the sums its micro-batches accumulate, finalised once.

A step runs ``n`` minibatches (one optimizer update each), each split into micro-batches.
Every micro-batch's gradient program returns a :class:`StepSums` (fp32 scalars on
device); a minibatch's sums are the field-wise combination of its micro-batches' (sums
add, the ``MAXIMA`` take the maximum). :func:`finalise_step` turns the minibatches' sums,
with the optimizer's grad norms and learning rate, into :class:`StepMetrics`: the means
under the names ``metrics.jsonl`` shows. This module is the one table of those names:
:data:`TOKEN_MEANS` (what each token mean divides), the fields of :class:`StepMetrics`
(every name, in the order a row lists them), :func:`step_timing` (the step's
wall-clock entries after them), :func:`row_entries` (the trainer's prefixes)
and :data:`HEADLINE` (the top-level copies plots and warnings read).

The critic's value loss (``algo.name: ppo``) has the same kind of structure:
:class:`ValueSums` per micro-batch, :func:`finalise_value_step` into
:class:`ValueStepMetrics`, with :data:`VALUE_TOKEN_MEANS` its token means and
:data:`CRITIC_PREFIX` the prefix its names take in a row (``train/critic_<name>``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.losses.mismatch import lag_bucket_names, mismatch_stats

# Token means: metric name -> the sum over valid (loss) tokens it divides by their count.
# The first eight are decoupled_ppo_loss's statistics (``ppo_stats_from_terms``).
TOKEN_MEANS: dict[str, str] = {
    "clip_frac": "clipped",
    "dual_clip_frac": "dual_clipped",
    "cap_drop_frac": "cap_dropped",
    "behav_mask_frac": "behav_masked",
    "behav_trunc_frac": "behav_truncated",
    "behav_imp_weight_mean": "behav_imp_weight",
    "approx_kl": "approx_kl",
    "staleness_mean": "staleness",
    "entropy": "entropy",
    "logp_behav_abs_diff": "logp_behav_abs_diff",
    "logp_behav_kl": "logp_behav_kl",
}
# Maxima over valid tokens: combined by maximum, reported as they are.
MAXIMA = ("behav_imp_weight_max", "staleness_max")
# The PPO loss's own sums (``PPOLossTerms.stat_sums`` without versions).
PPO_SUMS = ("clipped", "dual_clipped", "cap_dropped", "behav_masked", "behav_truncated",
            "behav_imp_weight", "approx_kl")
MISMATCH_PREFIX = "mismatch/"  # rollout-training mismatch per lag keeps its own section
TRAIN_PREFIX = "train/"  # the rest of the learner's metrics in a metrics.jsonl row
# Top-level copies in a metrics.jsonl row (plots and dashboards read them): row key ->
# the learner's metric.
HEADLINE = (("logp_mismatch", "logp_behav_abs_diff"), ("clip_frac", "clip_frac"),
            ("cap_frac", "cap_drop_frac"), ("staleness_mean", "staleness_mean"),
            ("staleness_max", "staleness_max"))


class StepSums(NamedTuple):
    """Sums of micro-batches (fp32 scalars; a pytree the gradient program carries).

    ``loss`` and ``kl_ref`` sum each micro-batch's share of its minibatch's loss (their
    sum over a minibatch is that minibatch's loss); ``token_count`` counts valid (loss)
    tokens, ``n_tokens`` the tokens of sequences (not padding); the rest are sums over
    valid tokens (``TOKEN_MEANS``), maxima (``MAXIMA``), and the rollout-training
    mismatch's per-lag sums and maxima (``losses.mismatch.mismatch_terms``).
    """

    loss: jax.Array
    kl_ref: jax.Array
    token_count: jax.Array
    n_tokens: jax.Array
    clipped: jax.Array
    dual_clipped: jax.Array
    cap_dropped: jax.Array
    behav_masked: jax.Array
    behav_truncated: jax.Array
    behav_imp_weight: jax.Array
    approx_kl: jax.Array
    staleness: jax.Array
    entropy: jax.Array
    logp_behav_abs_diff: jax.Array
    logp_behav_kl: jax.Array
    behav_imp_weight_max: jax.Array
    staleness_max: jax.Array
    mismatch_sums: dict[str, jax.Array]
    mismatch_maxes: dict[str, jax.Array]

    @classmethod
    def zeros(cls) -> StepSums:
        """The sums of no micro-batch: the identity of :meth:`add`. Every leaf is its own
        buffer (the gradient program donates them)."""

        def zero() -> jax.Array:
            return jnp.zeros((), jnp.float32)

        names = lag_bucket_names()
        return cls(**{k: zero() for k in cls._fields[:-2]},
                   mismatch_sums={f"{n}_{s}": zero() for n in names
                                  for s in ("abs_diff", "kl", "count")},
                   mismatch_maxes={f"{n}_abs_diff_max": zero() for n in names})

    def add(self, other: StepSums) -> StepSums:
        """Field-wise: sums add, maxima take the maximum (on device, fp32)."""
        merged = {k: (jnp.maximum(a, b) if k in MAXIMA else a + b)
                  for k, a, b in zip(self._fields[:-2], self[:-2], other[:-2], strict=True)}
        return StepSums(**merged,
                        mismatch_sums={k: v + other.mismatch_sums[k]
                                       for k, v in self.mismatch_sums.items()},
                        mismatch_maxes={k: jnp.maximum(v, other.mismatch_maxes[k])
                                        for k, v in self.mismatch_maxes.items()})

    def host_floats(self) -> dict[str, float]:
        """Every sum as a host float, the mismatch ones under ``mismatch/``."""
        flat = {k: float(v) for k, v in zip(self._fields[:-2], self[:-2], strict=True)}
        for k, v in (self.mismatch_sums | self.mismatch_maxes).items():
            flat[MISMATCH_PREFIX + k] = float(v)
        return flat


def _is_max(key: str) -> bool:
    return key in MAXIMA or (key.startswith(MISMATCH_PREFIX) and key.endswith("_max"))


@dataclass(frozen=True)
class StepMetrics:
    """One learner step's metrics, finalised (host floats). The fields are the metric
    names, in the order :meth:`as_dict` (and so a metrics.jsonl row) lists them."""

    loss: float  # mean over minibatches of the minibatch loss
    kl_ref: float
    grad_norm: float  # mean over minibatches
    grad_norm_max: float
    clip_frac: float
    dual_clip_frac: float
    cap_drop_frac: float
    behav_mask_frac: float
    behav_trunc_frac: float
    behav_imp_weight_mean: float
    behav_imp_weight_max: float
    approx_kl: float
    staleness_mean: float
    staleness_max: float
    entropy: float
    logp_behav_abs_diff: float
    logp_behav_kl: float
    n_tokens: float
    n_loss_tokens: float
    n_minibatches: float
    skipped_steps: float  # minibatches whose update was skipped (non-finite gradient)
    lr: float
    # losses.mismatch.mismatch_stats of the step (listed as mismatch/<name>)
    mismatch: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """Name -> value, the mismatch statistics as ``mismatch/<name>`` in their place."""
        out: dict[str, float] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "mismatch":
                out.update({MISMATCH_PREFIX + k: v for k, v in value.items()})
            else:
                out[f.name] = value
        return out


def _optimizer_entries(grad_norms: Sequence[float], applied: Sequence[bool],
                       lr: float) -> dict[str, float]:
    """What a step's optimizer updates add to the policy's and the critic's metrics alike:
    the grad norm's mean and max over minibatches, their count, the skipped updates
    (non-finite gradient) and the last learning rate."""
    return {"grad_norm": float(np.mean(grad_norms)), "grad_norm_max": float(np.max(grad_norms)),
            "n_minibatches": float(len(grad_norms)),
            "skipped_steps": float(sum(1 for ok in applied if not ok)), "lr": lr}


def finalise_step(per_step: Sequence[StepSums], grad_norms: Sequence[float],
                  applied: Sequence[bool], lr: float) -> StepMetrics:
    """The metrics of a step from each minibatch's sums, gradient norm and whether its
    update was applied. Minibatches combine on the host in float64 (sums add, maxima
    take the maximum); token means divide by the step's valid-token count (at least 1)."""
    total: dict[str, float] = {}
    for sums in per_step:
        for k, new in sums.host_floats().items():
            old = total.get(k, 0.0)
            total[k] = max(old, new) if _is_max(k) else old + new
    n_steps = len(per_step)
    count = max(total["token_count"], 1.0)
    means = {name: total[src] / count for name, src in TOKEN_MEANS.items()}
    mismatch = {k[len(MISMATCH_PREFIX):]: v for k, v in total.items()
                if k.startswith(MISMATCH_PREFIX)}
    return StepMetrics(
        loss=total["loss"] / n_steps,
        kl_ref=total["kl_ref"] / n_steps,
        **means,
        **{name: total[name] for name in MAXIMA},
        n_tokens=total["n_tokens"] / 1.0,
        n_loss_tokens=total["token_count"],
        **_optimizer_entries(grad_norms, applied, lr),
        mismatch=mismatch_stats(mismatch, mismatch),
    )


def step_timing(metrics: Mapping[str, float], *, prox_logp_recomputed: bool,
                n_micro_batches: int, step_time_s: float) -> dict[str, float]:
    """The entries a learner step adds after its :class:`StepMetrics` (they follow them in
    a row): whether prox_logp was recomputed, the micro-batch count, the wall-clock
    seconds and the tokens per second (``metrics["n_tokens"]`` over them)."""
    return {"prox_logp_recomputed": float(prox_logp_recomputed),
            "n_micro_batches": float(n_micro_batches),
            "step_time_s": step_time_s,
            "tokens_per_s": metrics["n_tokens"] / max(step_time_s, 1e-9)}


def row_entries(metrics: Mapping[str, float]) -> dict[str, float]:
    """The learner's metrics (``StepMetrics.as_dict()`` and any extra, e.g. the critic's)
    as metrics.jsonl entries: ``mismatch/*`` as they are, the rest under ``train/``."""
    return {(k if k.startswith(MISMATCH_PREFIX) else TRAIN_PREFIX + k): v
            for k, v in metrics.items()}


def headline(metrics: Mapping[str, float]) -> dict[str, float]:
    """The top-level copies of ``HEADLINE`` (NaN for a metric the step lacks)."""
    return {key: metrics.get(name, float("nan")) for key, name in HEADLINE}


# ----------------------------------------------------------------------------- the critic
# The critic's token means: metric name -> the ValueSums field it divides by the count of
# valid (loss) tokens.
VALUE_TOKEN_MEANS: dict[str, str] = {
    "value_clip_frac": "value_clipped",
    "value_mean": "value_sum",
    "value_abs_error": "value_abs_error",
    "returns_mean": "returns_sum",
}
CRITIC_PREFIX = "critic_"  # the critic's metrics in a row: train/critic_<name>


class ValueSums(NamedTuple):
    """Sums of micro-batches of the critic's value loss (fp32 scalars; a pytree its
    gradient program carries).

    ``value_loss`` sums each micro-batch's share of its minibatch's value loss;
    ``token_count`` counts valid (loss) tokens, ``n_tokens`` the tokens of sequences; the
    rest are sums over valid tokens: of the value-clip indicator, the values, |R - V|, the
    returns R and R², and the errors R - V and (R - V)² (V as predicted before the update).
    """

    value_loss: jax.Array
    token_count: jax.Array
    n_tokens: jax.Array
    value_clipped: jax.Array
    value_sum: jax.Array
    value_abs_error: jax.Array
    returns_sum: jax.Array
    returns_sq_sum: jax.Array
    error_sum: jax.Array
    error_sq_sum: jax.Array

    @classmethod
    def zeros(cls) -> ValueSums:
        """The sums of no micro-batch: the identity of :meth:`add` (each leaf its own buffer)."""
        return cls(*(jnp.zeros((), jnp.float32) for _ in cls._fields))

    def add(self, other: ValueSums) -> ValueSums:
        """Field-wise sums (on device, fp32)."""
        return ValueSums(*(a + b for a, b in zip(self, other, strict=True)))


@dataclass(frozen=True)
class ValueStepMetrics:
    """One critic step's metrics, finalised (host floats). The fields are the metric names,
    in the order :meth:`as_dict` lists them (a row shows them as ``train/critic_<name>``)."""

    value_loss: float  # mean over minibatches of the minibatch value loss
    value_clip_frac: float
    value_mean: float
    value_abs_error: float
    returns_mean: float
    # 1 - Var(R - V) / Var(R) over loss tokens, V as predicted before each update (NaN
    # when the returns do not vary).
    explained_variance: float
    grad_norm: float  # mean over minibatches
    grad_norm_max: float
    n_tokens: float
    n_loss_tokens: float
    n_minibatches: float
    skipped_steps: float  # minibatches whose update was skipped (non-finite gradient)
    lr: float

    def as_dict(self) -> dict[str, float]:
        """Name -> value, in field order."""
        return dataclasses.asdict(self)


def finalise_value_step(per_step: Sequence[ValueSums], grad_norms: Sequence[float],
                        applied: Sequence[bool], lr: float) -> ValueStepMetrics:
    """The critic's metrics of a step from each minibatch's sums, gradient norm and whether
    its update was applied. Minibatches add on the host in float64; token means divide by
    the step's valid-token count (at least 1)."""
    total = {k: sum(float(getattr(s, k)) for s in per_step) for k in ValueSums._fields}
    count = max(total["token_count"], 1.0)
    returns_var = total["returns_sq_sum"] / count - (total["returns_sum"] / count) ** 2
    error_var = total["error_sq_sum"] / count - (total["error_sum"] / count) ** 2
    return ValueStepMetrics(
        value_loss=total["value_loss"] / len(per_step),
        **{name: total[src] / count for name, src in VALUE_TOKEN_MEANS.items()},
        explained_variance=(1.0 - error_var / returns_var if returns_var > 1e-8
                            else float("nan")),
        n_tokens=total["n_tokens"],
        n_loss_tokens=total["token_count"],
        **_optimizer_entries(grad_norms, applied, lr),
    )


def critic_entries(metrics: Mapping[str, float]) -> dict[str, float]:
    """The critic's step metrics under their names in the learner's metrics
    (``critic_<name>``; :func:`row_entries` then adds ``train/``)."""
    return {CRITIC_PREFIX + k: v for k, v in metrics.items()}
