"""Learner memory from the compiled programs (the memory benchmark's figures,
areal_jax/bench/memory.py): fsdp=2 halves what each device holds and computes with."""

from __future__ import annotations

import jax
import pytest

from areal_jax.bench import memory as bench_memory
from areal_jax.parallel.mesh import make_mesh
from model_defs import ModelConfig

# Six layers: a program that keeps something per layer alive (e.g. XLA:CPU's all-reduce
# combiner holding every layer's full gradient until the end) grows with the depth.
CFG = ModelConfig.preset("tiny", vocab_size=4096, hidden_size=128, intermediate_size=512,
                         num_hidden_layers=6)


def _per_device_bytes(mesh) -> int:
    mem, _ = bench_memory.grad_memory(CFG, "float32", "full", 256, rows=4, mesh=mesh)
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
