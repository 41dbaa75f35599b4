"""The decoupled PPO objective (AReaL, arXiv 2505.24298), per token t with mask m_t:

    w_t = exp(prox_logp - behav_logp)             behaviour importance weight, a constant
    r_t = exp(logp - prox_logp)                   trust-region ratio
    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_higher))
    l_t = min(l_t, c_clip |A_t|)  where A_t < 0   dual clip, if c_clip is set
    m'_t = m_t and w_t <= behav_imp_weight_cap     cap, if set: heavier tokens are dropped
    loss = sum_t m'_t w_t l_t / sum_t m_t         ("token-mean"; other modes below)

With prox_logp == behav_logp this is standard clipped PPO.

``objective`` replaces the clipped surrogate l_t (everything else, w_t, the behaviour
correction, the aggregation, stays):

- ``ppo``: the clipped surrogate above.
- ``cispo`` (MiniMax-M1, arXiv 2506.13585): l_t = -sg(clip(r_t, 1 - eps_clip,
  1 + eps_clip_higher)) A_t logp_t, a REINFORCE term weighted by the clipped importance
  ratio as a constant: no token loses its gradient, the weight is only bounded.
- ``sapo`` (Qwen, arXiv 2511.20347): l_t = -f(r_t) A_t, f(r) = (4 / tau) sigmoid(tau (r - 1))
  with tau = sapo_tau_pos where A_t > 0, else sapo_tau_neg: a soft gate whose gradient,
  4 s (1 - s) r grad logp (s = the sigmoid), is PPO's at r = 1 and decays smoothly away
  from it instead of being cut.

``ratio_level="sequence"`` works with each: r_t is then the sequence's geometric-mean
ratio (GSPO; SAPO's sequence-level gate, CISPO's sequence-level weight).

The knobs are one frozen :class:`PPOLossConfig` and the [B, T] arrays one
:class:`PPOInputs`; :func:`decoupled_ppo_loss_terms` ``(inputs, config)`` is the one
implementation, :func:`decoupled_ppo_loss` a thin wrapper that takes the knobs as keywords.

``behav_correction`` generalises the cap (``areal_jax.losses.behav_correction``): it
replaces w_t by a corrected weight W_t (truncated: TIS; token or sequence level) or masks
tokens (IcePop band, sequence masks). Its ratio is rho_t = exp(prox_logp - behav_logp) =
w_t. With ``prox_logp=None`` (the decoupled loss off) the PPO ratio r_t = exp(logp -
behav_logp) is itself the importance ratio against the behaviour policy: the correction
then takes rho_t = r_t as a constant and multiplies l_t by W_t / rho_t, so at the current
parameters the token's effective weight is W_t (TIS: min(r_t, C)).

Aggregation (``agg_mode``), sequences being rows or packed segments (see ``segments``):

- ``token-mean``: sum_t m'_t w_t l_t / sum_t m_t (the global valid-token count).
- ``seq-mean-token-mean``: mean over sequences of (sum_{t in s} m' w l / sum_{t in s} m);
  sequences without valid tokens are not counted.
- ``seq-mean-token-sum``: mean over sequences of (sum_{t in s} m' w l / L) with a constant
  L = ``seq_token_sum_normalizer`` (Dr.GRPO: e.g. the max generation length).

``ratio_level="sequence"`` (GSPO): r_t is replaced, for every token of a sequence, by the
geometric mean of the per-token ratios of its non-dropped valid tokens,
exp(mean_{t in s} (logp_t - prox_logp_t)); gradients flow through that mean.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from areal_jax.losses import _checks
from areal_jax.losses.behav_correction import (
    BAND_CORRECTIONS,
    BEHAV_CORRECTIONS,
    CAPPED_CORRECTIONS,
    SEQUENCE_CORRECTIONS,
    BehavCorrection,
)
from areal_jax.losses.behav_correction import behav_correction as correct_behav_weight
from areal_jax.losses.segments import (
    AGG_MODES,
    SequenceLayout,
    sequence_count,
    sequence_layout,
    sequence_sum,
    to_tokens,
)
from areal_jax.losses.step_metrics import MAXIMA, PPO_SUMS, TOKEN_MEANS

RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
Objective = Literal["ppo", "cispo", "sapo"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)

_FN = "decoupled_ppo_loss"


@dataclass(frozen=True)
class PPOLossConfig:
    """The decoupled PPO loss's knobs (formula in the module docstring), validated on
    construction. Frozen and hashable: a static argument of ``jax.jit``.

    Attributes:
        eps_clip: lower (and default upper) clip range, in (0, 1).
        eps_clip_higher: upper clip range (DAPO "clip-higher"); None = eps_clip.
        c_clip: dual-clip constant c > 1 (only affects A < 0); None disables.
        behav_imp_weight_cap: drop tokens whose behaviour weight w exceeds it; None keeps all.
            The same as ``behav_correction="cap"`` with ``behav_correction_cap`` = it, except
            with ``prox_logp=None``, where it caps w = 1 (as it always did).
        behav_correction: one of ``BEHAV_CORRECTIONS`` (see the module docstring and
            ``areal_jax.losses.behav_correction``); None: "cap" when
            ``behav_imp_weight_cap`` is set, else "none".
        behav_correction_cap: C (> 0) of "cap", "tis", "seq_tis", "seq_tis_geo".
        behav_correction_low, behav_correction_high: the band 0 <= low < high of "icepop",
            "seq_mask", "seq_mask_geo".
        agg_mode: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum".
        seq_token_sum_normalizer: the constant L of "seq-mean-token-sum" (required there).
        ratio_level: "token" (PPO) or "sequence" (GSPO geometric-mean ratio).
        objective: "ppo" (clipped surrogate), "cispo" or "sapo" (module docstring).
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (> 0) for A > 0 and A <= 0.
    """

    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    c_clip: float | None = None
    behav_imp_weight_cap: float | None = None
    behav_correction: str | None = None
    behav_correction_cap: float | None = None
    behav_correction_low: float | None = None
    behav_correction_high: float | None = None
    agg_mode: str = "token-mean"
    seq_token_sum_normalizer: float | None = None
    ratio_level: str = "token"
    objective: str = "ppo"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def __post_init__(self) -> None:
        _check_hparams(self)
        self.correction()  # checks the correction's mode and bounds

    def correction(self) -> tuple[str, float | None]:
        """The behaviour correction's mode and its C (``behav_imp_weight_cap`` is the cap
        mode's C)."""
        return _resolve_correction(self.behav_correction, self.behav_correction_cap,
                                   self.behav_correction_low, self.behav_correction_high,
                                   self.behav_imp_weight_cap)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class PPOInputs:
    """The per-token inputs of the decoupled PPO loss: [B, T] arrays (bf16 or fp32 where
    floating; everything is computed in fp32), passed by keyword. A pytree whose only
    static part is ``max_segments``.

    Attributes:
        logp: log-probs of the taken tokens under the parameters being trained.
        behav_logp: behaviour-policy log-probs recorded at generation time.
        advantages: per-token advantages.
        loss_mask: 1 on tokens to train on (bool, int or float 0/1).
        prox_logp: proximal-policy log-probs (recomputed by the learner before the
            update, no gradient). None means prox = behav (standard PPO, w = 1).
        versions: optional int, the weight version that generated each token.
        current_version: the learner's version (a scalar); required with ``versions``.
        segment_ids: optional int for packed rows (0 = padding, 1.. = sequence number
            within the row). Padding tokens are treated as masked.
        max_segments: static bound on ``segment_ids``; required under jit with segment_ids.
    """

    logp: ArrayLike
    behav_logp: ArrayLike
    advantages: ArrayLike
    loss_mask: ArrayLike
    prox_logp: ArrayLike | None = None
    versions: ArrayLike | None = None
    current_version: ArrayLike | None = None
    segment_ids: ArrayLike | None = None
    max_segments: int | None = dataclasses.field(default=None, metadata={"static": True})


class PPOLossTerms(NamedTuple):
    """Sums and counts of the decoupled PPO loss for one micro-batch (all fp32 scalars).

    The loss of the whole minibatch is ``sum(loss_sum) / sum(denominator)`` where both
    sums run over every micro-batch and data shard. ``loss_sum`` carries the gradient.

    Attributes:
        loss_sum: the numerator: sum_t m'_t w_t l_t (token-mean), sum over sequences of
            the per-sequence token mean (seq-mean-token-mean), or sum_t m'_t w_t l_t / L
            (seq-mean-token-sum).
        denominator: the valid-token count (token-mean) or the number of sequences with
            at least one valid token (seq-mean-*). Never clamped here.
        token_count: the valid-token count, the denominator of every token statistic.
        stat_sums: sums over valid tokens: ``clipped``, ``dual_clipped``, ``cap_dropped``,
            ``behav_masked``, ``behav_truncated`` (0/1 flags), ``behav_imp_weight``,
            ``approx_kl`` and, with versions, ``staleness``. Combine across micro-batches by adding.
        stat_maxes: ``behav_imp_weight_max`` and, with versions, ``staleness_max`` (0 when
            there are no valid tokens). Combine by taking the maximum.
    """

    loss_sum: jax.Array
    denominator: jax.Array
    token_count: jax.Array
    stat_sums: dict[str, jax.Array]
    stat_maxes: dict[str, jax.Array]


class _Tokens(NamedTuple):
    """The checked per-token inputs, fp32 (the mask bool)."""

    logp_bt: jax.Array
    prox_bt: jax.Array
    behav_bt: jax.Array
    adv_bt: jax.Array
    mask_bt: jax.Array
    version_bt: jax.Array | None


def decoupled_ppo_loss_terms(inputs: PPOInputs, config: PPOLossConfig) -> PPOLossTerms:
    """The "sum and count" form of the decoupled PPO loss: the one implementation.

    Use it when one loss is spread over micro-batches or data shards: the minibatch
    loss is ``sum(terms.loss_sum) / sum(terms.denominator)``. Because the denominator
    does not depend on the parameters, compute it first (``loss_denominator``, summed
    over micro-batches and shards) and differentiate ``terms.loss_sum / global_denominator``
    per micro-batch; the accumulated gradients are those of the whole minibatch.
    Aggregate statistics with :func:`combine_ppo_terms` and :func:`ppo_stats_from_terms`.
    """
    tok = _check_inputs(inputs)
    mode, cap = config.correction()
    needs_sequences = (config.agg_mode != "token-mean" or config.ratio_level == "sequence"
                       or inputs.segment_ids is not None or mode in SEQUENCE_CORRECTIONS)
    layout = (sequence_layout(tok.logp_bt.shape, inputs.segment_ids, inputs.max_segments,
                              fn=_FN) if needs_sequences else None)
    mask_bt = tok.mask_bt
    if layout is not None and inputs.segment_ids is not None:
        mask_bt = mask_bt & layout.in_sequence_bt  # padding (segment id 0) is never valid

    # Behaviour weight (a constant) and its correction. Log differences are masked before
    # exp so garbage on invalid tokens can never produce inf or NaN (not even in gradients).
    behav_log_w = jax.lax.stop_gradient(jnp.where(mask_bt, tok.prox_bt - tok.behav_bt, 0.0))
    # The correction's ratio: against prox (decoupled), else against the current policy.
    # behav_imp_weight_cap keeps its meaning: it caps w = exp(prox - behav), which is 1 with
    # prox_logp=None. behav_correction's ratio is the current policy's there.
    against_current = inputs.prox_logp is None and config.behav_imp_weight_cap is None
    log_rho = behav_log_w if not against_current else jax.lax.stop_gradient(
        jnp.where(mask_bt, tok.logp_bt - tok.behav_bt, 0.0))
    corr = correct_behav_weight(log_rho, mask_bt, mode, cap=cap,
                                low=config.behav_correction_low,
                                high=config.behav_correction_high, layout=layout)
    keep_bt = corr.keep_bt
    # The weight applied to l_t: W_t (decoupled: behav_log_w == log_rho), else W_t / rho_t.
    applied_w = jnp.exp(jnp.where(keep_bt, corr.log_weight_bt - log_rho + behav_log_w, 0.0))

    log_ratio = jnp.where(keep_bt, tok.logp_bt - tok.prox_bt, 0.0)
    if config.ratio_level == "sequence":
        assert layout is not None  # needs_sequences
        kept_s = sequence_sum(keep_bt.astype(jnp.float32), layout)
        mean_log_ratio_s = sequence_sum(log_ratio, layout) / jnp.maximum(kept_s, 1.0)
        log_ratio = jnp.where(keep_bt, to_tokens(mean_log_ratio_s, layout), 0.0)
    ratio = jnp.exp(log_ratio)

    adv_bt = tok.adv_bt
    high = config.eps_clip if config.eps_clip_higher is None else config.eps_clip_higher
    if config.objective == "cispo":
        # A constant weight sg(clip(r)) on the REINFORCE term A logp: gradient w A grad logp.
        low_r, high_r = 1.0 - config.eps_clip, 1.0 + high
        weight = jax.lax.stop_gradient(jnp.clip(ratio, low_r, high_r))
        token_loss = -adv_bt * weight * jnp.where(keep_bt, tok.logp_bt, 0.0)
        clipped = keep_bt & ((ratio < low_r) | (ratio > high_r))
    elif config.objective == "sapo":
        tau = jnp.where(adv_bt > 0, config.sapo_tau_pos, config.sapo_tau_neg)
        gate = (4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0))
        token_loss = -adv_bt * gate
        clipped = jnp.zeros_like(keep_bt)  # a soft gate: nothing is cut
    else:
        loss_unclipped = -adv_bt * ratio
        loss_clipped = -adv_bt * jnp.clip(ratio, 1.0 - config.eps_clip, 1.0 + high)
        token_loss = jnp.maximum(loss_unclipped, loss_clipped)
        clipped = keep_bt & (loss_clipped > loss_unclipped)
    if config.c_clip is not None:
        dual_bound = config.c_clip * jnp.abs(adv_bt)
        dual_clipped = keep_bt & (adv_bt < 0) & (token_loss > dual_bound)
        token_loss = jnp.where(adv_bt < 0, jnp.minimum(token_loss, dual_bound), token_loss)
    else:
        dual_clipped = jnp.zeros_like(keep_bt)
    weighted_loss = jnp.where(keep_bt, applied_w * token_loss, 0.0)

    token_count = jnp.sum(mask_bt).astype(jnp.float32)
    loss_sum, denominator = _aggregate(weighted_loss, mask_bt, token_count, layout, config)
    stat_sums, stat_maxes = _stat_terms(
        tok, inputs.current_version, mask_bt, jnp.exp(behav_log_w), corr,
        cap_dropped=corr.masked_bt if mode == "cap" else jnp.zeros_like(mask_bt),
        clipped=clipped, dual_clipped=dual_clipped)
    return PPOLossTerms(loss_sum, denominator, token_count, stat_sums, stat_maxes)


def _check_inputs(inputs: PPOInputs) -> _Tokens:
    """The per-token inputs, checked (dtype, shape) and cast to fp32 (the mask to bool)."""
    fn = _FN
    logp_bt = _checks.float_input(fn, "logp", inputs.logp)
    _checks.ndim(fn, "logp", logp_bt, 2, "[B, T]")
    behav_bt = _checks.float_input(fn, "behav_logp", inputs.behav_logp)
    prox_bt = (behav_bt if inputs.prox_logp is None
               else _checks.float_input(fn, "prox_logp", inputs.prox_logp))
    adv_bt = _checks.float_input(fn, "advantages", inputs.advantages)
    mask_bt = _checks.mask_input(fn, "loss_mask", inputs.loss_mask)
    version_bt = (None if inputs.versions is None
                  else _checks.int_input(fn, "versions", inputs.versions))
    _checks.same_shape(fn, "logp", logp_bt, prox_logp=prox_bt, behav_logp=behav_bt,
                       advantages=adv_bt, loss_mask=mask_bt, versions=version_bt)
    if version_bt is not None and inputs.current_version is None:
        raise ValueError(f"{fn}: versions given without current_version (the learner's version)")
    return _Tokens(logp_bt, prox_bt, behav_bt, adv_bt, mask_bt, version_bt)


def _aggregate(weighted_loss: jax.Array, mask_bt: jax.Array, token_count: jax.Array,
               layout: SequenceLayout | None, config: PPOLossConfig
               ) -> tuple[jax.Array, jax.Array]:
    """(loss_sum, denominator) of ``config.agg_mode`` (module docstring)."""
    if config.agg_mode == "token-mean":
        return jnp.sum(weighted_loss), token_count
    assert layout is not None  # every seq-mean mode needs the sequences
    if config.agg_mode == "seq-mean-token-mean":
        tokens_s = sequence_sum(mask_bt.astype(jnp.float32), layout)
        loss_sum = jnp.sum(sequence_sum(weighted_loss, layout) / jnp.maximum(tokens_s, 1.0))
        return loss_sum, sequence_count(mask_bt, layout)
    # seq-mean-token-sum
    loss_sum = jnp.sum(weighted_loss) / jnp.float32(config.seq_token_sum_normalizer)
    return loss_sum, sequence_count(mask_bt, layout)


def _stat_terms(tok: _Tokens, current_version: ArrayLike | None, mask_bt: jax.Array,
                behav_w: jax.Array, corr: BehavCorrection, *, cap_dropped: jax.Array,
                clipped: jax.Array, dual_clipped: jax.Array
                ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The statistics' sums over valid tokens and maxima (no gradient)."""
    stat_log_ratio = jax.lax.stop_gradient(jnp.where(mask_bt, tok.logp_bt - tok.prox_bt, 0.0))
    approx_kl = jnp.expm1(stat_log_ratio) - stat_log_ratio  # k3 estimate of KL(prox || pi)
    valid_w = jnp.where(mask_bt, behav_w, 0.0)
    stat_sums = {
        "clipped": jnp.sum(clipped).astype(jnp.float32),
        "dual_clipped": jnp.sum(dual_clipped).astype(jnp.float32),
        "cap_dropped": jnp.sum(cap_dropped).astype(jnp.float32),
        "behav_masked": jnp.sum(corr.masked_bt).astype(jnp.float32),
        "behav_truncated": jnp.sum(corr.truncated_bt).astype(jnp.float32),
        "behav_imp_weight": jnp.sum(valid_w),
        "approx_kl": jnp.sum(jnp.where(mask_bt, approx_kl, 0.0)),
    }
    stat_maxes = {"behav_imp_weight_max": jnp.max(valid_w, initial=0.0)}
    if tok.version_bt is not None:
        staleness = (jnp.asarray(current_version, jnp.float32)
                     - tok.version_bt.astype(jnp.float32))
        staleness = jnp.where(mask_bt, staleness, 0.0)
        stat_sums["staleness"] = jnp.sum(staleness)
        stat_maxes["staleness_max"] = jnp.max(staleness, initial=0.0)
    return stat_sums, stat_maxes


def empty_ppo_terms(with_staleness: bool = False) -> PPOLossTerms:
    """Terms of an empty micro-batch: the identity of :func:`combine_ppo_terms` (e.g. the
    initial carry of a ``lax.scan`` over micro-batches)."""
    zero = jnp.zeros((), jnp.float32)
    sums = dict.fromkeys(PPO_SUMS, zero)
    maxes = {"behav_imp_weight_max": zero}
    if with_staleness:
        sums["staleness"] = zero
        maxes["staleness_max"] = zero
    return PPOLossTerms(zero, zero, zero, sums, maxes)


def combine_ppo_terms(a: PPOLossTerms, b: PPOLossTerms) -> PPOLossTerms:
    """Merge the terms of two micro-batches: sums and counts add, maxima take the max."""
    return PPOLossTerms(
        a.loss_sum + b.loss_sum,
        a.denominator + b.denominator,
        a.token_count + b.token_count,
        {k: a.stat_sums[k] + b.stat_sums[k] for k in a.stat_sums},
        {k: jnp.maximum(a.stat_maxes[k], b.stat_maxes[k]) for k in a.stat_maxes},
    )


def ppo_stats_from_terms(terms: PPOLossTerms) -> dict[str, jax.Array]:
    """Turn (possibly combined) terms into the statistics dict of :func:`decoupled_ppo_loss`:
    the token means of ``step_metrics.TOKEN_MEANS`` and the ``MAXIMA`` the terms have."""
    count = jnp.maximum(terms.token_count, 1.0)
    sums = jax.lax.stop_gradient(terms.stat_sums)
    stats = {name: sums[src] / count for name, src in TOKEN_MEANS.items() if src in sums}
    stats.update({name: jax.lax.stop_gradient(terms.stat_maxes[name]) for name in MAXIMA
                  if name in terms.stat_maxes})
    return stats


_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(PPOLossConfig))


def decoupled_ppo_loss(
    logp: ArrayLike,
    prox_logp: ArrayLike | None,
    behav_logp: ArrayLike,
    advantages: ArrayLike,
    loss_mask: ArrayLike,
    *,
    versions: ArrayLike | None = None,
    current_version: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    max_segments: int | None = None,
    normalizer: ArrayLike | None = None,
    config: PPOLossConfig | None = None,
    **knobs: Any,  # PPOLossConfig's fields (eps_clip=..., agg_mode=...), values of mixed types
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO loss (formula in the module docstring) and its statistics: a thin
    wrapper over :func:`decoupled_ppo_loss_terms` for a loss computed in one piece.

    Args:
        logp, prox_logp, behav_logp, advantages, loss_mask, versions, current_version,
            segment_ids, max_segments: as in :class:`PPOInputs` ([B, T] arrays).
        normalizer: the count to divide by instead of the local one: the global count of
            a minibatch split into micro-batches and data shards (see ``loss_denominator``).
            Like the local count it is clamped to >= 1.
        config: the loss's knobs as a :class:`PPOLossConfig`; or give them one by one as
            keywords (``eps_clip=0.2, agg_mode="seq-mean-token-mean"``), not both.

    Returns:
        ``(loss, stats)``: ``loss`` is an fp32 scalar (0 when nothing is valid); ``stats``
        maps names to fp32 scalars, all without gradient, all over valid tokens
        (``loss_mask != 0``):

        - ``clip_frac``: fraction of valid tokens whose clipped branch is active (their
          ratio gradient is cut by eps_clip / eps_clip_higher); with ``objective="cispo"``
          those whose weight was clipped, with ``"sapo"`` 0 (no hard clip);
        - ``dual_clip_frac``: fraction of valid tokens capped by the dual clip;
        - ``cap_drop_frac``: fraction of valid tokens dropped because w > cap (dropped
          tokens count as neither clipped nor dual-clipped);
        - ``behav_mask_frac`` / ``behav_trunc_frac``: fractions of valid tokens masked /
          with their weight truncated by ``behav_correction`` (the cap's drops included);
        - ``behav_imp_weight_mean`` / ``behav_imp_weight_max``: w over valid tokens,
          including dropped ones;
        - ``approx_kl``: mean of the k3 estimator (r - 1) - log r, r = exp(logp - prox_logp),
          an estimate of KL(prox || pi); >= 0 and 0 when logp == prox_logp;
        - with ``versions``: ``staleness_mean`` / ``staleness_max`` of
          ``current_version - versions`` over valid tokens (0 when none are valid).
    """
    unknown = sorted(set(knobs) - set(_CONFIG_KEYS))
    if unknown:
        raise TypeError(f"{_FN}: unknown keyword(s) {unknown}; the loss's knobs are "
                        f"{list(_CONFIG_KEYS)}")
    if config is not None and knobs:
        raise TypeError(f"{_FN}: give config or the knobs {sorted(knobs)} as keywords, "
                        "not both")
    config = PPOLossConfig(**knobs) if config is None else config
    inputs = PPOInputs(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp,
                       advantages=advantages, loss_mask=loss_mask, versions=versions,
                       current_version=current_version, segment_ids=segment_ids,
                       max_segments=max_segments)
    terms = decoupled_ppo_loss_terms(inputs, config)
    if normalizer is None:
        denominator = jnp.maximum(terms.denominator, 1.0)
    else:
        _checks.in_range(_FN, "normalizer", normalizer, 0.0, float("inf"))
        # A count: max(., 1) turns an all-masked minibatch into loss 0 instead of 0/0.
        denominator = jnp.maximum(jnp.asarray(normalizer, jnp.float32), 1.0)
    return terms.loss_sum / denominator, ppo_stats_from_terms(terms)


def _resolve_correction(mode: str | None, cap: float | None, low: float | None,
                        high: float | None, legacy_cap: float | None
                        ) -> tuple[str, float | None]:
    """(mode, C) after checks; ``behav_imp_weight_cap`` is the cap mode's C."""
    fn = _FN
    if legacy_cap is not None:
        if mode not in (None, "cap"):
            raise ValueError(f"{fn}: behav_imp_weight_cap={legacy_cap!r} is the 'cap' "
                             f"correction; it contradicts behav_correction={mode!r} (use "
                             "behav_correction_cap)")
        if cap is not None and cap != legacy_cap:
            raise ValueError(f"{fn}: behav_imp_weight_cap={legacy_cap!r} and "
                             f"behav_correction_cap={cap!r} disagree; give one")
        mode, cap = "cap", legacy_cap
    mode = "none" if mode is None else mode
    _checks.choice(fn, "behav_correction", mode, BEHAV_CORRECTIONS)
    if mode in CAPPED_CORRECTIONS:
        if cap is None:
            raise ValueError(f"{fn}: behav_correction={mode!r} needs behav_correction_cap, "
                             "the C its weight is capped at (> 0, e.g. 2.0)")
        _checks.positive(fn, "behav_correction_cap", cap)
    if mode in BAND_CORRECTIONS:
        if low is None or high is None:
            raise ValueError(f"{fn}: behav_correction={mode!r} needs behav_correction_low "
                             "and behav_correction_high, the band of ratios it keeps "
                             "(e.g. 0.5 and 2.0)")
        _checks.in_range(fn, "behav_correction_low", low, 0.0, float("inf"))
        _checks.positive(fn, "behav_correction_high", high)
        if not low < high:
            raise ValueError(f"{fn}: behav_correction_low={low!r} must be < "
                             f"behav_correction_high={high!r}")
    return mode, cap


def _check_hparams(config: PPOLossConfig) -> None:
    fn = _FN
    eps_clip, eps_clip_higher, c_clip = config.eps_clip, config.eps_clip_higher, config.c_clip
    cap, agg_mode, ratio_level = config.behav_imp_weight_cap, config.agg_mode, config.ratio_level
    seq_norm = config.seq_token_sum_normalizer
    _checks.in_range(fn, "eps_clip", eps_clip, 0.0, 1.0, lo_open=True, hi_open=True)
    _checks.positive(fn, "eps_clip_higher", eps_clip_higher, allow_none=True)
    _checks.in_range(fn, "c_clip", c_clip, 1.0, float("inf"), lo_open=True, allow_none=True)
    _checks.positive(fn, "behav_imp_weight_cap", cap, allow_none=True)
    _checks.choice(fn, "agg_mode", agg_mode, AGG_MODES)
    _checks.choice(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    _checks.choice(fn, "objective", config.objective, OBJECTIVES)
    _checks.positive(fn, "sapo_tau_pos", config.sapo_tau_pos)
    _checks.positive(fn, "sapo_tau_neg", config.sapo_tau_neg)
    if config.objective != "ppo" and c_clip is not None:
        raise ValueError(f"{fn}: c_clip={c_clip!r} (dual clip) is PPO's; objective="
                         f"{config.objective!r} bounds its weight itself")
    if config.objective == "sapo" and eps_clip_higher is not None:
        raise ValueError(f"{fn}: eps_clip_higher={eps_clip_higher!r} is a hard clip; objective="
                         "'sapo' has none (its gates are sapo_tau_pos and sapo_tau_neg)")
    if agg_mode == "seq-mean-token-sum":
        if seq_norm is None:
            raise ValueError(
                f"{fn}: agg_mode='seq-mean-token-sum' needs seq_token_sum_normalizer, the "
                "constant token count each sequence sum is divided by (Dr.GRPO uses the max "
                "generation length)"
            )
        _checks.positive(fn, "seq_token_sum_normalizer", seq_norm)
    elif seq_norm is not None:
        raise ValueError(
            f"{fn}: seq_token_sum_normalizer={seq_norm!r} is only used with "
            f"agg_mode='seq-mean-token-sum', not {agg_mode!r}"
        )
