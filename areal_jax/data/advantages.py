"""Advantages for every algorithm, from a batch's rewards: the one place they are asked for.

* GRPO / RLOO / Dr.GRPO (``algo.name`` grpo, rloo, drgrpo, and gspo, cispo, sapo with
  GRPO's: ``AlgoConfig.advantage_mode``): one scalar per trajectory,
  per group of samples of one prompt, from the shaped rewards alone
  (``group_advantages_for``); the trajectory pipeline (``data/trajectories.py``) calls it
  while it batches, and packing spreads each scalar over the trajectory's loss tokens.
* PPO (``algo.name: ppo``): per-token GAE over the critic's values of the packed batch
  (``gae_targets_for``); the trainer calls it once the batch is packed, since it needs
  the critic. It runs on the packed rows on device (``Critic.gae_targets``) and returns
  new micro-batches: the batch it is given is not modified. A truncated trajectory
  (finish reason ``length``: packed as ``truncated``) is bootstrapped from the critic's
  value after its last token.

Both start from ``shaped_rewards``: the reward section's scale/bias/clip and the
optional DAPO overlong penalty, which need the run's config (so this module, not
``learner/`` or ``losses/``, which never import it). The arithmetic is ``areal_jax.losses``'
(public API: ``group_advantages``, ``packed_gae``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from areal_jax.losses import group_advantages, overlong_penalty, shape_rewards

if TYPE_CHECKING:
    from areal_jax.config import TrainConfig
    from areal_jax.learner.critic import Critic, ValueTargets
    from areal_jax.learner.packing import PackedBatch
    from areal_jax.trajectory import Trajectory

__all__ = ["distill_advantages_for", "distill_metrics", "gae_targets_for", "group_advantages_for",
           "shaped_rewards"]


def shaped_rewards(cfg: TrainConfig, trajs: list[Trajectory]) -> np.ndarray:
    """Rewards after scale/bias/clip and the optional DAPO overlong penalty, [N] fp32."""
    rewards = np.array([t.reward for t in trajs], np.float32)
    r = cfg.reward
    shaped = shape_rewards(rewards, scale=r.scale, bias=r.bias, clip=r.clip)
    if r.overlong_penalty_tokens:
        lengths = np.array([t.num_generated for t in trajs], np.float32)
        shaped = shaped + overlong_penalty(lengths, max_response_length=cfg.rollout.max_new_tokens,
                                           overlong_tokens=r.overlong_penalty_tokens,
                                           penalty_factor=r.overlong_penalty_factor)
    return np.asarray(shaped, np.float32)


def group_advantages_for(cfg: TrainConfig, groups: list[list[Trajectory]]) -> np.ndarray:
    """A batch's groups -> per-trajectory advantages (GRPO / RLOO / Dr.GRPO), fp32."""
    trajs = [t for g in groups for t in g]
    adv = group_advantages(shaped_rewards(cfg, trajs), len(groups[0]),
                           mode=cfg.algo.advantage_mode)
    return np.asarray(adv, np.float32)


def gae_targets_for(cfg: TrainConfig, critic: Critic, micro: list[PackedBatch],
                    trajs: list[Trajectory]) -> ValueTargets:
    """PPO: GAE advantages (normalised) and returns over the critic's values of the packed
    micro-batches, from the shaped rewards: new micro-batches carrying the advantages
    (``micro`` is not modified), the critic's returns and old values, all on device."""
    return critic.gae_targets(micro, trajs, gamma=cfg.algo.gamma, lam=cfg.algo.lam,
                              normalize=True, rewards=shaped_rewards(cfg, trajs))


def distill_advantages_for(cfg: TrainConfig, groups: list[list[Trajectory]]
                           ) -> list[np.ndarray]:
    """On-policy distillation (the ``teacher`` section): per token, ``[T]`` fp32,

        A_t = kl_coef * (teacher_logp_t - behav_logp_t) + reward_weight * A_group

    on completion tokens (0 elsewhere): the negative per-token reverse KL of the sampling
    policy from the teacher, estimated on the student's own sample (Thinking Machines'
    on-policy distillation; slime's and AReaL's teacher KL), plus the algorithm's group
    advantage when ``reward_weight`` > 0. The loss is the run's policy loss (decoupled PPO)
    with these advantages."""
    teacher = cfg.teacher
    assert teacher is not None  # the run calls this only with a teacher section
    trajs = [t for g in groups for t in g]
    base = (group_advantages_for(cfg, groups) if teacher.reward_weight > 0
            else np.zeros(len(trajs), np.float32))
    out = []
    for traj, adv in zip(trajs, base, strict=True):
        if traj.teacher_logp is None:
            raise ValueError(f"trajectory of group {traj.group_id!r} has no teacher_logp: the "
                             "teacher-scored workflow (rollout/distill.py) sets it")
        mask = traj.loss_mask.astype(np.float32)
        a = teacher.kl_coef * (traj.teacher_logp - traj.behav_logp) + teacher.reward_weight * adv
        out.append((a * mask).astype(np.float32))
    return out


def distill_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """A batch's ``distill/reverse_kl`` (mean over completion tokens of behav_logp -
    teacher_logp, the sampled estimate of KL(student || teacher)) and the mean teacher and
    student logprobs; {} when no trajectory has teacher logprobs."""
    scored = [t for t in trajs if t.teacher_logp is not None]
    if not scored:
        return {}
    mask = np.concatenate([t.loss_mask for t in scored]).astype(np.float64)
    teacher = np.concatenate([t.teacher_logp for t in scored if t.teacher_logp is not None])
    student = np.concatenate([t.behav_logp for t in scored])
    n = max(float(mask.sum()), 1.0)
    return {"distill/reverse_kl": float(((student - teacher) * mask).sum() / n),
            "distill/teacher_logp_mean": float((teacher * mask).sum() / n),
            "distill/student_logp_mean": float((student * mask).sum() / n)}
