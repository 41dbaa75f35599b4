"""What a resume restores, read back (tests/test_trainer_faults.py, resume by state).

    python -m tests._resume_state RUN_DIR CKPT_DIR V1 V2 ...

Builds the learner side exactly as a resumed ``scripts/train.py`` does
(``run.build_learner_side`` on ``CKPT_DIR``, with RUN_DIR's saved config), then prints one
JSON line: the learner's step and version; the checkpoint's own, read back separately; the
largest difference between the learner's params / optimizer state and the checkpoint's;
and, for each version V given, the loss of training ``RUN_DIR/batches/vV.npz`` (recorded by
the uninterrupted run, ``train.record_batches``) from the resumed state, with the rounding
bound on it. One process and one CPU device, as train.py's own tests run it, so that the
learner's programs are the ones the uninterrupted run compiled.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.pop("XLA_FLAGS", None)  # one CPU device, as the run had
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _max_abs_diff(a, b) -> float:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return float("inf")
    return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                for x, y in zip(la, lb, strict=True) if np.size(x)), default=0.0)


def main() -> None:
    run_dir, ckpt_dir = Path(sys.argv[1]), sys.argv[2]
    versions = [int(v) for v in sys.argv[3:]]
    import numpy as np
    from tolerance import sum_tolerance

    from areal_jax.checkpoint import TrainCheckpointer
    from areal_jax.config import load_config
    from areal_jax.data.trajectories import load_batch
    from areal_jax.run import build_learner_side
    from areal_jax.run_inputs import resolve_model_path

    cfg = load_config(run_dir / "config.yaml")
    out: dict = {}
    with contextlib.ExitStack() as stack:
        side = build_learner_side(cfg, stack, resolve_model_path(cfg.model.path), ckpt_dir,
                                  restore=True)
        learner = side.learner
        out["learner"] = {"step": learner.step, "version": learner.version}
        reader = TrainCheckpointer(ckpt_dir, read_only=True)
        st = learner.state_dict()  # only the targets' shapes and shardings are used
        params, opt_state, meta = reader.restore(params_target=st["params"],
                                                 opt_state_target=st["opt_state"])
        reader.close()
        out["checkpoint"] = {"step": meta.step, "version": meta.version}
        out["params_max_abs_diff"] = _max_abs_diff(learner.params, params)
        out["opt_state_max_abs_diff"] = _max_abs_diff(learner.opt_state, opt_state)
        out["losses"] = {}
        # Each version's loss is a token mean of terms w_t * min(r_t A_t, clip(r_t) A_t): with
        # one minibatch r_t = 1 (the policy is the proximal one) and the behaviour weight w_t
        # is at most algo.behav_imp_weight_cap, so |term| <= cap * |A_t|. Two evaluations of
        # that mean by the same program differ by rounding alone: sum_tolerance of it.
        cap = cfg.algo.behav_imp_weight_cap or 1.0
        assert cfg.algo.ppo_n_minibatches == 1, "the bound above takes r_t = 1"
        for v in versions:
            batch = load_batch(str(run_dir / "batches" / f"v{v}.npz"))
            mask = np.concatenate([mb.loss_mask.ravel() for mb in batch.micro_batches]) > 0
            adv = np.concatenate([mb.advantages.ravel() for mb in batch.micro_batches])[mask]
            n = int(mask.sum())
            tol = float(sum_tolerance(cap * np.abs(adv).mean(), n))
            metrics = learner.train_step(batch.micro_batches, current_version=v - 1)
            out["losses"][str(v)] = [float(metrics["loss"]), tol]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
