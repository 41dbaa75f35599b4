"""Learner state through an Orbax checkpoint: restore, then train on exactly as before."""

import jax
import numpy as np
import pytest
from _learner_data import (
    make_learner,
    restore_learner,
    save_learner,
    standard_batches,
    train_version,
)

from areal_jax.parallel import make_mesh


@pytest.mark.devices(8)
def test_restore_resumes_training_exactly(tmp_path):
    learner = make_learner(make_mesh("data=2,fsdp=4"))  # sharded state through Orbax
    batches = standard_batches()
    train_version(learner, batches)
    save_learner(learner, tmp_path / "ckpt")
    want = train_version(learner, batches)
    want_params = [np.asarray(x) for x in jax.tree.leaves(learner.params)]

    train_version(learner, batches)  # move on, then go back to the checkpoint
    restore_learner(learner, tmp_path / "ckpt")
    assert (learner.step, learner.version) == (2, 1)
    got = train_version(learner, batches)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for g, w in zip(jax.tree.leaves(learner.params), want_params, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)

    with pytest.raises(ValueError, match=r"param \['embed_vd'\].value has shape \(4, 32\), "
                                         r"expected \(128, 32\)"):
        learner.load_state(jax.tree.map(lambda x: x[:4], learner.params))
