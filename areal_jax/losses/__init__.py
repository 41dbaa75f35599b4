"""areal_jax.losses: the decoupled PPO objective, advantage estimators, KL and entropy.

Pure JAX: this package imports only jax, numpy and the standard library, so other JAX
projects can use it without the rest of areal_jax. Every function takes bf16 or fp32
arrays, computes in fp32, and works under ``jax.jit`` and ``jax.grad``.
"""

from areal_jax.losses.advantages import (
    GROUP_MODES,
    gae,
    group_advantages,
    normalize_advantages,
    overlong_penalty,
    packed_gae,
    shape_rewards,
)
from areal_jax.losses.behav_correction import BEHAV_CORRECTIONS, behav_correction
from areal_jax.losses.critic import VALUE_LOSSES, ppo_value_loss
from areal_jax.losses.kl import KL_ESTIMATORS, token_kl
from areal_jax.losses.logprobs import (
    entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from areal_jax.losses.mismatch import lag_bucket_names, mismatch_stats, mismatch_terms
from areal_jax.losses.ppo import (
    OBJECTIVES,
    RATIO_LEVELS,
    PPOInputs,
    PPOLossConfig,
    PPOLossTerms,
    combine_ppo_terms,
    decoupled_ppo_loss,
    decoupled_ppo_loss_terms,
    empty_ppo_terms,
    ppo_stats_from_terms,
)
from areal_jax.losses.segments import AGG_MODES, loss_denominator
from areal_jax.losses.sft import SFTLossTerms, SFTSums, finalise_sft_step, sft_loss, sft_loss_terms
from areal_jax.losses.step_metrics import StepMetrics, StepSums, finalise_step

__all__ = [
    "AGG_MODES",
    "BEHAV_CORRECTIONS",
    "GROUP_MODES",
    "KL_ESTIMATORS",
    "OBJECTIVES",
    "RATIO_LEVELS",
    "VALUE_LOSSES",
    "PPOInputs",
    "PPOLossConfig",
    "PPOLossTerms",
    "SFTLossTerms",
    "SFTSums",
    "StepMetrics",
    "StepSums",
    "behav_correction",
    "combine_ppo_terms",
    "decoupled_ppo_loss",
    "decoupled_ppo_loss_terms",
    "empty_ppo_terms",
    "entropy_from_logits",
    "finalise_sft_step",
    "finalise_step",
    "gae",
    "group_advantages",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "lag_bucket_names",
    "loss_denominator",
    "mismatch_stats",
    "mismatch_terms",
    "normalize_advantages",
    "overlong_penalty",
    "packed_gae",
    "ppo_stats_from_terms",
    "ppo_value_loss",
    "sft_loss",
    "sft_loss_terms",
    "shape_rewards",
    "token_kl",
]
