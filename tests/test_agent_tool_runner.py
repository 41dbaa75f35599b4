"""Tools that fail like tools (areal_jax.rollout.tools.ToolRunner): the tool-calling demo's
agent (``arith_calculator_agent``, model ``builtin:arith_tools``, greedy, which always calls
the calculator on this prompt) runs through the agentic workflow against a real engine
server on 127.0.0.1 with calculators that raise, return 2 MB, or return None, a dict or a
number. The episode goes on with the error or the JSON text as the tool's result, the
group is accepted, and the tool counts reach the trajectory and the metrics. An episode
whose tool result no longer fits the context ends with finish reason ``context_length``."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from areal_jax.rollout.agent import AgenticWorkflow
from areal_jax.rollout.agent_examples import arith_calculator_agent, calculator
from areal_jax.rollout.client import RolloutClient
from areal_jax.rollout.tools import TRUNCATED, ToolRunner, counting_tools
from areal_jax.run_inputs import ASSETS_DIR
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import load_tokenizer
from areal_jax.trajectory import FINISH_CONTEXT
from tests.server_fixtures import run_workflow, start_server

MODEL = ASSETS_DIR / "arith_tools"
ITEM = {"prompt_id": "p0", "prompt": "Q:17+5-8=", "answer": "14"}
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
TWO_MB = 2_000_000


def call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def raising(expression):
    raise ZeroDivisionError(f"cannot evaluate {expression}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_server(MODEL, tmp_path_factory, max_slots=8, max_seq_len=128) as handle:
        yield handle


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def run_group(server, tok, n_samples=2, **agent_kwargs):
    """One group of the calculator agent: (trajectories or None, the workflow's counts)."""
    workflow = AgenticWorkflow(arith_calculator_agent, n_samples=n_samples, gconfig=GREEDY,
                               tokenizer=tok, max_turns=3, max_total_tokens=128,
                               agent_kwargs=agent_kwargs)
    return run_workflow(workflow, server.url, tok, ITEM, seed=1)


def tool_result(tok, traj):
    text = tok.decode(traj.input_ids.tolist(), skip_special_tokens=False)
    return text.split("<tool_response>")[1].split("</tool_response>")[0]


def test_the_runner_turns_failures_and_values_into_tool_messages():
    def huge(expression):
        return "9" * TWO_MB

    async def async_dict(expression):
        return {"value": 14, "expression": expression}

    runner = ToolRunner({"calculator": calculator, "raising": raising, "huge": huge,
                         "none": lambda expression: None, "number": lambda expression: 14.5,
                         "adict": async_dict}, max_result_chars=100, max_error_chars=60)
    args = json.dumps({"expression": "17+5-8"})
    calls = [call("calculator", args, "c0"), call("raising", args, "c1"),
             call("huge", args, "c2"), call("none", args, "c3"), call("number", args, "c4"),
             call("adict", args, "c5"), call("nope", args, "c6"), call("calculator", "{x", "c7"),
             call("calculator", "[1]", "c8"), call("calculator", '{"expr": "1"}', "c9")]
    with counting_tools() as counts:
        messages = asyncio.run(runner.run(calls))
        assert runner.run_sync(calls[:3]) == messages[:3]
    assert [m["tool_call_id"] for m in messages] == [f"c{i}" for i in range(10)]
    assert all(m["role"] == "tool" and isinstance(m["content"], str) for m in messages)
    content = [m["content"] for m in messages]
    assert content[0] == "14"
    assert content[1] == "Error: ZeroDivisionError: cannot evaluate 17+5-8"
    assert content[2] == "9" * 100 + TRUNCATED.format(shown=100, total=TWO_MB)
    assert content[3:6] == ["null", "14.5", '{"value": 14, "expression": "17+5-8"}']
    # An error is cut to max_error_chars, then the marker.
    assert content[6].startswith("Error: unknown tool 'nope'")
    assert content[6].endswith(TRUNCATED.format(shown=60, total=88))
    assert "not valid JSON" in content[7] and "JSON object" in content[8]
    assert content[9].startswith("Error: TypeError: calculator() got an unexpected")
    assert counts == {"tool_calls": 13, "tool_errors": 6, "tool_results_truncated": 2}


def test_a_slow_tool_is_answered_with_an_error():
    async def slow(expression):
        await asyncio.sleep(60)

    runner = ToolRunner({"calculator": slow}, timeout_s=0.05)
    (message,) = asyncio.run(runner.run([call("calculator", '{"expression": "1"}')]))
    assert message["content"] == "Error: the tool did not answer within 0.05 s"


def test_the_calculator_agent_solves_with_the_tool(server, tok):
    group, counts = run_group(server, tok)
    assert [t.reward for t in group] == [1.0, 1.0]
    assert [tool_result(tok, t) for t in group] == ["14", "14"]
    assert all(t.info["tool_calls"] == 1 and t.info["tool_errors"] == 0 for t in group)
    assert counts["tool_calls"] == 2 and counts["tool_errors"] == 0


def test_an_agent_asking_more_tokens_than_the_context_holds_is_capped(server, tok):
    """max_tokens=256 against a 128-token trajectory budget: capped (to what is left, and
    to rollout.max_new_tokens), as docs/rollout.md says, never a 400 on every first call."""
    group, counts = run_group(server, tok, max_tokens=256)
    assert [t.reward for t in group] == [1.0, 1.0]
    assert counts["agent_context_exceeded"] == 0 and counts["agent_failed_groups"] == 0
    assert all(t.info["turns"] == 2 for t in group)


def test_a_raising_tool_is_the_models_to_read_and_the_group_is_kept(server, tok):
    group, counts = run_group(server, tok, tools={"calculator": raising})
    assert group is not None and counts["agent_failed_groups"] == 0
    for traj in group:
        # The error went back as the tool's result and the model answered after it.
        assert traj.info["turns"] == 2 and traj.info["tool_errors"] == 1
        assert traj.finish_reason == "stop" and traj.reward == 0.0
    assert counts["tool_errors"] == 2 and counts["tool_calls"] == 2


@pytest.mark.parametrize("value,text", [(None, "null"), (14, "14"),
                                        ({"v": 14}, '{"v": 14}')])
def test_non_string_results_are_sent_as_json_text(server, tok, value, text):
    group, counts = run_group(server, tok, n_samples=1,
                              tools={"calculator": lambda expression: value})
    (traj,) = group
    want = tok.decode(tok.encode(text), skip_special_tokens=False)  # in the task's vocabulary
    assert tool_result(tok, traj) == want and traj.info["turns"] == 2
    assert counts["tool_errors"] == 0 and counts["agent_failed_groups"] == 0


@pytest.mark.parametrize("value,text", [
    (os.fsdecode(b"report-\xff.txt"), "report-\\xff.txt"),  # a non-UTF-8 file name
    ("a\ud800b", "a\\ud800b"), (["x\udcff"], '["x\\xff"]')])
def test_a_result_that_is_not_text_is_sent_escaped_and_the_episode_goes_on(server, tok, value,
                                                                            text):
    """A tool result holding lone surrogates (``os.fsdecode`` of a non-UTF-8 file name, or
    any other) cannot be sent in the next request as it is: its undecodable bytes and
    surrogates are sent as backslash escapes, and the episode goes on (the next call failed
    with UnicodeEncodeError)."""
    group, counts = run_group(server, tok, n_samples=1,
                              tools={"calculator": lambda expression: value})
    (traj,) = group
    want = tok.decode(tok.encode(text), skip_special_tokens=False)  # in the task's vocabulary
    assert tool_result(tok, traj) == want and traj.info["turns"] == 2
    assert counts["tool_errors"] == 0 and counts["agent_failed_groups"] == 0


def test_a_2mb_result_is_truncated_and_the_episode_goes_on(server, tok):
    group, counts = run_group(server, tok, tools={"calculator": lambda expression: "9" * TWO_MB})
    assert group is not None and counts["tool_results_truncated"] == 2
    for traj in group:
        assert traj.info["turns"] == 2 and traj.finish_reason != FINISH_CONTEXT
        assert tool_result(tok, traj).startswith("9" * 32)
    assert counts["agent_context_exceeded"] == 0


def test_an_episode_that_outgrows_the_context_ends_with_a_finish_reason(server, tok):
    # With a budget larger than the context, the 2 MB result makes the next prompt too long:
    # the agent's call is refused and the episode ends there, scored 0, group kept.
    group, counts = run_group(server, tok, tools={"calculator": lambda expression: "9" * TWO_MB},
                              max_result_chars=TWO_MB)
    assert group is not None and counts["agent_failed_groups"] == 0
    for traj in group:
        assert traj.finish_reason == FINISH_CONTEXT and traj.reward == 0.0
        assert traj.info["turns"] == 1 and traj.num_tokens <= 128
    assert counts["agent_context_exceeded"] == 2


def test_an_agent_that_raises_at_the_context_limit_still_ends_its_episode(server, tok):
    async def stubborn(base_url, item, **kwargs):  # does not catch the 400
        import openai

        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = [{"role": "user", "content": item["prompt"]}]
            for _ in range(3):
                r = await client.chat.completions.create(model="policy", messages=messages,
                                                         max_tokens=24)
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "9" * 200}]
        return 1.0

    workflow = AgenticWorkflow(stubborn, n_samples=1, gconfig=GREEDY, tokenizer=tok,
                               max_turns=3, max_total_tokens=128)
    (traj,), counts = run_workflow(workflow, server.url, tok, ITEM, seed=1, group_id="g1")
    assert traj.finish_reason == FINISH_CONTEXT and traj.reward == 0.0
    assert counts["agent_context_exceeded"] == 1 and counts["agent_failed_groups"] == 0


def test_eval_with_the_runs_own_workflow_and_single_turn_side_by_side(server, tok):
    """Issue 39 item 6b: an agent run's eval runs its own agent and tools (what it trains
    on); the single-turn figure (no tools) is a second, separately named number."""
    from areal_jax.rewards.pool import RewardPool
    from areal_jax.rollout.evaluate import evaluate_prompts, evaluate_workflow

    items = [{"prompt_id": f"e{i}", "prompt": p, "answer": a} for i, (p, a) in
             enumerate([("Q:17+5-8=", "14"), ("Q:3+4=", "7"), ("Q:9-2=", "7")])]
    train = AgenticWorkflow(arith_calculator_agent, n_samples=8, tokenizer=tok, max_turns=3,
                            max_total_tokens=128,
                            gconfig=SamplingParams(max_new_tokens=24, temperature=1.0))
    evaluation = train.for_eval(GREEDY, 2)
    assert evaluation.n_samples == 2 and evaluation.gconfig.temperature == 0.0
    assert evaluation.gconfig.stop_token_ids == train.gconfig.stop_token_ids
    broken = train.for_eval(GREEDY, 1)
    broken.agent_kwargs = {"max_calls": "not a number"}  # the agent raises: a failed group
    pool = RewardPool(num_workers=1)

    async def go():
        async with RolloutClient([server.url]) as client:
            agent = await evaluate_workflow(client, items, evaluation, tokenizer=tok,
                                            reward_pool=pool, seed=0)
            failed = await evaluate_workflow(client, items[:1], broken, tokenizer=tok,
                                             reward_pool=pool, seed=0)
            single = await evaluate_prompts(client, items, tokenizer=tok, reward_fn="builtin",
                                            reward_pool=pool, sampling=GREEDY, n_samples=2)
            return agent, failed, single

    try:
        agent, failed, single = asyncio.run(go())
    finally:
        evaluation.close()
        broken.close()
        pool.close()
    # Greedy, the policy calls the calculator and copies its result: right with the tool.
    assert agent["accuracy"] == 1.0 and agent["pass_at_k"] == 1.0
    assert agent["tool_calls"] == 6 and agent["tool_errors"] == 0 and agent["failed_groups"] == 0
    assert agent["n_prompts"] == 3 and agent["n_samples"] == 2
    # Single-turn, the same policy writes a call that nobody runs: the figure the run used
    # to report fell as the policy learned to use the tool.
    assert single["accuracy"] < agent["accuracy"]
    assert failed["failed_groups"] == 1 and failed["accuracy"] == 0.0


def test_a_plain_agent_runs_its_tools_with_run_sync_and_is_counted(server, tok):
    """A plain (non-async) agent runs in a thread; its runner's counts still reach the
    episode (the workflow's counting context is copied into that thread)."""
    import openai

    from areal_jax.rollout.agent_examples import CALCULATOR_TOOL

    runner = ToolRunner({"calculator": raising})

    def plain_agent(base_url, item):
        with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = [{"role": "user", "content": item["prompt"]}]
            reply = client.chat.completions.create(model="policy", messages=messages,
                                                   tools=[CALCULATOR_TOOL], max_tokens=24)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            messages += runner.run_sync(message.tool_calls)
            client.chat.completions.create(model="policy", messages=messages,
                                           tools=[CALCULATOR_TOOL], max_tokens=24)
        return 0.5

    workflow = AgenticWorkflow(plain_agent, n_samples=1, gconfig=GREEDY, tokenizer=tok,
                               max_turns=3, max_total_tokens=128)
    (traj,), counts = run_workflow(workflow, server.url, tok, ITEM, seed=1, group_id="g2")
    assert traj.reward == 0.5 and traj.info["turns"] == 2
    assert traj.info["tool_calls"] == 1 and traj.info["tool_errors"] == 1
    assert counts["tool_errors"] == 1


# --- issue 50: agents and tools that exit, interrupt, cancel themselves or hang ------------


def test_run_sync_honours_timeout_s_and_a_str_that_raises_is_named():
    from tests._faulty_agents import slow_tool

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    def unprintable(expression):
        raise Unprintable

    runner = ToolRunner({"calculator": slow_tool, "unprintable": unprintable}, timeout_s=0.2)
    args = json.dumps({"expression": "1"})
    messages = runner.run_sync([call("calculator", args), call("unprintable", args, "c2")])
    assert messages[0]["content"] == "Error: the tool did not answer within 0.2 s"
    assert messages[1]["content"] == "Error: Unprintable: <its str() raised>"
    (message,) = asyncio.run(runner.run([call("unprintable", args)]))
    assert message["content"] == "Error: Unprintable: <its str() raised>"


def test_a_tool_past_its_timeout_holds_neither_the_loops_executor_nor_the_exit(tmp_path):
    """A plain tool ran in the loop's shared default executor: a few hung ones queued the
    weight write behind them, and the process could not exit. Each now has a daemon thread
    of its own: the default executor stays free and the process exits."""
    import subprocess
    import sys

    script = tmp_path / "hung_tools.py"
    script.write_text(
        "import asyncio, json, threading\n"
        "from areal_jax.rollout.tools import ToolRunner\n"
        "from tests._faulty_agents import blocking_tool\n"
        "runner = ToolRunner({'calculator': blocking_tool}, timeout_s=0.05)\n"
        "call = {'id': 'c', 'function': {'name': 'calculator',\n"
        "        'arguments': json.dumps({'expression': '1'})}}\n"
        "async def main():\n"
        "    out = await asyncio.gather(*(runner.run([call]) for _ in range(40)))\n"
        "    loop = asyncio.get_running_loop()\n"  # the default executor is free
        "    write = await asyncio.wait_for(loop.run_in_executor(None, lambda: 'written'), 60)\n"
        "    return out[0][0]['content'], write\n"
        "print(*asyncio.run(main()), sep='|', flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path),
                          env={**__import__("os").environ,
                               "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "Error: the tool did not answer within 0.05 s|written"


@pytest.mark.parametrize("agent, culprit", [
    ("exits", "agent tests._faulty_agents:exits failed: SystemExit (sys.exit(3))"),
    ("exits_in_thread", "agent tests._faulty_agents:exits_in_thread failed: SystemExit "
                        "(sys.exit(4))"),
    ("interrupts", "agent tests._faulty_agents:interrupts failed: KeyboardInterrupt"),
    ("cancels_itself", "agent tests._faulty_agents:cancels_itself failed: it raised "
                       "CancelledError itself"),
    ("calls_an_exiting_tool", "tool 'calculator' raised SystemExit (sys.exit(5))"),
])
def test_an_agent_or_tool_that_exits_fails_its_episode_by_name(server, tok, agent, culprit,
                                                               caplog):
    """Issue 50 item 6: sys.exit or KeyboardInterrupt in an agent or a tool ended the
    executor's loop silently; now the episode fails with a line naming the culprit, the
    loop lives on, and the failed episodes' turns are still counted."""
    workflow = AgenticWorkflow(f"tests._faulty_agents:{agent}", n_samples=2, gconfig=GREEDY,
                               tokenizer=tok, max_turns=3, max_total_tokens=128)
    group, counts = run_workflow(workflow, server.url, tok, ITEM, seed=1, group_id="g3")
    assert group is None and counts["agent_failed_groups"] == 1
    assert culprit in caplog.text
    assert counts["agent_turns"] == 2  # one call each, although the episodes failed


def test_eval_ends_a_hanging_or_exiting_agent_and_counts_its_turns(server, tok):
    """Issue 50 items 6 and 7: in eval (which has no progress watchdog) an agent that hangs
    waited forever and one that calls sys.exit ended the loop; now each episode ends by
    rollout.episode_timeout_s or its failure, counts as failed, and its turns count."""
    from areal_jax.rewards.pool import RewardPool
    from areal_jax.rollout.evaluate import evaluate_workflow
    from tests._faulty_agents import RELEASE

    items = [{"prompt_id": "e0", "prompt": "Q:3+4=", "answer": "7"}]
    hanging = AgenticWorkflow("tests._faulty_agents:hangs_ignoring_cancellation", n_samples=2,
                              gconfig=GREEDY, tokenizer=tok, max_turns=3, max_total_tokens=128)
    threaded = AgenticWorkflow("tests._faulty_agents:hangs_in_thread", n_samples=1,
                               gconfig=GREEDY, tokenizer=tok, max_turns=3, max_total_tokens=128)
    exiting = AgenticWorkflow("tests._faulty_agents:exits_in_thread", n_samples=2,
                              gconfig=GREEDY, tokenizer=tok, max_turns=3, max_total_tokens=128)
    pool = RewardPool(num_workers=1)

    async def go():
        async with RolloutClient([server.url]) as client:
            results = [await evaluate_workflow(client, items, wf, tokenizer=tok,
                                               reward_pool=pool, episode_timeout_s=limit,
                                               seed=seed)
                       for seed, (wf, limit) in enumerate(((hanging, 10.0), (threaded, 10.0),
                                                           (exiting, 0.0)))]
            RELEASE.set()  # the abandoned episodes may end now (asyncio.run waits for them)
            return results

    try:
        hung, hung_thread, exited = asyncio.run(go())
    finally:
        RELEASE.set()
        for wf in (hanging, threaded, exiting):
            wf.close()
        pool.close()
    for result in (hung, hung_thread):
        assert result["failed_groups"] == 1 and result["episode_timeouts"] == 1
        assert result["accuracy"] == 0.0
    assert exited["failed_groups"] == 1 and exited["episode_timeouts"] == 0
    assert exited["agent_turns"] == 2  # failed episodes' turns are counted
