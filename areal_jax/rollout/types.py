"""Plain data types shared by the rollout client, workflows, executor and learner feed.

These are the contracts between rooms: the client returns a ``GenerateResponse``,
a workflow turns responses into ``Trajectory`` objects, and the data pipeline packs
trajectories for the learner. Token alignment: every per-token array is aligned with
``input_ids``; ``behav_logp[t]`` is log p(input_ids[t] | input_ids[:t]) under the
behaviour policy (0 where ``loss_mask`` is 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass
class GenerateRequest:
    """One sample: a prompt (token ids) and SGLang sampling params."""

    input_ids: list[int]
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    rid: str | None = None
    seed: int | None = None  # sent as sampling_params["sampling_seed"]

    def sampling_params(self, max_new_tokens: int | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": False,
        }
        if self.seed is not None:
            params["sampling_seed"] = int(self.seed)
        return params


@dataclass
class GenerateResponse:
    """A finished sample, stitched across interruptions by the client."""

    input_ids: list[int]  # the prompt
    output_ids: list[int]
    output_logprobs: list[float]  # behaviour logprob of each output token
    output_versions: list[int]  # weight version that produced each output token
    finish_reason: str  # "stop" | "length"
    n_interruptions: int = 0
    server: str | None = None
    latency_s: float = 0.0
    rid: str | None = None


@dataclass
class Trajectory:
    """One sequence ready for the learner. Per-token arrays have shape [T]."""

    input_ids: np.ndarray  # int32 [T]: prompt + completion (+ env turns)
    loss_mask: np.ndarray  # int32 [T]: 1 on model-generated tokens to train on
    behav_logp: np.ndarray  # float32 [T]: 0 where loss_mask == 0
    versions: np.ndarray  # int32 [T]: -1 on prompt / environment tokens
    reward: float
    group_id: str = ""  # samples of one prompt share it
    prompt_id: str = ""  # stable id of the dataset prompt
    start_version: int = 0  # learner version when the workflow was submitted
    finish_reason: str = FINISH_STOP
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.int32)
        self.behav_logp = np.asarray(self.behav_logp, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int32)
        n = self.input_ids.shape[0]
        for name in ("loss_mask", "behav_logp", "versions"):
            arr = getattr(self, name)
            if arr.shape != (n,):
                raise ValueError(f"Trajectory.{name} has shape {arr.shape}, expected ({n},)")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("input_ids", "loss_mask", "behav_logp", "versions"):
            d[k] = getattr(self, k).tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(**d)
