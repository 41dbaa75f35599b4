"""Worked example agents for :class:`areal_jax.rollout.agent.AgenticWorkflow`.

``arith_retry_agent`` solves the built-in arithmetic task with retry-with-feedback: it asks
the model through the OpenAI completions API; if the answer is wrong it shows the model
its failed attempt, closed by ``<eos>``, and the question again, up to ``max_attempts``
times. The reward is 1 for a right first answer, 1/k for a right k-th one, else 0, so
the policy is pushed to be right early. The trajectory is one sequence: the question, each
attempt (trained on) and the re-asked questions between them (not trained on).

    rollout:
      workflow: agent
      agent: areal_jax.rollout.agent_examples:arith_retry_agent
      max_turns: 2

``arith_calculator_agent`` gives the model a ``calculator`` tool through the chat API's
``tools`` and must call it (configs/arith_tools.yaml, with the ``builtin:arith_tools``
checkpoint, whose chat template writes calls in the task's vocabulary).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

from areal_jax.rewards.builtin import builtin_reward
from areal_jax.rollout.tools import ToolRunner

if TYPE_CHECKING:  # the agent extra's SDK; imported for real inside the agent
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam


async def arith_retry_agent(base_url: str, item: dict[str, Any], *, max_attempts: int = 2,
                            max_tokens: int = 48) -> float:
    import openai

    question = item["prompt"]
    prompt = question
    # Generous timeouts: under load a request may queue behind many others at the server.
    timeout = openai.Timeout(600.0, connect=60.0)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                  timeout=timeout) as client:
        for attempt in range(max_attempts):
            reply = await client.completions.create(model="policy", prompt=prompt,
                                                    max_tokens=max_tokens)
            text = reply.choices[0].text
            if builtin_reward(text, item["answer"]) > 0:
                return 1.0 / (attempt + 1)
            prompt = prompt + text + "<eos>" + question  # the feedback: "that was wrong, again"
    return 0.0


# ---------------------------------------------------------------------- tool calls
CALCULATOR_TOOL: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluates a chain of integer additions and subtractions, e.g. 17+5-8.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
_EXPRESSION_RE = re.compile(r"\d+([+-]\d+)*")


def calculator(expression: str) -> str:
    """The tool: the value of ``17+5-8``-style expressions, "" for anything else."""
    if not isinstance(expression, str) or not _EXPRESSION_RE.fullmatch(expression):
        return ""
    return str(sum(int(t) for t in re.findall(r"[+-]?\d+", expression)))


async def arith_calculator_agent(base_url: str, item: dict[str, Any], *, max_calls: int = 2,
                                 max_tokens: int = 24, max_result_chars: int = 32,
                                 tools: dict[str, Any] | None = None) -> float:
    """Solves the built-in task with a calculator tool it must call, through the OpenAI
    chat API's ``tools``: the model's calls are run by a :class:`ToolRunner` (a failing
    tool's error and a long result, truncated to ``max_result_chars``, are what the model
    reads) and sent back as ``tool`` messages until it answers. Reward 1 for a right
    ``A:<n>`` after at least one call, else 0; an episode that outgrows the context ends
    with 0. ``tools`` replaces the calculator's implementation (name -> callable)."""
    import openai

    runner = ToolRunner(tools or {"calculator": calculator}, max_result_chars=max_result_chars)
    messages: list[dict[str, Any]] = [{"role": "user", "content": item["prompt"]}]
    called = False
    timeout = openai.Timeout(600.0, connect=60.0)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                  timeout=timeout) as client:
        for _ in range(max_calls + 1):
            try:
                reply = await client.chat.completions.create(
                    model="policy", messages=cast("list[ChatCompletionMessageParam]", messages),
                    tools=[CALCULATOR_TOOL],
                    max_tokens=max_tokens)
            except openai.BadRequestError as e:
                body = e.body if isinstance(e.body, dict) else {}
                if body.get("code") == "context_length_exceeded":
                    return 0.0  # the conversation no longer fits: the episode ends here
                raise
            message = reply.choices[0].message
            if not message.tool_calls:
                right = builtin_reward(message.content or "", item["answer"]) > 0
                return 1.0 if called and right else 0.0
            called = True
            messages.append(message.model_dump(exclude_none=True))
            messages += await runner.run(message.tool_calls)
    return 0.0
