"""The new objectives, KL estimators and value loss in real `train.py` runs on the demo
(a real embedded server, real weights): CISPO with the straight-through k3+ KL penalty and
its clamp, SAPO at sequence level, and actor-critic PPO with the Huber value loss on
answers cut at the length limit (so GAE bootstraps them). Slow: each is a whole run."""

from __future__ import annotations

import numpy as np
import pytest
from test_trainer import _rows, _run

from areal_jax.data.trajectories import load_batch


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [
    ("cispo", ["algo.kl_coef=0.05", "algo.kl_estimator=k3+", "algo.kl_clamp=5",
               "algo.eps_clip_higher=0.28"]),
    ("sapo", ["algo.ratio_level=sequence"]),
])
def test_cispo_and_sapo_train_on_the_demo(tmp_path, name, extra):
    run_dir = tmp_path / "run"
    res = _run([f"run_dir={run_dir}", "train.total_versions=2", "mode=sync",
                f"algo.name={name}", *extra])
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert np.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert r["train/n_loss_tokens"] > 0
        if name == "cispo":  # the KL penalty to the frozen reference was computed
            assert np.isfinite(r["train/kl_ref"]) and abs(r["train/kl_ref"]) <= 5
        else:  # a soft gate: nothing is hard-clipped
            assert r["clip_frac"] == 0.0


@pytest.mark.slow
def test_ppo_with_huber_value_loss_bootstraps_truncated_answers(tmp_path):
    """max_new_tokens=6 cuts the demo's answers: their trajectories reach the packed batch
    flagged ``truncated`` (the recorded batch holds the flag), the critic's GAE bootstraps
    them, and both models step on it with critic.loss=huber. (A cut answer scores 0: the
    reward bias gives the critic a return to learn, gamma < 1 the tokens distinct
    advantages.)"""
    run_dir = tmp_path / "run"
    res = _run([f"run_dir={run_dir}", "train.total_versions=2", "mode=sync", "algo.name=ppo",
                "critic.loss=huber", "critic.huber_delta=0.5", "rollout.max_new_tokens=6",
                "reward.bias=0.5", "algo.gamma=0.9", "algo.lam=0.95",
                "train.record_batches=true"])
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["truncated_frac"] > 0
        assert np.isfinite(r["train/loss"]) and r["train/critic_value_loss"] > 0
        assert r["train/grad_norm"] > 0 and r["train/critic_grad_norm"] > 0
    batch = load_batch(str(run_dir / "batches" / "v1.npz"))
    flags = np.concatenate([mb.truncated[mb.segment_ids > 0] for mb in batch.micro_batches])
    assert flags.any() and set(np.unique(flags)) <= {0, 1}
