"""The sharded learner: packing, logprob recompute, the jitted PPO train step."""

from areal_jax.learner.config import AlgoConfig, OptimConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.optimizer import (
    learning_rate_schedule,
    make_optimizer,
    weight_decay_mask,
)
from areal_jax.learner.packing import (
    PackedBatch,
    Placement,
    pack_trajectories,
    unpack_per_token,
)
from areal_jax.learner.token_logp import packed_token_logprobs

__all__ = [
    "AlgoConfig",
    "Learner",
    "OptimConfig",
    "PackedBatch",
    "Placement",
    "learning_rate_schedule",
    "make_optimizer",
    "pack_trajectories",
    "packed_token_logprobs",
    "unpack_per_token",
    "weight_decay_mask",
]
