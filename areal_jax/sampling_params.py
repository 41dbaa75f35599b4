"""Sampling parameters of one generation request (SGLang's names and meanings).

One record for every side: the engine parses requests into it, workflows and the
client send it, the trainer builds it from ``rollout.*``. Imports nothing of ours, so
a client against SGLang does not load the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        if not isinstance(self.top_k, int) or not (
            self.top_k == -1 or 1 <= self.top_k <= INT32_MAX
        ):
            raise ValueError(
                f"top_k must be -1 (disabled) or in [1, {INT32_MAX}], got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [0, {SEED_MAX}], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)
