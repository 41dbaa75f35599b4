"""The executor's progress watchdog against a real engine server: a run that can never
progress stops with the cause it saw most, instead of looking like a run that is running."""

from __future__ import annotations

import asyncio

import pytest
from hf_fixtures import make_tiny_hf_checkpoint

from areal_jax.data import builtin_task
from areal_jax.engine.launch import launch_server
from areal_jax.rewards.pool import RewardPool
from areal_jax.rollout.client import RolloutClient
from areal_jax.rollout.executor import NoProgressError, RolloutExecutor
from areal_jax.rollout.workflows import RLVRWorkflow
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def server_and_tokenizer(tmp_path_factory):
    ckpt = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("watchdog"), vocab_size=32, seed=0)
    builtin_task.save_tokenizer(ckpt)
    server = launch_server(ckpt, max_slots=16, max_seq_len=64, xla_cpu_threads=1)
    yield server, load_tokenizer(ckpt)
    server.terminate()


def _prompts(n: int = 1000):
    for i in range(n):
        yield {"prompt_id": f"p{i}", "prompt": f"{i % 7}+{i % 5}=", "answer": str(i % 7 + i % 5)}


def _executor(
    server, tokenizer, workflow, pool=None, max_concurrent=4, **limits
) -> RolloutExecutor:
    client = RolloutClient([server.url], request_timeout=60)
    return RolloutExecutor(client, workflow, _prompts(), batch_size=2,
                           max_concurrent=max_concurrent, max_staleness=None,
                           tokenizer=tokenizer, reward_pool=pool, **limits)


def test_server_refusing_every_request_stops_with_its_message(server_and_tokenizer):
    server, tokenizer = server_and_tokenizer
    wf = RLVRWorkflow("areal_jax.rewards.builtin:builtin_reward", n_samples=2,
                      gconfig=SamplingParams(max_new_tokens=8, stop_token_ids=(10**6,)),
                      tokenizer=tokenizer)
    ex = _executor(server, tokenizer, wf, max_attempts_without_progress=6)
    try:
        with pytest.raises(NoProgressError) as info:
            ex.prepare_batch(timeout=120)
    finally:
        ex.stop(close_client=True)
    msg = str(info.value)
    assert "\n" not in msg
    assert "attempts in a row ended without an accepted group" in msg
    assert "RolloutRequestError" in msg and "HTTP 400" in msg and "stop_token_ids" in msg, msg
    assert "watchdog.max_attempts_without_progress=6" in msg


def test_workflow_rejecting_everything_is_named(server_and_tokenizer):
    server, tokenizer = server_and_tokenizer
    wf = RLVRWorkflow("areal_jax.rewards.builtin:builtin_reward", n_samples=2,
                      gconfig=SamplingParams(max_new_tokens=8), tokenizer=tokenizer,
                      group_filter=lambda g: False)
    with RewardPool(num_workers=1, timeout_s=10) as pool:
        ex = _executor(server, tokenizer, wf, pool, max_attempts_without_progress=5)
        try:
            # The stop names the filter that dropped every group, not only "rejected".
            with pytest.raises(NoProgressError, match="group_filter '<lambda>' dropped the group"):
                ex.prepare_batch(timeout=120)
        finally:
            ex.stop(close_client=True)
    assert ex.metrics()["accepted"] == 0 and ex.metrics()["rejected"] >= 5


def test_failing_reward_is_named_with_its_exception_type(server_and_tokenizer):
    server, tokenizer = server_and_tokenizer
    wf = RLVRWorkflow("tests._faulty_rewards:always_raises", n_samples=2,
                      gconfig=SamplingParams(max_new_tokens=8), tokenizer=tokenizer)
    with RewardPool(num_workers=1, timeout_s=10) as pool:
        ex = _executor(server, tokenizer, wf, pool, max_attempts_without_progress=4)
        try:
            with pytest.raises(NoProgressError) as info:
                ex.prepare_batch(timeout=120)
        finally:
            ex.stop(close_client=True)
    assert "ZeroDivisionError: cannot score" in str(info.value), str(info.value)


def test_no_accepted_group_for_too_long_stops(server_and_tokenizer):
    """The time limit: runs that never finish (here: a workflow stuck forever)."""
    server, tokenizer = server_and_tokenizer

    async def stuck(client, item, ctx):
        await asyncio.sleep(3600)

    ex = _executor(server, tokenizer, stuck, max_seconds_without_progress=1.5)
    try:
        with pytest.raises(NoProgressError, match=r"no group accepted for \d+s while the learner "
                                                  r"waited.*max_seconds_without_progress=1.5"):
            ex.prepare_batch(timeout=120)
    finally:
        ex.stop(close_client=True)


def test_progress_resets_the_count(server_and_tokenizer):
    """Failures between accepted groups never add up: a run that progresses is not stopped."""
    server, tokenizer = server_and_tokenizer
    calls = {"n": 0}

    async def every_third_fails(client, item, ctx):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("transient")
        return await RLVRWorkflow("areal_jax.rewards.builtin:builtin_reward", n_samples=1,
                                  gconfig=SamplingParams(max_new_tokens=4),
                                  tokenizer=tokenizer).arun(client, item, ctx)

    # one run at a time, so that runs finish in the order the failures were planned
    ex = _executor(server, tokenizer, every_third_fails, max_concurrent=1,
                   max_attempts_without_progress=2)
    try:
        for _ in range(5):
            assert len(ex.prepare_batch(timeout=120)) == 2
    finally:
        ex.stop(close_client=True)
    assert ex.metrics()["attempt_errors"] >= 2
