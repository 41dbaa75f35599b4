"""With one minibatch per version, the learner skips the separate prox_logp pass: the
proximal policy is the current params before the only step, so the loss's own forward
pass gives the same prox_logp. The update must be the one the recompute gives."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from areal_jax.learner import AlgoConfig, pack_trajectories
from areal_jax.parallel import make_mesh
from tests._learner_data import (
    make_learner,
    random_advantages,
    random_trajectories,
    train_version,
)


def _batches(seed: int) -> list:
    trajs = random_trajectories(seed, 16, 40, max_version=0)
    return pack_trajectories(trajs, random_advantages(seed, trajs), seq_len=48,
                             rows_per_micro_batch=4, n_shards=2)


@pytest.mark.devices(2)
@pytest.mark.parametrize("c_clip, cap", [pytest.param(None, None, marks=pytest.mark.slow),
                                         (3.0, 5.0)])
def test_skipped_prox_recompute_gives_the_same_update(c_clip, cap):
    mesh = make_mesh("data=2", jax.devices()[:2])
    algo = AlgoConfig(ppo_n_minibatches=1, c_clip=c_clip, behav_imp_weight_cap=cap)
    skip, recompute = make_learner(mesh, algo=algo), make_learner(mesh, algo=algo)
    batches = _batches(3)
    assert len(batches) > 1  # the gradient is accumulated over several micro-batches
    given = copy.deepcopy(batches)
    for version in range(2):  # the second step starts from the updated params
        # the old path: a separate logprob pass
        m_recompute = recompute.train_step(recompute.recompute_prox_logp(given))
        m_skip = train_version(skip, batches)
        assert m_skip["prox_logp_recomputed"] == 0.0 and m_recompute["prox_logp_recomputed"] == 1.0
        # The paths differ only in r = exp(logp - prox): exactly 1 when skipped, 1 +- the
        # fp32 rounding of a separately computed logprob (|logp| < 10 over a 128-way
        # softmax: ~eps32 * 10 * sqrt(128) ~ 1.4e-5 relative). That bounds the relative
        # difference of losses and gradients; an Adam update (<= lr per element) then moves
        # by <= lr * 1.4e-5 per step, x10 for the update's non-linearity near zero gradients.
        rel = 1.4e-5
        for key, value in m_recompute.items():
            if key.endswith(("_s", "tokens_per_s", "prox_logp_recomputed")):
                continue
            if key == "approx_kl":  # KL(prox || pi) at prox = pi: 0 up to that rounding
                assert m_skip[key] == 0.0 and abs(value) < rel**2, value
                continue
            assert m_skip[key] == pytest.approx(value, rel=rel, abs=1e-12), key
        atol = (version + 1) * 10 * skip.optim.lr * rel
        pairs = zip(jax.tree.leaves(skip.params), jax.tree.leaves(recompute.params), strict=True)
        for a, b in pairs:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)
