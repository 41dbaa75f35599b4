"""Host-side request state of the engine: sampling parameters and the running output."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INT32_MAX = 2**31 - 1
SEED_MAX = 2**64 - 1  # SGLang's sampling_seed is a 64-bit integer; the engine folds it to 32 bits
# Temperatures the device can hold: logits / T overflows float32 as T nears 0 (SGLang
# treats T < 1e-6 as greedy; send 0 for greedy here), and beyond 1e6 every token is
# equally likely in float32 anyway.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request (SGLang names and meanings).

    ``temperature == 0`` means greedy. ``top_k == -1`` disables top-k. ``seed`` None means
    the engine draws one.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        # The device holds temperature/top_p as float32, top_k as int32 and seeds as uint32.
        if not isinstance(self.max_new_tokens, int) or not 0 < self.max_new_tokens <= INT32_MAX:
            raise ValueError(f"max_new_tokens must be an int in [1, {INT32_MAX}], "
                             f"got {self.max_new_tokens!r}")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                             f"{MAX_TEMPERATURE}], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or 1 <= self.top_k <= INT32_MAX):
            raise ValueError(f"top_k must be -1 (disabled) or in [1, {INT32_MAX}], got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [0, {SEED_MAX}], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)


@dataclass
class EngineRequest:
    """One generation request inside the engine. The engine thread owns the mutable fields."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_finish: Callable[[EngineRequest], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    error: str | None = None  # set when the engine failed internally (HTTP 500)
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

    def finish(self, reason: dict[str, Any], weight_version: str) -> None:
        """Marks the request finished and fires its callback (called by the engine thread)."""
        self.finish_reason = reason
        self.weight_version = weight_version
        self.finish_time = time.perf_counter()
        self.done.set()
        if self.on_finish is not None:
            self.on_finish(self)
