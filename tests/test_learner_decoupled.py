"""The learner's loss is the decoupled PPO formula, checked on batches where the behaviour
policy (the one that generated the tokens) differs from the proximal one (the learner's
weights before the update): with eta > 0 the two losses differ, by the amount the formula
says, from plain PPO's (proximal := behaviour). A learner that silently ran plain PPO
(prox_logp replaced by behav_logp anywhere on its path) fails here directly.

    decoupled: -mean_t  w_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)
               r_t = exp(logp_t - prox_t),  w_t = exp(prox_t - behav_t)
    plain PPO: the same with prox_t := behav_t (w_t = 1)
"""

from __future__ import annotations

import copy
import math

import jax
import numpy as np
import pytest

from areal_jax.learner import AlgoConfig, pack_trajectories
from areal_jax.parallel import make_mesh
from tests._learner_data import TINY, make_learner, random_advantages, random_trajectories
from tests.tolerance import (
    decoder_path_length,
    logprob_tolerance,
    network_tolerance,
    sum_tolerance,
)

EPS_CLIP = 0.2
SEQ_LEN = 48


def _batches() -> list:
    # behav_logp ~ log U(0.01, 0.3): far from the random model's ~log(1/128) logprobs.
    trajs = random_trajectories(5, 12, 40, max_version=0)
    return pack_trajectories(trajs, random_advantages(5, trajs), seq_len=SEQ_LEN,
                             rows_per_micro_batch=4)


def _flat(batches: list, key: str, arrays: list | None = None) -> np.ndarray:
    values = arrays if arrays is not None else [getattr(b, key) for b in batches]
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in values])


def _formula(logp, prox, behav, adv, mask, *, decoupled: bool) -> tuple[float, float]:
    """(loss, Σ_t |term_t| / n): the loss by the formula in float64, and the magnitude of
    its terms (for the rounding bound)."""
    if not decoupled:
        prox = behav
    r, w = np.exp(logp - prox), np.exp(prox - behav)
    term = w * np.minimum(r * adv, np.clip(r, 1 - EPS_CLIP, 1 + EPS_CLIP) * adv)
    n = mask.sum()
    scale = (mask * w * np.maximum(r, 1 + EPS_CLIP) * np.abs(adv)).sum() / n
    return float(-(mask * term).sum() / n), float(scale)


def _logprob_bound(learner) -> float:
    """fp32 rounding bound on the difference of two evaluations of one token's logprob
    (the loss's own forward pass and compute_logp): tests/tolerance.py at this model's
    reduction path, with the output head's terms bounded by sqrt(D) * max_v Σ_d |g_d W_dv|
    (an RMS-normed vector has |h_d| <= |g_d| sqrt(D))."""
    params = learner.params
    g = np.abs(np.asarray(params["final_norm"]["scale"].value, np.float64))
    head_dv = np.abs(np.asarray(params["lm_head_dv"].value, np.float64))
    scale = math.sqrt(TINY.hidden_size) * float((g[:, None] * head_dv).sum(0).max())
    head_dim = TINY.hidden_size // TINY.num_attention_heads
    path = decoder_path_length(TINY.hidden_size, TINY.intermediate_size, head_dim,
                               TINY.num_hidden_layers, SEQ_LEN)
    return logprob_tolerance(TINY.vocab_size, float(network_tolerance(scale, path)))


def _tolerance(scale: float, n: int, delta: float) -> float:
    """Each term moves by at most a factor exp(±2 delta) when logp and prox do (r and w
    each carry one logprob), plus the rounding of the token sum."""
    return scale * math.expm1(2 * delta) + float(sum_tolerance(scale, n))


@pytest.mark.parametrize("given_prox", [False, True], ids=["prox=current", "prox=given"])
def test_decoupled_loss_differs_from_plain_ppo_by_the_formula(given_prox):
    """One minibatch per version (the trainer's path: the proximal policy is the current
    weights, taken from the loss's own forward pass), and a proximal policy given in the
    batch (as the recompute before several minibatches leaves it), here an older policy
    0.3 nats away on alternate tokens."""
    mesh = make_mesh("data=1", jax.devices()[:1])
    decoupled = make_learner(mesh, algo=AlgoConfig(ppo_n_minibatches=1))
    plain = make_learner(mesh, algo=AlgoConfig(ppo_n_minibatches=1, decoupled=False))
    batches = _batches()
    logp_now = decoupled.compute_logp(batches)  # the weights both learners start from
    prox_arrays = logp_now
    if given_prox:
        prox_arrays = [lp + np.where(np.arange(lp.size).reshape(lp.shape) % 2, 0.3, -0.3)
                       .astype(np.float32) for lp in logp_now]
    dec_batches, plain_batches = copy.deepcopy(batches), copy.deepcopy(batches)
    for b, prox in zip(dec_batches, prox_arrays, strict=True):
        b.prox_logp = prox if given_prox else None
    got_dec = decoupled.train_step(dec_batches)
    got_plain = plain.train_step(plain_batches)
    if not given_prox:  # prox from the loss's own forward pass, no separate logprob pass
        assert got_dec["prox_logp_recomputed"] == 0.0

    mask, adv = _flat(batches, "loss_mask"), _flat(batches, "advantages")
    behav, logp = _flat(batches, "behav_logp"), _flat(batches, None, logp_now)
    prox = _flat(batches, None, prox_arrays)
    want_dec, scale_dec = _formula(logp, prox, behav, adv, mask, decoupled=True)
    want_plain, scale_plain = _formula(logp, prox, behav, adv, mask, decoupled=False)
    n, delta = int(mask.sum()), _logprob_bound(decoupled)
    tol_dec, tol_plain = _tolerance(scale_dec, n, delta), _tolerance(scale_plain, n, delta)
    assert got_dec["loss"] == pytest.approx(want_dec, rel=0, abs=tol_dec)
    assert got_plain["loss"] == pytest.approx(want_plain, rel=0, abs=tol_plain)
    # The batch tells the two apart: the difference is far above both bounds.
    difference = got_dec["loss"] - got_plain["loss"]
    assert abs(want_dec - want_plain) > 100 * (tol_dec + tol_plain)
    assert difference == pytest.approx(want_dec - want_plain, rel=0, abs=tol_dec + tol_plain)
