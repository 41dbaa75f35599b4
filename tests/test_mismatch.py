"""Rollout-training mismatch apart from lag: the pure per-bucket terms against a NumPy
reference, the learner's metrics, the warning, and the plot."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from areal_jax.learner import AlgoConfig, pack_trajectories
from areal_jax.losses import lag_bucket_names, mismatch_stats, mismatch_terms
from areal_jax.metrics import MismatchWarner
from areal_jax.parallel import make_mesh
from tests._learner_data import make_learner, random_advantages, random_trajectories

REPO = Path(__file__).resolve().parent.parent


def _reference(logp, behav, mask, versions, current, n_buckets=4):
    """Independent NumPy: loop over tokens, bucket by lag, float64."""
    names = lag_bucket_names(n_buckets)
    acc = {n: [] for n in names}
    for d, m, v in zip((logp - behav).ravel().astype(np.float64), mask.ravel(),
                       versions.ravel(), strict=True):
        lag = current - v
        if not m or lag < 0:
            continue
        acc[names[min(lag, n_buckets - 1)]].append(d)
    total = sum(len(a) for a in acc.values())
    out = {}
    for n, ds in acc.items():
        out[f"{n}_frac"] = len(ds) / total
        if ds:
            ds = np.asarray(ds)
            out[f"{n}_abs_diff_mean"] = np.mean(np.abs(ds))
            out[f"{n}_abs_diff_max"] = np.max(np.abs(ds))
            out[f"{n}_kl"] = np.mean(np.exp(ds) - 1 - ds)
    return out


def _inputs(seed=0, shape=(4, 24), current=5, max_lag=6):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 3.0, shape).astype(np.float32)
    behav = (logp + rng.normal(0, 0.2, shape)).astype(np.float32)
    mask = rng.random(shape) < 0.8
    versions = current - rng.integers(-1, max_lag + 1, shape)  # lag -1: a newer version
    versions[:, :3] = -1  # prompt tokens
    mask[:, :3] = False
    behav[~mask] = 1e4  # garbage on invalid tokens must not leak (exp would overflow)
    return logp, behav, mask, versions, current


@pytest.mark.parametrize("n_buckets", [1, 4])
def test_terms_match_numpy_reference(n_buckets):
    logp, behav, mask, versions, current = _inputs()
    sums, maxes = jax.jit(mismatch_terms, static_argnames="n_buckets")(
        logp, behav, mask, versions, current, n_buckets=n_buckets)
    got = mismatch_stats(sums, maxes, n_buckets)
    want = _reference(logp, behav, mask, versions, current, n_buckets)
    assert set(got) == set(want)
    for k, v in want.items():  # fp32 sums of ~80 values of size <= 1: rtol 1e-5
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_empty_bucket_has_no_mean_and_agreement_is_zero():
    logp, _, mask, _, _ = _inputs(1)
    versions = np.where(mask, 7, -1)  # every valid token at lag 0
    sums, maxes = mismatch_terms(logp, logp, mask, versions, 7)
    stats = mismatch_stats(sums, maxes)
    assert stats["lag0_frac"] == 1.0 and stats["lag1_frac"] == 0.0
    assert stats["lag0_abs_diff_mean"] == 0.0 and stats["lag0_kl"] == 0.0
    assert "lag1_abs_diff_mean" not in stats and "lag3plus_kl" not in stats


def test_learner_metrics_split_mismatch_by_lag():
    """Tokens of versions 0..3 trained at version 3: the learner's metrics equal the
    reference computed from its own logprobs under the weights it holds."""
    trajs = random_trajectories(11, 12, 30, max_version=3)
    batches = pack_trajectories(trajs, random_advantages(11, trajs), seq_len=32,
                                rows_per_micro_batch=4, n_shards=1)
    learner = make_learner(make_mesh("data=1", jax.devices()[:1]),
                           algo=AlgoConfig(ppo_n_minibatches=1))
    held = learner.compute_logp(batches)  # the weights of the (only) step
    metrics = learner.train_step(batches, current_version=3)
    cat = {k: np.concatenate([np.asarray(getattr(b, k)).ravel() for b in batches])
           for k in ("behav_logp", "loss_mask", "versions")}
    want = _reference(np.concatenate([np.asarray(h).ravel() for h in held]),
                      cat["behav_logp"], cat["loss_mask"] != 0, cat["versions"], 3)
    assert all(want[f"{n}_frac"] > 0 for n in lag_bucket_names())
    for k, v in want.items():
        # Logprobs of two programs: fp32 rounding of |logp| < 10 (~1e-5), far below the
        # random behaviour gap (~1).
        assert metrics[f"mismatch/{k}"] == pytest.approx(v, rel=1e-4, abs=1e-5), k


def test_warner_bound_every_and_disabled(caplog):
    warner = MismatchWarner(0.05, every=10)
    row = {"version": 1, "mismatch/lag0_abs_diff_mean": 0.2, "mismatch/lag0_abs_diff_max": 3.0}
    with caplog.at_level(logging.WARNING, logger="areal_jax.trainer"):
        text = warner(row)
        assert "algo.mismatch_warn_abs_diff=0.05" in text and "0.2" in text
        assert warner({**row, "version": 5}) is None  # within 10 versions of the last
        assert warner({**row, "version": 11}) is not None
        assert warner({"version": 30, "mismatch/lag0_abs_diff_mean": 0.01}) is None
        assert warner({"version": 40}) is None  # no lag-0 tokens this version
    assert len([r for r in caplog.records if "lag-0" in r.message]) == 2
    assert MismatchWarner(None)(row) is None


def test_config_bound_validated():
    with pytest.raises(ValueError, match=r"algo.mismatch_warn_abs_diff must be > 0"):
        AlgoConfig(mismatch_warn_abs_diff=0.0)
    assert AlgoConfig(mismatch_warn_abs_diff=None).mismatch_warn_abs_diff is None


def test_plot_draws_mismatch(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_script", REPO / "scripts" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"version": v, "mismatch/lag0_abs_diff_mean": 1e-3, "mismatch/lag0_abs_diff_max": 0.1,
             "mismatch/lag0_kl": 1e-6, "mismatch/lag1_kl": 1e-3} for v in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.name for p in plot.plot_run(run, log=lambda m: None)}
    assert {"mismatch.png", "mismatch_kl.png"} <= names
