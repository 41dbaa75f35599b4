"""Learner configs: the optimizer and the PPO update. Frozen, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEDULES = ("constant", "cosine")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")


def _check_positive(section: str, **values: float | int | None) -> None:
    for key, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{section}.{key} must be > 0, got {value!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, then a constant or cosine learning rate.

    The learning rate ramps linearly from lr/warmup_steps (first step) to lr over
    ``warmup_steps`` steps; ``cosine`` then decays to ``lr * min_lr_ratio`` at
    ``total_steps``. Weight decay applies to matrices (ndim >= 2, embeddings included);
    norms and biases are never decayed. ``max_grad_norm=None`` disables clipping.
    """

    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int | None = None  # required by "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        _check_positive("optimizer", lr=self.lr, eps=self.eps, max_grad_norm=self.max_grad_norm)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optimizer.schedule={self.schedule!r}; expected one of {SCHEDULES}")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule == "cosine":
            if self.total_steps is None or self.total_steps <= self.warmup_steps:
                raise ValueError(f"optimizer.total_steps must be > warmup_steps={self.warmup_steps} "
                                 f"for the cosine schedule, got {self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        for key in ("b1", "b2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"optimizer.{key} must be in [0, 1), got {getattr(self, key)}")

    @classmethod
    def from_section(cls, section: Any, total_steps: int | None = None, **overrides: Any
                     ) -> OptimizerConfig:
        """From any object with the same field names (e.g. the run config's ``optim``)."""
        names = ("lr", "warmup_steps", "schedule", "min_lr_ratio", "weight_decay", "b1", "b2",
                 "eps", "max_grad_norm")
        kwargs = {n: getattr(section, n) for n in names if hasattr(section, n)}
        kwargs["total_steps"] = total_steps
        return cls(**{**kwargs, **overrides})


@dataclass(frozen=True)
class PPOConfig:
    """The PPO update (see README, "Using the losses in your own JAX code").

    ``use_decoupled_loss=False`` is naive PPO: prox_logp := behav_logp, so no recompute
    and no behaviour importance weight. ``temperature`` must be the sampling temperature.
    ``kl_coef > 0`` adds a KL penalty to ``ref_logp``, which the micro-batches must carry.
    """

    ppo_n_minibatches: int = 1
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    c_clip: float | None = None
    behav_imp_weight_cap: float | None = None
    temperature: float = 1.0
    agg_mode: str = "token-mean"
    seq_token_sum_normalizer: float | None = None  # the constant L of "seq-mean-token-sum"
    ratio_level: str = "token"  # "sequence": GSPO's per-sequence geometric-mean ratio
    use_decoupled_loss: bool = True
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    logp_chunk_size: int = 4096  # vocabulary chunk for logprobs

    def __post_init__(self) -> None:
        if not isinstance(self.ppo_n_minibatches, int) or self.ppo_n_minibatches < 1:
            raise ValueError(f"ppo.ppo_n_minibatches must be an int >= 1, got {self.ppo_n_minibatches!r}")
        _check_positive("ppo", eps_clip=self.eps_clip, eps_clip_higher=self.eps_clip_higher,
                        behav_imp_weight_cap=self.behav_imp_weight_cap,
                        temperature=self.temperature, logp_chunk_size=self.logp_chunk_size)
        if self.c_clip is not None and not self.c_clip > 1:
            raise ValueError(f"ppo.c_clip must be > 1 (or None), got {self.c_clip}")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"ppo.agg_mode={self.agg_mode!r}; expected one of {AGG_MODES}")
        if self.agg_mode == "seq-mean-token-sum":
            if self.seq_token_sum_normalizer is None or not self.seq_token_sum_normalizer > 0:
                raise ValueError("ppo.seq_token_sum_normalizer must be > 0 with agg_mode="
                                 "'seq-mean-token-sum' (Dr.GRPO: the max generation length), "
                                 f"got {self.seq_token_sum_normalizer!r}")
        elif self.seq_token_sum_normalizer is not None:
            raise ValueError(f"ppo.seq_token_sum_normalizer is only used with agg_mode="
                             f"'seq-mean-token-sum', not {self.agg_mode!r}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ppo.ratio_level={self.ratio_level!r}; expected one of {RATIO_LEVELS}")
        if self.kl_coef < 0:
            raise ValueError(f"ppo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"ppo.kl_estimator={self.kl_estimator!r}; expected one of {KL_ESTIMATORS}")

    @classmethod
    def from_algo(cls, algo: Any, temperature: float = 1.0, **overrides: Any) -> PPOConfig:
        """From the run config's ``algo`` section (``decoupled`` -> ``use_decoupled_loss``;
        ``ratio_level`` resolved from ``name``: "sequence" for gspo)."""
        names = ("ppo_n_minibatches", "eps_clip", "eps_clip_higher", "c_clip",
                 "behav_imp_weight_cap", "agg_mode", "seq_token_sum_normalizer", "kl_coef",
                 "kl_estimator")
        kwargs: dict[str, Any] = {n: getattr(algo, n) for n in names if hasattr(algo, n)}
        if hasattr(algo, "decoupled"):
            kwargs["use_decoupled_loss"] = bool(algo.decoupled)
        if hasattr(algo, "resolved_ratio_level"):
            kwargs["ratio_level"] = algo.resolved_ratio_level
        elif getattr(algo, "ratio_level", None) is not None:
            kwargs["ratio_level"] = algo.ratio_level
        kwargs["temperature"] = temperature
        return cls(**{**kwargs, **overrides})
