"""EngineConfig: what the generation engine serves and how many requests it runs at once."""

from __future__ import annotations

import os
from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32", "bfloat16")
LAYER_LOOPS = ("auto", "scan", "unrolled")
CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def request_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` CPU devices (for ``data_parallel=n`` on a CPU host).

    Takes effect only if called before JAX creates its CPU backend; an XLA_FLAGS that
    already sets a device count is left as it is.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and CPU_DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_DEVICE_COUNT_FLAG}={n}".strip()


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. ``max_seq_len`` None means min(model max_position_embeddings, 2048).

    Attributes:
      model_path: HF checkpoint directory (config.json + safetensors), as ``save_hf`` writes.
      max_slots: requests decoded together; each slot owns a KV-cache row of max_seq_len.
      max_seq_len: prompt + generated tokens per request (the context length).
      dtype: params and compute dtype; the KV cache uses it too unless cache_dtype is set.
      prefill_rows: prompts prefilled together in one call (fixed, padded with dummy rows).
      decode_steps: tokens generated per slot per device call. More amortises the
        per-call host work; a stop, abort or pause then takes effect up to this many
        tokens late (extra tokens are discarded, never returned).
      data_parallel: split the slots over this many local devices, each with a copy of
        the params (see ``runner``). On CPU the server makes one XLA device per unit, so
        ``--data-parallel 2`` decodes on two cores; max_slots must be a multiple.
      seed: seeds the per-request seeds drawn for requests that send no sampling_seed.
      weight_version: reported in every response until an update changes it.
      warmup: compile every prefill bucket and the decode step at start-up.
      check_weights: before swapping in a weight update, check the stored dtypes and that
        every value is finite (one pass over the params); False skips it on huge models.
      layer_loop: ``scan`` (one layer in each program: compile time independent of depth),
        ``unrolled`` (every layer in the program), or ``auto``: scan on TPU, unrolled on GPU
        and CPU (see ``areal_jax.engine.forward`` and docs/accelerators.md for the costs).
    """

    model_path: str
    max_slots: int = 16
    max_seq_len: int | None = None
    dtype: str = "float32"
    cache_dtype: str | None = None
    prefill_rows: int = 4
    decode_steps: int = 8
    data_parallel: int = 1
    seed: int = 0
    weight_version: str = "0"
    warmup: bool = False
    check_weights: bool = True
    layer_loop: str = "auto"

    def __post_init__(self) -> None:
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"EngineConfig.layer_loop must be one of {LAYER_LOOPS}, got "
                             f"{self.layer_loop!r}")
        for key in ("max_slots", "prefill_rows", "decode_steps", "data_parallel"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{key} must be a positive int, got {value!r}")
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or self.max_seq_len < 2
        ):
            raise ValueError(
                f"EngineConfig.max_seq_len must be an int >= 2, got {self.max_seq_len!r}")
        for key in ("dtype", "cache_dtype"):
            value = getattr(self, key)
            if value is not None and value not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"EngineConfig.{key}={value!r} is not supported; use one of {SUPPORTED_DTYPES}"
                )
        if not isinstance(self.weight_version, str):
            raise ValueError(
                f"EngineConfig.weight_version must be a string, got {self.weight_version!r}"
            )
