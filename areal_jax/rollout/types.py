"""The rollout client's plain data types: a ``GenerateRequest`` goes to a server and a
``GenerateResponse`` comes back, stitched across interruptions. Workflows turn responses
into ``areal_jax.trajectory.Trajectory`` objects (the learner's input, in a module of
its own that both sides import).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_jax.sampling_params import SamplingParams
from areal_jax.trajectory import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

__all__ = ["FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP", "GenerateRequest", "GenerateResponse"]


@dataclass
class GenerateRequest:
    """One sample: a prompt (token ids), its sampling params (``params.seed`` is sent as
    ``sampling_seed``) and an optional request id."""

    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None

    def sampling_params(self, max_new_tokens: int | None = None
                        ) -> dict[str, int | float | bool | list[int]]:
        """The ``sampling_params`` of /generate; ``max_new_tokens``: what is left of the
        budget after an interruption. Token ids out, so no special-token skipping."""
        p = self.params
        params: dict[str, int | float | bool | list[int]] = {
            "max_new_tokens": p.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": p.ignore_eos,
            "skip_special_tokens": False,
        }
        if p.seed is not None:
            params["sampling_seed"] = int(p.seed)
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
