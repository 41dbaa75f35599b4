"""Advantages for every algorithm, from a batch's rewards: the one place they are asked for.

* GRPO / RLOO / Dr.GRPO (``algo.name`` grpo, rloo, dr_grpo): one scalar per trajectory,
  per group of samples of one prompt, from the shaped rewards alone
  (``group_advantages_for``); the trajectory pipeline (``data/trajectories.py``) calls it
  while it batches, and packing spreads each scalar over the trajectory's loss tokens.
* PPO (``algo.name: ppo``): per-token GAE over the critic's values of the packed batch
  (``gae_targets_for``); the trainer calls it once the batch is packed, since it needs
  the critic. It runs on the packed rows on device (``Critic.gae_targets``) and returns
  new micro-batches: the batch it is given is not modified.

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

__all__ = ["gae_targets_for", "group_advantages_for", "shaped_rewards"]


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
    adv = group_advantages(shaped_rewards(cfg, trajs), len(groups[0]), mode=cfg.algo.name)
    return np.asarray(adv, np.float32)


def gae_targets_for(cfg: TrainConfig, critic: Critic, micro: list[PackedBatch],
                    trajs: list[Trajectory]) -> ValueTargets:
    """PPO: GAE advantages (normalised) and returns over the critic's values of the packed
    micro-batches, from the shaped rewards: new micro-batches carrying the advantages
    (``micro`` is not modified), the critic's returns and old values, all on device."""
    return critic.gae_targets(micro, trajs, gamma=cfg.algo.gamma, lam=cfg.algo.lam,
                              normalize=True, rewards=shaped_rewards(cfg, trajs))
