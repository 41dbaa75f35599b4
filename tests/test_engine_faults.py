"""The engine in-process under faults: a request whose step fails fails alone; an engine
whose loop dies answers every pending and new request and command at once; nothing
computed under old weights survives a weight swap (even of NaN weights, with the check
off)."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from areal_jax.engine.config import EngineConfig
from areal_jax.engine.engine import GenerationEngine
from areal_jax.engine.request import SamplingParams
from tests.hf_fixtures import make_tiny_hf_checkpoint

MAX_SEQ_LEN = 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_faults"), seed=0)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_sampling_params_out_of_device_range_are_refused():
    for kwargs, match in [({"top_k": 2**31}, "top_k"), ({"max_new_tokens": 2**31}, "max_new"),
                          ({"temperature": 1e-30}, "temperature"), ({"seed": 2**64}, "seed")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def unchecked_engine(ckpt):
    """One prompt per prefill call, and no weight check (so NaN weights can be served)."""
    engine = GenerationEngine(EngineConfig(str(ckpt), max_slots=2, max_seq_len=MAX_SEQ_LEN,
                                           prefill_rows=1, check_weights=False))
    yield engine
    engine.shutdown()


def test_a_failing_prefill_fails_only_its_request(unchecked_engine):
    engine = unchecked_engine
    expected = engine.generate([3, 4, 5], greedy(6), timeout=120).output_ids
    real_prefill = engine.runner.prefill
    try:

        def prefill(bucket, rows, **kwargs):  # injected host-side fault, before dispatch
            if rows[0]["input_ids"] == [9, 9, 9]:
                raise ValueError("injected fault")
            return real_prefill(bucket, rows, **kwargs)

        engine.runner.prefill = prefill
        reqs = [engine.submit(p, greedy(6)) for p in ([3, 4, 5], [9, 9, 9], [3, 4, 5])]
        assert all(r.done.wait(120) for r in reqs)
        assert reqs[1].error is not None and "injected fault" in reqs[1].error
        assert [r.output_ids for r in (reqs[0], reqs[2])] == [expected, expected]
        assert reqs[0].error is None and reqs[2].error is None
        assert engine.healthy
    finally:
        engine.runner.prefill = real_prefill
    assert engine.generate([3, 4, 5], greedy(6), timeout=120).output_ids == expected


def test_a_dead_engine_answers_everything_at_once(ckpt):
    engine = GenerationEngine(EngineConfig(str(ckpt), max_slots=2, max_seq_len=MAX_SEQ_LEN))
    try:
        engine.generate([3, 4, 5], greedy(2), timeout=120)  # compiled and running
        engine.pause()
        queued = [engine.submit([3, 4, 5 + i], greedy(20)) for i in range(4)]

        def decode(*args, **kwargs):
            raise RuntimeError("injected device failure")

        engine.runner.decode = decode
        engine.continue_generation()
        t0 = time.monotonic()
        assert all(r.done.wait(60) for r in queued)
        assert all(r.error is not None and "injected device failure" in r.error for r in queued)
        deadline = time.monotonic() + 30
        while engine.healthy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "injected device failure" in engine.fatal_error
        with pytest.raises(RuntimeError, match="injected device failure"):
            engine.submit([1, 2], greedy(2))
        with pytest.raises(RuntimeError, match="not running"):
            engine.pause()
        result = engine.update_weights_from_disk(str(ckpt), "1")
        assert result["success"] is False
        assert time.monotonic() - t0 < 60
    finally:
        engine.shutdown()


def test_no_cache_entry_survives_a_weight_swap(unchecked_engine, ckpt, tmp_path):
    """With the weight check off, NaN weights are served; swapping the good weights back
    must give exactly the tokens from before (stale NaN cache rows used to poison every
    later request until /flush_cache)."""
    nan_dir = tmp_path / "nan"
    shutil.copytree(ckpt, nan_dir)
    tensors = load_file(str(nan_dir / "model.safetensors"))
    key = sorted(k for k in tensors if k.endswith("self_attn.v_proj.weight"))[0]
    tensors[key] = np.full_like(tensors[key], np.nan)
    save_file(tensors, str(nan_dir / "model.safetensors"), metadata={"format": "pt"})

    engine = unchecked_engine
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]
    # 20 new tokens attend to 32 cache positions, beyond their 16-token prefill bucket,
    # where the NaN phase's 20-token prompts (prefill bucket 32) left NaN rows, which
    # masking alone does not neutralise (0 * NaN).
    before = [engine.generate(p, greedy(20), timeout=120).output_ids for p in prompts]
    assert engine.update_weights_from_disk(str(nan_dir), "1")["success"]
    poisoned = [engine.generate(list(range(3 + 20 * i, 23 + 20 * i)), greedy(4), timeout=120)
                for i in range(2)]
    assert all(r.error is not None and "non-finite logprob" in r.error for r in poisoned)
    assert engine.healthy  # a request that fails fails alone
    assert engine.update_weights_from_disk(str(ckpt), "2")["success"]
    after = [engine.generate(p, greedy(20), timeout=120).output_ids for p in prompts]
    assert after == before
