"""The HTTP calls of model-judged rewards and of the distillation teacher: JSON POSTs to a
model server, with a per-event-loop aiohttp session and concurrency limit.

A session and a semaphore belong to one event loop; :class:`LoopSessions` keeps one pair per
loop (the executor's loop, an eval's, a test's), so one reward object serves them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import weakref
from typing import Any

import aiohttp


class ModelServerError(RuntimeError):
    """A model server answered with an error or could not be reached. ``retryable``:
    worth another try (connection lost, 429, 5xx); a 4xx otherwise is the request's fault."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def base_url(url: str) -> str:
    """``host:port``, ``http://host:port/`` or ``.../v1`` -> ``http://host:port`` (routes are
    appended to it)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url[: -len("/v1")] if url.endswith("/v1") else url


class LoopSessions:
    """One aiohttp session and one ``asyncio.Semaphore(limit)`` per running event loop."""

    def __init__(self, limit: int, api_key: str | None = None) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {limit}")
        self.limit = limit
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self._by_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary())

    def get(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        with self._lock:
            pair = self._by_loop.get(loop)
            if pair is None or pair[0].closed:
                session = aiohttp.ClientSession(
                    headers=self.headers, connector=aiohttp.TCPConnector(limit=self.limit))
                pair = (session, asyncio.Semaphore(self.limit))
                self._by_loop[loop] = pair
            return pair

    def close(self) -> None:
        """Closes each session on its own loop (a loop that has ended is skipped)."""
        with self._lock:
            pairs = list(self._by_loop.items())
            self._by_loop.clear()
        for loop, (session, _) in pairs:
            if loop.is_closed() or session.closed:
                continue
            with contextlib.suppress(RuntimeError):
                if loop.is_running():
                    fut = asyncio.run_coroutine_threadsafe(session.close(), loop)
                    with contextlib.suppress(Exception):
                        fut.result(5.0)
                else:
                    loop.run_until_complete(session.close())


async def post_json(sessions: LoopSessions, url: str, route: str, body: dict[str, Any],
                    timeout_s: float) -> Any:  # a server's JSON, checked by the caller: Any
    """POST ``body`` to ``base_url(url) + route``; the decoded JSON reply. Raises TimeoutError
    past ``timeout_s`` (the wait for a concurrency slot not counted) and ModelServerError for
    an HTTP error, a lost connection or a reply that is not JSON."""
    session, limit = sessions.get()
    target = base_url(url) + route
    async with limit:
        try:
            async with asyncio.timeout(timeout_s):
                async with session.post(target, json=body) as resp:
                    raw = await resp.read()
                    status = resp.status
        except TimeoutError:
            raise
        except (aiohttp.ClientError, OSError) as e:
            raise ModelServerError(f"{target}: {type(e).__name__}: {e}", retryable=True) from None
    if status != 200:
        text = raw.decode("utf-8", errors="replace")[:200]
        raise ModelServerError(f"{target} answered HTTP {status}: {text}",
                               retryable=status == 429 or status >= 500)
    try:
        return json.loads(raw)
    except ValueError:
        raise ModelServerError(f"{target} answered with something that is not JSON: "
                               f"{raw[:120]!r}", retryable=True) from None
