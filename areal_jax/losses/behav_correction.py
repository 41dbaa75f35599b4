"""Corrections of the behaviour importance weight for rollout-training mismatch.

The engine that sampled a token (the behaviour policy mu) and the learner never agree
exactly: precision, kernels, and, for stale tokens, older weights. The correction acts on
the token's importance ratio against the behaviour policy,

    rho_t = exp(target_logp_t - behav_logp_t)

where the target is the proximal policy (decoupled loss: rho_t is the behaviour weight
w_t) or, with the decoupled loss off, the current policy (a constant: rho_t is the value
of the PPO ratio). Each mode gives a corrected weight W_t and a keep mask:

==============  ======================================================================
``none``        W_t = rho_t
``cap``         W_t = rho_t; tokens with rho_t > C are masked (AReaL's drop cap)
``tis``         W_t = min(rho_t, C) (truncated importance sampling)
``icepop``      W_t = rho_t; tokens with rho_t outside [low, high] are masked (IcePop)
``seq_tis``     W_t = min(prod_{u in s} rho_u, C) for every token t of sequence s
``seq_tis_geo`` W_t = min(exp(mean_{u in s} log rho_u), C) (geometric mean)
``seq_mask``    W_t = rho_t; whole sequences with prod_{u in s} rho_u outside [low, high]
                are masked
``seq_mask_geo`` W_t = rho_t; whole sequences whose geometric mean ratio is outside
                [low, high] are masked
==============  ======================================================================

Products and means run over the valid tokens of a sequence (a row, or a packed segment)
and are computed in log space, so a long sequence's product cannot overflow. A masked
token has no loss and no gradient; a truncated one keeps its gradient with a smaller
weight.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp

from areal_jax.losses.segments import SequenceLayout, sequence_sum, to_tokens

BehavCorrectionMode = Literal["none", "cap", "tis", "icepop", "seq_tis", "seq_tis_geo",
                              "seq_mask", "seq_mask_geo"]
BEHAV_CORRECTIONS: tuple[str, ...] = get_args(BehavCorrectionMode)
CAPPED_CORRECTIONS = ("cap", "tis", "seq_tis", "seq_tis_geo")  # take C
BAND_CORRECTIONS = ("icepop", "seq_mask", "seq_mask_geo")  # take [low, high]
SEQUENCE_CORRECTIONS = ("seq_tis", "seq_tis_geo", "seq_mask", "seq_mask_geo")


class BehavCorrection(NamedTuple):
    """The correction of one [B, T] batch.

    Attributes:
        log_weight_bt: log W_t on kept tokens, 0 elsewhere.
        keep_bt: valid tokens that are not masked.
        truncated_bt: kept tokens whose (token or sequence) weight was cut to C.
        masked_bt: valid tokens masked by the correction.
    """

    log_weight_bt: jax.Array
    keep_bt: jax.Array
    truncated_bt: jax.Array
    masked_bt: jax.Array


def behav_correction(log_ratio_bt: jax.Array, mask_bt: jax.Array, mode: str, *,
                     cap: float | None = None, low: float | None = None,
                     high: float | None = None,
                     layout: SequenceLayout | None = None) -> BehavCorrection:
    """The corrected weights of mode ``mode`` (module docstring).

    Args:
        log_ratio_bt: [B, T] fp32 log rho_t = target_logp - behav_logp (no gradient; any
            value on invalid tokens, which are ignored).
        mask_bt: [B, T] bool, the valid tokens.
        mode: one of ``BEHAV_CORRECTIONS``.
        cap: C of the modes in ``CAPPED_CORRECTIONS``.
        low, high: the band of the modes in ``BAND_CORRECTIONS``.
        layout: the sequences (``segments.sequence_layout``); required by sequence modes.

    Arguments are checked by the loss that calls this (``decoupled_ppo_loss``).
    """
    log_rho = jax.lax.stop_gradient(jnp.where(mask_bt, log_ratio_bt, 0.0))
    no = jnp.zeros_like(mask_bt)
    if mode == "none":
        return BehavCorrection(log_rho, mask_bt, no, no)
    if mode in SEQUENCE_CORRECTIONS:
        if layout is None:
            raise ValueError(f"behav_correction: mode {mode!r} needs the sequences (layout)")
        log_seq_s = sequence_sum(log_rho, layout)
        if mode.endswith("_geo"):
            count_s = sequence_sum(mask_bt.astype(jnp.float32), layout)
            log_seq_s = log_seq_s / jnp.maximum(count_s, 1.0)
        log_stat_bt = to_tokens(log_seq_s, layout)
    else:
        log_stat_bt = log_rho
    # exp may be inf for a long sequence's product; comparisons with inf are exact.
    stat_bt = jnp.exp(log_stat_bt)
    if mode in BAND_CORRECTIONS:
        if low is None or high is None:
            raise ValueError(f"behav_correction: mode {mode!r} needs low and high, its band")
        keep = mask_bt & (stat_bt >= low) & (stat_bt <= high)
        return BehavCorrection(jnp.where(keep, log_rho, 0.0), keep, no, mask_bt & ~keep)
    if cap is None:
        raise ValueError(f"behav_correction: mode {mode!r} needs cap, its C")
    if mode == "cap":
        keep = mask_bt & (stat_bt <= cap)
        return BehavCorrection(jnp.where(keep, log_rho, 0.0), keep, no, mask_bt & ~keep)
    # tis, seq_tis, seq_tis_geo: the weight (token or sequence) truncated at C.
    log_cap = jnp.log(jnp.float32(cap))
    truncated = mask_bt & (log_stat_bt > log_cap)
    log_w = jnp.where(mask_bt, jnp.minimum(log_stat_bt, log_cap), 0.0)
    return BehavCorrection(log_w, mask_bt, truncated, no)
