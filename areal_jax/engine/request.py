"""Host-side request state of the engine: the running output of one request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_jax.sampling_params import SamplingParams
from model_defs import JsonDict


@dataclass
class EngineRequest:
    """One generation request inside the engine. The engine thread owns the mutable fields."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_finish: Callable[[EngineRequest], None] | None = None
    # Called by the engine thread after a device call appended tokens to a request that goes
    # on (once per call, not per token): streaming readers wait for it instead of polling.
    on_tokens: Callable[[EngineRequest], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: JsonDict | None = None
    weight_version: str = ""
    error: str | None = None  # set when the request failed (HTTP ``error_status``)
    error_status: int = 500  # 500: the engine failed; 4xx: the request can no longer run
    # (name, load id) of the LoRA adapter the request named; it runs on that load only.
    lora: tuple[str, int] | None = None
    seed: int = 0  # the seed actually used (params.seed or engine-drawn)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: JsonDict, weight_version: str) -> None:
        """Marks the request finished and fires its callback (called by the engine thread)."""
        self.finish_reason = reason
        self.weight_version = weight_version
        self.finish_time = time.perf_counter()
        self.done.set()
        if self.on_finish is not None:
            self.on_finish(self)
