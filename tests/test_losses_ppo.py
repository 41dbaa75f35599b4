"""decoupled_ppo_loss against an independent NumPy loop reference, its properties, and
its behaviour under jit / grad / bf16 / micro-batching / bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.losses import (
    AGG_MODES,
    PPOInputs,
    PPOLossConfig,
    combine_ppo_terms,
    decoupled_ppo_loss,
    decoupled_ppo_loss_terms,
    empty_ppo_terms,
    loss_denominator,
    ppo_stats_from_terms,
)
from tests.tolerance import UNIT_ROUNDOFF_F32, sum_tolerance

B, T = 4, 12
REFERENCE_SCALE = [0.0]  # set by each reference_ppo call: the loss's aggregated |terms|


def token_tolerance(inputs: dict) -> float:
    """fp32 bound, relative, on one token's term against float64: exp of a difference of
    fp32 logprobs (error ~ u·(|logp| + |prox| + |behav|), a few u more for exp and the
    products)."""
    log_size = max(float(np.abs(inputs[k]).max()) for k in ("logp", "prox", "behav"))
    return 4 * (3 * log_size + 4) * UNIT_ROUNDOFF_F32


def loss_tolerance(inputs: dict, scale: float | None = None) -> float:
    """fp32 bound on the loss against the float64 reference: each token's term within
    ``token_tolerance``, then a sum over at most B·T tokens, both relative to the aggregated
    |terms| (``scale``; default: the last ``reference_ppo`` call's)."""
    scale = REFERENCE_SCALE[0] if scale is None else scale
    return float((token_tolerance(inputs) + sum_tolerance(1.0, B * T)) * scale)
SEQ_NORM = 16.0  # the constant L of seq-mean-token-sum in these tests


# ----------------------------------------------------------------------------- reference


def reference_ppo(logp, prox, behav, adv, mask, *, eps_clip, eps_clip_higher=None, c_clip=None,
                  cap=None, agg_mode="token-mean", seq_norm=None, ratio_level="token",
                  segment_ids=None, versions=None, current_version=None, correction=None,
                  corr_cap=None, band=None):
    """Plain-Python loops over tokens, in float64. Returns (loss, stats).

    ``prox=None``: the decoupled loss off (prox = behav); the correction's ratio is then
    the current policy's, and the token's weight W / rho (module docstring of ppo.py), except
    for the legacy ``cap`` (behav_imp_weight_cap), which always caps exp(prox - behav)."""
    decoupled = prox is not None
    prox = behav if prox is None else prox
    logp, prox, behav, adv = (np.asarray(x, np.float64) for x in (logp, prox, behav, adv))
    mask = np.asarray(mask) != 0
    rows, cols = logp.shape
    high = eps_clip if eps_clip_higher is None else eps_clip_higher

    def seq_key(b, t):
        if segment_ids is None:
            return (b, 1)
        s = int(segment_ids[b][t])
        return None if s == 0 else (b, s)

    weight, keep, rho = {}, {}, {}
    for b in range(rows):
        for t in range(cols):
            if mask[b, t] and seq_key(b, t) is not None:  # segment 0 is padding
                weight[b, t] = math.exp(prox[b, t] - behav[b, t])
                target = prox if decoupled or cap is not None else logp
                rho[b, t] = math.exp(target[b, t] - behav[b, t])
    mode, c = ("cap", cap) if cap is not None else (correction or "none", corr_cap)
    seq_logs = {}
    for (b, t), r in rho.items():
        seq_logs.setdefault(seq_key(b, t), []).append(math.log(r))
    seq_stat = {k: math.exp(sum(v) / (len(v) if mode.endswith("_geo") else 1))
                for k, v in seq_logs.items()}
    applied, truncated = {}, 0
    for (b, t), r in rho.items():
        stat = seq_stat[seq_key(b, t)] if mode.startswith("seq_") else r
        w_corr = r
        keep[b, t] = True
        if mode == "cap":
            keep[b, t] = r <= c
        elif mode in ("icepop", "seq_mask", "seq_mask_geo"):
            keep[b, t] = band[0] <= stat <= band[1]
        elif mode in ("tis", "seq_tis", "seq_tis_geo"):
            w_corr = min(stat, c)
            truncated += stat > c
        applied[b, t] = w_corr / r * weight[b, t]

    seq_log_ratio = {}
    if ratio_level == "sequence":
        acc = {}
        for (b, t), kept in keep.items():
            if kept:
                total, n = acc.get(seq_key(b, t), (0.0, 0))
                acc[seq_key(b, t)] = (total + logp[b, t] - prox[b, t], n + 1)
        seq_log_ratio = {k: total / n for k, (total, n) in acc.items()}

    contrib, clipped, dual = {}, 0, 0
    for (b, t), kept in keep.items():
        if not kept:
            contrib[b, t] = 0.0
            continue
        if ratio_level == "sequence":
            ratio = math.exp(seq_log_ratio[seq_key(b, t)])
        else:
            ratio = math.exp(logp[b, t] - prox[b, t])
        a = adv[b, t]
        unclipped = -a * ratio
        clipped_loss = -a * min(max(ratio, 1 - eps_clip), 1 + high)
        token_loss = max(unclipped, clipped_loss)
        if clipped_loss > unclipped:
            clipped += 1
        if c_clip is not None and a < 0 and token_loss > c_clip * abs(a):
            token_loss = c_clip * abs(a)
            dual += 1
        contrib[b, t] = applied[b, t] * token_loss

    n_valid = len(keep)

    def aggregate(per_token: dict) -> float:
        if agg_mode == "token-mean":
            return sum(per_token.values()) / max(n_valid, 1)
        per_seq_sum, per_seq_count = {}, {}
        for (b, t), c in per_token.items():
            k = seq_key(b, t)
            per_seq_sum[k] = per_seq_sum.get(k, 0.0) + c
            per_seq_count[k] = per_seq_count.get(k, 0) + 1
        if agg_mode == "seq-mean-token-mean":
            per_seq = [per_seq_sum[k] / per_seq_count[k] for k in per_seq_sum]
        else:
            per_seq = [per_seq_sum[k] / seq_norm for k in per_seq_sum]
        return sum(per_seq) / max(len(per_seq), 1)

    loss = aggregate(contrib)
    # The same aggregation of |terms|: the scale that fp32 rounding of the loss is relative to.
    REFERENCE_SCALE[0] = aggregate({k: abs(c) for k, c in contrib.items()})

    ws = list(weight.values())
    n = max(n_valid, 1)
    stats = {
        "clip_frac": clipped / n,
        "dual_clip_frac": dual / n,
        "cap_drop_frac": sum(not k for k in keep.values()) / n if mode == "cap" else 0.0,
        "behav_mask_frac": sum(not k for k in keep.values()) / n,
        "behav_trunc_frac": truncated / n,
        "behav_imp_weight_mean": sum(ws) / n,
        "behav_imp_weight_max": max(ws, default=0.0),
        "approx_kl": sum(math.exp(logp[b, t] - prox[b, t]) - 1 - (logp[b, t] - prox[b, t])
                         for (b, t) in keep) / n,
    }
    if versions is not None:
        stale = [current_version - int(versions[b][t]) for (b, t) in keep]
        stats["staleness_mean"] = sum(stale) / n
        stats["staleness_max"] = max(stale, default=0)
    return loss, stats


# ----------------------------------------------------------------------------- inputs


def make_inputs(seed: int, rows: int = B, cols: int = T, spread: float = 0.5):
    """Random inputs where the cap, both clips and the dual clip all trigger."""
    rng = np.random.default_rng(seed)
    behav = -rng.uniform(0.1, 3.0, (rows, cols))
    prox = behav + rng.normal(0.0, spread, (rows, cols))
    logp = prox + rng.normal(0.0, spread, (rows, cols))
    adv = rng.normal(0.0, 1.0, (rows, cols))
    mask = (rng.random((rows, cols)) < 0.75).astype(np.int32)
    mask[0, :] = 1
    versions = rng.integers(0, 5, (rows, cols)).astype(np.int32)
    f32 = lambda x: x.astype(np.float32)  # noqa: E731
    return dict(logp=f32(logp), prox=f32(prox), behav=f32(behav), adv=f32(adv), mask=mask,
                versions=versions)


def packed_segments(rows: int = B, cols: int = T) -> np.ndarray:
    """Two or three sequences per row, then padding."""
    seg = np.zeros((rows, cols), np.int32)
    for b in range(rows):
        cuts = [0, 3 + b % 3, 7 + b % 2, cols - 1 - b % 2]
        for i in range(len(cuts) - 1):
            seg[b, cuts[i]:cuts[i + 1]] = i + 1
    return seg


HPARAMS = [
    dict(eps_clip=0.2),
    dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=1.5, cap=1.6),
]


def call(inp, hp, **kw):
    return decoupled_ppo_loss(
        inp["logp"], inp["prox"], inp["behav"], inp["adv"], inp["mask"],
        eps_clip=hp["eps_clip"], eps_clip_higher=hp.get("eps_clip_higher"),
        c_clip=hp.get("c_clip"), behav_imp_weight_cap=hp.get("cap"), **kw)


def check_stats(stats, ref_stats):
    # Fractions are exact counts / n; the means are of exp(fp32 log differences of size <= 6)
    # over <= 48 tokens: a few tens of u (rtol 1e-5 = 84 u), and atol for means near 0.
    assert set(stats) == set(ref_stats)
    for k, v in ref_stats.items():
        np.testing.assert_allclose(float(stats[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)


# ----------------------------------------------------------------------------- reference comparison


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("hp_index", range(len(HPARAMS)))
def test_matches_numpy_reference(agg_mode, ratio_level, packed, hp_index):
    hp = HPARAMS[hp_index]
    inp = make_inputs(seed=hp_index * 7 + 1)
    seg = packed_segments() if packed else None
    seq_norm = SEQ_NORM if agg_mode == "seq-mean-token-sum" else None
    if packed:  # padding tokens are never valid
        inp["mask"] = inp["mask"] * (seg > 0)
    loss, stats = call(inp, hp, agg_mode=agg_mode, seq_token_sum_normalizer=seq_norm,
                       ratio_level=ratio_level, segment_ids=seg, versions=inp["versions"],
                       current_version=6)
    ref_loss, ref_stats = reference_ppo(
        inp["logp"], inp["prox"], inp["behav"], inp["adv"], inp["mask"],
        eps_clip=hp["eps_clip"], eps_clip_higher=hp.get("eps_clip_higher"),
        c_clip=hp.get("c_clip"), cap=hp.get("cap"), agg_mode=agg_mode, seq_norm=seq_norm,
        ratio_level=ratio_level, segment_ids=seg, versions=inp["versions"], current_version=6)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert abs(float(loss) - ref_loss) <= loss_tolerance(inp), (float(loss), ref_loss)
    check_stats(stats, ref_stats)


def test_inputs_exercise_every_branch():
    """Guard for the test above: the random inputs really clip, dual-clip and cap."""
    hp = HPARAMS[1]
    _, stats = call(make_inputs(seed=8), hp)
    for key in ("clip_frac", "dual_clip_frac", "cap_drop_frac"):
        assert 0.0 < float(stats[key]) < 0.5, (key, float(stats[key]))


def test_eps_clip_higher_changes_only_the_upper_side():
    inp = make_inputs(seed=3)
    lo, _ = call(inp, dict(eps_clip=0.2))
    hi, _ = call(inp, dict(eps_clip=0.2, eps_clip_higher=0.5))
    ref_hi, _ = reference_ppo(inp["logp"], inp["prox"], inp["behav"], inp["adv"], inp["mask"],
                              eps_clip=0.2, eps_clip_higher=0.5)
    # Tighter than loss_tolerance (8e-6 here, 13x): kept as it has always passed.
    np.testing.assert_allclose(float(hi), ref_hi, rtol=1e-5)
    assert float(hi) != pytest.approx(float(lo))


# ----------------------------------------------------------------------------- properties


def standard_clipped_ppo(logp, old_logp, adv, mask, eps):
    """(loss, Σ|terms| / n) in float64."""
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps, 1 + eps))
    return float((loss * mask).sum() / mask.sum()), float((np.abs(loss) * mask).sum() / mask.sum())


def test_prox_equal_behav_is_standard_clipped_ppo():
    inp = make_inputs(seed=11)
    expected, _ = standard_clipped_ppo(inp["logp"], inp["behav"], inp["adv"], inp["mask"], 0.2)
    for prox in (inp["behav"], None):
        loss, stats = decoupled_ppo_loss(inp["logp"], prox, inp["behav"], inp["adv"], inp["mask"],
                                         eps_clip=0.2, behav_imp_weight_cap=1.5)
        # Tighter than loss_tolerance(inp, scale) (4.6e-6 here, 18x): kept.
        np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
        assert float(stats["behav_imp_weight_max"]) == 1.0
        assert float(stats["cap_drop_frac"]) == 0.0


@pytest.mark.parametrize("cap", [None, 1.6])
def test_first_minibatch_gradient_is_importance_weighted_policy_gradient(cap):
    """With logp == prox: d loss / d logp_t = -m'_t w_t A_t / sum_t m_t."""
    inp = make_inputs(seed=12)
    prox = inp["prox"]

    def loss_fn(logp):
        return decoupled_ppo_loss(logp, prox, inp["behav"], inp["adv"], inp["mask"],
                                  eps_clip=0.2, c_clip=3.0, behav_imp_weight_cap=cap)[0]

    grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(prox)))
    w = np.exp(prox.astype(np.float64) - inp["behav"])
    kept = (inp["mask"] != 0) & ((w <= cap) if cap is not None else True)
    expected = np.where(kept, -w * inp["adv"], 0.0) / inp["mask"].sum()
    # Each element is one token's -w A / n: its own rounding only (dropped tokens: exact 0).
    np.testing.assert_allclose(grad, expected, rtol=token_tolerance(inp), atol=0)
    if cap is not None:
        assert (kept != (inp["mask"] != 0)).any()  # some tokens were really dropped


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_tokens_over_cap_contribute_no_gradient(agg_mode, ratio_level):
    inp = make_inputs(seed=13)
    cap = 1.3
    kw = dict(eps_clip=0.2, c_clip=2.0, behav_imp_weight_cap=cap, agg_mode=agg_mode,
              ratio_level=ratio_level,
              seq_token_sum_normalizer=SEQ_NORM if agg_mode == "seq-mean-token-sum" else None)

    def loss_fn(logp):
        return decoupled_ppo_loss(logp, inp["prox"], inp["behav"], inp["adv"], inp["mask"], **kw)[0]

    over_cap = (inp["mask"] != 0) & (np.exp(inp["prox"] - inp["behav"]) > cap)
    assert over_cap.sum() >= 3
    grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(inp["logp"])))
    assert np.all(grad[over_cap] == 0.0)
    assert np.any(grad[~over_cap & (inp["mask"] != 0)] != 0.0)
    # Moving their logp does not move the loss either.
    moved = np.where(over_cap, inp["logp"] + 1.7, inp["logp"]).astype(np.float32)
    # Their terms are dropped (multiplied out), not small: the loss is the same number.
    assert float(loss_fn(moved)) == float(loss_fn(inp["logp"]))


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_fully_masked_gives_zero_loss_and_no_nan(agg_mode, ratio_level):
    inp = make_inputs(seed=14)
    garbage = np.full((B, T), 900.0, np.float32)  # exp(900) overflows fp32
    mask = np.zeros((B, T), np.int32)
    kw = dict(eps_clip=0.2, c_clip=2.0, behav_imp_weight_cap=2.0, agg_mode=agg_mode,
              ratio_level=ratio_level, versions=inp["versions"], current_version=3,
              seq_token_sum_normalizer=SEQ_NORM if agg_mode == "seq-mean-token-sum" else None)

    def loss_fn(logp, prox):
        return decoupled_ppo_loss(logp, prox, -garbage, inp["adv"], mask, **kw)

    (loss, stats), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        jnp.asarray(garbage), jnp.asarray(-garbage))
    assert float(loss) == 0.0
    for g in grads:
        assert np.all(np.asarray(g) == 0.0)
    for k, v in stats.items():
        assert float(v) == 0.0, k


def test_garbage_on_masked_tokens_does_not_leak():
    inp = make_inputs(seed=15)
    masked = inp["mask"] == 0
    dirty = {k: (np.where(masked, 900.0, v).astype(np.float32) if k in ("logp", "behav") else v)
             for k, v in inp.items()}
    clean_loss, clean_stats = call(inp, HPARAMS[1])
    dirty_loss, dirty_stats = call(dirty, HPARAMS[1])
    assert float(dirty_loss) == float(clean_loss)  # masked terms are selected out: the same sum
    check_stats(dirty_stats, {k: float(v) for k, v in clean_stats.items()})


def test_staleness_definition():
    inp = make_inputs(seed=16)
    _, stats = call(inp, HPARAMS[0], versions=inp["versions"], current_version=9)
    valid = inp["mask"] != 0
    # An integer sum (exact in fp32) and one division: one rounding.
    assert float(stats["staleness_mean"]) == pytest.approx(
        9 - inp["versions"][valid].mean(), rel=UNIT_ROUNDOFF_F32, abs=0)
    assert float(stats["staleness_max"]) == 9 - inp["versions"][valid].min()


# ----------------------------------------------------------------------------- sum and count form


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_micro_batches_with_global_normalizer_match_the_full_batch(agg_mode):
    inp = make_inputs(seed=17, rows=6)
    seg = packed_segments(rows=6)
    seq_norm = SEQ_NORM if agg_mode == "seq-mean-token-sum" else None
    kw = dict(eps_clip=0.2, eps_clip_higher=0.3, c_clip=2.0, behav_imp_weight_cap=1.6,
              agg_mode=agg_mode, seq_token_sum_normalizer=seq_norm, max_segments=3,
              current_version=5)
    names = ("prox", "behav", "adv", "mask", "versions")

    @jax.jit
    def full_loss_and_grad(logp, prox, behav, adv, mask, versions, seg):
        def loss_fn(lp):
            return decoupled_ppo_loss(lp, prox, behav, adv, mask, segment_ids=seg,
                                      versions=versions, **kw)
        return jax.value_and_grad(loss_fn, has_aux=True)(logp)

    @jax.jit
    def micro_step(logp, prox, behav, adv, mask, versions, seg, normalizer):
        def loss_fn(lp):
            inputs = PPOInputs(logp=lp, prox_logp=prox, behav_logp=behav, advantages=adv,
                               loss_mask=mask, segment_ids=seg, versions=versions,
                               max_segments=kw["max_segments"],
                               current_version=kw["current_version"])
            knobs = {k: v for k, v in kw.items() if k not in ("max_segments", "current_version")}
            terms = decoupled_ppo_loss_terms(inputs, PPOLossConfig(**knobs))
            return terms.loss_sum / normalizer, terms
        return jax.value_and_grad(loss_fn, has_aux=True)(logp)

    micro = [slice(0, 2), slice(2, 4), slice(4, 6)]
    # The global denominator is computed first, from the masks alone.
    global_count = sum(loss_denominator(inp["mask"][s], agg_mode=agg_mode, segment_ids=seg[s],
                                        max_segments=3) for s in micro)
    total_loss, grads, terms = 0.0, [], empty_ppo_terms(with_staleness=True)
    for s in micro:
        (value, mb_terms), grad = micro_step(inp["logp"][s], *(inp[k][s] for k in names), seg[s],
                                             global_count)
        total_loss += float(value)
        grads.append(np.asarray(grad))
        terms = combine_ppo_terms(terms, mb_terms)

    (loss, stats), grad = full_loss_and_grad(inp["logp"], *(inp[k] for k in names), seg)
    reference_ppo(inp["logp"], inp["prox"], inp["behav"], inp["adv"], inp["mask"],
                  eps_clip=0.2, eps_clip_higher=0.3, c_clip=2.0, cap=1.6, agg_mode=agg_mode,
                  seq_norm=seq_norm, segment_ids=seg, versions=inp["versions"],
                  current_version=5)  # for the terms' size (REFERENCE_SCALE)
    both = 2 * loss_tolerance(inp)  # two fp32 evaluations, each within it of the exact loss
    assert abs(total_loss - float(loss)) <= both, (total_loss, float(loss))
    # Per token: the same formula, the same normaliser; only its own rounding differs.
    np.testing.assert_allclose(np.concatenate(grads), np.asarray(grad),
                               rtol=2 * token_tolerance(inp), atol=0)
    np.testing.assert_allclose(float(terms.denominator), float(global_count))
    assert abs(float(terms.loss_sum / terms.denominator) - float(loss)) <= both
    check_stats(ppo_stats_from_terms(terms), {k: float(v) for k, v in stats.items()})


def test_loss_denominator_counts():
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]])
    seg = np.array([[1, 1, 2, 0], [1, 1, 0, 0], [1, 2, 2, 3]])
    assert float(loss_denominator(mask)) == 5.0
    assert float(loss_denominator(mask, agg_mode="seq-mean-token-mean")) == 2.0
    assert float(loss_denominator(mask, agg_mode="seq-mean-token-sum", segment_ids=seg)) == 3.0


# ----------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_jit_and_grad_with_bf16_inputs_compute_in_fp32(agg_mode):
    inp = make_inputs(seed=18)
    seg = packed_segments()
    bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in inp.items()
            if k in ("logp", "prox", "behav", "adv")}
    kw = dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=2.0, behav_imp_weight_cap=1.6,
              agg_mode=agg_mode, ratio_level="sequence", segment_ids=seg, max_segments=3,
              seq_token_sum_normalizer=SEQ_NORM if agg_mode == "seq-mean-token-sum" else None)

    @jax.jit
    def loss_and_grad(logp, prox, behav, adv):
        def loss_fn(lp):
            return decoupled_ppo_loss(lp, prox, behav, adv, inp["mask"], **kw)
        return jax.value_and_grad(loss_fn, has_aux=True)(logp)

    (loss, stats), grad = loss_and_grad(bf16["logp"], bf16["prox"], bf16["behav"], bf16["adv"])
    assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    assert all(v.dtype == jnp.float32 for v in stats.values())
    # Same as fp32 on the bf16-rounded values: all internal arithmetic is fp32.
    upcast = {k: np.asarray(v.astype(jnp.float32)) for k, v in bf16.items()}
    ref_loss, _ = reference_ppo(upcast["logp"], upcast["prox"], upcast["behav"], upcast["adv"],
                                inp["mask"], eps_clip=0.2, eps_clip_higher=0.28, c_clip=2.0,
                                cap=1.6, agg_mode=agg_mode, ratio_level="sequence",
                                segment_ids=seg, seq_norm=kw["seq_token_sum_normalizer"])
    assert abs(float(loss) - ref_loss) <= loss_tolerance(upcast), (float(loss), ref_loss)
    grad32 = jax.grad(lambda lp: decoupled_ppo_loss(lp, upcast["prox"], upcast["behav"],
                                                    upcast["adv"], inp["mask"], **kw)[0])(
        jnp.asarray(upcast["logp"]))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(grad32.astype(jnp.bfloat16)))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(prox=np.zeros((B, T + 1), np.float32)), r"prox_logp has shape \(4, 13\) but logp"),
        (dict(mask=np.ones((B,), np.int32)), r"loss_mask has shape \(4,\)"),
        (dict(logp=np.zeros((B, T), np.int32)), r"logp has dtype int32"),
        (dict(logp=np.zeros((B, T, 2), np.float32)),
         r"logp has shape \(4, 12, 2\); expected 2 dims"),
        (dict(kw=dict(agg_mode="seq-mean")), r"agg_mode='seq-mean'; expected one of"),
        (dict(kw=dict(ratio_level="seq")), r"ratio_level='seq'"),
        (dict(kw=dict(c_clip=1.0)), r"c_clip=1.0; expected a number in \(1.0, inf\]"),
        (dict(kw=dict(eps_clip=-0.1)), r"eps_clip=-0.1"),
        (dict(kw=dict(behav_imp_weight_cap=0)), r"behav_imp_weight_cap=0; expected a number > 0"),
        (dict(kw=dict(agg_mode="seq-mean-token-sum")), r"needs seq_token_sum_normalizer"),
        (dict(kw=dict(seq_token_sum_normalizer=4.0)),
         r"only used with agg_mode='seq-mean-token-sum'"),
        (dict(kw=dict(versions=np.zeros((B, T), np.int32))),
         r"versions given without current_version"),
        (dict(kw=dict(versions=np.zeros((B, T), np.float32), current_version=1)),
         r"versions has dtype float32"),
        (dict(kw=dict(agg_mode="seq-mean-token-mean", segment_ids=np.full((B, T), 4),
                      max_segments=3)), r"segment_ids range over \[4, 4\].*max_segments=3"),
        (dict(kw=dict(normalizer=-1.0)), r"normalizer=-1.0"),
    ],
)
def test_bad_input_gets_a_specific_error(change, match):
    inp = make_inputs(seed=19)
    kw = change.pop("kw", {})
    inp.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        decoupled_ppo_loss(inp["logp"], inp["prox"], inp["behav"], inp["adv"], inp["mask"], **kw)


def test_traced_segment_ids_need_max_segments():
    inp = make_inputs(seed=20)

    @jax.jit
    def f(seg):
        return decoupled_ppo_loss(inp["logp"], inp["prox"], inp["behav"], inp["adv"], inp["mask"],
                                  agg_mode="seq-mean-token-mean", segment_ids=seg)[0]

    with pytest.raises(ValueError, match="max_segments must be given"):
        f(packed_segments())
