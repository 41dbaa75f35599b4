"""Agents and tools that misbehave, for fault-injection tests of the agentic workflow, the
tool runner, the executor and eval (issue 50): each makes one model call (so the episode has
turns to count), then exits, interrupts, cancels itself or hangs."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import openai

from areal_jax.rollout.agent_examples import arith_calculator_agent

RELEASE = threading.Event()  # ends the hanging agents and tools (a test sets it when done)


async def _one_call(base_url: str, item: dict) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        await client.chat.completions.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": item["prompt"]}])


def _one_call_sync(base_url: str, item: dict) -> None:
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        client.chat.completions.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": item["prompt"]}])


async def exits(base_url: str, item: dict) -> float:
    await _one_call(base_url, item)
    sys.exit(3)


def exits_in_thread(base_url: str, item: dict) -> float:
    """A plain agent: it runs in a thread."""
    _one_call_sync(base_url, item)
    sys.exit(4)


async def interrupts(base_url: str, item: dict) -> float:
    await _one_call(base_url, item)
    raise KeyboardInterrupt


async def cancels_itself(base_url: str, item: dict) -> float:
    await _one_call(base_url, item)
    raise asyncio.CancelledError()


def hangs_in_thread(base_url: str, item: dict) -> float:
    """A plain agent that never answers (until RELEASE)."""
    _one_call_sync(base_url, item)
    RELEASE.wait(600)
    return 1.0


async def hangs_ignoring_cancellation(base_url: str, item: dict) -> float:
    await _one_call(base_url, item)
    while not RELEASE.is_set():
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass
    return 1.0


def exiting_tool(expression: str) -> str:
    sys.exit(5)


def blocking_tool(expression: str) -> str:
    """Never answers in time (until RELEASE)."""
    RELEASE.wait(600)
    return "14"


def slow_tool(expression: str) -> str:
    time.sleep(5)
    return "14"


async def calls_an_exiting_tool(base_url: str, item: dict) -> float:
    """The calculator agent whose calculator calls sys.exit."""
    return await arith_calculator_agent(base_url, item, tools={"calculator": exiting_tool})
