"""The generation engine in-process: exactness against transformers and model_defs,
sampling semantics, continuous batching, aborts, weight swaps, compile counting."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.engine.config import EngineConfig
from areal_jax.engine.engine import EngineRequestError, GenerationEngine, ModelPathError
from areal_jax.engine.request import SamplingParams
from areal_jax.engine.runner import chunk_plan, prefill_chunks
from areal_jax.engine.sampling import first_argmax, sample_tokens
from model_defs import load_hf
from tests.hf_fixtures import make_tiny_hf_checkpoint, token_logprob_tolerance
from tests.tolerance import UNIT_ROUNDOFF_F32, sum_tolerance

MAX_SEQ_LEN = 48  # prefill chunks 16 and 48


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_a"), seed=0)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_b"), seed=1)


@pytest.fixture(scope="module")
def engine(ckpt_a):
    eng = GenerationEngine(EngineConfig(str(ckpt_a), max_slots=8, max_seq_len=MAX_SEQ_LEN))
    yield eng
    eng.shutdown()


def hf_greedy(path, prompt, n):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


_FORWARDS: dict = {}


def forward_logprobs(path, prompt, output, temperature):
    """log p(output[i] | prefix) under model_defs' full forward (the learner's), at
    ``temperature``. Sequences are right-padded to MAX_SEQ_LEN (causal: padding after a
    token does not change its logits), so one compiled forward serves every call."""
    if path not in _FORWARDS:
        model, _ = load_hf(path)
        _FORWARDS[path] = jax.jit(lambda ids: model(ids)[0])
    seq = list(prompt) + list(output)
    ids = np.zeros((1, MAX_SEQ_LEN), np.int32)
    ids[0, : len(seq)] = seq
    logits_tv = _FORWARDS[path](jnp.asarray(ids)) / (temperature if temperature > 0 else 1.0)
    logprobs_tv = np.asarray(jax.nn.log_softmax(logits_tv, axis=-1))
    rows = logprobs_tv[len(prompt) - 1 : len(seq) - 1]
    return rows[np.arange(len(output)), np.asarray(output)], rows


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_prefill_chunks_and_plans():
    assert prefill_chunks(2048) == prefill_chunks(100_000) == [16, 64, 256]
    assert prefill_chunks(40) == [16, 40]
    # (start, tokens, chunk length): the shortest chunk that holds the rest, else full ones.
    assert chunk_plan(5, [16, 64, 256]) == [(0, 5, 16)]
    assert chunk_plan(17, [16, 64, 256]) == [(0, 17, 64)]
    assert chunk_plan(300, [16, 64, 256]) == [(0, 256, 256), (256, 44, 64)]
    assert chunk_plan(40, [16]) == [(0, 16, 16), (16, 16, 16), (32, 8, 16)]
    # Weighing calls against padding (the CPU's plan): the pieces of least work, each call
    # counted as its chunk plus 8 tokens, longest first; a tie goes to fewer calls.
    assert chunk_plan(85, [16, 64, 256], 8) == [(0, 64, 64), (64, 16, 16), (80, 5, 16)]
    assert chunk_plan(17, [16, 64, 256], 8) == [(0, 16, 16), (16, 1, 16)]
    assert chunk_plan(64, [16, 64, 256], 8) == [(0, 64, 64)]
    assert chunk_plan(300, [16, 64, 256], 8) == [(0, 256, 256), (256, 44, 64)]
    assert chunk_plan(300, [16, 64, 256], 1000) == chunk_plan(300, [16, 64, 256])
    for n in range(1, 450):
        plan = chunk_plan(n, [16, 64, 256], 8)
        assert [s for s, _, _ in plan] == list(np.cumsum([0] + [k for _, k, _ in plan])[:-1])
        assert sum(k for _, k, _ in plan) == n and all(0 < k <= c for _, k, c in plan)


def test_first_argmax_and_greedy_logprob_match_the_reference_ops():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 300)).astype(np.float32)
    x[3, [5, 9, 200]] = 10.0  # ties: the first index wins, as jnp.argmax
    x[4, :] = -1.0  # all equal
    x[5, 17] = np.inf
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), jnp.argmax(x, -1))
    assert first_argmax(jnp.asarray(x)).dtype == jnp.int32
    # The shared-max logsumexp equals jax.nn.log_softmax at several temperatures.
    x[5, 17] = 0.0
    temps = np.array([0.0, 0.5, 1.0, 2.0] * 4, np.float32)
    token_b, logprob_b = sample_tokens(
        jnp.asarray(x), jnp.asarray(temps), jnp.ones(16), jnp.full(16, -1),
        jnp.arange(16, dtype=jnp.uint32), jnp.zeros(16, jnp.int32), jnp.bool_(False),
        jnp.bool_(True))
    scaled = x / np.where(temps > 0, temps, 1.0)[:, None]
    ref = jax.nn.log_softmax(jnp.asarray(scaled), -1)[np.arange(16), np.asarray(token_b)]
    # Two fp32 logsumexps over 300 terms of size <= 1 (after the max is taken out), then
    # x - lse: rounding of the sum plus that of the max-sized values themselves.
    tol = sum_tolerance(1.0, x.shape[1]) + 4 * UNIT_ROUNDOFF_F32 * np.abs(scaled).max()
    np.testing.assert_allclose(logprob_b, ref, rtol=0, atol=tol)
    greedy = temps == 0
    np.testing.assert_array_equal(np.asarray(token_b)[greedy], np.argmax(x, -1)[greedy])


def test_greedy_matches_transformers_generate(engine, ckpt_a):
    for prompt in ([5, 9, 17, 3, 44], list(range(3, 23))):  # chunks 16 and 48
        req = engine.generate(prompt, greedy(24))
        assert req.finish_reason == {"type": "length", "length": 24}
        assert req.output_ids == hf_greedy(ckpt_a, prompt, 24)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_learner_forward(engine, ckpt_a, temperature):
    prompt = [7, 8, 9, 10, 11, 12]
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=3, ignore_eos=True)
    req = engine.generate(prompt, params)
    assert len(req.output_ids) == 40
    ref, _ = forward_logprobs(ckpt_a, prompt, req.output_ids, temperature)
    tol = token_logprob_tolerance(ckpt_a, prompt + req.output_ids, temperature)
    np.testing.assert_allclose(np.asarray(req.output_logprobs), ref, rtol=0, atol=tol)


def test_seeded_request_reproducible_alone_and_in_a_batch(engine):
    prompt = [4, 5, 6]
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate(prompt, params).output_ids
    others = [engine.submit([4 + i, 7, 1 + i], SamplingParams(max_new_tokens=20 + i, seed=i))
              for i in range(6)]
    target = engine.submit(prompt, params)
    for r in [*others, target]:
        assert r.done.wait(120)
    assert target.output_ids == alone
    # Unseeded requests get different engine-drawn seeds, so their samples differ.
    a, b = (engine.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
            for _ in range(2))
    assert a.output_ids != b.output_ids
    assert engine.generate(prompt, SamplingParams(
        max_new_tokens=30, seed=99, ignore_eos=True)).output_ids != alone


def test_top_k_and_top_p_restrict_the_sampled_support(engine, ckpt_a):
    prompt = [20, 21, 22, 23]
    greedy_ids = engine.generate(prompt, greedy(16)).output_ids
    assert engine.generate(prompt, SamplingParams(
        max_new_tokens=16, top_k=1, seed=5, ignore_eos=True)).output_ids == greedy_ids
    assert engine.generate(prompt, SamplingParams(
        max_new_tokens=16, top_p=1e-6, seed=5, ignore_eos=True)).output_ids == greedy_ids
    req = engine.generate(prompt, SamplingParams(
        max_new_tokens=32, temperature=1.5, top_k=3, seed=11, ignore_eos=True))
    ref, rows = forward_logprobs(ckpt_a, prompt, req.output_ids, 1.5)
    top3 = np.argsort(-rows, axis=-1)[:, :3]
    assert all(tok in top3[i] for i, tok in enumerate(req.output_ids))
    # The reported logprob is the untruncated temperature-scaled one (documented).
    tol = token_logprob_tolerance(ckpt_a, prompt + req.output_ids, 1.5)
    np.testing.assert_allclose(req.output_logprobs, ref, rtol=0, atol=tol)


def test_finish_reasons(engine):
    prompt = [30, 31, 32]
    ids = engine.generate(prompt, greedy(20)).output_ids
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    req = engine.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0.0,
                                                 stop_token_ids=(stop_tok,)))
    assert req.finish_reason == {"type": "stop", "matched": stop_tok}
    assert req.output_ids == ids[: first + 1]
    saved = engine.eos_token_ids
    engine.eos_token_ids = (stop_tok,)
    try:
        eos_req = engine.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0.0))
        ignored = engine.generate(prompt, greedy(20))
    finally:
        engine.eos_token_ids = saved
    assert eos_req.finish_reason == {"type": "stop", "matched": stop_tok}
    assert eos_req.output_ids == ids[: first + 1]
    assert ignored.output_ids == ids
    prompt_30 = list(range(3, 33))
    ctx = engine.generate(prompt_30, greedy(100))  # stops at the context length
    assert ctx.finish_reason["type"] == "length"
    assert len(ctx.output_ids) == MAX_SEQ_LEN - 30


def test_on_tokens_reports_each_device_call_until_the_finish(engine):
    """The streaming routes wait on ``on_tokens`` instead of polling: it is called after
    the prefill and after each decode call that gave the request tokens, never after the
    finish, and each call sees more tokens than the last."""
    seen = []
    done = engine.submit([30, 31, 32], greedy(20), on_tokens=lambda r: seen.append(
        len(r.output_ids)))
    assert done.done.wait(120)
    steps = engine.config.decode_steps
    assert len(done.output_ids) == 20
    assert seen[0] == 1 and seen == sorted(set(seen)) and seen[-1] < 20
    assert all(b - a <= steps for a, b in zip(seen, seen[1:], strict=False))
    assert len(seen) >= (20 - 1) // steps  # one per decode call that left it running


def test_abort_pause_and_continue(engine):
    # A request can end by length (max_seq_len) before the abort lands: retry until the
    # abort catches it running.
    deadline = time.monotonic() + 60
    for _ in range(50):
        req = engine.submit([3, 4], greedy(120))
        while len(req.output_ids) < 2 and not req.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        aborted = engine.abort(req.rid)
        assert req.done.wait(10)
        if aborted == 1:
            break
    assert aborted == 1 and req.finish_reason["type"] == "abort"
    assert 2 <= len(req.output_ids) < MAX_SEQ_LEN - 2  # stopped before its context ran out
    assert len(req.output_logprobs) == len(req.output_ids)

    for _ in range(50):
        running = engine.submit([3, 4, 5], greedy(120))
        while not running.output_ids and time.monotonic() < deadline:
            time.sleep(0.001)
        paused = engine.pause()
        assert running.done.wait(10)
        if paused == 1:
            break
        engine.continue_generation()  # it ended by length first; try again
    assert paused == 1 and running.finish_reason["type"] == "abort"
    queued = engine.submit([6, 7], greedy(5), rid="queued-while-paused")
    with pytest.raises(EngineRequestError, match="already in flight"):
        engine.submit([6, 7], greedy(5), rid="queued-while-paused")
    time.sleep(0.2)
    assert not queued.done.is_set() and engine.info()["num_waiting_reqs"] == 1
    engine.continue_generation()
    assert queued.done.wait(60) and queued.finish_reason["type"] == "length"


def test_submit_rejects_bad_prompts(engine):
    with pytest.raises(EngineRequestError, match="empty"):
        engine.submit([], greedy(4))
    with pytest.raises(EngineRequestError, match="token id 128 outside the vocabulary"):
        engine.submit([1, 128], greedy(4))
    with pytest.raises(EngineRequestError, match="token id -1"):
        engine.submit([-1], greedy(4))
    with pytest.raises(EngineRequestError, match=f"at most {MAX_SEQ_LEN - 1}"):
        engine.submit([1] * MAX_SEQ_LEN, greedy(4))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_no_recompilation_after_warmup_and_weight_swap(engine, ckpt_a, ckpt_b, tmp_path):
    count = engine.warmup()
    assert count >= len(engine.runner.program_keys())  # the decode and a prefill per chunk
    variants = [greedy(6), SamplingParams(max_new_tokens=6, top_k=5),
                SamplingParams(max_new_tokens=6, top_p=0.5, temperature=0.3),
                SamplingParams(max_new_tokens=9, stop_token_ids=(1, 2, 3))]
    reqs = [engine.submit(list(range(3, 3 + n)), variants[n % len(variants)])
            for n in (1, 5, 9, 15, 16, 17, 25, 31, 32, 40, 47)]
    assert all(r.done.wait(120) for r in reqs)
    assert engine.num_compilations == count

    result = engine.update_weights_from_disk(str(ckpt_b), "7")
    assert result["success"], result
    assert engine.weight_version == "7"
    prompt = [5, 9, 17, 3, 44]
    req = engine.generate(prompt, greedy(12))
    assert req.weight_version == "7"
    assert req.output_ids == hf_greedy(ckpt_b, prompt, 12)
    assert engine.num_compilations == count

    # Incompatible checkpoints are refused and the served weights stay.
    wide = make_tiny_hf_checkpoint(tmp_path, seed=2, hidden_size=48)
    bad = engine.update_weights_from_disk(str(wide), "8")
    assert not bad["success"] and "hidden_size=48" in bad["message"]
    missing = engine.update_weights_from_disk(str(tmp_path / "nope"), "8")
    assert not missing["success"] and "does not exist" in missing["message"]
    assert engine.weight_version == "7"
    assert engine.generate(prompt, greedy(12)).output_ids == req.output_ids

    # Back to A; update with abort_all_requests aborts a running request. The request
    # can end by length (max_seq_len) while the update loads the checkpoint, so retry
    # until the abort catches it running.
    for _ in range(50):
        before = engine.weight_version
        running = engine.submit([3, 4], greedy(120))
        while not running.output_ids:
            time.sleep(0.001)
        back = engine.update_weights_from_disk(str(ckpt_a), "9", abort_all_requests=True)
        assert back["success"], back
        if back["num_paused_requests"] == 1:
            break
        assert back["num_paused_requests"] == 0 and running.finish_reason["type"] == "length"
    assert back["num_paused_requests"] == 1, "no running request was ever aborted"
    assert running.finish_reason["type"] == "abort" and running.weight_version == before
    assert 0 < len(running.output_ids) < MAX_SEQ_LEN - 2  # partial output returned
    assert engine.generate(prompt, greedy(12)).output_ids == hf_greedy(ckpt_a, prompt, 12)
    assert engine.num_compilations == count


def test_config_and_model_path_errors(tmp_path):
    with pytest.raises(ValueError, match="max_slots must be a positive int"):
        EngineConfig("x", max_slots=0)
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        EngineConfig("x", dtype="float16")
    with pytest.raises(ModelPathError, match="does not exist"):
        GenerationEngine(EngineConfig(str(tmp_path / "missing")))
    with pytest.raises(ModelPathError, match="has no config.json"):
        GenerationEngine(EngineConfig(str(tmp_path)))


@pytest.mark.devices(4)
@pytest.mark.slow
def test_data_parallel_slots_give_the_same_tokens_and_logprobs(engine, ckpt_a):
    """Slots split over 2 and 4 devices (conftest makes 8 CPU devices): every request,
    greedy or seeded-sampled, more requests than slots so slots are refilled, gets the
    same tokens and logprobs as on one device; greedy still equals transformers."""
    prompts = [[3 + i, 7, 11 + 2 * i, 5][: 2 + i % 3] for i in range(12)]
    params = [SamplingParams(max_new_tokens=10 + 3 * (i % 4), temperature=0.0 if i % 2 else 0.9,
                             seed=i, ignore_eos=True) for i in range(12)]

    def run(eng):
        reqs = [eng.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for r in reqs:
            assert r.done.wait(120)
        return [(r.output_ids, r.output_logprobs) for r in reqs]

    expected = run(engine)
    for dp in (2, 4):
        eng = GenerationEngine(EngineConfig(str(ckpt_a), max_slots=8, max_seq_len=MAX_SEQ_LEN,
                                            data_parallel=dp))
        try:
            got = run(eng)
            assert eng.info()["data_parallel"] == dp
            assert eng.generate([5, 9, 17, 3, 44], greedy(24)).output_ids == hf_greedy(
                ckpt_a, [5, 9, 17, 3, 44], 24)
        finally:
            eng.shutdown()
        for prompt, sp, (ids, lps), (ids_ref, lps_ref) in zip(prompts, params, got, expected,
                                                               strict=True):
            assert ids == ids_ref
            tol = token_logprob_tolerance(ckpt_a, prompt + ids, sp.temperature)
            np.testing.assert_allclose(lps, lps_ref, rtol=0, atol=tol)


@pytest.mark.devices(4)  # data_parallel=3 must fail on the slot count, not on devices
def test_data_parallel_errors(ckpt_a):
    with pytest.raises(ValueError, match="data_parallel must be a positive int"):
        EngineConfig("x", data_parallel=0)
    with pytest.raises(ValueError, match="must be a multiple of data_parallel=3"):
        GenerationEngine(EngineConfig(str(ckpt_a), max_slots=8, data_parallel=3))
    with pytest.raises(ValueError, match="needs that many local devices"):
        GenerationEngine(EngineConfig(str(ckpt_a), max_slots=64, data_parallel=64))


@pytest.mark.parametrize("layer_loop", ["scan"])  # unrolled: the CPU default, tested above
def test_layer_loop_setting_serves_transformers_greedy_tokens(ckpt_a, layer_loop):
    """EngineConfig.layer_loop (serve.py --layer-loop, rollout.engine_layer_loop) picks the
    runner's layer loop and cache layout; a scan serves transformers' greedy tokens too, and
    the warm-up's ahead-of-time programs cover every request (no compile after it)."""
    engine = GenerationEngine(EngineConfig(str(ckpt_a), max_slots=2, max_seq_len=32,
                                           warmup=True, layer_loop=layer_loop))
    try:
        assert engine.runner.stacked_cache == (layer_loop == "scan")
        count = engine.num_compilations
        prompt = [5, 9, 17, 3, 44]
        assert engine.generate(prompt, greedy(10)).output_ids == hf_greedy(ckpt_a, prompt, 10)
        assert engine.num_compilations == count
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="layer_loop must be one of"):
        EngineConfig(str(ckpt_a), layer_loop="fused")
