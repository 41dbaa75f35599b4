"""Exact tokens across turns: a tool-calling chat agent (the official ``openai`` client,
``tools``, ``tool`` messages) runs a multi-turn episode through the agentic workflow's
recording endpoint against a real engine server. The trajectory's trained tokens are
exactly the tokens the model generated, turn by turn, with their logprobs and versions,
although re-tokenizing the conversation's text gives other tokens (tests/tool_fixtures.py:
the call's text tokenizes to one merged token the model never generated). An agent that
edits the model's turn gets that turn re-tokenized, counted, and not trained on."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from areal_jax.engine.openai_api import chat_prompt_ids
from areal_jax.rollout.agent import AgenticWorkflow
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import load_tokenizer
from tests.server_fixtures import run_workflow, start_server
from tests.tool_fixtures import (
    ADDED,
    CALL_A,
    CALL_B,
    PAD_ID,
    WEATHER_TOOL,
    tool_chat_model_dir,
)

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
ITEM = {"prompt_id": "p0", "prompt": "Weather in Paris, three times please.", "answer": "x"}
RESULT = "sunny, 21 C"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tool_chat_model_dir(tmp_path_factory, "agenttools")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with start_server(model_dir, tmp_path_factory, max_slots=2, max_seq_len=1024) as handle:
        yield handle


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


async def weather_agent(base_url, item, *, turns=3, edit=False, seen=None):
    """Calls the model with a weather tool, answers each call, ``turns`` times; with
    ``edit`` it changes the call's arguments before sending the history back."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        messages = [{"role": "user", "content": item["prompt"]}]
        for _ in range(turns):
            r = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=[WEATHER_TOOL], logprobs=True)
            seen.append(r)
            message = r.choices[0].message
            assert message.tool_calls, "the fixture model always calls the tool"
            sent = message.model_dump(exclude_none=True)
            if edit:
                sent["tool_calls"][0]["function"]["arguments"] = '{"city": "Rome"}'
            messages.append(sent)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": RESULT}
                         for c in message.tool_calls]
        return 1.0


def run_episode(server, tok, **kwargs):
    """One sample of ``weather_agent`` through the workflow: (trajectory, replies, counts)."""
    seen: list = []
    workflow = AgenticWorkflow(weather_agent, n_samples=1, gconfig=GREEDY, tokenizer=tok,
                               max_turns=4, max_total_tokens=1024,
                               agent_kwargs={**kwargs, "seen": seen})
    (traj,), counts = run_workflow(workflow, server.url, tok, ITEM, seed=3)
    return traj, seen, counts


def test_trained_tokens_are_the_generated_tokens_over_tool_turns(server, tok):
    traj, seen, counts = run_episode(server, tok)
    ids = {t: tok.encode(t)[0] for t in ADDED}
    generated = [ids["<tool_call>"], ids[CALL_A], ids[CALL_B], ids["</tool_call>"],
                 tok.eos_token_id]
    prompt = chat_prompt_ids(tok, [{"role": "user", "content": ITEM["prompt"]}], [WEATHER_TOOL])
    between = tok.encode(f"\n<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response>"
                         "<|im_end|>\n<|im_start|>assistant\n")
    want = prompt + generated + between + generated + between + generated
    assert traj.input_ids.tolist() == want
    mask = [0] * len(prompt) + ([1] * 5 + [0] * len(between)) * 2 + [1] * 5
    assert traj.loss_mask.tolist() == mask
    # Re-tokenizing the same conversation's text would have trained other tokens: the call
    # body tokenizes to the merged token, which the model never generated.
    messages = [{"role": "user", "content": ITEM["prompt"]}]
    for r in seen[:2]:
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id,
                         "content": RESULT})
    retokenized = chat_prompt_ids(tok, messages, [WEATHER_TOOL])
    assert retokenized != want[:len(retokenized)] and ids[CALL_A + CALL_B] in retokenized
    # Each turn's logprobs are the ones the agent was given (the stop token's is not shown
    # by the API; the trajectory keeps it), at the version that generated them.
    turns = np.flatnonzero(np.array(mask)).reshape(3, 5)
    for r, pos in zip(seen, turns, strict=True):
        np.testing.assert_array_equal(traj.behav_logp[pos[:4]],
                                      [c.logprob for c in r.choices[0].logprobs.content])
        assert traj.behav_logp[pos[4]] <= 0.0
    assert traj.versions.tolist() == [0 if m else -1 for m in mask]
    assert traj.info["turns"] == 3 and traj.info["calls_unmatched"] == 0
    assert traj.info["assistant_mismatch"] == 0 and traj.info["history_retokenized"] == 0
    assert counts["agent_turns"] == 3 and counts["agent_assistant_mismatch"] == 0


def test_an_edited_turn_is_retokenized_counted_and_not_trained(server, tok):
    traj, seen, counts = run_episode(server, tok, edit=True)
    assert traj.info["assistant_mismatch"] == 2 and counts["agent_assistant_mismatch"] == 2
    # The edited turns are prompt text (Rome, not Paris), trained on only as far as they
    # are still the model's tokens: <tool_call> and CALL_A, before the edit.
    text = tok.decode(traj.input_ids.tolist())
    assert text.count('"city": "Rome"') == 2 and text.count('"city": "Paris"') == 1
    ids = traj.input_ids.tolist()
    trained = [ids[i] for i in np.flatnonzero(traj.loss_mask)]
    head = [tok.encode("<tool_call>")[0], tok.encode(CALL_A)[0]]
    assert trained == head + head + head + tok.encode(CALL_B + "</tool_call>") + \
        [tok.eos_token_id]
    assert traj.info["calls_unmatched"] == 0


def test_generated_ids_past_the_tokenizer_vocabulary_are_kept(tmp_path_factory):
    """Real checkpoints pad their vocabulary past the tokenizer's; a turn that holds a
    padding id (which decodes to nothing) is sent back with it, and trained on."""
    model_dir = tool_chat_model_dir(tmp_path_factory, "agentpadded", padded_vocab=True)
    tok = load_tokenizer(model_dir)
    assert PAD_ID >= tok.vocab_size
    with start_server(model_dir, tmp_path_factory, max_slots=2, max_seq_len=1024) as server:
        traj, seen, counts = run_episode(server, tok, turns=2)
    assert seen[1].choices[0].message.tool_calls[0].function.name == "get_weather"
    ids = traj.input_ids.tolist()
    trained = [ids[i] for i in np.flatnonzero(traj.loss_mask)]
    turn = [tok.encode("<tool_call>")[0], tok.encode(CALL_A)[0], PAD_ID, tok.encode(CALL_B)[0],
            tok.encode("</tool_call>")[0], tok.eos_token_id]
    assert trained == turn + turn
    assert traj.info["assistant_mismatch"] == 0 and traj.info["history_retokenized"] == 0
