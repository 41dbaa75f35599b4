"""The agentic workflow: agents written against the openai client, run against a real
engine server on 127.0.0.1 through the per-trajectory recording endpoint. The trajectory's
loss mask covers exactly the model's tokens (not the prompt, tool output or template
tokens), its logprobs are the ones the API returned, and its versions follow weight
updates between turns."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from areal_jax.config import ConfigError, load_config
from areal_jax.rollout.agent import AgenticWorkflow, RecordedCall, assemble_trajectory
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import load_tokenizer
from tests.hf_fixtures import arith_chat_model_dir
from tests.server_fixtures import run_workflow, start_server

EOS = 2
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return arith_chat_model_dir(tmp_path_factory, "agent")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with start_server(model_dir, tmp_path_factory, max_slots=4, max_seq_len=160) as handle:
        yield handle


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


ITEM = {"prompt_id": "p0", "prompt": "Q:17+5-8=", "answer": "14"}
SEEN: dict[str, list] = {}


async def tool_agent(base_url, item):
    """Two completions; between them a 'tool' result the model did not write."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        r1 = await client.completions.create(model="p", prompt=item["prompt"], max_tokens=40,
                                             logprobs=0)
        text = r1.choices[0].text
        tool = "Q:3+4="
        r2 = await client.completions.create(model="p", prompt=item["prompt"] + text + "<eos>"
                                             + tool, max_tokens=40, logprobs=0)
        SEEN["tool"] = [r1, r2, tool]
        return 0.5


def test_completions_agent_masks_model_tokens_only(server, tok):
    wf = AgenticWorkflow(tool_agent, n_samples=1, gconfig=GREEDY, tokenizer=tok, max_turns=2,
                         max_total_tokens=160)
    group, counts = run_workflow(wf, server.url, tok, ITEM)
    (traj,) = group
    r1, r2, tool = SEEN["tool"]
    p = tok.encode(ITEM["prompt"])
    o1 = tok.encode(r1.choices[0].text)
    o2 = tok.encode(r2.choices[0].text)
    assert r1.choices[0].finish_reason == "stop"  # so the <eos> it ended with is the model's
    between = tok.encode(tool)
    want_ids = (p + o1 + [EOS] + between + o2
                + ([EOS] if r2.choices[0].finish_reason == "stop" else []))
    assert traj.input_ids.tolist() == want_ids
    n_o2 = len(want_ids) - len(p) - len(o1) - 1 - len(between)
    want_mask = [0] * len(p) + [1] * (len(o1) + 1) + [0] * len(between) + [1] * n_o2
    assert traj.loss_mask.tolist() == want_mask
    # The logprobs the agent saw are the trajectory's behaviour logprobs (the API hides the
    # stop token, the trajectory keeps it).
    lp = traj.behav_logp
    np.testing.assert_array_equal(lp[len(p):len(p) + len(o1)],
                                  r1.choices[0].logprobs.token_logprobs)
    start2 = len(p) + len(o1) + 1 + len(between)
    np.testing.assert_array_equal(lp[start2:start2 + len(o2)],
                                  r2.choices[0].logprobs.token_logprobs)
    assert np.all(lp[np.array(want_mask) == 0] == 0.0) and np.all(lp[np.array(want_mask) == 1] < 0)
    assert traj.versions.tolist() == [0 if m else -1 for m in want_mask]
    assert traj.reward == 0.5 and traj.info["turns"] == 2
    assert counts["agent_turns"] == 2 and counts["agent_calls_unmatched"] == 0


def chat_agent(base_url, item, *, between):
    """A plain (blocking) agent over the chat API; ``between`` runs between its turns."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": item["prompt"]}]
    a1 = client.chat.completions.create(model="p", messages=messages, logprobs=True)
    between()
    messages += [{"role": "assistant", "content": a1.choices[0].message.content},
                 {"role": "user", "content": "Q:2+2="}]
    a2 = client.chat.completions.create(model="p", messages=messages, logprobs=True)
    SEEN["chat"] = [a1, a2]
    return 1


def test_chat_agent_across_a_weight_update(server, tok):
    def bump_version():
        r = httpx.post(f"{server.url}/update_weight_version", json={"new_version": "1"})
        assert r.status_code == 200

    wf = AgenticWorkflow(chat_agent, n_samples=1, gconfig=GREEDY, tokenizer=tok, max_turns=2,
                         max_total_tokens=160, agent_kwargs={"between": bump_version})
    try:
        (traj,), _ = run_workflow(wf, server.url, tok, ITEM)
    finally:
        httpx.post(f"{server.url}/update_weight_version", json={"new_version": "0"})
    a1, a2 = SEEN["chat"]
    n1 = len(tok.encode(a1.choices[0].message.content)) + 1  # + its <eos>
    n2 = a2.usage.completion_tokens
    p = len(tok.encode(ITEM["prompt"]))
    between = len(tok.encode("Q:2+2="))
    assert traj.num_tokens == p + n1 + between + n2
    assert traj.loss_mask.tolist() == [0] * p + [1] * n1 + [0] * between + [1] * n2
    # Each turn's tokens carry the version that generated them.
    assert traj.versions.tolist() == [-1] * p + [0] * n1 + [-1] * between + [1] * n2
    np.testing.assert_array_equal(traj.behav_logp[p:p + n1 - 1],
                                  [c.logprob for c in a1.choices[0].logprobs.content])


async def greedy_agent(base_url, item, *, calls=3, reward=1.0):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        for _ in range(calls):
            await client.completions.create(model="p", prompt=item["prompt"], max_tokens=4)
    return reward


@pytest.mark.parametrize("kwargs, problem", [
    ({"calls": 3}, "turn limit reached"),
    ({"calls": 1, "reward": "1.0"}, "reward must be a real number"),
    ({"calls": 0}, "the agent made no model call"),
])
def test_failed_agents_reject_the_group(server, tok, kwargs, problem, caplog):
    wf = AgenticWorkflow(greedy_agent, n_samples=2, gconfig=GREEDY, tokenizer=tok, max_turns=2,
                         max_total_tokens=160, agent_kwargs=kwargs)
    group, counts = run_workflow(wf, server.url, tok, ITEM)
    assert group is None and counts["agent_failed_groups"] == 1
    assert problem in caplog.text


def test_group_filter_rejects_equal_reward_groups(server, tok):
    wf = AgenticWorkflow(greedy_agent, n_samples=2, gconfig=GREEDY, tokenizer=tok, max_turns=2,
                         max_total_tokens=160, agent_kwargs={"calls": 1},
                         group_filter=lambda g: len({t.reward for t in g}) > 1)
    group, counts = run_workflow(wf, server.url, tok, ITEM)
    assert group is None and counts["filtered_groups"] == 1 and counts["agent_turns"] == 2


def test_assemble_trajectory_keeps_only_calls_inside_the_final_sequence():
    calls = [RecordedCall([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 0], "stop"),
             RecordedCall([9, 9], [7], [-0.5], [0], "stop"),  # a side conversation
             RecordedCall([1, 2, 3, 4, 8, 6], [7, 2], [-0.4, -0.6], [1, 1], "stop")]
    traj, unmatched = assemble_trajectory(calls, 1.0)
    assert unmatched == 1
    assert traj.input_ids.tolist() == [1, 2, 3, 4, 8, 6, 7, 2]
    # The first call's tokens count up to where the agent changed them (5 -> 8).
    assert traj.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    np.testing.assert_array_equal(traj.behav_logp, np.float32([0, 0, -0.1, -0.2, 0, 0, -0.4, -0.6]))
    assert traj.versions.tolist() == [-1, -1, 0, 0, -1, -1, 1, 1]
    with pytest.raises(ValueError, match="the agent made no model call"):
        assemble_trajectory([], 1.0)


def test_agent_workflow_from_config(tmp_path):
    base = ["model.path=builtin:arith_sft", "rollout.workflow=agent"]
    cfg = load_config(None, base + [
        "rollout.agent=areal_jax.rollout.agent_examples:arith_retry_agent",
        "rollout.max_turns=2"])
    assert cfg.rollout.workflow == "agent" and cfg.rollout.max_turns == 2
    with pytest.raises(ConfigError, match="rollout.workflow='agent' needs rollout.agent"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="rollout.max_turns must be > 0"):
        load_config(None, base + ["rollout.agent=a:b", "rollout.max_turns=0"])
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        AgenticWorkflow("no_such_module:agent")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        AgenticWorkflow("areal_jax.rollout.agent_examples:nope")


@pytest.mark.slow
def test_agent_config_trains_from_train_py_alone(tmp_path):
    """configs/arith_agent.yaml through scripts/train.py: versions train on agent
    trajectories (two model turns where the first answer was wrong)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts" / "train.py"), "--config",
         str(repo / "configs" / "arith_agent.yaml"), f"run_dir={run_dir}",
         "train.total_versions=2", "train.batch_size=4", "rollout.n_samples=4",
         "rollout.max_slots=16", "eval.every_versions=0", "eval.at_start=false",
         "eval.at_end=false", "progress_bar=false", "rollout.server_cpu_cores=null",
         "rollout.learner_cpu_cores=null"],
        capture_output=True, text=True, timeout=900, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    # Every sample made one or two model calls; none failed.
    turns = rows[-1]["rollout/agent_turns"]
    accepted = rows[-1].get("rollout/accepted", 8)
    assert 4 * accepted <= turns <= 8 * accepted, rows[-1]
    assert "rollout/agent_failed_groups" not in rows[-1]
