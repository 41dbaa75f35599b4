"""decoupled_ppo_loss's behaviour corrections (TIS, IcePop, sequence-level weights and
masks) against the independent NumPy loop reference of test_losses_ppo.py, with and
without the decoupled loss, on rows and on packed segments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.losses import BEHAV_CORRECTIONS, decoupled_ppo_loss
from tests.test_losses_ppo import (
    check_stats,
    loss_tolerance,
    make_inputs,
    packed_segments,
    reference_ppo,
)
from tests.tolerance import UNIT_ROUNDOFF_F32

# Per mode: its parameters, chosen so that on make_inputs some tokens are corrected and
# most are not (checked by test_inputs_exercise_every_correction).
MODES = {
    "cap": dict(behav_correction_cap=1.3),
    "tis": dict(behav_correction_cap=1.3),
    "icepop": dict(behav_correction_low=0.7, behav_correction_high=1.4),
    "seq_tis": dict(behav_correction_cap=2.0),
    "seq_tis_geo": dict(behav_correction_cap=1.1),
    "seq_mask": dict(behav_correction_low=0.3, behav_correction_high=3.0),
    "seq_mask_geo": dict(behav_correction_low=0.85, behav_correction_high=1.2),
}


def _loss(inp, mode, decoupled, seg=None, agg_mode="token-mean", **kw):
    return decoupled_ppo_loss(
        inp["logp"], inp["prox"] if decoupled else None, inp["behav"], inp["adv"], inp["mask"],
        eps_clip=0.2, c_clip=2.0, behav_correction=mode, agg_mode=agg_mode, segment_ids=seg,
        **MODES.get(mode, {}), **kw)


def _reference(inp, mode, decoupled, seg=None, agg_mode="token-mean"):
    p = MODES.get(mode, {})
    return reference_ppo(
        inp["logp"], inp["prox"] if decoupled else None, inp["behav"], inp["adv"], inp["mask"],
        eps_clip=0.2, c_clip=2.0, agg_mode=agg_mode, segment_ids=seg, correction=mode,
        corr_cap=p.get("behav_correction_cap"),
        band=(p.get("behav_correction_low"), p.get("behav_correction_high")))


def test_modes_are_the_documented_ones():
    assert set(BEHAV_CORRECTIONS) == {"none", *MODES}


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("mode", ["none", *MODES])
def test_matches_numpy_reference(mode, decoupled, packed, agg_mode):
    inp = make_inputs(seed=5)
    seg = packed_segments() if packed else None
    if packed:
        inp["mask"] = inp["mask"] * (seg > 0)
    loss, stats = _loss(inp, mode, decoupled, seg, agg_mode)
    ref_loss, ref_stats = _reference(inp, mode, decoupled, seg, agg_mode)
    assert abs(float(loss) - ref_loss) <= loss_tolerance(inp), (float(loss), ref_loss)
    check_stats(stats, ref_stats)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("mode", list(MODES))
def test_inputs_exercise_every_correction(mode, decoupled):
    """Guard for the test above: each mode really corrects some tokens, not all."""
    inp = make_inputs(seed=5)
    seg = packed_segments()
    inp["mask"] = inp["mask"] * (seg > 0)
    _, stats = _loss(inp, mode, decoupled, seg)
    key = "behav_trunc_frac" if "tis" in mode else "behav_mask_frac"
    assert 0.05 < float(stats[key]) < 0.9, (key, float(stats[key]))
    other = "behav_mask_frac" if "tis" in mode else "behav_trunc_frac"
    assert float(stats[other]) == 0.0


@pytest.mark.parametrize("decoupled", [True, False])
def test_icepop_masked_tokens_get_no_gradient(decoupled):
    inp = make_inputs(seed=2)
    grad = jax.grad(lambda lp: _loss({**inp, "logp": lp}, "icepop", decoupled)[0])(
        jnp.asarray(inp["logp"]))
    target = inp["prox"] if decoupled else inp["logp"]
    rho = np.exp(target.astype(np.float64) - inp["behav"])
    p = MODES["icepop"]
    outside = (inp["mask"] != 0) & ((rho < p["behav_correction_low"])
                                    | (rho > p["behav_correction_high"]))
    assert outside.sum() > 3
    assert np.all(np.asarray(grad)[outside] == 0.0)
    kept = (inp["mask"] != 0) & ~outside
    assert np.count_nonzero(np.asarray(grad)[kept]) > 5  # clipped ones have none either


def test_tis_without_decoupling_weights_the_gradient_by_min_r_c():
    """Decoupled off, no clip active: the token's gradient is that of -A min(r, C), i.e.
    -A r min(1, C / r) / N: TIS's truncated weight on the score function."""
    inp = make_inputs(seed=4)
    cap = 1.3
    fn = lambda lp: decoupled_ppo_loss(  # noqa: E731
        lp, None, inp["behav"], inp["adv"], inp["mask"], eps_clip=0.999, eps_clip_higher=1e6,
        behav_correction="tis", behav_correction_cap=cap)[0]
    grad = np.asarray(jax.grad(fn)(jnp.asarray(inp["logp"])), np.float64)
    r = np.exp(inp["logp"].astype(np.float64) - inp["behav"])
    want = -inp["adv"] * r * np.minimum(1.0, cap / r) * inp["mask"] / inp["mask"].sum()
    assert ((r > cap) & (inp["mask"] != 0)).sum() > 3
    # per token: exp of an fp32 log difference (its rounding, u (|logp| + |behav|), becomes
    # relative), then a few products and a division by N: a few u more.
    rel = (np.abs(inp["logp"]) + np.abs(inp["behav"]) + 6) * UNIT_ROUNDOFF_F32
    np.testing.assert_allclose(grad, want, rtol=rel.max(), atol=0)


def test_sequence_product_does_not_overflow():
    """A long sequence whose product ratio is e^400 is truncated, not inf/NaN."""
    rows, cols = 1, 400
    behav = np.full((rows, cols), -2.0, np.float32)
    prox = behav + 1.0
    loss, stats = decoupled_ppo_loss(
        prox, prox, behav, np.ones((rows, cols), np.float32), np.ones((rows, cols)),
        behav_correction="seq_tis", behav_correction_cap=2.0)
    assert np.isfinite(float(loss)) and float(stats["behav_trunc_frac"]) == 1.0
    # every token's weight is C = 2 and r = 1: loss = mean(-A * 2) = -2
    assert float(loss) == -2.0  # 400 terms of -2 (exact in fp32), over 400


@pytest.mark.parametrize("kw, message", [
    (dict(behav_correction="bogus"), r"behav_correction='bogus'; expected one of"),
    (dict(behav_correction="tis"), r"behav_correction='tis' needs behav_correction_cap"),
    (dict(behav_correction="icepop", behav_correction_low=0.5),
     r"needs behav_correction_low and behav_correction_high"),
    (dict(behav_correction="icepop", behav_correction_low=2.0, behav_correction_high=0.5),
     r"behav_correction_low=2.0 must be < behav_correction_high=0.5"),
    (dict(behav_correction="tis", behav_correction_cap=2.0, behav_imp_weight_cap=5.0),
     r"behav_imp_weight_cap=5.0 is the 'cap' correction; it contradicts"),
    (dict(behav_correction_cap=2.0, behav_imp_weight_cap=5.0), r"disagree"),
])
def test_bad_arguments_name_the_key(kw, message):
    inp = make_inputs(seed=0)
    with pytest.raises(ValueError, match=message):
        decoupled_ppo_loss(inp["logp"], inp["prox"], inp["behav"], inp["adv"], inp["mask"], **kw)


def test_jit_bf16_inputs_match_fp32():
    inp = make_inputs(seed=6)
    seg = packed_segments()
    inp["mask"] = inp["mask"] * (seg > 0)
    bf = {k: (jnp.asarray(v, jnp.bfloat16) if v.dtype == np.float32 else v)
          for k, v in inp.items()}
    fp = {k: (np.asarray(jnp.asarray(v, jnp.float32)) if k in ("logp", "prox", "behav", "adv")
              else v) for k, v in bf.items()}
    fn = jax.jit(lambda d: _loss(d, "seq_mask_geo", True, seg, max_segments=T_SEG)[0])
    np.testing.assert_allclose(float(fn(bf)), float(_loss(fp, "seq_mask_geo", True, seg)[0]),
                               rtol=1e-6)


T_SEG = 4  # packed_segments has at most 3 segments per row


# ----------------------------------------------------------------------------- the learner


def test_learner_icepop_from_algo_config_zeroes_the_masked_tokens_gradient():
    """algo.behav_correction=icepop reaches the learner's loss: tokens whose behaviour
    logprob is 3 nats below the learner's (rho = e^3, outside [0.5, 2]) contribute no
    gradient (the same as zero advantages there), and the step reports them masked."""
    import copy

    from areal_jax.learner import AlgoConfig, pack_trajectories
    from areal_jax.parallel import make_mesh
    from tests._learner_data import make_learner, random_advantages, random_trajectories

    trajs = random_trajectories(21, 8, 30, max_version=0)
    batches = pack_trajectories(trajs, random_advantages(21, trajs), seq_len=32,
                                rows_per_micro_batch=4, n_shards=1)
    mesh = make_mesh("data=1", jax.devices()[:1])

    def learner(mode):
        return make_learner(mesh, algo=AlgoConfig(ppo_n_minibatches=1, behav_correction=mode,
                                                  behav_correction_low=0.5,
                                                  behav_correction_high=2.0))

    icepop = learner("icepop")
    chosen, n_valid = 0, 0
    for b, held in zip(batches, icepop.compute_logp(batches), strict=True):
        valid = np.asarray(b.loss_mask) != 0
        far = valid & (np.cumsum(valid).reshape(valid.shape) % 3 == 0)
        b.behav_logp = np.where(far, held - 3.0, held).astype(np.float32)
        b.far = far
        chosen, n_valid = chosen + far.sum(), n_valid + valid.sum()
    zeroed = copy.deepcopy(batches)
    for b in zeroed:
        b.advantages = np.where(b.far, 0.0, b.advantages).astype(np.float32)
    assert 0.2 < chosen / n_valid < 0.5

    def grads(lrn, mbs):
        return [np.asarray(g) for g in jax.tree.leaves(lrn.compute_gradients(mbs)[1])]

    # The two gradients differ only by fp32 rounding of the same sums over the kept tokens.
    for a, z in zip(grads(icepop, batches), grads(icepop, zeroed), strict=True):
        np.testing.assert_allclose(a, z, rtol=1e-5, atol=1e-7)
    none = learner("none")  # control: without the correction the far tokens do count
    differs = [not np.allclose(a, z, rtol=1e-3, atol=1e-6)
               for a, z in zip(grads(none, batches), grads(none, zeroed), strict=True)]
    assert any(differs)
    metrics = icepop.train_step(batches)
    # integer counts (exact in fp32) divided once: one rounding
    assert metrics["behav_mask_frac"] == pytest.approx(chosen / n_valid, rel=UNIT_ROUNDOFF_F32,
                                                       abs=0)
    assert metrics["behav_trunc_frac"] == 0.0 and metrics["cap_drop_frac"] == 0.0


def test_algo_config_selects_and_validates_the_correction():
    from areal_jax.learner import AlgoConfig

    assert AlgoConfig().behav_correction_kwargs["behav_correction"] == "none"
    assert AlgoConfig(behav_imp_weight_cap=5.0).resolved_behav_correction == "cap"
    assert AlgoConfig(behav_imp_weight_cap=5.0).behav_correction_kwargs == {
        "behav_imp_weight_cap": 5.0}
    assert AlgoConfig(behav_correction="tis").behav_correction_kwargs["behav_correction_cap"] == 2.0
    kw = AlgoConfig(behav_correction="seq_mask_geo", behav_correction_low=0.9,
                    behav_correction_high=1.1).behav_correction_kwargs
    assert (kw["behav_correction_low"], kw["behav_correction_high"]) == (0.9, 1.1)
    for bad, message in [
        (dict(behav_correction="trunc"), r"algo.behav_correction='trunc'; expected one of"),
        (dict(behav_correction="tis", behav_imp_weight_cap=5.0),
         r"algo.behav_imp_weight_cap=5.0 is the 'cap' correction"),
        (dict(behav_correction_cap=0.0), r"algo.behav_correction_cap must be > 0"),
        (dict(behav_correction_low=2.0), r"algo.behav_correction_low=2.0 and "),
    ]:
        with pytest.raises(ValueError, match=message):
            AlgoConfig(**bad)
