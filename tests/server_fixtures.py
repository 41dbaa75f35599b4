"""Engine servers for the tests: one shared compilation cache per test session (servers
of the same shapes compile once), and an HTTP client that sends the API key."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from areal_jax.engine.launch import ServerHandle, launch_server, launch_servers


def shared_cache(tmp_path_factory: Any) -> Path:
    return tmp_path_factory.getbasetemp() / "engine_compilation_cache"


def start_server(model_dir: Any, tmp_path_factory: Any, **kwargs: Any) -> ServerHandle:
    """``launch_server`` with the session's compilation cache (use it as a context manager)."""
    return launch_server(model_dir, compilation_cache_dir=shared_cache(tmp_path_factory),
                         **kwargs)


def start_servers(model_dir: Any, count: int, tmp_path_factory: Any,
                  **kwargs: Any) -> list[ServerHandle]:
    """``launch_servers`` with the session's compilation cache."""
    return launch_servers(model_dir, count, compilation_cache_dir=shared_cache(tmp_path_factory),
                          **kwargs)


def http_client(url: str, api_key: str | None, timeout: float = 60.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url, timeout=timeout, headers=headers)


def run_workflow(workflow: Any, url: str, tok: Any, item: dict, *, seed: int = 5,
                 group_id: str = "g0", counts: Counter | None = None) -> tuple[Any, Counter]:
    """One group of ``workflow`` (an ``arun`` workflow, e.g. ``AgenticWorkflow``) on
    ``item`` against the server at ``url`` through a real ``RolloutClient``, then closes the
    workflow. Returns (what ``arun`` returned, the counts it reported)."""
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.workflows import WorkflowContext

    counts = Counter() if counts is None else counts

    async def go() -> Any:
        async with RolloutClient([url]) as client:
            ctx = WorkflowContext(start_version=0, seed=seed, group_id=group_id, tokenizer=tok,
                                  _count=lambda name, n: counts.update({name: n}))
            return await workflow.arun(client, item, ctx)

    try:
        return asyncio.run(go()), counts
    finally:
        workflow.close()
