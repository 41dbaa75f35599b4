"""Slow is not dead: real engine servers, one of them SIGSTOPped for a few seconds during a
weight update and a generation (both are retried with backoff and succeed once it
resumes), and one SIGKILLed (it is dropped at once, and the fleet goes on without it)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from areal_jax.rollout.client import RolloutClient
from areal_jax.rollout.types import GenerateRequest
from areal_jax.sampling_params import SamplingParams
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.server_fixtures import start_servers

pytestmark = pytest.mark.slow  # two real servers and two 5 s stalls (~2 min on 2 cores)
STALL_S = 5.0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("stall")
    return make_tiny_hf_checkpoint(root, seed=0), make_tiny_hf_checkpoint(root, seed=1)


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    handles = start_servers(ckpts[0], 2, tmp_path_factory, max_slots=4, max_seq_len=64,
                            allowed_weight_dirs=[ckpts[0].parent])
    yield handles
    for h in handles:
        os.killpg(h.pid, signal.SIGCONT) if h.alive() else None
        h.terminate()


def weight_version(url: str) -> str:
    return httpx.get(f"{url}/get_server_info", timeout=60).json()["weight_version"]


def stall(pid: int, seconds: float) -> threading.Timer:
    os.killpg(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, os.killpg, (pid, signal.SIGCONT))
    timer.start()
    return timer


def test_a_stalled_server_is_retried_until_it_answers(servers, ckpts):
    """Each attempt times out after 1 s while the server is stopped for 5 s; the deadline
    (60 s) is longer, so the update and the generation both succeed once it resumes.
    Without retries both failed and the server was dropped."""
    victim = servers[0]
    req = GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0))

    async def run():
        async with RolloutClient([victim.url], control_timeout=1.0, request_timeout=1.0,
                                 retry_deadline_s=60.0, retry_backoff_s=0.25,
                                 retry_backoff_max_s=1.0, max_retries=2) as client:
            before = await client.agenerate(req)
            timer = stall(victim.pid, STALL_S)
            t0 = time.monotonic()
            try:
                await client.pause()
                await client.update_weights_from_disk(str(ckpts[1]), 1)
                await client.continue_()
                waited = time.monotonic() - t0
                after = await client.agenerate(req)
            finally:
                timer.join()
            return before, after, waited, client.servers[0].up

    before, after, waited, up = asyncio.run(run())
    assert waited >= STALL_S - 1.0  # it really waited out the stall
    assert up
    assert weight_version(victim.url) == "1"
    assert before.output_versions == [0] * 8 and after.output_versions == [1] * 8
    assert after.output_ids != before.output_ids  # the new weights serve

    async def generate_through_a_stall():
        async with RolloutClient([victim.url], request_timeout=1.0, retry_deadline_s=60.0,
                                 retry_backoff_s=0.25, retry_backoff_max_s=1.0) as client:
            timer = stall(victim.pid, STALL_S)
            try:
                return await client.agenerate(req)
            finally:
                timer.join()

    again = asyncio.run(generate_through_a_stall())
    assert again.output_ids == after.output_ids and again.output_versions == [1] * 8


def test_a_killed_server_is_dropped_at_once(servers, ckpts):
    """Runs last: kills servers[1]. Connection refused means gone: no waiting for the
    retry deadline (10 minutes here); the update lands on the survivor and generation
    goes on there."""
    survivor, victim = servers
    req = GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0))

    async def run():
        async with RolloutClient([s.url for s in servers], retry_deadline_s=600.0,
                                 health_check_interval=60.0) as client:
            victim.kill()
            t0 = time.monotonic()
            await client.update_weights_from_disk(str(ckpts[0]), 2)
            took = time.monotonic() - t0
            results = await asyncio.gather(*(client.agenerate(req) for _ in range(4)))
            return took, results, {s.url: s.up for s in client.servers}

    took, results, up = asyncio.run(run())
    assert not victim.alive()
    assert up == {survivor.url: True, victim.url: False}
    assert took < 60  # far below the retry deadline
    assert weight_version(survivor.url) == "2"
    assert all(r.server == survivor.url and r.output_versions == [2] * 8 for r in results)
