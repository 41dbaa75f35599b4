"""The rollout client's plain data types: a ``GenerateRequest`` goes to a server and a
``GenerateResponse`` comes back, stitched across interruptions. Workflows turn responses
into ``areal_jax.trajectory.Trajectory`` objects (the learner's input, in a module of
its own that both sides import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_jax.trajectory import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

__all__ = ["FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP", "GenerateRequest", "GenerateResponse"]


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
