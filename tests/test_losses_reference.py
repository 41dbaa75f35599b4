"""The losses against independent float64 NumPy references written from the papers' and
peers' formulas (not from our JAX code): group advantages (GRPO, RLOO, Dr.GRPO) exact for
equal rewards, whole-batch normalisation, GAE with truncated sequences bootstrapped, the
PPO / CISPO / SAPO objectives (values and gradients w.r.t. the log-probs), the KL
estimators with k2's straight-through gradient and a clamp, and the Huber value loss.

Tolerances come from the float32 unit roundoff and the size of the terms each result adds
up (``tests.tolerance``), never from what one machine printed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.losses import (
    decoupled_ppo_loss,
    gae,
    group_advantages,
    normalize_advantages,
    packed_gae,
    ppo_value_loss,
    token_kl,
)
from tests.tolerance import LAMBDA, UNIT_ROUNDOFF_F32

U = UNIT_ROUNDOFF_F32
EPS_STD = 1e-5  # group_advantages' and normalize_advantages' default eps

# ----------------------------------------------------------------------------- references
# Each is the formula as its source states it, in float64.


def ref_group_advantages(rewards, group_size, mode):
    """GRPO (Shao et al. 2024, as AReaL: (r - mean) / (unbiased std + eps)), RLOO (Ahmadian
    et al. 2024: r minus the mean of the other G - 1), Dr.GRPO (Liu et al. 2025: r - mean)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    mean = r.mean(axis=1, keepdims=True)
    if mode == "rloo":
        return (r - (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)).ravel()
    adv = r - mean
    if mode == "drgrpo":
        return adv.ravel()
    std = (r.std(axis=1, ddof=1, keepdims=True) if group_size > 1
           else np.zeros_like(mean))
    return (adv / (std + EPS_STD)).ravel()


def ref_gae_sequence(rewards, values, gamma, lam, bootstrap):
    """GAE (Schulman et al. 2016) of one sequence's valid tokens, in order:
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_k (gamma lam)^k delta_{t+k}, where the
    value after the last token is ``bootstrap`` (0: terminal; the critic's value of the
    next state: truncated, as AReaL's seq_no_eos_mask)."""
    n = len(rewards)
    next_values = np.append(np.asarray(values[1:], np.float64), bootstrap)
    deltas = np.asarray(rewards, np.float64) + gamma * next_values - np.asarray(values, np.float64)
    adv = np.zeros(n)
    for t in range(n):
        adv[t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t))
    return adv


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def ref_policy_loss(logp, prox, behav, adv, mask, *, objective, eps_clip=0.2, eps_high=None,
                    c_clip=None, tis_cap=None, tau_pos=1.0, tau_neg=1.05, level="token",
                    agg="token-mean"):
    """Loss and d loss / d logp (float64) of one batch of rows (a row = a sequence).

    w_t = exp(prox - behav) (AReaL's decoupled weight; with ``tis_cap``, min(w_t, C):
    truncated IS), r_t = exp(logp - prox) per token, or per sequence exp(mean_t log r_t)
    (GSPO, Zheng et al. 2025). Per token:

    - ppo (Schulman et al. 2017; dual clip: Ye et al. 2020): max(-A r, -A clip(r));
    - cispo (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1 - eps, 1 + eps_high)) A logp;
    - sapo (Gao et al., arXiv 2511.20347): -(4 / tau) sigmoid(tau (r - 1)) A,
      tau = tau_pos if A > 0 else tau_neg.
    """
    logp, prox, behav, adv = (np.asarray(x, np.float64) for x in (logp, prox, behav, adv))
    mask = np.asarray(mask, bool)
    high = eps_clip if eps_high is None else eps_high
    w = np.exp(prox - behav)
    if tis_cap is not None:
        w = np.minimum(w, tis_cap)
    log_r = np.where(mask, logp - prox, 0.0)
    n_valid = mask.sum(axis=1, keepdims=True)
    if level == "sequence":
        log_r = np.broadcast_to(log_r.sum(axis=1, keepdims=True) / np.maximum(n_valid, 1),
                                log_r.shape)
    r = np.exp(log_r)
    # dr_t/dlogp_u: r_t for u = t (token); r_s / n for every u of the sequence (sequence)
    if objective == "ppo":
        clipped_r = np.clip(r, 1 - eps_clip, 1 + high)
        unclipped, clipped = -adv * r, -adv * clipped_r
        token = np.maximum(unclipped, clipped)
        dtoken_dr = np.where(clipped > unclipped, 0.0, -adv)
        if c_clip is not None:
            bound = c_clip * np.abs(adv)
            capped = (adv < 0) & (token > bound)
            token = np.where(adv < 0, np.minimum(token, bound), token)
            dtoken_dr = np.where(capped, 0.0, dtoken_dr)
        dtoken_dlogp_self = 0.0
    elif objective == "cispo":
        weight = np.clip(r, 1 - eps_clip, 1 + high)
        token = -weight * adv * logp
        dtoken_dr = np.zeros_like(r)  # the weight is a constant
        dtoken_dlogp_self = -weight * adv
    else:  # sapo
        tau = np.where(adv > 0, tau_pos, tau_neg)
        s = sigmoid(tau * (r - 1.0))
        token = -(4.0 / tau) * s * adv
        dtoken_dr = -4.0 * s * (1.0 - s) * adv
        dtoken_dlogp_self = 0.0
    weighted = np.where(mask, w * token, 0.0)
    dweighted_dr = np.where(mask, w * dtoken_dr, 0.0)
    dweighted_dlogp_self = np.where(mask, w * dtoken_dlogp_self, 0.0)
    if agg == "token-mean":
        denom = max(mask.sum(), 1)
        row_scale = np.ones((len(mask), 1)) / denom
    else:  # seq-mean-token-mean over sequences with a valid token
        denom = max(int((n_valid > 0).sum()), 1)
        row_scale = 1.0 / (np.maximum(n_valid, 1) * denom)
    loss = float((weighted * row_scale).sum())
    if level == "sequence":
        # d r_s / d logp_u = r_s / n for each valid u of the sequence
        per_row = (dweighted_dr * row_scale * r).sum(axis=1, keepdims=True) / np.maximum(n_valid, 1)
        grad = np.where(mask, per_row, 0.0)
    else:
        grad = dweighted_dr * row_scale * r
    grad = grad + dweighted_dlogp_self * row_scale
    return loss, np.where(mask, grad, 0.0)


def ref_kl(logp, ref, estimator, clamp=None):
    """KL estimators (Schulman, "Approximating KL divergence"; verl's kl_penalty) and their
    gradients w.r.t. logp. x = ref - logp. k1 = -x, k2 = x^2 / 2, k3 = e^x - 1 - x,
    low_var_kl = clip(k3(clip(x, -20, 20)), -10, 10); "+": the value of the estimator, the
    gradient of k2 (-x * dx/dlogp = x ... written out below)."""
    x = np.asarray(ref, np.float64) - np.asarray(logp, np.float64)
    base = estimator.rstrip("+")
    if base == "k1":
        value, grad = -x, np.ones_like(x)
    elif base == "k2":
        value, grad = 0.5 * x * x, -x
    elif base == "k3":
        value, grad = np.expm1(x) - x, -(np.exp(x) - 1.0)
    else:  # low_var_kl
        xc = np.clip(x, -20.0, 20.0)
        inner = np.expm1(xc) - xc
        value = np.clip(inner, -10.0, 10.0)
        live = (np.abs(x) < 20.0) & (inner < 10.0)
        grad = np.where(live, -(np.exp(xc) - 1.0), 0.0)
    if clamp is not None:
        grad = np.where(np.abs(value) < clamp, grad, 0.0)
        value = np.clip(value, -clamp, clamp)
    if estimator.endswith("+"):
        grad = -x  # d(x^2 / 2)/dlogp = x * dx/dlogp = -x
    return value, grad


def huber(x, delta):
    ax = np.abs(x)
    return np.where(ax <= delta, 0.5 * x * x, delta * (ax - 0.5 * delta))


def huber_grad(x, delta):
    return np.where(np.abs(x) <= delta, x, delta * np.sign(x))


# ----------------------------------------------------------------------------- group advantages

ALL_MODES = ("grpo", "rloo", "drgrpo", "gspo")
MAGNITUDES = np.concatenate([np.logspace(-3, 3, 13), [0.7, 100.3, 1 / 3, 2 / 3, 999.9, -0.7,
                                                      -123.456, 0.1 + 0.2]])


@functools.partial(jax.jit, static_argnums=1)
def _every_mode(rewards, group_size):
    """[modes, N]: the advantages of every mode (one compiled program per group size)."""
    return jnp.stack([group_advantages(rewards, group_size, mode=m) for m in ALL_MODES])


def _equal_rewards_are_zero(group_sizes):
    for g in group_sizes:
        adv = np.asarray(_every_mode(np.repeat(MAGNITUDES.astype(np.float32), g), g))
        for mode, a in zip(ALL_MODES, adv, strict=True):
            assert np.all(a == 0.0), (mode, g, a[a != 0][:4])


def test_equal_rewards_give_exactly_zero():
    """The issue's reproduction (0.7 and 100.3 in a group of 8 gave 0.006 and 0.42) for
    every mode and rewards over 1e-3..1e3 (signed, shaped-looking values); the group sizes
    the old code failed worst at, odd ones and powers of two. The slow test below runs
    every G from 2 to 64."""
    _equal_rewards_are_zero([2, 3, 7, 8, 16, 64])


@pytest.mark.slow
def test_equal_rewards_give_exactly_zero_for_every_group_size():
    _equal_rewards_are_zero(range(2, 65))


def test_the_issue_reproduction_prints_zero():
    assert float(group_advantages(jnp.full((8,), 0.7), 8)[0]) == 0.0
    assert float(group_advantages(jnp.full((8,), 100.3), 8)[0]) == 0.0


def group_tolerance(rewards, group_size, mode):
    """fp32 bound per advantage, from the error analysis of the centred computation: every
    group is centred on its first reward (exact for equal or close rewards), then a sum of
    G deviations and ~4 rounded operations a term, all relative to the group's spread
    max|r - mean| (over std + eps when standardised; times G/(G-1) for RLOO)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    spread = np.abs(r - r.mean(axis=1, keepdims=True)).max(axis=1, keepdims=True)
    spread = spread + np.abs(r - r[:, :1]).max(axis=1, keepdims=True)  # the centring pivot
    if mode in ("grpo", "gspo") and group_size > 1:
        spread = spread / (r.std(axis=1, ddof=1, keepdims=True) + EPS_STD)
    if mode == "rloo":
        spread = spread * group_size / (group_size - 1)
    bound = (4 + LAMBDA * math.sqrt(group_size)) * U * spread
    return np.broadcast_to(bound, r.shape).ravel()


@pytest.mark.parametrize("group_size", [1, 2, 4, 8, 64])
def test_group_advantages_match_float64_over_magnitudes(group_size):
    rng = np.random.default_rng(group_size)
    parts = []
    for mag in (1e-3, 1e-1, 1.0, 10.0, 1e3):
        parts.append(rng.uniform(-mag, mag, 8 * group_size))  # random
        parts.append(rng.integers(0, 2, 8 * group_size) * mag)  # pass / fail
        parts.append(mag * (1 + rng.integers(-3, 4, 8 * group_size) * 2.0**-23))  # ~1 ulp apart
        parts.append(mag * (1 + 1e-4 * rng.normal(size=8 * group_size)))  # near-equal
    rewards = np.concatenate(parts).astype(np.float32)
    modes = [m for m in ALL_MODES if not (m == "rloo" and group_size == 1)]
    if group_size == 1:  # leave-one-out needs G >= 2
        every = [np.asarray(group_advantages(rewards, 1, mode=m)) for m in modes]
    else:
        every = list(np.asarray(_every_mode(rewards, group_size)))
    for mode, adv in zip(modes, every, strict=True):
        expected = ref_group_advantages(rewards, group_size,
                                        "grpo" if mode == "gspo" else mode)
        err = np.abs(adv.astype(np.float64) - expected)
        assert np.all(err <= group_tolerance(rewards, group_size, mode)), (mode, err.max())
        if mode in ("grpo", "gspo"):
            # The issue's bound: standardised advantages within 1e-6 of the float64
            # reference (|A| <= sqrt(G - 1): the bound above at |A| ~ 1 to 8).
            assert err.max() <= 1e-6, mode


def test_group_advantages_of_one_reward_groups():
    rewards = np.array([0.3, -2.0, 1e3], np.float32)
    assert np.all(np.asarray(group_advantages(rewards, 1)) == 0.0)  # std 0, mean itself
    assert np.all(np.asarray(group_advantages(rewards, 1, mode="drgrpo")) == 0.0)


def test_group_advantages_gradient_matches_float64():
    """d/dr of GRPO's standardised advantages (through the mean and std), on a group of
    random rewards: the float64 gradient by central differences of the reference."""
    rng = np.random.default_rng(3)
    r = rng.uniform(0, 1, 8).astype(np.float32)
    weights = rng.normal(size=8)
    grad = np.asarray(jax.grad(lambda x: jnp.sum(group_advantages(x, 8) * weights))(r))
    h = 1e-6
    fd = np.array([(np.sum(ref_group_advantages(r.astype(np.float64) + h * e, 8, "grpo")
                           * weights)
                    - np.sum(ref_group_advantages(r.astype(np.float64) - h * e, 8, "grpo")
                             * weights)) / (2 * h) for e in np.eye(8)])
    scale = np.abs(weights).sum() / r.std(ddof=1) * 8  # |d A / d r| <= ~G / std
    assert np.all(np.abs(grad - fd) <= 64 * U * scale)


# ----------------------------------------------------------------------------- normalisation


def test_normalize_advantages_equal_values_give_exactly_zero():
    mask = np.zeros((4, 33), np.int32)
    mask[:, 5:] = 1
    mask[2, 20:] = 0  # ragged
    for value in MAGNITUDES:
        adv = np.full(mask.shape, value, np.float32)
        for unbiased in (False, True):
            out = np.asarray(normalize_advantages(adv, mask, unbiased=unbiased))
            assert np.all(out == 0.0), (value, out[out != 0][:3])


@pytest.mark.parametrize("offset", [0.0, 1.0, 100.3, -1e3])
def test_normalize_advantages_matches_float64(offset):
    rng = np.random.default_rng(7)
    adv = (offset + rng.normal(size=(6, 40))).astype(np.float32)
    mask = rng.random((6, 40)) < 0.7
    mask[3] = False  # a row with nothing valid
    out = np.asarray(normalize_advantages(adv, mask))
    a = adv.astype(np.float64)[mask]
    expected = (a - a.mean()) / (a.std() + EPS_STD)
    n = mask.sum()
    spread = (np.abs(a - a.mean()).max() + np.abs(a - a[0]).max()) / (a.std() + EPS_STD)
    tol = (6 + LAMBDA * math.sqrt(n)) * U * spread
    assert np.all(np.abs(out[mask] - expected) <= tol)
    assert np.all(out[~mask] == 0.0)


def test_critic_normalisation_of_equal_advantages_is_exactly_zero():
    """The critic's batch-wide GAE normalisation (packed_gae_targets, summed per
    micro-batch): zero values and equal rewards with gamma = lam = 1 make every loss
    token's advantage the reward; standardised, exactly 0."""
    from areal_jax.learner.critic import packed_gae_targets
    from areal_jax.learner.packing import pack_trajectories

    trajs = _trajectories(np.random.default_rng(0), 9, finish="stop")
    batches = pack_trajectories(trajs, None, seq_len=32, rows_per_micro_batch=2)
    assert len(batches) > 1  # the sums run over several micro-batches
    for reward in (0.7, 100.3, 1e3):
        targets = packed_gae_targets(batches, [np.zeros(b.shape, np.float32) for b in batches],
                                     [reward] * len(trajs), gamma=1.0, lam=1.0)
        for b in targets.micro_batches:
            assert np.all(np.asarray(b.advantages) == 0.0), reward


# ----------------------------------------------------------------------------- truncation

# Compiled once per shape and (gamma, lam): eager calls would trace the scan every time.
_gae = jax.jit(gae, static_argnums=(3, 4))
_packed_gae = jax.jit(packed_gae, static_argnums=(4, 5))


def _trajectories(rng, n, finish):
    from areal_jax.trajectory import Trajectory

    trajs = []
    for i in range(n):
        prompt, gen = int(rng.integers(2, 6)), int(rng.integers(2, 9))
        mask = np.r_[np.zeros(prompt), np.ones(gen)].astype(np.int32)
        if gen > 4:
            mask[prompt + 2] = 0  # an environment token inside the answer: skipped
        f = finish if isinstance(finish, str) else finish[i]
        trajs.append(Trajectory(input_ids=rng.integers(3, 32, prompt + gen), loss_mask=mask,
                                behav_logp=-mask.astype(np.float32), versions=mask - 1,
                                reward=float(rng.normal()), finish_reason=f))
    return trajs


def _reference_packed(rewards_bt, values_bt, next_bt, mask_bt, seg_bt, trunc_bt, gamma, lam):
    """The float64 GAE of every sequence of packed rows alone; truncated ones bootstrap
    from the next-state value at their last token."""
    out = np.zeros(rewards_bt.shape)
    for row in range(rewards_bt.shape[0]):
        for seg in set(seg_bt[row][seg_bt[row] > 0].tolist()):
            pos = np.flatnonzero(seg_bt[row] == seg)
            valid = pos[mask_bt[row, pos] != 0]
            boot = next_bt[row, pos[-1]] if trunc_bt[row, pos[-1]] else 0.0
            if valid.size:
                out[row, valid] = ref_gae_sequence(rewards_bt[row, valid], values_bt[row, valid],
                                                   gamma, lam, boot)
    return out


def gae_tol(rewards, values, boot, length):
    """A discounted sum of <= length deltas (each 3 terms, ~3 roundings), on top of
    the scan's one rounding per step."""
    terms = np.abs(rewards).sum() + 2 * np.abs(values).sum() + np.abs(boot).sum()
    return (6 + LAMBDA * math.sqrt(3 * length)) * U * terms * 2


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_bootstraps_truncated_rows(gamma, lam):
    rng = np.random.default_rng(1)
    b, t = 5, 12
    rewards = rng.normal(size=(b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.75).astype(np.int32)
    mask[:, -2:] = 0  # padding after the last valid token: the bootstrap carries over it
    truncated = np.array([True, False, True, False, True])
    boot = rng.normal(size=b).astype(np.float32) * 3
    boot[1] = np.nan  # never read where not truncated
    adv, ret = _gae(rewards, values, mask, gamma, lam, truncated=truncated,
                    bootstrap_values=boot)
    plain, _ = _gae(rewards, values, mask, gamma, lam)
    for row in range(b):
        valid = np.flatnonzero(mask[row])
        expected = ref_gae_sequence(rewards[row, valid], values[row, valid], gamma, lam,
                                    float(boot[row]) if truncated[row] else 0.0)
        tol = gae_tol(rewards[row, valid], values[row, valid], boot[row] if truncated[row] else 0,
                      t)
        assert np.all(np.abs(np.asarray(adv)[row, valid] - expected) <= tol)
        if not truncated[row]:  # a finished row's advantages are unchanged (up to rounding)
            assert np.all(np.abs(np.asarray(adv)[row] - np.asarray(plain)[row]) <= 2 * tol)
    np.testing.assert_array_equal(np.asarray(ret), np.where(mask, np.asarray(adv) + values, 0.0))


def test_packed_gae_bootstraps_truncated_sequences_through_packing():
    """Trajectories with finish reason length are packed with ``truncated`` set; their GAE
    on the packed rows equals the float64 bootstrap reference, finished ones are unchanged."""
    from areal_jax.learner.packing import pack_trajectories
    from areal_jax.trajectory import FINISH_LENGTH, FINISH_STOP

    rng = np.random.default_rng(2)
    finishes = [FINISH_LENGTH if i % 3 == 0 else FINISH_STOP for i in range(14)]
    trajs = _trajectories(rng, 14, finishes)
    batches = pack_trajectories(trajs, None, seq_len=24, rows_per_micro_batch=2)
    assert any(b.segment_ids.max() > 1 for b in batches)  # several sequences a row
    for b in batches:
        for p in b.placements:
            flag = b.truncated[p.row, p.start:p.start + p.length]
            assert np.all(flag == int(trajs[p.traj_index].truncated))
        rewards = rng.normal(size=b.shape).astype(np.float32)
        values = rng.normal(size=b.shape).astype(np.float32)
        next_values = rng.normal(size=b.shape).astype(np.float32) * 2
        for gamma, lam in [(1.0, 1.0), (0.99, 0.9)]:
            adv, _ = _packed_gae(rewards, values, b.loss_mask, b.segment_ids, gamma, lam,
                                 truncated=b.truncated, bootstrap_values=next_values)
            plain, _ = _packed_gae(rewards, values, b.loss_mask, b.segment_ids, gamma, lam)
            expected = _reference_packed(rewards, values, next_values, b.loss_mask,
                                         b.segment_ids, b.truncated, gamma, lam)
            tol = gae_tol(rewards, values, next_values, b.shape[1])
            assert np.all(np.abs(np.asarray(adv) - expected) <= tol)
            # A finished sequence's advantages are unchanged (two compiled programs: equal
            # up to their rounding).
            finished = (b.truncated == 0) | (b.segment_ids == 0)
            assert np.all(np.abs(np.asarray(adv) - np.asarray(plain))[finished] <= 2 * tol)
            assert np.any(np.asarray(adv)[~finished] != np.asarray(plain)[~finished])


def test_packed_gae_targets_bootstrap_and_its_errors():
    """The critic's path: packed_gae_targets bootstraps the truncated trajectories from the
    next values it is given (advantages unnormalised here, compared per trajectory), and
    refuses truncated trajectories without them."""
    from areal_jax.learner.critic import packed_gae_targets, terminal_rewards
    from areal_jax.learner.packing import pack_trajectories

    rng = np.random.default_rng(4)
    trajs = _trajectories(rng, 8, ["length", "stop"] * 4)
    batches = pack_trajectories(trajs, None, seq_len=32, rows_per_micro_batch=2)
    rewards = [t.reward for t in trajs]
    values = [rng.normal(size=b.shape).astype(np.float32) for b in batches]
    nexts = [rng.normal(size=b.shape).astype(np.float32) for b in batches]
    with pytest.raises(ValueError, match="truncated trajectories.*bootstrap_values"):
        packed_gae_targets(batches, values, rewards, gamma=1.0, lam=0.95)
    targets = packed_gae_targets(batches, values, rewards, gamma=1.0, lam=0.95,
                                 normalize=False, bootstrap_values=nexts)
    for b, out, v, nx in zip(batches, targets.micro_batches, values, nexts, strict=True):
        expected = _reference_packed(terminal_rewards(b, np.asarray(rewards)), v, nx,
                                     b.loss_mask, b.segment_ids, b.truncated, 1.0, 0.95)
        tol = gae_tol(np.asarray(rewards), v, nx, b.shape[1])
        assert np.all(np.abs(np.asarray(out.advantages) - expected) <= tol)


def test_gae_truncation_input_errors():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="truncated needs bootstrap_values"):
        gae(x, x, x, 1.0, 1.0, truncated=np.ones(2, bool))
    with pytest.raises(ValueError, match="bootstrap_values given without truncated"):
        gae(x, x, x, 1.0, 1.0, bootstrap_values=np.ones(2))
    with pytest.raises(ValueError, match=r"truncated has shape \(2, 3\); expected \(2,\)"):
        gae(x, x, x, 1.0, 1.0, truncated=np.ones((2, 3), bool), bootstrap_values=np.ones(2))
    with pytest.raises(ValueError, match=r"bootstrap_values has shape \(2,\); expected \(2, 3\)"):
        packed_gae(x, x, x, np.ones((2, 3), np.int32), 1.0, 1.0, truncated=x,
                   bootstrap_values=np.ones(2))


# ----------------------------------------------------------------------------- objectives


def _policy_batch(seed, b=6, t=20):
    """Log-probs whose ratios reach far past every clip and gate (r from ~0.05 to ~20),
    behaviour weights away from 1, ragged masks (a fully masked row), advantages of both
    signs; no ratio within rounding of a clip boundary (the branch is then well defined)."""
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-6, -0.05, (b, t)).astype(np.float32)
    log_r = rng.uniform(-3, 3, (b, t))
    bad = np.abs(np.exp(log_r)[..., None] - np.array([0.8, 1.2, 1.28])) < 1e-3
    log_r[bad.any(-1)] += 0.01
    prox = (logp - log_r).astype(np.float32)
    behav = (prox - rng.normal(scale=0.5, size=(b, t))).astype(np.float32)
    adv = rng.normal(scale=2.0, size=(b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.8).astype(np.int32)
    mask[0, : t // 2] = 0  # ragged
    mask[2] = 0  # nothing valid
    return logp, prox, behav, adv, mask


def _loss_tolerance(logp, prox, behav, adv, mask, objective, grad=False):
    """Each token term is ~8 rounded operations (exps of O(3) log-ratios: a few u each) of
    magnitude |w A r| (|w A logp| for CISPO), summed over the tokens."""
    w = np.exp(np.asarray(prox, np.float64) - behav)
    r = np.exp(np.asarray(logp, np.float64) - prox)
    term = np.abs(w * adv) * (np.maximum(r, 1.0) + (np.abs(logp) if objective == "cispo" else 0))
    n = max(int(np.asarray(mask).sum()), 1)
    if grad:  # per token: no sum, but the sequence-level ratio sums a row's log-ratios
        return (16 + LAMBDA * math.sqrt(n)) * U * term / n * 4
    return (16 + LAMBDA * math.sqrt(n)) * U * float((term * mask).sum()) / n


OBJECTIVE_CASES = [
    dict(objective="ppo"),
    dict(objective="ppo", eps_high=0.28, c_clip=3.0),
    dict(objective="ppo", level="sequence", agg="seq-mean-token-mean"),
    dict(objective="cispo"),
    dict(objective="cispo", eps_high=0.28, tis_cap=2.0),
    dict(objective="cispo", level="sequence"),
    dict(objective="sapo"),
    dict(objective="sapo", tau_pos=0.5, tau_neg=2.0, agg="seq-mean-token-mean"),
    dict(objective="sapo", level="sequence", tis_cap=2.0),
]


@pytest.mark.parametrize("case", OBJECTIVE_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in OBJECTIVE_CASES])
def test_objective_value_and_gradient_match_float64(case):
    logp, prox, behav, adv, mask = _policy_batch(11)
    kw = {"objective": case["objective"], "eps_clip": 0.2,
          "eps_clip_higher": case.get("eps_high"), "c_clip": case.get("c_clip"),
          "ratio_level": case.get("level", "token"),
          "agg_mode": case.get("agg", "token-mean")}
    if case["objective"] == "sapo":
        kw.update(sapo_tau_pos=case.get("tau_pos", 1.0), sapo_tau_neg=case.get("tau_neg", 1.05))
    if "tis_cap" in case:
        kw.update(behav_correction="tis", behav_correction_cap=case["tis_cap"])

    def loss_fn(lp):
        return decoupled_ppo_loss(lp, prox, behav, adv, mask, **kw)[0]

    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
    ref_loss, ref_grad = ref_policy_loss(logp, prox, behav, adv, mask, **case)
    assert abs(float(loss) - ref_loss) <= _loss_tolerance(logp, prox, behav, adv, mask,
                                                          case["objective"])
    tol = _loss_tolerance(logp, prox, behav, adv, mask, case["objective"], grad=True)
    if case.get("agg") == "seq-mean-token-mean":
        tol = tol * mask.sum()  # a row's token mean: 1 / n_row instead of 1 / N
    assert np.all(np.abs(np.asarray(grad) - ref_grad) <= tol + 1e-30)
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_objectives_reach_every_clip_and_gate():
    """The batch above is far enough out: PPO clips on both sides and the dual clip caps,
    CISPO truncates its weight on both sides, SAPO's gate falls below 1/2 of PPO's gradient
    on both sides."""
    logp, prox, behav, adv, mask = _policy_batch(11)
    r = np.exp(logp.astype(np.float64) - prox)[mask != 0]
    a = adv[mask != 0]
    assert np.any((r < 0.8) & (a < 0)) and np.any((r > 1.28) & (a > 0))  # PPO's clips
    assert np.any((r > 3 + 1) & (a < 0))  # dual clip at c = 3
    assert np.any(r < 0.8) and np.any(r > 1.28)  # CISPO's weight cut
    # SAPO's gradient weight relative to PPO's is 4 s (1 - s), s = sigmoid(tau (r - 1)): at
    # the default temperatures it gates r > 1; r < 1 is gated with a larger tau_neg (2).
    gate = [4 * s * (1 - s) for s in (sigmoid(np.where(a > 0, 1.0, 1.05) * (r - 1)),
                                      sigmoid(np.where(a > 0, 0.5, 2.0) * (r - 1)))]
    assert np.any((gate[0] < 0.5) & (r > 1) & (a > 0)) and np.any((gate[0] < 0.5) & (a <= 0))
    assert np.any((gate[1] < 0.5) & (r < 1) & (a <= 0))
    stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, objective="cispo",
                               eps_clip_higher=0.28)[1]
    expected = np.mean((r < 0.8) | (r > 1.28))
    assert abs(float(stats["clip_frac"]) - expected) <= 1e-6


def test_objective_config_errors():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="objective='bogus'"):
        decoupled_ppo_loss(x, x, x, x, x + 1, objective="bogus")
    with pytest.raises(ValueError, match="c_clip=3.0 .*dual clip.*objective='cispo'"):
        decoupled_ppo_loss(x, x, x, x, x + 1, objective="cispo", c_clip=3.0)
    with pytest.raises(ValueError, match="eps_clip_higher=0.28 .*'sapo'"):
        decoupled_ppo_loss(x, x, x, x, x + 1, objective="sapo", eps_clip_higher=0.28)
    with pytest.raises(ValueError, match="sapo_tau_neg"):
        decoupled_ppo_loss(x, x, x, x, x + 1, objective="sapo", sapo_tau_neg=0.0)


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl", "k1+", "k3+",
                                       "low_var_kl+"])
@pytest.mark.parametrize("clamp", [None, 2.0])
def test_kl_estimators_value_and_gradient_match_float64(estimator, clamp):
    """x = ref - logp from -25 to 25: past low_var_kl's clamps of x (20) and of the
    estimate (10) and the clamp option, and values near 0."""
    rng = np.random.default_rng(5)
    x = np.concatenate([np.linspace(-25, 25, 101), rng.normal(scale=0.3, size=60)])
    x = x[np.all(np.abs(x[:, None] - np.array([-20.0, 20.0])) > 1e-3, axis=1)]
    logp = rng.uniform(-8, -0.1, x.shape).astype(np.float32)
    ref = (logp + x).astype(np.float32)
    mask = np.ones(x.shape, bool)
    mask[::7] = False
    values = np.asarray(token_kl(logp, ref, estimator, mask, clamp=clamp))
    grad = np.asarray(jax.grad(lambda lp: jnp.sum(token_kl(lp, ref, estimator, mask,
                                                           clamp=clamp)))(jnp.asarray(logp)))
    x32 = ref.astype(np.float64) - logp  # the x the fp32 inputs hold
    ref_value, ref_grad = ref_kl(logp, ref, estimator, clamp)
    # Avoid tokens whose estimate sits within rounding of a clamp (branch undefined).
    edge = np.zeros(x.shape, bool)
    raw, _ = ref_kl(logp, ref, estimator.rstrip("+"))
    for bound in (10.0, clamp or np.inf):
        edge |= np.abs(np.abs(raw) - bound) < 1e-3 * bound
    keep = mask & ~edge
    # x itself is one rounded subtraction of logp and ref (u |logp| + u |ref|); exp(x) of
    # it then carries that error times e^x.
    dx = U * (np.abs(logp) + np.abs(ref)) * 2
    scale = np.abs(x32) + np.exp(np.minimum(x32, 20.0) if "low_var" in estimator else x32) + 1
    tol = 8 * U * scale + dx * scale
    assert np.all(np.abs(values[keep] - ref_value[keep]) <= tol[keep])
    assert np.all(np.abs(grad[keep] - ref_grad[keep]) <= tol[keep])
    assert np.all(values[~mask] == 0) and np.all(grad[~mask] == 0)


def test_kl_straight_through_keeps_the_estimators_value_exactly():
    rng = np.random.default_rng(6)
    logp = rng.uniform(-5, -0.1, 50).astype(np.float32)
    ref = (logp + rng.normal(size=50)).astype(np.float32)
    for base in ("k1", "k3", "low_var_kl"):
        np.testing.assert_array_equal(np.asarray(token_kl(logp, ref, base + "+")),
                                      np.asarray(token_kl(logp, ref, base)))
    g = jax.grad(lambda lp: jnp.sum(token_kl(lp, ref, "k3+")))(jnp.asarray(logp))
    g2 = jax.grad(lambda lp: jnp.sum(token_kl(lp, ref, "k2")))(jnp.asarray(logp))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g2))
    with pytest.raises(ValueError, match="estimator='k4'"):
        token_kl(logp, ref, "k4")
    with pytest.raises(ValueError, match="clamp"):
        token_kl(logp, ref, "k3", clamp=0.0)


# ----------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("loss", ["mse", "huber"])
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_value_and_gradient_match_float64(loss, clip):
    """Values far from the returns (both Huber regimes) and far from the old values (the
    clip active), ragged mask."""
    rng = np.random.default_rng(8)
    shape = (4, 30)
    returns = rng.normal(scale=3, size=shape).astype(np.float32)
    values = (returns + rng.normal(scale=2, size=shape)).astype(np.float32)
    old = (values + rng.normal(scale=0.5, size=shape)).astype(np.float32)
    mask = rng.random(shape) < 0.8
    delta = 1.0
    v, o, rt = (a.astype(np.float64) for a in (values, old, returns))
    rho = (lambda e: huber(e, delta)) if loss == "huber" else (lambda e: 0.5 * e * e)
    drho = (lambda e: huber_grad(e, delta)) if loss == "huber" else (lambda e: e)
    plain = rho(v - rt)
    if clip is None:
        token, dtoken = plain, drho(v - rt)
    else:
        vc = o + np.clip(v - o, -clip, clip)
        clipped = rho(vc - rt)
        token = np.maximum(plain, clipped)
        inside = np.abs(v - o) < clip
        dtoken = np.where(clipped > plain, drho(vc - rt) * inside, drho(v - rt))
    n = mask.sum()
    ref_loss = (token * mask).sum() / n
    ref_grad = np.where(mask, dtoken, 0.0) / n

    def fn(vals):
        return ppo_value_loss(vals, old, returns, mask, value_eps_clip=clip, loss=loss,
                              huber_delta=delta)[0]

    out, grad = jax.value_and_grad(fn)(jnp.asarray(values))
    terms = (np.abs(v - rt) + np.abs(o - rt) + 1) ** 2
    assert abs(float(out) - ref_loss) <= (8 + LAMBDA * math.sqrt(n)) * U * (terms * mask).sum() / n
    # Skip tokens within rounding of a branch (|e| = delta, the clip edge, equal branches).
    e = v - rt
    edge = np.abs(np.abs(e) - delta) < 1e-4
    if clip is not None:
        edge |= np.abs(np.abs(v - o) - clip) < 1e-4
        edge |= np.abs(clipped - plain) < 1e-4 * (1 + plain)
    keep = mask & ~edge
    gtol = 8 * U * (np.abs(v) + np.abs(o) + np.abs(rt) + 1) / n
    assert np.all(np.abs(np.asarray(grad) - ref_grad)[keep] <= gtol[keep])
    if loss == "huber":  # the gradient is bounded by delta / n
        assert np.all(np.abs(np.asarray(grad)) <= delta / n * (1 + 4 * U))
        assert np.any(np.abs(e[mask]) > 2 * delta)  # the linear part was reached


def test_value_loss_errors():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="loss='l1'"):
        ppo_value_loss(x, x, x, x + 1, loss="l1")
    with pytest.raises(ValueError, match="huber_delta"):
        ppo_value_loss(x, x, x, x + 1, loss="huber", huber_delta=-1.0)
