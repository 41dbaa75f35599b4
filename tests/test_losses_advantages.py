"""Advantage estimators, reward shaping, KL estimators and the value loss against NumPy loops."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.losses import (
    gae,
    group_advantages,
    normalize_advantages,
    overlong_penalty,
    packed_gae,
    ppo_value_loss,
    shape_rewards,
    token_kl,
)
from tests.tolerance import UNIT_ROUNDOFF_F32, reference_tolerance

# ----------------------------------------------------------------------------- group advantages


def reference_group_advantages(rewards, group_size, leave_one_out, std_normalize, eps):
    out = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start:start + group_size]]
        mean = sum(group) / len(group)
        if len(group) > 1:
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        else:
            std = 0.0
        for i, r in enumerate(group):
            if leave_one_out:
                others = group[:i] + group[i + 1:]
                baseline = sum(others) / len(others)
            else:
                baseline = mean
            a = r - baseline
            out.append(a / (std + eps) if std_normalize else a)
    return np.array(out)


def group_advantage_tolerance(rewards, group_size, std_normalize, eps=1e-5):
    """fp32 bound per advantage: (r_i - mean) / (std + eps), the mean and the variance each
    a sum over the group; terms |r_i| + mean|r| over the divisor, ~10 operations a term."""
    values = np.asarray(rewards, np.float64).reshape(-1, group_size)
    terms = np.abs(values) + np.abs(values).mean(1, keepdims=True)
    # A group of equal rewards: the fp32 mean of equal values is that value, so r - mean is
    # exactly 0 (the caller checks it): no rounding to allow for.
    spread = values.max(1, keepdims=True) > values.min(1, keepdims=True)
    if std_normalize:
        std = values.std(1, ddof=1, keepdims=True) if group_size > 1 else np.zeros((len(values), 1))
        terms = terms / (std + eps)
    return reference_tolerance(np.where(spread, terms, 0.0).ravel(), group_size, ops=10)


GROUP_CASES = [(mode, loo, std, g)
               for mode, loo, std in [("grpo", False, True), ("rloo", True, False),
                                      ("drgrpo", False, False), (None, True, True)]
               for g in (1, 2, 5) if not (loo and g == 1)]  # leave-one-out needs G >= 2


@pytest.mark.parametrize("mode, loo, std, group_size", GROUP_CASES)
def test_group_advantages_match_reference(mode, loo, std, group_size):
    rng = np.random.default_rng(group_size)
    rewards = rng.choice([0.0, 1.0, 0.5], size=4 * group_size).astype(np.float32)
    rewards[:group_size] = 1.0  # an all-equal group: std 0
    if mode is None:
        adv = group_advantages(rewards, group_size, mean_leave_one_out=loo, std_normalize=std)
    else:
        adv = group_advantages(rewards, group_size, mode=mode)
    expected = reference_group_advantages(rewards, group_size, loo, std, 1e-5)
    assert adv.dtype == jnp.float32 and adv.shape == rewards.shape
    tol = group_advantage_tolerance(rewards, group_size, std)
    assert np.all(np.abs(np.asarray(adv) - expected) <= tol)
    assert np.all(np.asarray(adv[:group_size]) == 0.0)


def test_group_advantages_default_is_grpo_and_jits():
    rewards = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], jnp.bfloat16)
    adv = jax.jit(group_advantages, static_argnums=1)(rewards, 3)
    expected = reference_group_advantages(np.asarray(rewards, np.float32), 3, False, True, 1e-5)
    tol = group_advantage_tolerance(np.asarray(rewards, np.float32), 3, True)
    assert np.all(np.abs(np.asarray(adv) - expected) <= tol)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rewards=np.zeros(7), group_size=2),
     r"7 rewards do not split into groups of group_size=2"),
    (dict(rewards=np.zeros(4), group_size=0), r"group_size=0"),
    (dict(rewards=np.zeros((2, 2)), group_size=2), r"rewards has shape \(2, 2\)"),
    (dict(rewards=np.zeros(4), group_size=1, mean_leave_one_out=True), r"needs group_size >= 2"),
    (dict(rewards=np.zeros(4), group_size=2, mode="ppo"), r"mode='ppo'; expected one of 'grpo'"),
])
def test_group_advantages_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)


# ----------------------------------------------------------------------------- GAE


def reference_gae(rewards, values, mask, gamma, lam):
    rows, cols = rewards.shape
    adv = np.zeros((rows, cols))
    ret = np.zeros((rows, cols))
    for b in range(rows):
        valid = [t for t in range(cols) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t]
            adv[b, t] = next_adv
            ret[b, t] = next_adv + values[b, t]
    return adv, ret


def gae_tolerance(rewards, values, mask, gamma, lam):
    """fp32 bounds on (advantages, returns): the advantage at t sums (gamma lam)^k delta_{t+k}
    over the rest of the sequence, each delta = r + gamma V' - V; so its terms' magnitudes
    are the same recursion on |r| + gamma |V'| + |V| (4 operations a step), and the return
    adds |V|."""
    # reference_gae's delta = r' + gamma V'_next - V': r' = |r| + 2|V|, V' = |V| make it
    # |r| + |V| + gamma |V_next|.
    abs_adv, _ = reference_gae(np.abs(rewards) + 2 * np.abs(values), np.abs(values), mask,
                               gamma, lam)
    n = rewards.shape[1]
    adv_tol = reference_tolerance(np.abs(abs_adv), n, ops=4)
    return adv_tol, adv_tol + reference_tolerance(np.abs(abs_adv) + np.abs(values), 1, ops=1)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference(gamma, lam):
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=(3, 9)).astype(np.float32)
    values = rng.normal(size=(3, 9)).astype(np.float32)
    mask = np.ones((3, 9), np.int32)
    mask[0, :2] = 0       # prompt
    mask[1, 4:6] = 0      # an environment turn in the middle
    mask[2, 6:] = 0       # padding
    adv, ret = jax.jit(gae)(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    adv_tol, ret_tol = gae_tolerance(rewards, values, mask, gamma, lam)
    assert np.all(np.abs(np.asarray(adv) - ref_adv) <= adv_tol)
    assert np.all(np.abs(np.asarray(ret) - ref_ret) <= ret_tol)


def test_gae_with_terminal_reward_and_lambda_one_is_reward_to_go_minus_value():
    values = jnp.asarray([[0.5, 0.2, 0.1, 0.0]], jnp.bfloat16)
    rewards = jnp.asarray([[0.0, 0.0, 1.0, 0.0]], jnp.bfloat16)
    mask = jnp.asarray([[1, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    assert adv.dtype == jnp.float32
    # The bf16 inputs are what the formula sees: 0.2 and 0.1 are not bf16 numbers.
    v64 = np.asarray(values, np.float64)
    want_ret = np.array([[1.0, 1.0, 1.0, 0.0]])
    want_adv = np.where(np.asarray(mask) == 1, want_ret - v64, 0.0)
    adv_tol, ret_tol = gae_tolerance(np.asarray(rewards, np.float64), v64, np.asarray(mask),
                                     1.0, 1.0)
    assert np.all(np.abs(np.asarray(ret) - want_ret) <= ret_tol)
    assert np.all(np.abs(np.asarray(adv) - want_adv) <= adv_tol)
    grad = jax.grad(lambda v: gae(rewards, v, mask, 0.99, 0.95)[0].sum())(values)
    assert grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(grad, np.float32)))


def test_gae_errors():
    with pytest.raises(ValueError,
                       match=r"gae: values has shape \(2, 3\) but rewards has shape \(2, 4\)"):
        gae(np.zeros((2, 4)), np.zeros((2, 3)), np.ones((2, 4)), 0.9, 0.9)
    with pytest.raises(ValueError, match=r"gae: lam=1.5"):
        gae(np.zeros((2, 4)), np.zeros((2, 4)), np.ones((2, 4)), 0.9, 1.5)


def random_packing(rng, rows, length):
    """Packed [rows, length] arrays as the learner's packing lays them out: segments 1..k one
    after another in each row (a ragged tail of padding, segment id 0), each a prompt then
    generated and environment spans (loss tokens that are not contiguous), sometimes no loss
    token at all. Rewards and values sit on every token, padding included, to show that
    masked ones are ignored. Returns (rewards, values, mask, segment_ids, spans) with spans
    the (row, start, stop) of every segment."""
    mask = np.zeros((rows, length), np.int32)
    segment_ids = np.zeros((rows, length), np.int32)
    spans = []
    for r in range(rows):
        start, seg = 0, 1
        while start < length and rng.random() < 0.85:
            n = int(rng.integers(1, min(14, length - start) + 1))
            kinds = rng.integers(0, 3, n)  # 0: prompt or environment, 1-2: generated
            kinds[0] = 0
            if rng.random() < 0.1:
                kinds[:] = 0  # a sequence without loss tokens
            mask[r, start:start + n] = kinds > 0
            segment_ids[r, start:start + n] = seg
            spans.append((r, start, start + n))
            start, seg = start + n, seg + 1
    rewards = rng.normal(size=(rows, length)).astype(np.float32)
    values = rng.normal(scale=2.0, size=(rows, length)).astype(np.float32)
    return rewards, values, mask, segment_ids, spans


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_packed_gae_is_gae_of_each_sequence_alone(gamma, lam):
    """On many random packings, every sequence of a packed row gets what ``gae`` gives it
    in a row of its own (and what the float64 loop gives it); padding gets 0."""
    rows, length, max_segments = 4, 40, 4 * 40
    packed = jax.jit(packed_gae, static_argnums=(4, 5))
    alone = jax.jit(gae, static_argnums=(3, 4))
    n_segments = 0
    for seed in range(25):
        rng = np.random.default_rng(seed)
        rewards, values, mask, segment_ids, spans = random_packing(rng, rows, length)
        adv, ret = (np.asarray(x) for x in packed(rewards, values, mask, segment_ids, gamma, lam))
        # Each sequence alone at the start of a row of its own, the rest masked: the layout
        # of one trajectory per row, padded.
        one_r, one_v, one_m = (np.zeros((max_segments, length), np.float32) for _ in range(3))
        for k, (r, start, stop) in enumerate(spans):
            one_r[k, :stop - start] = rewards[r, start:stop]
            one_v[k, :stop - start] = values[r, start:stop]
            one_m[k, :stop - start] = mask[r, start:stop]
        want_adv, want_ret = (np.asarray(x) for x in alone(one_r, one_v, one_m, gamma, lam))
        ref_adv, ref_ret = reference_gae(one_r, one_v, one_m, gamma, lam)
        adv_tol, ret_tol = gae_tolerance(one_r, one_v, one_m, gamma, lam)
        for k, (r, start, stop) in enumerate(spans):
            n = stop - start
            # Two fp32 evaluations of the same recursion: within twice one's bound.
            assert np.all(np.abs(adv[r, start:stop] - want_adv[k, :n]) <= 2 * adv_tol[k, :n])
            assert np.all(np.abs(ret[r, start:stop] - want_ret[k, :n]) <= 2 * ret_tol[k, :n])
            assert np.all(np.abs(adv[r, start:stop] - ref_adv[k, :n]) <= adv_tol[k, :n])
            assert np.all(np.abs(ret[r, start:stop] - ref_ret[k, :n]) <= ret_tol[k, :n])
        assert np.all(adv[mask == 0] == 0) and np.all(ret[mask == 0] == 0)
        assert np.all(adv[segment_ids == 0] == 0) and np.all(ret[segment_ids == 0] == 0)
        n_segments += len(spans)
    assert n_segments > 200


def test_packed_gae_with_one_segment_a_row_is_gae():
    rng = np.random.default_rng(5)
    rewards, values = rng.normal(size=(2, 3, 9)).astype(np.float32)
    mask = rng.random((3, 9)) < 0.7
    got = packed_gae(rewards, values, mask, np.ones((3, 9), np.int32), 0.99, 0.95)
    want = gae(rewards, values, mask, 0.99, 0.95)
    # The same recursion, compiled with the segment resets: two fp32 evaluations.
    for g, w, tol in zip(got, want, gae_tolerance(rewards, values, mask, 0.99, 0.95),
                         strict=True):
        assert np.all(np.abs(np.asarray(g) - np.asarray(w)) <= 2 * tol)


def test_packed_gae_errors():
    z = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"packed_gae: segment_ids has shape \(2, 3\) but "
                                         r"rewards has shape \(2, 4\)"):
        packed_gae(z, z, z, np.ones((2, 3), np.int32), 0.9, 0.9)
    with pytest.raises(TypeError, match="packed_gae: segment_ids has dtype float32"):
        packed_gae(z, z, z, z, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"packed_gae: gamma=-0.1"):
        packed_gae(z, z, z, np.ones((2, 4), np.int32), -0.1, 0.9)


# --------------------------------------------------------------------------- normalisation, shaping


@pytest.mark.parametrize("center, unbiased", [(True, False), (False, False), (True, True)])
def test_normalize_advantages_matches_reference(center, unbiased):
    rng = np.random.default_rng(4)
    adv = rng.normal(2.0, 3.0, (4, 6)).astype(np.float32)
    mask = rng.random((4, 6)) < 0.6
    vals = adv[mask].astype(np.float64)
    mean = vals.mean()
    std = math.sqrt(((vals - mean) ** 2).sum() / (len(vals) - (1 if unbiased else 0)))
    expected = np.where(mask, ((adv - mean) if center else adv) / (std + 1e-5), 0.0)
    out = normalize_advantages(adv, mask, center=center, unbiased=unbiased)
    # (a - mean) / (std + eps), the mean and variance sums over the valid entries.
    terms = np.where(mask, (np.abs(adv) + np.abs(vals).mean()) / (std + 1e-5), 0.0)
    tol = reference_tolerance(terms, len(vals), ops=10)
    assert np.all(np.abs(np.asarray(out) - expected) <= tol)


def test_normalize_advantages_all_masked_is_zero():
    out = normalize_advantages(np.full((2, 3), 7.0, np.float32), np.zeros((2, 3)))
    assert np.all(np.asarray(out) == 0.0)


def test_shape_rewards():
    rewards = np.array([-3.0, -0.5, 0.0, 1.0, 4.0], np.float32)
    out = shape_rewards(rewards, scale=2.0, bias=-0.5, clip=3.0)
    expected = [max(-3.0, min(3.0, (r - 0.5) * 2.0)) for r in rewards]
    np.testing.assert_allclose(np.asarray(out), expected)
    np.testing.assert_allclose(np.asarray(shape_rewards(rewards)), rewards)
    with pytest.raises(ValueError, match=r"shape_rewards: clip=-1.0"):
        shape_rewards(rewards, clip=-1.0)


def test_overlong_penalty_is_dapo_soft_punishment():
    max_len, cache, factor = 20, 8, 0.5
    lengths = np.arange(0, 26)
    out = np.asarray(overlong_penalty(lengths, max_response_length=max_len, overlong_tokens=cache,
                                      penalty_factor=factor))
    for length, got in zip(lengths, out, strict=True):
        if length <= max_len - cache:
            expected = 0.0
        elif length <= max_len:
            expected = (max_len - cache - length) / cache * factor
        else:
            expected = -factor
        # (max - cache - length) / cache * factor: a subtraction of integers (exact), a
        # division and a product: two roundings.
        assert got == pytest.approx(expected, rel=2 * UNIT_ROUNDOFF_F32, abs=0), length
    with pytest.raises(ValueError, match=r"overlong_tokens=30"):
        overlong_penalty(lengths, max_response_length=20, overlong_tokens=30)


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_token_kl_matches_reference(estimator):
    rng = np.random.default_rng(5)
    logp = -rng.uniform(0.1, 3.0, (3, 5)).astype(np.float32)
    ref = (logp + rng.normal(0, 0.5, (3, 5))).astype(np.float32)
    mask = rng.random((3, 5)) < 0.7
    ref_masked = np.where(mask, ref, 500.0).astype(np.float32)  # garbage under the mask
    out = token_kl(jnp.asarray(logp, jnp.bfloat16).astype(jnp.float32), ref_masked, estimator,
                   mask=mask)
    lp = np.asarray(jnp.asarray(logp, jnp.bfloat16).astype(jnp.float32), np.float64)
    expected = np.zeros((3, 5))
    for b in range(3):
        for t in range(5):
            if not mask[b, t]:
                continue
            x = ref[b, t] - lp[b, t]
            expected[b, t] = {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[estimator]
    # x = ref - logp is rounded once (error u |x| <= u (|ref| + |logp|)); that moves k1 by it,
    # k2 = x^2 / 2 by |x| times it, k3 = exp(x) - 1 - x by |exp(x) - 1| times it; then each
    # estimator's own few operations on terms of size |x|, x^2 / 2, exp(x) + 1 + |x|.
    x = np.where(mask, ref - lp, 0.0)
    dx = UNIT_ROUNDOFF_F32 * (np.abs(ref) + np.abs(lp))
    moved, size = {"k1": (dx, np.abs(x)), "k2": (np.abs(x) * dx, 0.5 * x * x),
                   "k3": (np.abs(np.expm1(x)) * dx, np.exp(x) + 1 + np.abs(x))}[estimator]
    tol = np.where(mask, moved + reference_tolerance(size, 1, ops=4), 0.0)
    assert np.all(np.abs(np.asarray(out) - expected) <= tol)
    grad = jax.grad(lambda lp_: token_kl(lp_, ref_masked, estimator, mask=mask).sum())(
        jnp.asarray(logp, jnp.bfloat16))
    assert grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(grad, np.float32)))
    with pytest.raises(ValueError, match="estimator='k4'"):
        token_kl(logp, ref, "k4")


# ----------------------------------------------------------------------------- value loss


def reference_value_loss(values, old, returns, mask, clip):
    total, n, clipped = 0.0, 0, 0
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not mask[b, t]:
                continue
            plain = 0.5 * (values[b, t] - returns[b, t]) ** 2
            if clip is None:
                loss = plain
            else:
                v_clip = old[b, t] + min(max(values[b, t] - old[b, t], -clip), clip)
                clipped_loss = 0.5 * (v_clip - returns[b, t]) ** 2
                clipped += clipped_loss > plain
                loss = max(plain, clipped_loss)
            total += loss
            n += 1
    return total / max(n, 1), clipped / max(n, 1)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_reference(clip):
    rng = np.random.default_rng(6)
    old = rng.normal(size=(3, 7)).astype(np.float32)
    values = (old + rng.normal(0, 0.4, (3, 7))).astype(np.float32)
    returns = rng.normal(size=(3, 7)).astype(np.float32)
    mask = rng.random((3, 7)) < 0.7
    loss, stats = jax.jit(
        lambda v: ppo_value_loss(v, old, returns, mask, value_eps_clip=clip))(values)
    ref_loss, ref_clip_frac = reference_value_loss(
        values.astype(np.float64), old, returns, mask, clip)
    # A mean over the valid tokens of squares of differences: each (v - R) is rounded within
    # u (|v| + |old| + |R|), moving its half square by |v - R| times that, plus the few
    # operations of the (clipped) square on terms of size (|v| + |old| + |R|)^2.
    size = (np.abs(values) + np.abs(old) + np.abs(returns)).astype(np.float64)[mask]
    tol = float(reference_tolerance((size**2).sum(), mask.sum(), ops=8) / mask.sum())
    assert abs(float(loss) - ref_loss) <= tol, (float(loss), ref_loss, tol)
    # A count over a count: one rounding.
    assert float(stats["value_clip_frac"]) == pytest.approx(ref_clip_frac,
                                                            rel=UNIT_ROUNDOFF_F32, abs=0)
    if clip is not None:
        assert 0 < ref_clip_frac < 1
    grad = jax.grad(lambda v: ppo_value_loss(v, old, returns, mask, value_eps_clip=clip)[0])(
        jnp.asarray(values, jnp.bfloat16))
    assert grad.dtype == jnp.bfloat16
    assert np.all(np.asarray(grad, np.float32)[~mask] == 0.0)


def test_value_loss_fully_masked_and_errors():
    zeros = np.zeros((2, 3), np.float32)
    loss, stats = ppo_value_loss(zeros + 5, zeros, zeros, zeros)
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in stats.values())
    with pytest.raises(ValueError,
                       match=r"returns has shape \(2, 2\) but values has shape \(2, 3\)"):
        ppo_value_loss(zeros, zeros, np.zeros((2, 2)), zeros)
