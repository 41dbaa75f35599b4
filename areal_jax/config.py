"""The run config schema: frozen dataclasses, loaded from YAML + ``key=value`` overrides.

``python scripts/train.py --config configs/tiny_demo.yaml train.total_versions=20``
loads ``configs/tiny_demo.yaml`` into :class:`TrainConfig`, applies the overrides
(dotted keys, values parsed as YAML), and validates every section. Unknown keys and
bad values fail with a :class:`ConfigError` that names the dotted key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from areal_jax.config_io import ConfigError, from_dict, load, to_dict

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelSection",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "TrainLoopConfig",
    "from_dict",
    "load_config",
    "to_dict",
]


def _positive(section: str, **values: float | int | None) -> None:
    for key, v in values.items():
        if v is not None and v <= 0:
            raise ValueError(f"{section}.{key} must be > 0, got {v}")


@dataclass(frozen=True)
class ModelSection:
    path: str = ""  # HF directory of the initial policy (config.json + safetensors)
    tokenizer_path: str | None = None  # defaults to model.path
    dtype: Literal["float32", "bfloat16"] = "float32"  # learner params/compute
    remat: bool = False  # gradient checkpointing per decoder layer

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("model.path is required (an HF model directory)")


@dataclass(frozen=True)
class DataConfig:
    train: str = "builtin:train"  # JSONL / Parquet path, gs:// path, or builtin:train
    eval: str | None = "builtin:eval"
    prompt_key: str = "question"
    answer_key: str = "answer"
    shuffle: bool = True
    max_eval_prompts: int | None = None
    use_chat_template: bool = True  # when the tokenizer has one

    def __post_init__(self) -> None:
        _positive("data", max_eval_prompts=self.max_eval_prompts)


@dataclass(frozen=True)
class RewardConfig:
    fn: str = "builtin"  # builtin | math | code | package.module:function
    num_workers: int = 1
    timeout_s: float = 10.0
    scale: float = 1.0
    bias: float = 0.0
    clip: float | None = None  # clip |reward| to this after scale and bias
    overlong_penalty_tokens: int | None = None  # DAPO: soft penalty zone length, in tokens
    overlong_penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        _positive("reward", num_workers=self.num_workers, timeout_s=self.timeout_s,
                  clip=self.clip, overlong_penalty_tokens=self.overlong_penalty_tokens)


@dataclass(frozen=True)
class RolloutConfig:
    servers: list[str] = field(default_factory=list)  # external servers (e.g. SGLang); empty: launch embedded
    num_servers: int = 1  # embedded servers to launch when `servers` is empty
    server_cpu_cores: list[int] | None = None  # CPU cores pinned to the embedded servers
    learner_cpu_cores: list[int] | None = None  # CPU cores pinned to the learner process
    max_slots: int = 64  # embedded engine: concurrent sequences per server
    max_seq_len: int = 256  # embedded engine: prompt + completion tokens per slot
    n_samples: int = 8  # samples per prompt (the group)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_concurrent: int | None = None  # prompts in flight; default 2 * batch_size
    max_staleness: int | None = 2  # eta; None: unbounded (still capped by max_concurrent)
    interruptible: bool = True  # abort in-flight requests on a weight update (else wait for them)
    request_timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        _positive("rollout", num_servers=self.num_servers, max_slots=self.max_slots,
                  max_seq_len=self.max_seq_len, n_samples=self.n_samples,
                  max_new_tokens=self.max_new_tokens, max_concurrent=self.max_concurrent,
                  top_p=self.top_p, request_timeout_s=self.request_timeout_s)
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0 or null, got {self.max_staleness}")
        if self.top_p > 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        for s in self.servers:
            if not s.startswith(("http://", "https://")):
                raise ValueError(f"rollout.servers entry {s!r} must be a URL like http://127.0.0.1:30000")


@dataclass(frozen=True)
class AlgoConfig:
    name: Literal["grpo", "rloo", "drgrpo", "ppo"] = "grpo"  # ppo: actor-critic with GAE
    decoupled: bool = True  # decoupled PPO (prox recompute + behaviour weights); False: naive PPO
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None  # DAPO clip-higher
    c_clip: float | None = None  # dual clip, > 1
    behav_imp_weight_cap: float | None = None
    ppo_n_minibatches: int = 1
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    dynamic_filter: bool = False  # DAPO: drop groups whose rewards are all equal
    kl_coef: float = 0.0  # reference-model KL penalty (0: no reference model)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    gamma: float = 1.0  # ppo only
    lam: float = 1.0  # ppo only
    value_eps_clip: float = 0.2  # ppo only
    value_coef: float = 1.0  # ppo only: critic loss weight (critic has its own optimizer)

    def __post_init__(self) -> None:
        _positive("algo", eps_clip=self.eps_clip, ppo_n_minibatches=self.ppo_n_minibatches,
                  behav_imp_weight_cap=self.behav_imp_weight_cap)
        if self.c_clip is not None and self.c_clip <= 1:
            raise ValueError(f"algo.c_clip must be > 1 (or null), got {self.c_clip}")
        if self.kl_coef < 0:
            raise ValueError(f"algo.kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr, max_grad_norm=self.max_grad_norm)
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class TrainLoopConfig:
    batch_size: int = 16  # prompts (groups) per version
    total_versions: int = 100  # learner versions (= optimizer batches) to train
    seq_len: int = 256  # tokens per packed row
    rows_per_micro_batch: int = 8  # rows per micro-batch (a multiple of data * fsdp)
    logp_chunk_size: int = 4096  # vocabulary chunk for logprobs

    def __post_init__(self) -> None:
        _positive("train", batch_size=self.batch_size, total_versions=self.total_versions,
                  seq_len=self.seq_len, rows_per_micro_batch=self.rows_per_micro_batch,
                  logp_chunk_size=self.logp_chunk_size)


@dataclass(frozen=True)
class EvalConfig:
    every_versions: int = 5  # 0: never (except at_start / at_end)
    at_start: bool = True
    at_end: bool = True
    n_samples: int = 1  # pass@1 averaged over this many samples per prompt
    temperature: float = 1.0  # 0: greedy
    max_new_tokens: int | None = None  # default: rollout.max_new_tokens

    def __post_init__(self) -> None:
        _positive("eval", n_samples=self.n_samples, max_new_tokens=self.max_new_tokens)
        if self.every_versions < 0 or self.temperature < 0:
            raise ValueError("eval.every_versions and eval.temperature must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    every_versions: int = 10  # 0: only at the end
    keep: int = 3  # Orbax checkpoints kept
    keep_weights: int = 3  # published serving-weight versions kept
    async_save: bool = True
    dir: str | None = None  # default: RUN_DIR/checkpoints (local path or gs://)

    def __post_init__(self) -> None:
        _positive("checkpoint", keep=self.keep, keep_weights=self.keep_weights)
        if self.every_versions < 0:
            raise ValueError(f"checkpoint.every_versions must be >= 0, got {self.every_versions}")


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = None  # host:port; default from the environment
    num_processes: int | None = None
    process_id: int | None = None


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSection
    run_dir: str = "runs/default"
    seed: int = 0
    mode: Literal["async", "sync"] = "async"
    mesh: str = "data=-1"  # data=D,fsdp=F,tensor=T; one -1 means "the rest"
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    log_every: int = 1
    progress_bar: bool = True

    def __post_init__(self) -> None:
        if self.rollout.max_new_tokens >= self.rollout.max_seq_len:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) must be smaller than "
                f"rollout.max_seq_len ({self.rollout.max_seq_len})"
            )
        if self.mode == "sync" and self.rollout.max_staleness not in (0, None):
            pass  # sync mode ignores max_staleness: it is 0 by construction

    @property
    def max_concurrent(self) -> int:
        return self.rollout.max_concurrent or 2 * self.train.batch_size

    @property
    def eta(self) -> int | None:
        return 0 if self.mode == "sync" else self.rollout.max_staleness


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Load and validate a run config; raises ConfigError naming the bad key."""
    cfg = load(TrainConfig, path, overrides)
    return cfg
