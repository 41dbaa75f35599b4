"""Learner state through an Orbax checkpoint: restore, then train on exactly as before."""

import jax
import numpy as np
import pytest
from _learner_data import make_learner, standard_batches

from areal_jax.checkpoint import TrainCheckpointer
from areal_jax.parallel import make_mesh


def train(learner, batches):
    for b in batches:
        b.prox_logp = None
    return learner.train_step(batches)


@pytest.mark.devices(8)
def test_restore_resumes_training_exactly(tmp_path):
    learner = make_learner(make_mesh("data=2,fsdp=4"))  # sharded state through Orbax
    batches = standard_batches()
    train(learner, batches)
    st = learner.state_dict()
    with TrainCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(st["version"], st["params"], st["opt_state"],
                  {"step": st["step"], "version": st["version"]})
    want = train(learner, batches)
    want_params = [np.asarray(x) for x in jax.tree.leaves(learner.params)]

    train(learner, batches)  # move on, then go back to the checkpoint
    st = learner.state_dict()
    with TrainCheckpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        params, opt_state, meta = ckpt.restore(params_target=st["params"],
                                               opt_state_target=st["opt_state"])
    learner.load_state(params, opt_state, step=meta["step"], version=meta["version"])
    assert (learner.step, learner.version) == (2, 1)
    got = train(learner, batches)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for g, w in zip(jax.tree.leaves(learner.params), want_params, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)

    with pytest.raises(ValueError, match=r"param \['embed_vd'\].value has shape \(4, 32\), "
                                         r"expected \(128, 32\)"):
        learner.load_state(jax.tree.map(lambda x: x[:4], learner.params))
