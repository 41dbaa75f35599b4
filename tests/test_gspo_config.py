"""GSPO chosen in YAML reaches the learner: its loss is what areal_jax.losses computes with
ratio_level="sequence" (and differs from the token-level loss on the same batch)."""

import jax
import numpy as np
import pytest
import torch
from _learner_data import FAST_COMPILE, random_advantages, random_trajectories
from hf_fixtures import logit_tolerance, make_hf_model, make_tiny_hf_checkpoint
from tolerance import logprob_tolerance, sum_tolerance

from areal_jax.config import ConfigError, load_config
from areal_jax.learner import (
    AlgoConfig,
    Learner,
    OptimConfig,
    pack_trajectories,
    unpack_per_token,
)
from areal_jax.losses import decoupled_ppo_loss
from areal_jax.parallel import make_mesh


def _padded(per_traj: list[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(per_traj), width), np.float32)
    for i, x in enumerate(per_traj):
        out[i, :len(x)] = x
    return out


def test_gspo_from_yaml_gives_the_loss_areal_jax_losses_computes(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True, seed=4)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(f"model:\n  path: {path}\nalgo:\n  name: gspo\n  eps_clip: 0.05\n")
    cfg = load_config(yaml_path)
    algo = cfg.algo  # the learner takes the run config's section as is
    assert isinstance(algo, AlgoConfig) and algo.resolved_ratio_level == "sequence"
    assert load_config(yaml_path, ["algo.name=grpo"]).algo.resolved_ratio_level == "token"
    grpo_seq = load_config(yaml_path, ["algo.name=grpo", "algo.ratio_level=sequence"]).algo
    assert grpo_seq.resolved_ratio_level == "sequence"
    with pytest.raises(ConfigError, match="algo.ratio_level='token' contradicts algo.name='gspo'"):
        load_config(yaml_path, ["algo.ratio_level=token"])

    learner = Learner.from_hf(str(path), OptimConfig(), algo,
                              mesh=make_mesh("data=1", jax.devices()[:1]),
                              compiler_options=FAST_COMPILE)
    trajs = random_trajectories(13, 8, 20)
    advs = random_advantages(13, trajs)
    batches = pack_trajectories(trajs, advs, seq_len=48, rows_per_micro_batch=2)
    assert max(b.segment_ids.max() for b in batches) >= 2  # sequences share rows
    logp = unpack_per_token(batches, learner.compute_logp(batches), len(trajs))
    # prox from a perturbed policy, so sequence ratios spread on both sides of the clip range.
    rng = np.random.default_rng(1)
    prox = [lp + (rng.normal(0, 0.1) + rng.normal(0, 0.1, len(lp))).astype(np.float32)
            * t.loss_mask for lp, t in zip(logp, trajs, strict=True)]
    for b in batches:
        arr = np.zeros(b.shape, np.float32)
        for p in b.placements:
            arr[p.row, p.start:p.start + p.length] = prox[p.traj_index]
        b["prox_logp"] = arr
    got, _ = learner.compute_gradients(batches)

    width = max(t.num_tokens for t in trajs)
    adv_tok = [np.broadcast_to(np.float32(a), (t.num_tokens,)) * t.loss_mask
               for a, t in zip(advs, trajs, strict=True)]
    args = [_padded(x, width) for x in (logp, prox, [t.behav_logp for t in trajs], adv_tok,
                                        [t.loss_mask for t in trajs])]
    want, stats = decoupled_ppo_loss(*args, eps_clip=0.05, ratio_level="sequence")
    token_level, _ = decoupled_ppo_loss(*args, eps_clip=0.05, ratio_level="token")
    assert 0.0 < float(stats["clip_frac"]) < 1.0

    # Bound: the learner's logp (recomputed inside its gradient program) is within the fp32
    # logprob bound d of the one used here; a sequence ratio s moves by at most s*2d, so each
    # term |A w s| by |A w| s 2d; plus the rounding of the sum over the n masked tokens.
    hf = make_hf_model("qwen2", tie=True, seed=4)
    with torch.no_grad():
        d = max(logprob_tolerance(hf.config.vocab_size, logit_tolerance(hf, t.input_ids[None]))
                for t in trajs)
    mask = args[4] > 0
    log_ratio = np.where(mask, args[0] - args[1], 0.0)
    s = np.exp(log_ratio.sum(1) / np.maximum(mask.sum(1), 1))[:, None]
    w = np.exp(args[1] - args[2])
    terms = np.where(mask, np.abs(args[3]) * w * np.maximum(s, 1 + 0.05), 0.0)
    n = int(mask.sum())
    tol = float(terms.sum() * 2 * d + sum_tolerance(terms.sum(), n)) / n
    assert abs(got - float(want)) <= tol, (got, float(want), tol)
    assert abs(got - float(token_level)) > tol  # a token-level learner would fail the check
