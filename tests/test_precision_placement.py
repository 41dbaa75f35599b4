"""model.dtype end to end (engine params and KV cache, learner compute, published
weights) and where the embedded engine runs (rollout.engine_platform / engine_devices)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from areal_jax.checkpoint.publish import WeightPublisher
from areal_jax.config import RolloutConfig, load_config
from areal_jax.engine import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.learner.token_logp import packed_token_logprobs
from areal_jax.run import TrainerError, engine_placement
from model_defs import load_hf
from tests.hf_fixtures import logit_tolerance, make_tiny_hf_checkpoint
from tests.tolerance import EPS, logprob_tolerance

REPO = Path(__file__).resolve().parent.parent

PROMPT = [5, 9, 17, 3, 44, 12, 7]


def _learner_logprobs(path, dtype: str, seq: list[int]) -> np.ndarray:
    """The learner's logprobs of ``seq`` (one packed row, one segment) at ``dtype``:
    fp32 master weights cast to the compute dtype, as ``learner.steps.cast_params``."""
    model, _ = load_hf(path, dtype=dtype)
    ids = jnp.asarray([seq], jnp.int32)
    pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
    logp, _ = packed_token_logprobs(model, ids, pos, jnp.ones_like(ids), temperature=1.0,
                                    chunk_size=4096)
    return np.asarray(logp[0, len(PROMPT):])


@pytest.mark.slow
def test_bf16_engine_serves_bf16_and_matches_the_bf16_learner(tmp_path):
    path = str(make_tiny_hf_checkpoint(tmp_path, arch="qwen2", seed=5))
    mismatch = {}
    for dtype in ("float32", "bfloat16"):
        engine = GenerationEngine(EngineConfig(path, max_slots=2, max_seq_len=64, dtype=dtype))
        try:
            assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(engine.runner.state)
                       if jnp.issubdtype(x.dtype, jnp.floating))
            assert engine.runner.cache.k[0].dtype == jnp.dtype(dtype)
            req = engine.generate(PROMPT, SamplingParams(max_new_tokens=24, temperature=1.0,
                                                         seed=3, ignore_eos=True))
        finally:
            engine.shutdown()
        ref = _learner_logprobs(path, dtype, PROMPT + req.output_ids)
        mismatch[dtype] = float(np.max(np.abs(np.asarray(req.output_logprobs) - ref)))
        # The fp32 rounding bound of two evaluations, in units of this dtype's roundoff.
        logit_tol = logit_tolerance(path, [PROMPT + req.output_ids]) * (
            EPS[dtype] / EPS["float32"])
        assert mismatch[dtype] <= logprob_tolerance(256, logit_tol, dtype), (dtype, mismatch)
    print(f"max |engine - learner| token logprob: fp32 {mismatch['float32']:.2e}, "
          f"bf16 {mismatch['bfloat16']:.2e}")


def test_publisher_writes_bf16_safetensors(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen3", seed=1)
    model, cfg = load_hf(path)  # fp32 master weights, as the learner holds them
    out = WeightPublisher(str(tmp_path / "weights"), dtype="bfloat16").publish(model, cfg, 1)
    with safe_open(f"{out}/model.safetensors", "flax") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert json.loads((tmp_path / "weights" / "v1" / "config.json").read_text())[
        "torch_dtype"] == "bfloat16"
    served, _ = load_hf(out, dtype="bfloat16")  # and the engine's loader reads them back
    np.testing.assert_array_equal(
        np.asarray(served.embed_vd[...], np.float32),
        np.asarray(model.embed_vd[...].astype(jnp.bfloat16), np.float32))


def test_engine_placement_follows_the_run_placement():
    """Each embedded engine's JAX_PLATFORMS and device environment come from the run's
    placement (tests/test_placement.py covers the GPU and TPU placements): on this CPU
    host, every engine on the CPU with no device variable."""
    cfg = load_config(REPO / "configs" / "tiny_demo.yaml", ["rollout.num_servers=2"])
    assert engine_placement(cfg) == [("cpu", None), ("cpu", None)]


def test_engine_child_gets_one_platform_jax_accepts_alone():
    from areal_jax.engine.launch import _child_env, jax_platform_name

    assert jax_platform_name("gpu", backends=["cuda", "cpu"]) == "cuda"
    assert jax_platform_name("gpu", backends=["rocm"]) == "rocm"
    assert jax_platform_name("gpu,cpu", backends=["cuda"]) == "cuda,cpu"
    for name in ("cpu", "cuda", "rocm", "tpu"):
        assert jax_platform_name(name, backends=["cuda"]) == name
    # No GPU backend in this process (the learner on CPU): the installed plugin decides,
    # and it is never the two-platform alias.
    assert jax_platform_name("gpu", backends=["cpu"]) in ("cuda", "rocm")
    assert _child_env("gpu", None, None)["JAX_PLATFORMS"] in ("cuda", "rocm")
    assert _child_env("cpu", None, None)["JAX_PLATFORMS"] == "cpu"


def test_engine_placement_errors():
    with pytest.raises(ValueError, match="rollout.engine_platform must be null or one of"):
        RolloutConfig(engine_platform="metal")
    with pytest.raises(ValueError, match="rollout.engine_devices must be null or a non-empty"):
        RolloutConfig(engine_devices=[])
    with pytest.raises(TrainerError, match="use rollout.server_cpu_cores"):
        engine_placement(load_config(REPO / "configs" / "tiny_demo.yaml",
                                     ["rollout.engine_devices=[0]"]))


def test_rollout_engine_tuning_keys_reach_the_launched_server():
    """rollout.prefill_rows / decode_steps become the embedded server's flags (what
    /get_server_info reports); unset keys leave the engine's defaults; bad values name
    the key."""
    import httpx

    from areal_jax.engine.launch import launch_server
    from areal_jax.run import engine_tuning_args

    assert engine_tuning_args(RolloutConfig()) == []
    args = engine_tuning_args(RolloutConfig(prefill_rows=2, decode_steps=3,
                                            engine_layer_loop="scan"))
    assert args == ["--prefill-rows", "2", "--decode-steps", "3", "--layer-loop", "scan"]
    with launch_server("areal_jax/data/assets/arith_sft", max_slots=4, max_seq_len=64,
                       extra_args=args) as server:
        info = httpx.get(f"{server.url}/get_server_info", timeout=30).json()
    assert (info["prefill_rows"], info["decode_steps"], info["layer_loop"]) == (2, 3, "scan")
    for key in ("prefill_rows", "decode_steps"):
        with pytest.raises(ValueError, match=f"rollout.{key} must be > 0"):
            RolloutConfig(**{key: 0})


def test_engine_dtype_sets_the_servers_and_published_weights_apart(tmp_path):
    """rollout.engine_dtype: the embedded engines' and the published weights' dtype,
    apart from the learner's model.dtype (issue 30: a bf16 learner against fp32 engines)."""
    from areal_jax.checkpoint.publish import serving_copy
    from areal_jax.config import ConfigError, load_config

    demo = "configs/tiny_demo.yaml"
    assert load_config(demo, ["model.dtype=bfloat16"]).serving_dtype == "bfloat16"
    cfg = load_config(demo, ["model.dtype=bfloat16", "rollout.engine_dtype=float32"])
    assert cfg.model.dtype == "bfloat16" and cfg.serving_dtype == "float32"
    with pytest.raises(ConfigError, match="rollout.engine_dtype"):
        load_config(demo, ["rollout.engine_dtype=float16"])
    path = str(make_tiny_hf_checkpoint(tmp_path, arch="qwen2", seed=5))
    model, _ = load_hf(path, dtype="float32")
    for dtype in ("float32", "bfloat16"):
        weights = serving_copy(model, cfg.model, cfg.serving_dtype if dtype == "float32"
                               else None)
        floats = {x.dtype for x in jax.tree.leaves(weights.params)
                  if np.issubdtype(x.dtype, np.floating) or x.dtype == jnp.bfloat16}
        assert floats == {jnp.dtype(dtype)}, (dtype, floats)


def test_fp32_matmul_precision_per_dtype_and_platform():
    from model_defs import fp32_matmul_precision

    for platform in ("gpu", "cuda", "rocm", "tpu"):
        assert fp32_matmul_precision("float32", platform) == "highest"
        assert fp32_matmul_precision(None, platform) == "highest"  # the fp32 params' own
        assert fp32_matmul_precision("bfloat16", platform) is None
        assert fp32_matmul_precision(jnp.float16, platform) is None
    assert fp32_matmul_precision("float32", "cpu") is None  # CPU programs unchanged


def _lowered_precision(target: str, dtype: str) -> dict:
    script = Path(__file__).with_name("_precision_lower.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script), target, dtype], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="needs the CUDA plugin: pip install jax-cuda13-plugin "
                           "jax-cuda13-pjrt (aot extra)")
def test_fp32_programs_pin_fp32_products_on_gpu_and_nowhere_else():
    """XLA and Triton run fp32 products in TF32 on a GPU by default (a GPU check saw fp32
    attention 8.6e-4 off an fp32 reference). The learner's gradient program (forward and
    the custom-VJP backward rules) and the engine's prefill and decode, lowered for an H100
    as the planner lowers them, ask for the highest precision in every product when the
    dtype is fp32; bf16 programs and CPU programs ask for nothing."""
    for name, prog in _lowered_precision("h100:1", "float32").items():
        assert prog["dots"] > 0 and prog["highest"] == prog["dots"], (name, prog)
    for target, dtype in (("h100:1", "bfloat16"), ("cpu", "float32")):
        for name, prog in _lowered_precision(target, dtype).items():
            assert prog["dots"] > 0 and prog["highest"] == 0, (target, dtype, name, prog)
