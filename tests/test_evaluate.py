"""Evaluation scores rewards through the reward pool, under its timeout: a verifier that
hangs costs its samples (counted as failures), never the eval."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_jax.engine.launch import launch_server
from areal_jax.rewards.pool import RewardPool
from areal_jax.rollout.client import RolloutClient
from areal_jax.rollout.evaluate import evaluate_prompts
from areal_jax.run_inputs import ASSETS_DIR
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import load_tokenizer

MODEL = ASSETS_DIR / "arith_sft"
ITEMS = [{"input_ids": [1, 2, 3, 4], "answer": "7"}, {"input_ids": [5, 6, 7], "answer": "3"}]


def hangs(completion: str, answer: str) -> float:
    time.sleep(3600)
    return 1.0


def scores_one(completion: str, answer: str) -> float:
    return 1.0


@pytest.fixture(scope="module")
def server():
    handle = launch_server(MODEL, max_slots=4, max_seq_len=32)
    yield handle
    handle.terminate()


def _evaluate(server, reward_fn, pool, n_samples=2):
    async def run():
        client = RolloutClient([server.url])
        try:
            return await evaluate_prompts(
                client, ITEMS, tokenizer=load_tokenizer(MODEL), reward_fn=reward_fn,
                reward_pool=pool, sampling=SamplingParams(max_new_tokens=4), n_samples=n_samples)
        finally:
            await client.aclose()

    # The bound only turns a hang into a failure message; the timeout under test is 0.5 s.
    return asyncio.run(asyncio.wait_for(run(), 300))


def test_a_hanging_reward_times_out_and_counts_as_a_failure(server):
    with RewardPool(num_workers=2, timeout_s=0.5) as pool:
        out = _evaluate(server, "test_evaluate:hangs", pool)
        assert pool.metrics()["timeouts"] == 4
    assert out["reward_failures"] == 4 and out["accuracy"] == 0.0 and out["n_prompts"] == 2
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:
        out = _evaluate(server, "test_evaluate:scores_one", pool, n_samples=1)
    assert out["reward_failures"] == 0 and out["accuracy"] == 1.0


def test_evaluate_needs_a_reward_pool(server):
    with pytest.raises(TypeError, match="needs a RewardPool"):
        _evaluate(server, scores_one, None)
