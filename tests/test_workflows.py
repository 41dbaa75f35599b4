"""Workflow building blocks that need no server (the server-backed checks of RLVR and
multi-turn workflows are in test_executor_servers.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from areal_jax.rollout.types import GenerateResponse
from areal_jax.rollout.workflows import (
    MultiTurnWorkflow,
    RLVRWorkflow,
    WorkflowContext,
    as_workflow_fn,
    compute_reward,
    prompt_token_ids,
    sample_request,
    trajectory_from_response,
)
from areal_jax.sampling_params import SamplingParams
from tests.tolerance import UNIT_ROUNDOFF_F32


def add_one(x):
    return x + 1


def boom(x):
    raise ValueError("boom")


def sleepy(x):
    time.sleep(1.0)
    return x


def test_sample_request_builds_requests_from_validated_params():
    cfg = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5,
                         stop_token_ids=(2,), ignore_eos=True)
    req = sample_request(cfg, [1, 2], seed=11, rid="g/0", max_new_tokens=3)
    assert req.input_ids == [1, 2] and req.params.max_new_tokens == 3 and req.params.seed == 11
    assert req.rid == "g/0" and cfg.seed is None  # the shared params are not changed
    params = req.sampling_params()
    assert params["temperature"] == 0.5 and params["top_k"] == 5 and params["stop_token_ids"] == [2]
    assert params["ignore_eos"] is True and params["sampling_seed"] == 11
    assert params["skip_special_tokens"] is False  # the client works on token ids
    with pytest.raises(ValueError, match="max_new_tokens must be an int in"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or in"):
        SamplingParams(temperature=-1.0)


def test_trajectory_from_response_aligns_tokens():
    resp = GenerateResponse(input_ids=[5, 6, 7], output_ids=[8, 9], output_logprobs=[-0.1, -0.2],
                            output_versions=[3, 4], finish_reason="stop", n_interruptions=1)
    t = trajectory_from_response(resp, 1.0, info={"sample_index": 2})
    assert t.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert t.versions.tolist() == [-1, -1, -1, 3, 4]
    # stored as float32: one rounding of each logprob
    np.testing.assert_allclose(t.behav_logp, [0, 0, 0, -0.1, -0.2], rtol=UNIT_ROUNDOFF_F32)
    assert t.info["n_interruptions"] == 1 and t.info["sample_index"] == 2
    bad = GenerateResponse(input_ids=[1], output_ids=[2, 3], output_logprobs=[-1.0],
                           output_versions=[0, 0], finish_reason="stop", rid="r1")
    with pytest.raises(ValueError, match="response r1: 2 output ids but 1 logprobs"):
        trajectory_from_response(bad, 0.0)


def test_prompt_token_ids():
    assert prompt_token_ids({"input_ids": [3, 4], "prompt": "ignored"}, None) == [3, 4]
    with pytest.raises(KeyError, match="prompt item 'p9' has neither 'input_ids' nor 'prompt'"):
        prompt_token_ids({"prompt_id": "p9", "question": "?"}, None)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        prompt_token_ids({"prompt_id": "p9", "prompt": "?"}, None)


def test_compute_reward_without_a_pool_counts_failures():
    counts = {}
    ctx = WorkflowContext(start_version=0, seed=0, group_id="g", reward_timeout_s=0.2,
                          _count=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n))

    async def main():
        return await asyncio.gather(compute_reward(ctx, add_one, 1.0),
                                    compute_reward(ctx, boom, 1.0),
                                    compute_reward(ctx, sleepy, 1.0),
                                    compute_reward(ctx, "test_workflows:add_one", 2.0))

    assert asyncio.run(main()) == [2.0, None, None, 3.0]
    assert counts == {"reward_errors": 1, "reward_timeouts": 1}


def test_workflow_constructors_validate():
    with pytest.raises(ValueError, match="n_samples must be >= 1"):
        RLVRWorkflow(add_one, n_samples=0)
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        RLVRWorkflow("no_such_mod_xyz:fn")
    with pytest.raises(ValueError, match="must be a callable, a .module:function. string"):
        RLVRWorkflow("not a spec")
    with pytest.raises(ValueError, match="MultiTurnWorkflow needs"):
        MultiTurnWorkflow(lambda item: None, max_turns=0)
    with pytest.raises(TypeError, match="must be an async function"):
        as_workflow_fn(object())

    class Tok:
        stop_token_ids = [2, 7]

    assert RLVRWorkflow(add_one, tokenizer=Tok()).gconfig.stop_token_ids == (2, 7)
    explicit = RLVRWorkflow(add_one, tokenizer=Tok(), gconfig=SamplingParams(stop_token_ids=(9,)))
    assert explicit.gconfig.stop_token_ids == (9,)


def test_rlvr_missing_answer_is_named():
    class Tok:
        stop_token_ids = [2]

    wf = RLVRWorkflow(add_one, tokenizer=Tok(), answer_key="tests")
    ctx = WorkflowContext(start_version=0, seed=0, group_id="g")
    with pytest.raises(KeyError, match="prompt item 'p1' has no 'tests' key"):
        asyncio.run(wf.arun(None, {"prompt_id": "p1", "prompt": "x"}, ctx))
