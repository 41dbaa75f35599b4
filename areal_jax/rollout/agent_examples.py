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
"""

from __future__ import annotations

from typing import Any

from areal_jax.rewards.builtin import builtin_reward


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
