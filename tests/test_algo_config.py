"""The algorithm table reaches the loss: algo.name cispo / sapo select their objective
(through the decoupled loss, behaviour correction included), the KL estimator and clamp
and critic.loss are run-config keys, and bad combinations fail naming the key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from areal_jax.config import ConfigError, load_config
from areal_jax.learner.config import ALGORITHM_SPECS, ALGORITHMS, AlgoConfig
from areal_jax.losses import GROUP_MODES, OBJECTIVES, decoupled_ppo_loss

DEMO = Path(__file__).resolve().parent.parent / "configs" / "tiny_demo.yaml"


def test_every_algorithm_is_a_known_advantage_and_objective():
    assert set(ALGORITHMS) >= {"grpo", "rloo", "drgrpo", "gspo", "cispo", "sapo", "ppo"}
    for name, spec in ALGORITHM_SPECS.items():
        assert spec.advantages in (*GROUP_MODES, "gae"), name
        assert spec.objective in OBJECTIVES, name
        algo = AlgoConfig(name=name)
        assert algo.ppo_loss_config().objective == spec.objective
        assert algo.advantage_mode == spec.advantages


@pytest.mark.parametrize("name, overrides", [
    ("cispo", ["algo.eps_clip_higher=0.28", "algo.behav_correction=tis",
               "algo.behav_imp_weight_cap=null"]),
    ("sapo", ["algo.sapo_tau_pos=0.5", "algo.sapo_tau_neg=2.0", "algo.ratio_level=sequence"]),
])
def test_cispo_and_sapo_from_yaml_give_the_losses_objective(name, overrides):
    cfg = load_config(DEMO, [f"algo.name={name}", *overrides])
    loss_cfg = cfg.algo.ppo_loss_config()
    rng = np.random.default_rng(0)
    logp = rng.uniform(-4, -0.1, (3, 9)).astype(np.float32)
    prox = (logp + rng.normal(scale=0.8, size=logp.shape)).astype(np.float32)
    behav = (prox + rng.normal(scale=0.8, size=logp.shape)).astype(np.float32)
    adv = rng.normal(size=logp.shape).astype(np.float32)
    mask = np.ones(logp.shape, np.int32)
    got = decoupled_ppo_loss(logp, prox, behav, adv, mask, config=loss_cfg)[0]
    kw = dict(objective=name, ratio_level=cfg.algo.resolved_ratio_level)
    if name == "cispo":
        kw.update(eps_clip_higher=0.28, behav_correction="tis", behav_correction_cap=2.0)
    else:  # the demo's cap stays
        kw.update(sapo_tau_pos=0.5, sapo_tau_neg=2.0, behav_imp_weight_cap=5.0)
    assert float(got) == float(decoupled_ppo_loss(logp, prox, behav, adv, mask, **kw)[0])
    ppo = decoupled_ppo_loss(logp, prox, behav, adv, mask)[0]
    assert float(got) != float(ppo)  # another objective, not PPO's


@pytest.mark.parametrize("overrides, match", [
    (["algo.name=cispo", "algo.c_clip=3"], "algo.c_clip"),
    (["algo.name=sapo", "algo.eps_clip_higher=0.28"], "algo.eps_clip_higher"),
    (["algo.name=sapo", "algo.sapo_tau_neg=0"], "algo.sapo_tau_neg"),
    (["algo.name=cispo2"], "algo.name"),
    (["algo.kl_estimator=k4"], "algo.kl_estimator"),
    (["algo.kl_clamp=-1"], "algo.kl_clamp"),
    (["critic.loss=l1", "algo.name=ppo"], "critic.loss"),
    (["critic.huber_delta=0", "algo.name=ppo"], "critic.huber_delta"),
    (["critic.loss=huber"], "critic.loss / critic.huber_delta .* algo.name='grpo'"),
])
def test_bad_algorithm_keys_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DEMO, overrides)


def test_kl_and_critic_keys_load():
    cfg = load_config(DEMO, ["algo.kl_coef=0.01", "algo.kl_estimator=low_var_kl+",
                             "algo.kl_clamp=5", "algo.name=ppo", "critic.loss=huber",
                             "critic.huber_delta=0.5"])
    assert cfg.algo.kl_estimator == "low_var_kl+" and cfg.algo.kl_clamp == 5.0
    assert cfg.critic.loss == "huber" and cfg.critic.huber_delta == 0.5
