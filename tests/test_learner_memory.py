"""Learner memory from the compiled programs (the memory benchmark's figures,
areal_jax/plan/memory.py): fsdp=2 halves what each device holds and computes with."""

from __future__ import annotations

import jax
import pytest

from areal_jax.parallel.mesh import make_mesh
from areal_jax.plan import memory as plan_memory
from model_defs import ModelConfig

# Six layers: a program that keeps something per layer alive (e.g. XLA:CPU's all-reduce
# combiner holding every layer's full gradient until the end) grows with the depth.
CFG = ModelConfig.preset("tiny", vocab_size=4096, hidden_size=128, intermediate_size=512,
                         num_hidden_layers=6)


def _per_device_bytes(mesh) -> int:
    mem, _ = plan_memory.grad_memory(CFG, "float32", "full", 256, rows=4, mesh=mesh)
    return mem.argument_size_in_bytes + mem.temp_size_in_bytes


@pytest.mark.slow  # two compiles of the gradient program
@pytest.mark.devices(2)
def test_fsdp2_halves_the_per_device_learner_memory():
    one = _per_device_bytes(make_mesh("data=1,fsdp=1,tensor=1", jax.devices()[:1]))
    two = _per_device_bytes(make_mesh("data=1,fsdp=2,tensor=1", jax.devices()[:2]))
    # Params, gradient accumulator and rows (so activations) are all split in two: one half.
    # What is not split: one layer's gathered weights at a time (under 1/6 of the layers'
    # params, themselves under half the model here) and replicated scalars: < 0.6 in all.
    assert two <= 0.6 * one, (one, two)


def test_rematerialised_layers_keep_only_their_input():
    """With ``remat: full`` each further decoder layer adds its input ([tokens, hidden])
    to the gradient program's temporaries, not its recomputed activations or its fresh
    weight gradients (XLA:CPU deferred those to the end of the backward pass before the
    layer-level backward step: 14 MiB a layer here against the 4 MiB input)."""
    t, d = 2048, 512

    def temp(n_layers: int) -> int:
        cfg = ModelConfig.preset("tiny", vocab_size=4096, hidden_size=d, intermediate_size=4 * d,
                                 num_hidden_layers=n_layers, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=64)
        mem, _ = plan_memory.grad_memory(cfg, "float32", "full", t, rows=1)
        return mem.temp_size_in_bytes

    per_layer = (temp(6) - temp(2)) / 4
    layer_input = t * d * 4
    assert per_layer <= 1.5 * layer_input, (per_layer / 2**20, layer_input / 2**20)


@pytest.mark.slow  # compiles the gradient and optimizer programs of a 494M-param model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen2_5_0_5b_learner_fits_20_bytes_per_param_at_the_gsm8k_length(dtype):
    """A Qwen2.5-0.5B-shaped learner (abstract: nothing is allocated) with one row of the
    GSM8K config's packed row length (train.seq_len 4096 tokens), ``remat: full``, fp32
    and bf16 compute: params, gradient accumulator and AdamW moments (16 B/param) plus
    the larger program's compiled temporaries stay within 20 B/param, and within the
    prediction of the formula in docs/models.md, "Memory", plus the largest parameter (the
    formula's one-layer working set is an estimate)."""
    cfg = ModelConfig.preset("qwen2.5-0.5b")
    grad_mem, n_params = plan_memory.grad_memory(cfg, dtype, "full", 4096, rows=1)
    apply_mem, _ = plan_memory._apply_memory(cfg)
    held = 16 * n_params
    peak = held + max(grad_mem.temp_size_in_bytes, apply_mem.temp_size_in_bytes)
    assert peak <= 20 * n_params, peak / n_params
    predicted = plan_memory.predicted_learner_bytes(cfg, n_params, 4096, dtype)
    largest_param = 4 * cfg.vocab_size * cfg.hidden_size
    assert peak <= predicted["peak"] + largest_param, (peak, predicted)
