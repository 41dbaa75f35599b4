"""The learner's configs: the optimizer (``optim``) and the RL algorithm (``algo``).

These are the run config's ``optim`` and ``algo`` sections themselves (``areal_jax.config``
embeds them), so the Python API and YAML share one class each and every error names the
key a user writes. Frozen, validated on construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from areal_jax.losses import AGG_MODES, KL_ESTIMATORS, RATIO_LEVELS, PPOLossConfig
from areal_jax.losses.behav_correction import (
    BAND_CORRECTIONS,
    BEHAV_CORRECTIONS,
    CAPPED_CORRECTIONS,
    BehavCorrectionMode,
)
from areal_jax.losses.kl import KLEstimator
from areal_jax.losses.ppo import RatioLevel
from areal_jax.losses.segments import AggMode

SCHEDULES = ("constant", "cosine")


class AlgorithmSpec(NamedTuple):
    """What an ``algo.name`` means: how its advantages are made (a ``losses.GROUP_MODES``
    key, or "gae": a critic's GAE), the policy objective it trains (``losses.OBJECTIVES``,
    always through the decoupled loss) and its default ``ratio_level``."""

    advantages: str
    objective: str = "ppo"
    ratio_level: str = "token"


# algo.name -> its spec. A new algorithm is one line here (and its docs).
ALGORITHM_SPECS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec("grpo"),
    "rloo": AlgorithmSpec("rloo"),
    "drgrpo": AlgorithmSpec("drgrpo"),
    "gspo": AlgorithmSpec("grpo", ratio_level="sequence"),  # GRPO advantages, sequence ratio
    "cispo": AlgorithmSpec("grpo", objective="cispo"),  # MiniMax-M1
    "sapo": AlgorithmSpec("grpo", objective="sapo"),  # Qwen's soft-gated objective
    "ppo": AlgorithmSpec("gae"),  # actor-critic
}
ALGORITHMS = tuple(ALGORITHM_SPECS)


def check_positive(section: str, **values: float | int | None) -> None:
    """``section.key must be > 0`` for each value that is not None (NaN fails too)."""
    for key, v in values.items():
        if v is not None and not v > 0:
            raise ValueError(f"{section}.{key} must be > 0, got {v}")


def check_non_negative(section: str, **values: float | int | None) -> None:
    for key, v in values.items():
        if v is not None and not v >= 0:
            raise ValueError(f"{section}.{key} must be >= 0, got {v}")


def check_finite(section: str, **values: float | int | None) -> None:
    """``section.key must be a finite number`` for each value that is not None (.inf
    passes the > 0 checks, then overflows where a library uses it)."""
    for key, v in values.items():
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{section}.{key} must be a finite number, got {v}")


def _check_choice(section: str, key: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{section}.{key}={value!r}; expected one of {list(allowed)}")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, then a constant or cosine learning rate.

    The learning rate ramps linearly from lr/warmup_steps (first step) to lr over
    ``warmup_steps`` steps; ``cosine`` then decays to ``lr * min_lr_ratio`` at
    ``total_steps`` (in a run config, null: the run's optimizer steps, train.total_versions
    x algo.ppo_n_minibatches). Weight decay applies to matrices (ndim >= 2, embeddings
    included); norms and biases are never decayed. ``max_grad_norm=None``: no clipping.
    """

    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = None  # the cosine schedule's length
    min_lr_ratio: float = 0.0  # cosine: the final lr is lr * min_lr_ratio
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        check_positive("optim", lr=self.lr, max_grad_norm=self.max_grad_norm, eps=self.eps,
                       total_steps=self.total_steps)
        check_finite("optim", lr=self.lr, max_grad_norm=self.max_grad_norm, eps=self.eps,
                     weight_decay=self.weight_decay, b1=self.b1, b2=self.b2)
        check_non_negative("optim", warmup_steps=self.warmup_steps,
                           weight_decay=self.weight_decay)
        _check_choice("optim", "schedule", self.schedule, SCHEDULES)
        if (self.schedule == "cosine" and self.total_steps is not None
                and self.total_steps <= self.warmup_steps):
            raise ValueError(f"optim.total_steps ({self.total_steps}) must be larger than "
                             f"optim.warmup_steps ({self.warmup_steps}) for the cosine schedule")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for key in ("b1", "b2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"optim.{key} must be in [0, 1), got {getattr(self, key)}")


@dataclass(frozen=True)
class CriticConfig:
    """``critic``: the value model's loss (``algo.name: ppo``; its clip range and weight are
    ``algo.value_eps_clip`` and ``algo.value_coef``). ``loss``: "mse" (0.5 (V - R)^2) or
    "huber" (quadratic within ``huber_delta`` of the return, linear beyond: a bounded
    gradient for returns far from the values); both clipped around the old values."""

    loss: Literal["mse", "huber"] = "mse"
    huber_delta: float = 1.0

    def __post_init__(self) -> None:
        _check_choice("critic", "loss", self.loss, ("mse", "huber"))
        check_positive("critic", huber_delta=self.huber_delta)
        if not math.isfinite(self.huber_delta):
            raise ValueError(f"critic.huber_delta must be a finite number, got "
                             f"{self.huber_delta} (plain 0.5 * squared error is critic.loss=mse)")


@dataclass(frozen=True)
class AlgoConfig:
    """The RL algorithm and its PPO update (see docs/architecture.md, "The decoupled PPO
    loss"). ``decoupled=False`` is naive PPO: prox_logp := behav_logp, so no recompute and
    no behaviour importance weight. ``kl_coef > 0`` adds a KL penalty to ``ref_logp``,
    which the micro-batches must then carry."""

    # One of ALGORITHMS (ALGORITHM_SPECS: its advantages, objective and ratio level):
    # grpo | rloo | drgrpo | gspo (GRPO advantages, sequence-level ratio) | cispo | sapo |
    # ppo (actor-critic, GAE)
    name: str = "grpo"
    decoupled: bool = True  # decoupled PPO (prox recompute + behaviour weights); False: naive
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None  # DAPO clip-higher
    c_clip: float | None = None  # dual clip, > 1
    behav_imp_weight_cap: float | None = None  # the same as behav_correction: cap, C = it
    # Rollout-training mismatch correction of the behaviour weight (docs/losses.md,
    # "Behaviour corrections"): none | cap | tis | icepop | seq_tis | seq_tis_geo | seq_mask |
    # seq_mask_geo. null: "cap" when behav_imp_weight_cap is set, else "none".
    behav_correction: BehavCorrectionMode | None = None
    behav_correction_cap: float | None = None  # C of cap, tis, seq_tis*; null: 2.0
    behav_correction_low: float = 0.5  # the band [low, high] of icepop, seq_mask*
    behav_correction_high: float = 2.0
    ppo_n_minibatches: int = 1
    agg_mode: AggMode = "token-mean"
    # The trust-region ratio: per token (PPO) or per sequence (GSPO). null: "sequence" for
    # name gspo, else "token" (AReaL calls this importance_sampling_level).
    ratio_level: RatioLevel | None = None
    dynamic_filter: bool = False  # DAPO: drop groups whose rewards are all equal
    kl_coef: float = 0.0  # reference-model KL penalty (0: no reference model)
    kl_estimator: KLEstimator = "k3"  # k1 | k2 | k3 | low_var_kl | k1+ | k3+ | low_var_kl+
    kl_clamp: float | None = None  # clip each token's KL estimate to [-kl_clamp, kl_clamp]
    sapo_tau_pos: float = 1.0  # sapo: gate temperature where A > 0
    sapo_tau_neg: float = 1.05  # sapo: gate temperature where A <= 0
    gamma: float = 1.0  # ppo only
    lam: float = 1.0  # ppo only
    value_eps_clip: float = 0.2  # ppo only
    value_coef: float = 1.0  # ppo only: critic loss weight (critic has its own optimizer)
    # A warning line (at most every 10 versions) when the lag-0 rollout-training mismatch,
    # mismatch/lag0_abs_diff_mean, passes this bound; null disables it.
    mismatch_warn_abs_diff: float | None = 0.05

    def __post_init__(self) -> None:
        _check_choice("algo", "name", self.name, ALGORITHMS)
        _check_choice("algo", "agg_mode", self.agg_mode, AGG_MODES)
        _check_choice("algo", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("algo", "ratio_level", self.ratio_level, (*RATIO_LEVELS, None))
        if isinstance(self.ppo_n_minibatches, bool) or not isinstance(self.ppo_n_minibatches, int):
            raise ValueError(f"algo.ppo_n_minibatches must be an int, got "
                             f"{self.ppo_n_minibatches!r}")
        check_positive("algo", eps_clip=self.eps_clip, ppo_n_minibatches=self.ppo_n_minibatches,
                       behav_imp_weight_cap=self.behav_imp_weight_cap,
                       eps_clip_higher=self.eps_clip_higher,
                       mismatch_warn_abs_diff=self.mismatch_warn_abs_diff,
                       kl_clamp=self.kl_clamp, sapo_tau_pos=self.sapo_tau_pos,
                       sapo_tau_neg=self.sapo_tau_neg)
        objective = self.spec.objective
        if objective != "ppo" and self.c_clip is not None:
            raise ValueError(f"algo.c_clip (PPO's dual clip) does not apply to algo.name="
                             f"{self.name!r}, whose objective bounds its weight itself; set "
                             "algo.c_clip=null")
        if objective == "sapo" and self.eps_clip_higher is not None:
            raise ValueError("algo.eps_clip_higher does not apply to algo.name='sapo' (a soft "
                             "gate, no hard clip: tune algo.sapo_tau_pos / algo.sapo_tau_neg); "
                             "set algo.eps_clip_higher=null")
        self._check_behav_correction()
        if self.c_clip is not None and not self.c_clip > 1:
            raise ValueError(f"algo.c_clip must be > 1 (or null), got {self.c_clip}")
        check_non_negative("algo", kl_coef=self.kl_coef, value_eps_clip=self.value_eps_clip,
                           value_coef=self.value_coef)
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"algo.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.name == "gspo" and self.ratio_level == "token":
            raise ValueError("algo.ratio_level='token' contradicts algo.name='gspo' (GSPO is "
                             "the sequence-level ratio); drop algo.ratio_level or use name grpo")

    def _check_behav_correction(self) -> None:
        _check_choice("algo", "behav_correction", self.behav_correction,
                      (*BEHAV_CORRECTIONS, None))
        check_positive("algo", behav_correction_cap=self.behav_correction_cap)
        for key in ("behav_imp_weight_cap", "behav_correction_cap", "behav_correction_low",
                    "behav_correction_high"):
            value = getattr(self, key)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"algo.{key} must be a finite number, got {value} (no "
                                 "correction at all is algo.behav_correction=none)")
        legacy = self.behav_imp_weight_cap
        if legacy is not None and self.behav_correction not in (None, "cap"):
            raise ValueError(f"algo.behav_imp_weight_cap={legacy} is the 'cap' correction and "
                             f"contradicts algo.behav_correction={self.behav_correction!r}; "
                             "set algo.behav_imp_weight_cap=null (the cap of tis and seq_tis* is "
                             "algo.behav_correction_cap)")
        if legacy is not None and self.behav_correction_cap not in (None, legacy):
            raise ValueError(f"algo.behav_imp_weight_cap={legacy} and "
                             f"algo.behav_correction_cap={self.behav_correction_cap} disagree; "
                             "give one")
        low, high = self.behav_correction_low, self.behav_correction_high
        if not (low >= 0 and high > low):
            raise ValueError(f"algo.behav_correction_low={low} and algo.behav_correction_high="
                             f"{high} must satisfy 0 <= low < high")

    @property
    def spec(self) -> AlgorithmSpec:
        """``ALGORITHM_SPECS[name]``: its advantages, objective and default ratio level."""
        return ALGORITHM_SPECS[self.name]

    @property
    def advantage_mode(self) -> str:
        """How advantages are made: a ``losses.GROUP_MODES`` key, or "gae" (the critic)."""
        return self.spec.advantages

    @property
    def resolved_behav_correction(self) -> str:
        """``behav_correction``, or its default: "cap" with behav_imp_weight_cap, else none."""
        if self.behav_correction is not None:
            return self.behav_correction
        return "cap" if self.behav_imp_weight_cap is not None else "none"

    def _correction(self) -> tuple[str, float | None, float | None, float | None]:
        """(mode, C, low, high) of the behaviour correction as the loss takes them: C only
        for the capped modes (default 2.0), the band only for the band modes."""
        mode = self.resolved_behav_correction
        cap = 2.0 if self.behav_correction_cap is None else self.behav_correction_cap
        band = mode in BAND_CORRECTIONS
        return (mode, cap if mode in CAPPED_CORRECTIONS else None,
                self.behav_correction_low if band else None,
                self.behav_correction_high if band else None)

    @property
    def behav_correction_kwargs(self) -> dict[str, str | float | None]:
        """The correction's arguments of ``areal_jax.losses.decoupled_ppo_loss``."""
        if self.behav_imp_weight_cap is not None:  # as before: caps exp(prox - behav)
            return {"behav_imp_weight_cap": self.behav_imp_weight_cap}
        mode, cap, low, high = self._correction()
        return {"behav_correction": mode, "behav_correction_cap": cap,
                "behav_correction_low": low, "behav_correction_high": high}

    def ppo_loss_config(self, seq_token_sum_normalizer: float | None = None) -> PPOLossConfig:
        """The PPO loss's config (``areal_jax.losses.PPOLossConfig``) of this algorithm;
        ``seq_token_sum_normalizer``: the constant L of agg_mode seq-mean-token-sum. With
        ``behav_imp_weight_cap`` the loss caps exp(prox - behav) itself, as before, and the
        correction's own fields stay unset."""
        capped = self.behav_imp_weight_cap is not None
        mode, cap, low, high = (None, None, None, None) if capped else self._correction()
        return PPOLossConfig(eps_clip=self.eps_clip, eps_clip_higher=self.eps_clip_higher,
                             c_clip=self.c_clip, behav_imp_weight_cap=self.behav_imp_weight_cap,
                             behav_correction=mode, behav_correction_cap=cap,
                             behav_correction_low=low, behav_correction_high=high,
                             agg_mode=self.agg_mode,
                             seq_token_sum_normalizer=seq_token_sum_normalizer,
                             ratio_level=self.resolved_ratio_level,
                             objective=self.spec.objective, sapo_tau_pos=self.sapo_tau_pos,
                             sapo_tau_neg=self.sapo_tau_neg)

    @property
    def resolved_ratio_level(self) -> str:
        """``ratio_level``, or its default for ``name``: "sequence" for gspo, else "token"."""
        if self.ratio_level is not None:
            return self.ratio_level
        return self.spec.ratio_level
