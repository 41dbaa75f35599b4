"""RolloutClient against real engine servers on 127.0.0.1: concurrency, interrupted
weight updates with per-token versions, failover."""

from __future__ import annotations

import asyncio
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.engine.launch import free_port
from areal_jax.rollout.client import (
    NoServerAvailableError,
    RolloutClient,
    RolloutRequestError,
)
from areal_jax.rollout.types import GenerateRequest
from areal_jax.sampling_params import SamplingParams
from model_defs import load_hf
from tests.hf_fixtures import make_tiny_hf_checkpoint, token_logprob_tolerance
from tests.server_fixtures import start_servers

MAX_SEQ_LEN = 512  # long generations, so pauses and kills land mid-run


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("client_a"), seed=0)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("client_b"), seed=1)


@pytest.fixture(scope="module")
def servers(ckpt_a, tmp_path_factory):
    # Same shapes as tests/test_server.py: the shared compilation cache skips recompiling.
    handles = start_servers(ckpt_a, 2, tmp_path_factory, max_slots=16, max_seq_len=MAX_SEQ_LEN,
                            allowed_weight_dirs=[tmp_path_factory.getbasetemp()])
    yield handles
    for h in handles:
        h.terminate()


def server_info(url):
    return httpx.get(f"{url}/get_server_info", timeout=30).json()


def wait_until(predicate, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


_FORWARDS: dict = {}


def learner_logprobs(path, seq, temperature):
    """[len(seq)-1] log p(seq[t+1] | seq[:t+1]) under model_defs' full forward."""
    if path not in _FORWARDS:
        model, _ = load_hf(path)
        _FORWARDS[path] = jax.jit(lambda ids: model(ids)[0])
    logits_tv = _FORWARDS[path](jnp.asarray([seq], jnp.int32))
    logprobs_tv = np.asarray(jax.nn.log_softmax(logits_tv / temperature, axis=-1))
    return logprobs_tv[np.arange(len(seq) - 1), np.asarray(seq[1:])]


def mixed_requests(n=64):
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(n):
        prompt = rng.integers(3, 128, size=int(rng.integers(1, 40))).tolist()
        if i % 8 == 7:  # a few seeded sampled requests in the mix
            reqs.append(GenerateRequest(prompt, SamplingParams(
                max_new_tokens=int(rng.integers(4, 25)), temperature=1.0, seed=i), rid=f"r{i}"))
        else:
            reqs.append(GenerateRequest(prompt, SamplingParams(
                max_new_tokens=int(rng.integers(4, 25)), temperature=0.0), rid=f"r{i}"))
    return reqs


def test_64_concurrent_requests_match_one_at_a_time(servers, ckpt_a):
    reqs = mixed_requests(64)

    async def run():
        async with RolloutClient([servers[0].url]) as client:
            alone = [await client.agenerate(r) for r in reqs]
            together = await asyncio.gather(*(client.agenerate(r) for r in reqs))
            return alone, together

    alone, together = asyncio.run(run())
    assert len(together) == 64
    for req, a, b in zip(reqs, alone, together, strict=True):
        assert b.finish_reason in ("stop", "length")
        assert 0 < len(b.output_ids) <= req.params.max_new_tokens
        assert b.output_ids == a.output_ids, req.rid
        # Another batch composition: the same math in other kernel shapes, so fp32 rounding.
        tol = token_logprob_tolerance(ckpt_a, req.input_ids + a.output_ids,
                                      req.params.temperature)
        np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, rtol=0, atol=tol)
        assert b.output_versions == [0] * len(b.output_ids)
    assert server_info(servers[0].url)["num_running_reqs"] == 0


def test_bad_request_is_not_retried(servers):
    async def run():
        async with RolloutClient([s.url for s in servers]) as client:
            await client.agenerate(GenerateRequest([1, 500], SamplingParams(max_new_tokens=4)))

    with pytest.raises(RolloutRequestError, match="outside the vocabulary"):
        asyncio.run(run())


def test_interrupted_update_stitches_versions(servers, ckpt_a, ckpt_b):
    url = servers[1].url
    n_new, temperature = 400, 1.0
    prompts = [[3 + i, 10, 20 + i, 7] for i in range(6)]

    async def run():
        async with RolloutClient([url]) as client, httpx.AsyncClient(timeout=120) as raw:
            # Compile first, so that the server answers the polls below promptly.
            await client.agenerate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))
            before = server_info(url)["generated_tokens"]
            tasks = [asyncio.create_task(client.agenerate(GenerateRequest(
                p, SamplingParams(max_new_tokens=n_new, temperature=temperature, seed=i,
                                  ignore_eos=True))))
                for i, p in enumerate(prompts)]
            raw_task = asyncio.create_task(raw.post(f"{url}/generate", json={
                "input_ids": [9, 9, 9], "return_logprob": True,
                "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True}}))
            # Every request running (the raw one too: a request still queued at the pause is
            # not aborted, and its reply would wait for the continue below), with tokens.
            await asyncio.to_thread(wait_until, lambda: (
                (info := server_info(url))["num_running_reqs"] == len(prompts) + 1
                and info["generated_tokens"] >= before + 5 * (len(prompts) + 1)),
                what="every request running, with tokens")
            await client.pause()
            try:
                partial = (await raw_task).json()
                await client.update_weights_from_disk(str(ckpt_b), 1)
            finally:  # a failure above must not leave the server paused for later tests
                await client.continue_()
            results = await asyncio.gather(*tasks)
            await client.update_weights_from_disk(str(ckpt_a), 2)  # restore for other tests
            return partial, results

    partial, results = asyncio.run(run())
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(partial["output_ids"]) < n_new
    assert partial["meta_info"]["weight_version"] == "0"
    assert sum(res.n_interruptions >= 1 for res in results) >= len(results) // 2
    for prompt, res in zip(prompts, results, strict=True):
        versions = np.asarray(res.output_versions)
        assert len(res.output_ids) == n_new and res.finish_reason == "length"
        n_old = int((versions == 0).sum())
        assert (versions[n_old:] == 1).all()  # 0...0 1...1
        if res.n_interruptions == 0:  # not yet admitted at the pause: all under v1
            assert n_old == 0
            continue
        assert 0 < n_old < n_new
        seq = prompt + res.output_ids
        lp_a = learner_logprobs(ckpt_a, seq, temperature)[len(prompt) - 1:]
        lp_b = learner_logprobs(ckpt_b, seq, temperature)[len(prompt) - 1:]
        got = np.asarray(res.output_logprobs)
        tol_a = token_logprob_tolerance(ckpt_a, seq, temperature)
        tol_b = token_logprob_tolerance(ckpt_b, seq, temperature)
        np.testing.assert_allclose(got[:n_old], lp_a[:n_old], rtol=0, atol=tol_a)
        np.testing.assert_allclose(got[n_old:], lp_b[n_old:], rtol=0, atol=tol_b)
        assert np.abs(got[n_old:] - lp_a[n_old:]).max() > 1e-2  # the weights really changed


def test_batched_requests_match_one_at_a_time(servers, ckpt_a):
    """agenerate_batch sends a group as one /generate in SGLang's batch form (a list of
    prompts, one sampling_params and rid each) and gets what one request per sample gets."""
    reqs = mixed_requests(24)
    url = servers[0].url

    async def run():
        async with RolloutClient([url]) as client:
            alone = [await client.agenerate(r) for r in reqs]
            batched = await asyncio.gather(*(client.agenerate_batch(reqs[i:i + 8])
                                             for i in range(0, len(reqs), 8)))
            return alone, [r for group in batched for r in group]

    alone, batched = asyncio.run(run())
    for req, a, b in zip(reqs, alone, batched, strict=True):
        assert b.rid == req.rid and b.finish_reason in ("stop", "length")
        assert b.output_ids == a.output_ids, req.rid
        tol = token_logprob_tolerance(ckpt_a, req.input_ids + a.output_ids,
                                      req.params.temperature)
        np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, rtol=0, atol=tol)
        assert b.output_versions == [int(server_info(url)["weight_version"])] * len(b.output_ids)
    # The raw reply: a list of single replies, in order, each with its own rid.
    raw = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": [[5, 6, 7], [8, 9]], "rid": ["x1", "x2"], "return_logprob": True,
        "sampling_params": [{"max_new_tokens": 3, "temperature": 0.0},
                            {"max_new_tokens": 2, "temperature": 0.0}]}).json()
    assert [r["meta_info"]["id"] for r in raw] == ["x1", "x2"]
    assert [r["meta_info"]["completion_tokens"] for r in raw] == [3, 2]
    assert server_info(url)["num_running_reqs"] == 0


def test_interrupted_batch_resumes_under_the_new_weights(servers, ckpt_a, ckpt_b):
    """A batch paused mid-generation comes back with every sample aborted; the client
    resubmits the unfinished ones together, partial outputs appended, under the new
    weights: each sample is v_old...v_old v_new...v_new with the right logprobs."""
    url = servers[1].url
    n_new, temperature = 300, 1.0
    prompts = [[4 + i, 11, 21 + i, 8] for i in range(6)]

    async def run(new):
        async with RolloutClient([url]) as client:
            await client.agenerate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))
            before = server_info(url)["generated_tokens"]
            task = asyncio.create_task(client.agenerate_batch([GenerateRequest(
                p, SamplingParams(max_new_tokens=n_new, temperature=temperature, seed=i,
                                  ignore_eos=True), rid=f"b{i}") for i, p in enumerate(prompts)]))
            await asyncio.to_thread(wait_until, lambda: server_info(url)["generated_tokens"]
                                    >= before + 5 * len(prompts), what="tokens")
            await client.pause()
            try:
                await client.update_weights_from_disk(str(ckpt_b), new)
            finally:  # a failure above must not leave the server paused for later tests
                await client.continue_()
            results = await task
            await client.update_weights_from_disk(str(ckpt_a), new + 1)  # for other tests
            return results

    # The pause races the server's decoding: on a quick, idle server the 1,800 tokens can
    # all be done before it lands. Run again (under the next versions) until it catches
    # the batch mid-generation, as test_engine's abort check does.
    for _ in range(10):
        old = int(server_info(url)["weight_version"])
        new = old + 10
        results = asyncio.run(run(new))
        if any(res.n_interruptions >= 1 for res in results):
            break
    assert sum(res.n_interruptions >= 1 for res in results) >= 1, "no pause caught the batch"
    for prompt, res in zip(prompts, results, strict=True):
        versions = np.asarray(res.output_versions)
        assert len(res.output_ids) == n_new and res.finish_reason == "length"
        n_old = int((versions == old).sum())
        assert (versions[:n_old] == old).all() and (versions[n_old:] == new).all()
        seq = prompt + res.output_ids
        got = np.asarray(res.output_logprobs)
        lp_a = learner_logprobs(ckpt_a, seq, temperature)[len(prompt) - 1:]
        lp_b = learner_logprobs(ckpt_b, seq, temperature)[len(prompt) - 1:]
        np.testing.assert_allclose(got[:n_old], lp_a[:n_old], rtol=0,
                                   atol=token_logprob_tolerance(ckpt_a, seq, temperature))
        np.testing.assert_allclose(got[n_old:], lp_b[n_old:], rtol=0,
                                   atol=token_logprob_tolerance(ckpt_b, seq, temperature))


def test_no_server_available(tmp_path):
    async def run():
        async with RolloutClient([f"127.0.0.1:{free_port()}"], no_server_timeout=1.0,
                                 health_check_interval=0.2, max_retries=1) as client:
            await client.agenerate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))

    with pytest.raises((NoServerAvailableError,), match="no rollout server is up|failed"):
        asyncio.run(run())
    with pytest.raises(ValueError, match="schedule must be one of"):
        RolloutClient(["127.0.0.1:1"], schedule="random")
    with pytest.raises(ValueError, match="at least one server"):
        RolloutClient([])


def test_failover_when_a_server_dies(servers):
    """Runs last in this module: it kills servers[1] mid-run.

    64 long requests, round-robin: each server gets two waves of its 16 slots, so the
    victim is still busy when it is killed (the engine is fast enough that one wave of
    8 requests can finish between two polls of its status)."""
    reqs = [GenerateRequest([5 + i, 6, 7], SamplingParams(max_new_tokens=500, temperature=1.0,
                                                          seed=i, ignore_eos=True))
            for i in range(64)]
    victim, survivor = servers[1], servers[0]
    victim_tokens_before = server_info(victim.url)["generated_tokens"]

    async def run():
        async with RolloutClient([s.url for s in servers], schedule="round_robin",
                                 health_check_interval=0.5) as client:
            tasks = [asyncio.create_task(client.agenerate(r)) for r in reqs]
            await asyncio.to_thread(wait_until, lambda: server_info(victim.url)[
                "generated_tokens"] > victim_tokens_before, what="the victim generating")
            victim.kill()
            results = await asyncio.gather(*tasks)
            states = {s.url: s.up for s in client.servers}
            return results, states

    results, states = asyncio.run(run())
    assert not victim.alive()
    assert states == {survivor.url: True, victim.url: False}
    for req, res in zip(reqs, results, strict=True):
        assert len(res.output_ids) == req.params.max_new_tokens and res.finish_reason == "length"
    # Half the requests went to the victim; those it had not finished moved to the survivor.
    on_survivor = sum(res.server == survivor.url for res in results)
    assert on_survivor > len(reqs) // 2, on_survivor
