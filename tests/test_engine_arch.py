"""The engine's own forward (head-major slot cache, multi-step decode chunks) on the other
architectures: Qwen3 (q/k norms, no bias) and Llama 3 (llama3 RoPE scaling, untied head)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.engine import EngineConfig, GenerationEngine, SamplingParams
from model_defs import load_hf
from tests.hf_fixtures import make_tiny_hf_checkpoint, token_logprob_tolerance

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
MAX_SEQ_LEN = 32  # prefill/attention buckets 16 and 32


@pytest.mark.slow  # Qwen2 is covered by the default tests/test_engine.py
@pytest.mark.parametrize("arch,tie,extra", [
    ("qwen3", True, {}),
    ("llama", False, {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0}),
])
def test_engine_matches_transformers_and_model_defs(tmp_path, arch, tie, extra):
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_checkpoint(tmp_path, arch=arch, tie=tie, seed=4, **extra)
    engine = GenerationEngine(EngineConfig(str(path), max_slots=4, max_seq_len=MAX_SEQ_LEN,
                                           prefill_rows=2, decode_steps=4))
    try:
        prompt = [5, 17, 29, 3, 11]
        n = MAX_SEQ_LEN - len(prompt)  # runs past the llama3 original context (16)
        greedy = engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0,
                                                        ignore_eos=True))
        sampled = engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.8,
                                                         seed=2, ignore_eos=True))
    finally:
        engine.shutdown()

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert greedy.output_ids == ref[0, len(prompt):].tolist()

    model, _ = load_hf(path)
    forward = jax.jit(lambda ids: model(ids)[0])
    for req, temperature in ((greedy, 1.0), (sampled, 0.8)):
        seq = jnp.asarray([prompt + req.output_ids], jnp.int32)
        logprobs_tv = jax.nn.log_softmax(forward(seq) / temperature, axis=-1)
        rows = logprobs_tv[len(prompt) - 1 : -1]
        expected = np.asarray(rows[jnp.arange(n), jnp.asarray(req.output_ids)])
        tol = token_logprob_tolerance(path, prompt + req.output_ids, temperature)
        np.testing.assert_allclose(req.output_logprobs, expected, rtol=0, atol=tol)
