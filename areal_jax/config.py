"""The run config schema: frozen dataclasses, loaded from YAML + ``key=value`` overrides.

``python scripts/train.py --config configs/tiny_demo.yaml train.total_versions=20``
loads ``configs/tiny_demo.yaml`` into :class:`TrainConfig`, applies the overrides
(dotted keys, values parsed as YAML), and validates every section. Unknown keys and
bad values fail with a :class:`ConfigError` that names the dotted key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from areal_jax.config_io import ConfigError, from_dict, load, to_dict
from areal_jax.learner.config import (
    AlgoConfig,
    CriticConfig,
    OptimConfig,
    check_finite,
    check_non_negative,
    check_positive,
)

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "JudgeSection",
    "ModelServerSection",
    "RewardModelSection",
    "LoggingConfig",
    "LoraSection",
    "ModelSection",
    "OptimConfig",
    "PlacementConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SGLangConfig",
    "StorageConfig",
    "TeacherSection",
    "TrainConfig",
    "TrainLoopConfig",
    "WandbSection",
    "WatchdogConfig",
    "from_dict",
    "load_config",
    "to_dict",
]


@dataclass(frozen=True)
class LoraSection:
    """``model.lora``: train LoRA adapters instead of the whole model (absent: full
    fine-tuning). Adapter scale = alpha / rank, as PEFT's ``lora_alpha / r``."""

    rank: int = 8
    alpha: float = 16.0
    # PEFT module names: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # Written to the PEFT adapter_config.json; training needs 0 (see __post_init__).
    dropout: float = 0.0
    # Also write each version's adapter alone, in PEFT layout, to weights/v{N}/adapter
    # (for servers that load adapters); the merged model is always published.
    publish_adapter: bool = False
    # What the rollout servers load each version: "merged" (/update_weights_from_disk of
    # weights/v{N}) or "adapter" (/load_lora_adapter of weights/v{N}/adapter as "v{N}" onto
    # the base model they started from; requests carry "lora_path"). Adapter mode publishes
    # the adapter whatever publish_adapter says.
    serving: Literal["merged", "adapter"] = "merged"

    def __post_init__(self) -> None:
        from model_defs.lora import LORA_TARGETS

        if self.rank <= 0:
            raise ValueError(f"model.lora.rank must be > 0, got {self.rank}")
        check_positive("model.lora", alpha=self.alpha)
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(f"model.lora.target_modules {self.target_modules}: "
                             f"{'unknown ' + str(unknown) if unknown else 'empty'}; "
                             f"choose from {list(LORA_TARGETS)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"model.lora.target_modules {self.target_modules} has duplicates")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.dropout > 0:
            raise ValueError(
                f"model.lora.dropout={self.dropout} is not supported: the decoupled loss "
                "compares the policy's logprobs with the behaviour and proximal ones, which "
                "dropout in the training forward pass would perturb; use 0")
        if self.serving not in ("merged", "adapter"):
            raise ValueError(f"model.lora.serving must be 'merged' or 'adapter', got "
                             f"{self.serving!r}")
        if self.serving == "adapter":
            object.__setattr__(self, "publish_adapter", True)  # the servers load it

    def spec(self) -> Any:
        """The ``model_defs.LoraConfig`` the learner attaches."""
        from model_defs.lora import LoraConfig

        return LoraConfig(rank=self.rank, alpha=self.alpha,
                          target_modules=tuple(self.target_modules), dropout=self.dropout)


@dataclass(frozen=True)
class ModelSection:
    # The initial policy: a local or gs:// HF directory (config.json + safetensors), builtin:NAME,
    # or a Hugging Face hub id (org/name), fetched into the hub cache when the run starts.
    path: str = ""
    revision: str | None = None  # hub ids only: a branch, tag or commit (default: main)
    tokenizer_path: str | None = None  # defaults to model.path
    # Compute dtype of the learner, the embedded engines' params and KV cache, and the
    # published serving weights. The learner's master weights and AdamW state stay fp32.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Gradient checkpointing per decoder layer: false/"none", true/"full" (keep only each
    # layer's input), "dots" (keep matmul outputs), "dots_no_batch" (keep weight matmuls).
    remat: bool | Literal["none", "full", "dots", "dots_no_batch"] = False
    # Self-attention kernel of the learner and the embedded engines' prefill: "auto" is
    # splash (Pallas) on TPU, cuDNN or Pallas-Triton on GPU and the XLA blockwise path on
    # CPU; "xla" forces the portable path everywhere.
    attention: Literal["auto", "xla", "splash", "cudnn", "pallas_gpu"] = "auto"
    lora: LoraSection | None = None  # LoRA adapters (see LoraSection); null: full fine-tuning

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("model.path is required (an HF model directory or a hub id "
                             "such as Qwen/Qwen2.5-1.5B-Instruct)")


@dataclass(frozen=True)
class DataConfig:
    # JSONL / JSON / Parquet file (local or gs://), hf://ORG/NAME?config=C&split=S (through
    # `datasets`), or builtin:train
    train: str = "builtin:train"
    eval: str | None = "builtin:eval"
    prompt_key: str = "question"
    answer_key: str = "answer"
    shuffle: bool = True
    max_eval_prompts: int | None = None
    use_chat_template: bool = True  # when the tokenizer has one

    def __post_init__(self) -> None:
        check_positive("data", max_eval_prompts=self.max_eval_prompts)


@dataclass(frozen=True)
class ModelServerSection:
    """A model server a run asks besides its rollout servers (``reward.judge``,
    ``teacher``): an external one at ``url`` (SGLang, vLLM, a hosted API) or an embedded
    server of ``model_path`` that the run starts and stops itself."""

    url: str | None = None  # http://host:port (a trailing /v1 is accepted)
    # Or: a checkpoint (local, gs:// or hub id, like model.path) the run serves itself.
    model_path: str | None = None
    api_key_env: str | None = None  # the environment variable holding the bearer key
    max_concurrency: int = 16  # requests in flight to it
    timeout_s: float = 60.0  # per request
    retries: int = 2  # more tries after a timeout, lost connection, 429/5xx or bad reply
    backoff_s: float = 0.5  # before the first retry; doubled each time
    # The embedded server (model_path) only:
    max_slots: int = 32
    max_seq_len: int | None = None  # default: rollout.max_seq_len + 1 (scores whole rows)
    dtype: Literal["float32", "bfloat16"] | None = None  # default: the rollout engines' dtype
    cpu_cores: list[int] | None = None  # CPU ids to pin it to (like rollout.server_cpu_cores)
    platform: str | None = None  # JAX platform (default: rollout.engine_platform's)
    devices: list[int] | None = None  # accelerator ids (like rollout.engine_devices)

    def __post_init__(self) -> None:
        name = type(self).SECTION
        if (self.url is None) == (self.model_path is None):
            raise ValueError(f"{name} needs exactly one of url (a running server) and "
                             "model_path (a checkpoint the run serves itself)")
        check_positive(name, max_concurrency=self.max_concurrency, timeout_s=self.timeout_s,
                       max_slots=self.max_slots, max_seq_len=self.max_seq_len)
        check_non_negative(name, retries=self.retries, backoff_s=self.backoff_s)
        if self.platform is not None and self.platform not in ENGINE_PLATFORMS:
            raise ValueError(f"{name}.platform must be one of {ENGINE_PLATFORMS}, got "
                             f"{self.platform!r}")

    SECTION = "server"


@dataclass(frozen=True)
class JudgeSection(ModelServerSection):
    """``reward.judge``: the LLM judge of ``reward.fn: judge`` (areal_jax/rewards/judge.py)."""

    # {question}, {reference} and {answer} are filled in; literal braces are {{ and }}.
    template: str | None = None  # default: rewards.judge.DEFAULT_TEMPLATE ("Score: 1"/"0")
    model: str = "default"  # the requests' "model" (a hosted API needs its model id)
    endpoint: Literal["chat", "completions"] = "chat"  # /v1/chat/completions or /v1/completions
    system_prompt: str | None = None
    score_pattern: str = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"  # group 1: the score
    score_min: float = 0.0  # a score outside [score_min, score_max] is unparsable
    score_max: float = 1.0
    max_tokens: int = 64
    temperature: float = 0.0
    cache_size: int = 10000  # identical judgments kept (LRU); 0: none
    # What a judgment that still failed after its retries becomes: "reject" drops the
    # sample's group (counted as rollout/reward_failed_groups); "fallback" scores it
    # fallback_score (counted as rollout/judge_fallbacks). Never a silent 0.
    on_failure: Literal["reject", "fallback"] = "reject"
    fallback_score: float | None = None

    SECTION = "reward.judge"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"reward.judge.endpoint must be chat or completions, got "
                             f"{self.endpoint!r}")
        if self.on_failure not in ("reject", "fallback"):
            raise ValueError(f"reward.judge.on_failure must be reject or fallback, got "
                             f"{self.on_failure!r}")
        if self.on_failure == "fallback" and self.fallback_score is None:
            raise ValueError("reward.judge.on_failure: fallback needs reward.judge.fallback_score")
        check_positive("reward.judge", max_tokens=self.max_tokens)
        check_non_negative("reward.judge", temperature=self.temperature,
                           cache_size=self.cache_size)


@dataclass(frozen=True)
class RewardModelSection(ModelServerSection):
    """``reward.reward_model``: the classifier of ``reward.fn: reward_model``: SGLang's
    ``/classify`` (``--is-embedding``) or the run's embedded server of an HF
    ``*ForSequenceClassification`` checkpoint (areal_jax/rewards/reward_model.py)."""

    template: str = "{question}\n{answer}"  # the text scored; {question} {reference} {answer}
    label: int = 0  # the head's output that is the reward
    score_min: float = -1.0e6  # a score outside [score_min, score_max] is a failed call
    score_max: float = 1.0e6
    cache_size: int = 10000
    on_failure: Literal["reject", "fallback"] = "reject"  # as reward.judge.on_failure
    fallback_score: float | None = None

    SECTION = "reward.reward_model"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_failure not in ("reject", "fallback"):
            raise ValueError(f"reward.reward_model.on_failure must be reject or fallback, got "
                             f"{self.on_failure!r}")
        if self.on_failure == "fallback" and self.fallback_score is None:
            raise ValueError("reward.reward_model.on_failure: fallback needs "
                             "reward.reward_model.fallback_score")
        check_non_negative("reward.reward_model", label=self.label, cache_size=self.cache_size)


@dataclass(frozen=True)
class TeacherSection(ModelServerSection):
    """``teacher``: on-policy distillation. The teacher scores each sample's tokens and every
    completion token's advantage gets ``kl_coef * (teacher_logp - behav_logp)``, the negative
    per-token reverse KL (docs/distillation.md), plus ``reward_weight`` times the algorithm's
    own advantage (0: pure distillation, the reward only measured)."""

    kl_coef: float = 1.0
    reward_weight: float = 0.0
    timeout_s: float = 120.0

    SECTION = "teacher"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("teacher", kl_coef=self.kl_coef)
        check_non_negative("teacher", reward_weight=self.reward_weight)


@dataclass(frozen=True)
class RewardConfig:
    fn: str = "builtin"  # builtin | math | code | judge | reward_model | package.module:function
    judge: JudgeSection | None = None  # the judge of fn: judge
    reward_model: RewardModelSection | None = None  # the classifier of fn: reward_model
    # What evals score with (a verifier: builtin | math | code | module:function); default
    # fn. Needed when fn is judge, whose scores evals do not use.
    eval_fn: str | None = None
    num_workers: int = 1
    timeout_s: float = 10.0
    scale: float = 1.0
    bias: float = 0.0
    clip: float | None = None  # clip |reward| to this after scale and bias
    overlong_penalty_tokens: int | None = None  # DAPO: soft penalty zone length, in tokens
    overlong_penalty_factor: float = 1.0
    # A reward outside [-max_abs, max_abs] counts as a failed reward (like one that raises);
    # the default keeps group statistics far inside float32. .inf: only finiteness is checked.
    max_abs: float = 1.0e6

    def __post_init__(self) -> None:
        check_positive("reward", num_workers=self.num_workers, timeout_s=self.timeout_s,
                  clip=self.clip, overlong_penalty_tokens=self.overlong_penalty_tokens,
                  max_abs=self.max_abs)
        if (self.fn == "judge") != (self.judge is not None):
            raise ValueError("reward.fn: judge needs a reward.judge section (url or model_path), "
                             "and reward.judge is used only with reward.fn: judge")
        if (self.fn == "reward_model") != (self.reward_model is not None):
            raise ValueError("reward.fn: reward_model needs a reward.reward_model section (url or "
                             "model_path), and reward.reward_model is used only with reward.fn: "
                             "reward_model")
        if self.eval_fn in ("judge", "reward_model"):
            raise ValueError("reward.eval_fn: evals score with a verifier (builtin, math, code or "
                             f"module:function), not {self.eval_fn}")


ENGINE_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")


def _check_fraction(key: str, value: float | None) -> None:
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"{key} must be null or in (0, 1], got {value}")


@dataclass(frozen=True)
class SGLangConfig:
    """``rollout.sglang``: train.py starts these SGLang servers itself (and stops them at
    the end), on GPUs of this host (docs/servers.md, "SGLang started by train.py")."""

    num_servers: int = 1
    tp_size: int = 1  # GPUs per server (SGLang's --tp-size)
    # GPU ids, tp_size per server in order; null: the host's last num_servers x tp_size GPUs.
    devices: list[int] | None = None
    # SGLang's --mem-fraction-static: its share of each GPU (weights + KV cache); null:
    # SGLang's own default. Required where a server shares a GPU with the learner.
    mem_fraction_static: float | None = None
    port: int = 30000  # server i listens on 127.0.0.1:port + i
    # The Python of the environment SGLang is installed in (its own virtualenv, see
    # docs/accelerators.md); null: this one (pip install -e '.[sglang]').
    python: str | None = None
    extra_args: list[str] = field(default_factory=list)  # more sglang.launch_server flags
    startup_timeout_s: float = 900.0  # launch to healthy (loads and captures CUDA graphs)

    def __post_init__(self) -> None:
        check_positive("rollout.sglang", num_servers=self.num_servers, tp_size=self.tp_size,
                       port=self.port, startup_timeout_s=self.startup_timeout_s)
        _check_fraction("rollout.sglang.mem_fraction_static", self.mem_fraction_static)
        if self.devices is not None and any(not isinstance(d, int) or d < 0
                                            for d in self.devices):
            raise ValueError(f"rollout.sglang.devices must be null or GPU ids >= 0, "
                             f"got {self.devices}")


@dataclass(frozen=True)
class PlacementConfig:
    """``placement``: which accelerators the learner process takes (docs/accelerators.md,
    "Placement"). The rollout's are rollout.engine_devices and rollout.sglang.devices."""

    # Device ids of the learner; null: those no rollout server was given (all of them when
    # the servers take every one: a shared card).
    learner_devices: list[int] | None = None
    # XLA_PYTHON_CLIENT_MEM_FRACTION of the learner: its share of each GPU's memory; null:
    # JAX's default (75%). Required where the learner shares a GPU.
    learner_mem_fraction: float | None = None

    def __post_init__(self) -> None:
        _check_fraction("placement.learner_mem_fraction", self.learner_mem_fraction)
        if self.learner_devices is not None and (
                not self.learner_devices or any(not isinstance(d, int) or d < 0
                                                for d in self.learner_devices)):
            raise ValueError("placement.learner_devices must be null or a non-empty list of "
                             f"device ids >= 0, got {self.learner_devices}")


@dataclass(frozen=True)
class RolloutConfig:
    # External servers (e.g. SGLang); empty: launch embedded ones.
    servers: list[str] = field(default_factory=list)
    num_servers: int = 1  # embedded servers to launch when `servers` is empty
    server_cpu_cores: list[int] | None = None  # CPU cores pinned to the embedded servers
    learner_cpu_cores: list[int] | None = None  # CPU cores pinned to the learner process
    max_slots: int = 64  # embedded engine: concurrent sequences per server
    max_seq_len: int = 256  # embedded engine: prompt + completion tokens per slot
    # Embedded engine: prompts prefilled per device call (padded to this many rows) and
    # tokens decoded per slot per call; null: the engine's defaults (EngineConfig).
    prefill_rows: int | None = None
    decode_steps: int | None = None
    # Embedded engine: dtype of its params and KV cache, and of the published serving
    # weights; null: model.dtype. "float32" with model.dtype "bfloat16" gives the servers
    # the fp32 master weights while the learner computes in bf16 (the two then differ by
    # the learner's bf16 rounding alone: mismatch/lag0_* measures it).
    engine_dtype: Literal["float32", "bfloat16"] | None = None
    # Embedded engine: its loop over the layers. "scan": one layer per program (compile time
    # independent of depth); "unrolled": every layer inlined; "auto": scan on TPU, unrolled on
    # GPU and CPU (docs/accelerators.md, "Engine start-up": what each costs on an H100).
    engine_layer_loop: Literal["auto", "scan", "unrolled"] = "auto"
    n_samples: int = 8  # samples per prompt (the group)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_concurrent: int | None = None  # prompts in flight; default 2 * batch_size
    max_staleness: int | None = 2  # eta; None: unbounded (still capped by max_concurrent)
    interruptible: bool = True  # abort in-flight requests on a weight update (else wait for them)
    request_timeout_s: float = 600.0
    server_startup_timeout_s: float = 600.0  # embedded servers: launch to healthy
    # A stalled server (timeouts, 5xx, dropped connections) is retried with backoff for this
    # long before it is dropped; one that refuses connections is dropped at once.
    request_retry_deadline_s: float = 300.0
    api_key: str | None = None
    # Agentic RL (areal_jax.rollout.agent): "agent" runs rollout.agent, a "module:function"
    # written against the OpenAI API, per sample, recording every call token-in/token-out.
    workflow: Literal["rlvr", "agent"] = "rlvr"
    agent: str | None = None
    max_turns: int = 4  # agent: model calls per trajectory
    max_total_tokens: int | None = None  # agent: tokens per trajectory; null: train.seq_len
    # Each workflow run (one prompt's group: its requests, rewards, an agent's episodes and
    # tools) must end within this many seconds, in training and in eval; one that does not
    # is cancelled and counts as a failed attempt naming the workflow. 0: no limit.
    episode_timeout_s: float = 1200.0
    # JAX platform of the embedded engines ("cpu", "gpu", "tpu"); null: the learner's.
    # engine_devices: the accelerator each engine runs on (one id per server, or one id
    # for all), e.g. [1] to keep it off device 0; null: the host's last num_servers devices
    # (the only one on a one-GPU host). engine_mem_fraction: each engine's share of its
    # GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION), required on a card it shares
    # (docs/accelerators.md, "Placement").
    engine_platform: str | None = None
    engine_devices: list[int] | None = None
    engine_mem_fraction: float | None = None
    # SGLang servers train.py starts and stops itself (instead of servers or the engine).
    sglang: SGLangConfig | None = None

    def __post_init__(self) -> None:
        check_positive("rollout", max_turns=self.max_turns, max_total_tokens=self.max_total_tokens)
        if self.workflow == "agent" and not self.agent:
            raise ValueError("rollout.workflow='agent' needs rollout.agent, the agent function "
                             "as 'module:function'")
        if self.agent and self.workflow != "agent":
            raise ValueError(f"rollout.agent is set but rollout.workflow={self.workflow!r}; "
                             "set rollout.workflow: agent")
        if self.engine_platform is not None and self.engine_platform not in ENGINE_PLATFORMS:
            raise ValueError(f"rollout.engine_platform must be null or one of {ENGINE_PLATFORMS}, "
                             f"got {self.engine_platform!r}")
        if self.engine_devices is not None and (
                not self.engine_devices or any(not isinstance(d, int) or d < 0
                                               for d in self.engine_devices)):
            raise ValueError("rollout.engine_devices must be null or a non-empty list of device "
                             f"ids >= 0, got {self.engine_devices}")
        _check_fraction("rollout.engine_mem_fraction", self.engine_mem_fraction)
        if self.sglang is not None and self.servers:
            raise ValueError("rollout.sglang starts SGLang servers; rollout.servers names "
                             "servers already running: set one of them")
        check_positive("rollout", prefill_rows=self.prefill_rows, decode_steps=self.decode_steps)
        check_positive("rollout", num_servers=self.num_servers, max_slots=self.max_slots,
                  max_seq_len=self.max_seq_len, n_samples=self.n_samples,
                  max_new_tokens=self.max_new_tokens, max_concurrent=self.max_concurrent,
                  top_p=self.top_p, request_timeout_s=self.request_timeout_s,
                  server_startup_timeout_s=self.server_startup_timeout_s)
        check_finite("rollout", request_timeout_s=self.request_timeout_s,
                     server_startup_timeout_s=self.server_startup_timeout_s)
        if self.request_timeout_s < 1.0:  # each request would time out and be retried
            raise ValueError(f"rollout.request_timeout_s must be >= 1 (seconds a /generate "
                             f"request may take), got {self.request_timeout_s}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k must be -1 (disabled) or >= 1, got {self.top_k} "
                             "(servers reject every request with top_k=0)")
        for key in ("server_cpu_cores", "learner_cpu_cores"):
            cores = getattr(self, key)
            if cores is not None and (not cores or any(c < 0 for c in cores)):
                raise ValueError(f"rollout.{key} must be null or a non-empty list of core ids "
                                 f">= 0, got {cores}")
        if not self.temperature > 0:
            raise ValueError("rollout.temperature must be > 0 for RL sampling, "
                             f"got {self.temperature}")
        if not 0 <= self.episode_timeout_s < math.inf:
            raise ValueError("rollout.episode_timeout_s must be a finite number of seconds >= 0 "
                             f"(0: no limit), got {self.episode_timeout_s}")
        if not self.request_retry_deadline_s >= 0:
            raise ValueError(f"rollout.request_retry_deadline_s must be >= 0, got "
                             f"{self.request_retry_deadline_s}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("rollout.max_staleness must be >= 0 or null, "
                             f"got {self.max_staleness}")
        if self.top_p > 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        for s in self.servers:
            if not s.startswith(("http://", "https://")):
                raise ValueError(f"rollout.servers entry {s!r} must be a URL like "
                                 "http://127.0.0.1:30000")


@dataclass(frozen=True)
class TrainLoopConfig:
    batch_size: int = 16  # prompts (groups) per version
    total_versions: int = 100  # learner versions (= optimizer batches) to train
    seq_len: int = 256  # tokens per packed row
    rows_per_micro_batch: int = 8  # rows per micro-batch (a multiple of data * fsdp)
    # Shorter row lengths a packed row may take (seq_len is always one): each row is as long
    # as the smallest that holds it, micro-batches of L-token rows hold about
    # rows_per_micro_batch * seq_len / L rows; one compiled program per length
    # (learner/packing.py). None: every row is seq_len long.
    row_lengths: list[int] | None = None
    logp_chunk_size: int = 4096  # vocabulary chunk for logprobs
    # Process 0 writes each version's packed global batch to RUN_DIR/batches/v{N}.npz (the
    # batch that trained version N; read back with data.trajectories.load_batch).
    record_batches: bool = False

    def __post_init__(self) -> None:
        check_positive("train", batch_size=self.batch_size, total_versions=self.total_versions,
                  seq_len=self.seq_len, rows_per_micro_batch=self.rows_per_micro_batch,
                  logp_chunk_size=self.logp_chunk_size)
        if self.row_lengths is not None:
            bad = [n for n in self.row_lengths
                   if not isinstance(n, int) or isinstance(n, bool) or not 1 < n <= self.seq_len]
            if bad or not self.row_lengths:
                raise ValueError(f"train.row_lengths must be a list of ints in [2, train.seq_len="
                                 f"{self.seq_len}] (a row holds at least a prompt token and a "
                                 f"generated one), got {self.row_lengths}")


@dataclass(frozen=True)
class EvalConfig:
    every_versions: int = 5  # 0: never (except at_start / at_end)
    at_start: bool = True
    at_end: bool = True
    n_samples: int = 1  # pass@1 averaged over this many samples per prompt
    temperature: float = 1.0  # 0: greedy
    max_new_tokens: int | None = None  # default: rollout.max_new_tokens

    def __post_init__(self) -> None:
        check_positive("eval", n_samples=self.n_samples, max_new_tokens=self.max_new_tokens)
        if self.every_versions < 0 or self.temperature < 0:
            raise ValueError("eval.every_versions and eval.temperature must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    every_versions: int = 10  # 0: only at the end
    keep: int = 3  # Orbax checkpoints kept
    keep_weights: int = 3  # published serving-weight versions kept
    async_save: bool = True
    dir: str | None = None  # default: RUN_DIR/checkpoints (local path or gs://)
    on_interrupt: bool = False  # SIGINT/SIGTERM: also save a checkpoint of the current version
    # Serving weights v{N}, read by the rollout servers: on several hosts a directory they
    # can all read (a shared filesystem or gs://). Default RUN_DIR/weights.
    publish_dir: str | None = None
    # How a version's serving weights are written. "background": a host copy (serving
    # dtype: 4 B/param fp32, 2 bf16; process 0 holds the whole model) is taken and written
    # while the learner trains on. "inline": written straight from the learner's arrays,
    # one tensor at a time, before the next step (the learner waits for the write; no
    # host copy). The servers' update runs in the background either way.
    publish_mode: Literal["background", "inline"] = "background"
    # How a version's serving weights reach the rollout servers (docs/checkpoints.md).
    # "memory": streamed from the learner's memory to the embedded servers over HTTP in
    # checksummed buckets, staged while they generate and swapped at a step boundary (no
    # disk; generation pauses only for the swap). "disk": HF safetensors written to
    # publish_dir/v{N} (as publish_mode says), loaded by /update_weights_from_disk: for
    # external servers, SGLang and LoRA adapter serving. "auto": memory where every server
    # is an embedded engine this run starts (and LoRA adapters are merged), else disk.
    # "delta": publish_dir/v{N}.delta, the compressed XOR of v{N}'s serving bits with
    # v{N-1}'s (checksummed), applied by embedded engines with /update_weights_from_delta:
    # for engines that read a shared path or gs:// (rollout.servers, other hosts); a
    # server that missed a version or refuses the delta gets the full version.
    # "distributed": SGLang's own in-memory update (/init_weights_update_group +
    # /update_weights_from_distributed): the learner joins a torch process group with the
    # servers as rank 0 and broadcasts the HF-named tensors, bucketed; for SGLang servers
    # (NCCL) and embedded engines (gloo). Needs torch on the learner (not a core dependency).
    publish: Literal["auto", "memory", "delta", "disk", "distributed"] = "auto"
    publish_bucket_mb: int = 64  # memory, distributed: the bytes per bucket
    # memory, servers on this host: each version is written into the shared-memory file
    # of an earlier one that no server maps any more (a spare made ahead for the first
    # two), so a bump only copies into allocated pages (0.5B shape: the write 0.35 ->
    # ~0.15 s); /dev/shm holds the served version and the next (docs/checkpoints.md)
    publish_spare_file: bool = True
    # distributed: the group's backend ("gloo": CPU, any server; "nccl": SGLang on GPUs,
    # torch with CUDA on the learner), the address the servers reach the learner's
    # rendezvous at (default: 127.0.0.1 for servers on this host, else this host's address
    # on the route to the first server), its port (0: a free one), and the bound on every
    # group operation (a server or learner that died mid-broadcast is noticed by it).
    distributed_backend: Literal["gloo", "nccl"] = "gloo"
    distributed_master_address: str | None = None
    distributed_master_port: int = 0
    distributed_timeout_s: float = 600.0
    # delta: every this many versions (v % K == 0) the file holds the full version, so a
    # version on disk is rebuilt from at most K files (docs/checkpoints.md)
    delta_full_every: int = 10

    def __post_init__(self) -> None:
        check_positive("checkpoint", keep=self.keep, keep_weights=self.keep_weights,
                       publish_bucket_mb=self.publish_bucket_mb,
                       delta_full_every=self.delta_full_every)
        if self.publish not in ("auto", "memory", "delta", "disk", "distributed"):
            raise ValueError(f"checkpoint.publish must be 'auto', 'memory', 'delta', 'disk' or "
                             f"'distributed', got {self.publish!r}")
        if self.distributed_backend not in ("gloo", "nccl"):
            raise ValueError(f"checkpoint.distributed_backend must be 'gloo' or 'nccl', got "
                             f"{self.distributed_backend!r}")
        if not 0 <= self.distributed_master_port <= 65535:
            raise ValueError(f"checkpoint.distributed_master_port must be a port (0: a free "
                             f"one), got {self.distributed_master_port}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"checkpoint.distributed_timeout_s must be > 0, got "
                             f"{self.distributed_timeout_s}")
        if self.publish_mode not in ("background", "inline"):
            raise ValueError(f"checkpoint.publish_mode must be 'background' or 'inline', "
                             f"got {self.publish_mode!r}")
        if self.every_versions < 0:
            raise ValueError(f"checkpoint.every_versions must be >= 0, got {self.every_versions}")


@dataclass(frozen=True)
class WatchdogConfig:
    """When a run that cannot progress stops, and how long a shutdown may take."""

    # Stop when this many workflow attempts in a row end without an accepted group
    # (failed requests, failed rewards, rejected groups); 0: never.
    max_attempts_without_progress: int = 200
    # Stop when the learner has waited this long for a batch without any group being
    # accepted; 0: never.
    max_seconds_without_progress: float = 1800.0
    # Stop when the training loss is not finite this many versions in a row; 0: never.
    max_nonfinite_versions: int = 3
    # SIGINT/SIGTERM and the end of a run: the whole shutdown takes at most this long,
    # then the process exits anyway.
    shutdown_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        check_non_negative("watchdog",
                           max_attempts_without_progress=self.max_attempts_without_progress,
                           max_seconds_without_progress=self.max_seconds_without_progress,
                           max_nonfinite_versions=self.max_nonfinite_versions)
        check_positive("watchdog", shutdown_timeout_s=self.shutdown_timeout_s)
        check_finite("watchdog", shutdown_timeout_s=self.shutdown_timeout_s)


@dataclass(frozen=True)
class StorageConfig:
    """Local side of a run whose paths are ``gs://`` URLs (see ``areal_jax/storage.py``)."""

    cache_dir: str | None = None  # downloads and run-file working copies; ~/.cache/areal_jax
    # gs:// run dirs: run files are uploaded this often (and at each checkpoint).
    upload_every_s: float = 60.0

    def __post_init__(self) -> None:
        if self.upload_every_s <= 0:
            raise ValueError(f"storage.upload_every_s must be > 0, got {self.upload_every_s}")
        if self.cache_dir is not None and "://" in self.cache_dir:
            raise ValueError(f"storage.cache_dir must be a local directory, got {self.cache_dir!r}")


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = None  # host:port; default from the environment
    num_processes: int | None = None
    process_id: int | None = None
    # Several processes: a process that stops heart-beating this long counts as failed,
    # and every process ends (a failure with an error message ends them at once).
    peer_timeout_s: float = 15.0
    auto_detect: bool = True  # with nothing set: join a detected Slurm / TPU pod / MPI job

    def __post_init__(self) -> None:
        check_positive("distributed", num_processes=self.num_processes)
        if self.peer_timeout_s < 2:
            raise ValueError(f"distributed.peer_timeout_s must be >= 2 (heartbeats every 0.5 s), "
                             f"got {self.peer_timeout_s}")


WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class WandbSection:
    """``logging.wandb``: log the run to Weights & Biases (the ``wandb`` extra)."""

    project: str = "areal-jax"
    name: str | None = None  # the W&B run's name; default: run_dir's last component
    # online: sent as it goes; offline: written under RUN_DIR/wandb only (no network;
    # `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later); disabled: nothing.
    mode: Literal["online", "offline", "disabled"] = "online"
    entity: str | None = None  # a W&B team or user; default: the API key's
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb.mode must be one of {list(WANDB_MODES)}, "
                             f"got {self.mode!r}")
        if not self.project:
            raise ValueError("logging.wandb.project must be a non-empty name")


@dataclass(frozen=True)
class LoggingConfig:
    """``logging``: where metrics go besides metrics.jsonl and TensorBoard."""

    wandb: WandbSection | None = None  # null: no W&B run


@dataclass(frozen=True)
class SFTConfig:
    """``sft``: supervised fine-tuning (``mode: sft``; docs/training.md, "Supervised
    fine-tuning"). data.train (and data.eval, for the held-out loss) hold chat messages or
    prompt/completion pairs."""

    # A row with this key is chat messages (a list of {role, content}); the loss is on the
    # assistant turns only.
    messages_key: str = "messages"
    # Otherwise data.prompt_key is the prompt and this key the completion (learned, + EOS).
    completion_key: str = "completion"
    # Start from random weights (drawn from seed) of model.path's architecture (config.json)
    # instead of its trained ones: a model trained from scratch, like the demo's warm start.
    random_init: bool = False
    # Evaluate the task's accuracy too (data.eval's prompt_key/answer_key, reward.fn, through
    # the run's rollout servers); false: the held-out loss only (data.eval rows need no answer).
    eval_accuracy: bool = True


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSection
    run_dir: str = "runs/default"  # a local path or gs://bucket/path
    seed: int = 0
    # async / sync: RL (sync is eta = 0); sft: supervised fine-tuning (the sft section).
    mode: Literal["async", "sync", "sft"] = "async"
    mesh: str = "data=-1"  # data=D,fsdp=F,tensor=T; one -1 means "the rest"
    # The hardware this config is sized for: "cpu", a TPU slice (v5e:2x2, v5e:2x4, v4:2x2x1,
    # v5p:2x2x1, v6e:2x2) or N GPUs of one host (h100:N, h200:N). Documentation that
    # scripts/plan.py checks (its default --target); training runs on whatever JAX finds.
    hardware: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # algo.name ppo: the value loss
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    teacher: TeacherSection | None = None  # on-policy distillation (TeacherSection)
    log_every: int = 1
    progress_bar: bool = True
    # JAX's persistent compilation cache, shared by the learner and the embedded servers:
    # a second run of the same shapes compiles nothing. null (or ""): off.
    compilation_cache_dir: str | None = "~/.cache/areal_jax/jax_compilation_cache"

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32 - 1] (numpy's seed range), got "
                             f"{self.seed}")
        if self.hardware is not None and self.hardware != "cpu":
            from areal_jax.parallel.targets import check_target

            try:
                check_target(self.hardware)
            except ValueError:
                from areal_jax.parallel.targets import TARGET_HELP

                raise ValueError(f"hardware: {self.hardware!r} is not a known target; use cpu, "
                                 f"{TARGET_HELP} (or leave it out)") from None
        if self.rollout.max_new_tokens >= self.rollout.max_seq_len:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) must be smaller than "
                f"rollout.max_seq_len ({self.rollout.max_seq_len})"
            )
        if self.algo.dynamic_filter and self.rollout.n_samples < 2:
            raise ValueError(
                f"algo.dynamic_filter needs rollout.n_samples >= 2, got {self.rollout.n_samples}: "
                f"a group of one sample has one reward, and the filter drops every such group")
        if self.train.seq_len <= self.rollout.max_new_tokens:
            raise ValueError(
                f"train.seq_len ({self.train.seq_len}) must be larger than rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}): a packed row holds a whole prompt + completion")
        if self.critic != CriticConfig() and self.algo.advantage_mode != "gae":
            raise ValueError(f"critic.loss / critic.huber_delta set a critic's value loss, but "
                             f"algo.name={self.algo.name!r} has no critic (algo.name: ppo does)")
        if self.checkpoint.publish == "memory" and self.publish_path != "memory":
            raise ValueError(
                "checkpoint.publish: memory streams weights to the embedded servers a run "
                "starts; this run's servers are external (rollout.servers, rollout.sglang) or "
                "load LoRA adapters (model.lora.serving: adapter): use disk or auto")
        if self.checkpoint.publish == "delta" and (
                getattr(self.rollout, "sglang", None) is not None
                or (self.model.lora is not None and self.model.lora.serving == "adapter")):
            raise ValueError(
                "checkpoint.publish: delta needs servers that apply weight deltas (the "
                "embedded engine's /update_weights_from_delta, merged weights); SGLang and "
                "LoRA adapter serving load files: use disk or auto")
        if self.checkpoint.publish == "distributed" and (
                self.model.lora is not None and self.model.lora.serving == "adapter"):
            raise ValueError(
                "checkpoint.publish: distributed sends merged weights; LoRA adapter serving "
                "(model.lora.serving: adapter) loads adapter files: use disk or auto")
        if self.optim.schedule == "cosine" and self.optimizer_steps <= self.optim.warmup_steps:
            raise ValueError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) must be smaller than the "
                f"cosine schedule's optimizer steps (optim.total_steps, default train."
                f"total_versions x algo.ppo_n_minibatches = {self.optimizer_steps})")

    @property
    def optimizer_steps(self) -> int:
        """The cosine schedule's length: optim.total_steps, else the run's optimizer steps."""
        return self.optim.total_steps or self.train.total_versions * self.algo.ppo_n_minibatches

    @property
    def max_concurrent(self) -> int:
        return self.rollout.max_concurrent or 2 * self.train.batch_size

    @property
    def eta(self) -> int | None:
        return 0 if self.mode == "sync" else self.rollout.max_staleness

    @property
    def publish_path(self) -> Literal["memory", "delta", "disk", "distributed"]:
        """How the servers get each version (checkpoint.publish, "auto" resolved): memory
        where every server is an embedded engine this run starts and LoRA adapters are
        merged, else disk; delta and distributed only when asked for."""
        if self.checkpoint.publish == "delta":
            return "delta"
        if self.checkpoint.publish == "distributed":
            return "distributed"
        embedded = not self.rollout.servers and getattr(self.rollout, "sglang", None) is None
        adapters = self.model.lora is not None and self.model.lora.serving == "adapter"
        if self.checkpoint.publish == "disk" or not embedded or adapters:
            return "disk"
        return "memory"

    @property
    def serving_dtype(self) -> str:
        """The embedded engines' and the published weights' dtype (rollout.engine_dtype,
        else model.dtype)."""
        return self.rollout.engine_dtype or self.model.dtype


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Load and validate a run config; raises ConfigError naming the bad key."""
    cfg = load(TrainConfig, path, overrides)
    return cfg
