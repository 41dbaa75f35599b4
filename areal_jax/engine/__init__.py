"""The embedded JAX generation engine and its SGLang-protocol HTTP server.

    from areal_jax.engine import GenerationEngine, EngineConfig, SamplingParams
    engine = GenerationEngine(EngineConfig("ckpt_dir", max_slots=16))
    req = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=32, temperature=0.0))

    from areal_jax.engine import launch_server        # a server subprocess
    with launch_server("ckpt_dir") as server: ...     # server.url, server.kill(), ...
"""

from areal_jax.engine.config import EngineConfig
from areal_jax.engine.engine import EngineRequestError, EngineStoppedError, GenerationEngine
from areal_jax.engine.launch import (
    ServerHandle,
    ServerStartError,
    launch_server,
    launch_servers,
    wait_healthy,
)
from areal_jax.engine.model_dir import ModelPathError
from areal_jax.engine.request import EngineRequest
from areal_jax.sampling_params import SamplingParams

__all__ = [
    "EngineConfig",
    "EngineRequest",
    "EngineRequestError",
    "EngineStoppedError",
    "GenerationEngine",
    "ModelPathError",
    "SamplingParams",
    "ServerHandle",
    "ServerStartError",
    "launch_server",
    "launch_servers",
    "wait_healthy",
]
