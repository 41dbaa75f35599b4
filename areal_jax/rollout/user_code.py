"""Running user code (agents, tools, workflows) so that nothing it does can stop or hang the
loop that runs it.

- ``SystemExit``/``KeyboardInterrupt`` raised inside an asyncio task escape the event loop
  itself (``run_until_complete`` re-raises them) and ended the rollout executor's loop:
  they become :class:`Escaped`, an ordinary error naming what was raised.
- ``asyncio.CancelledError`` raised by user code of its own accord (nobody cancelled the
  task: :func:`is_own_cancellation` is False) is a failure too, not a cancellation.
- Blocking user code runs in a daemon thread of its own (:func:`run_in_daemon_thread`),
  never in the loop's shared default executor, whose few threads a hung tool would hold
  (weight writes queued behind them, the process unable to exit).
- A deadline is enforced without waiting for a task that ignores its cancellation
  (:func:`wait_abandoning`).

Imports nothing of this package.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """A deadline set by :func:`wait_abandoning` passed (not a TimeoutError of the code)."""


class Escaped(RuntimeError):
    """User code (an agent, a tool, a workflow) raised ``SystemExit``, ``KeyboardInterrupt``
    or ``asyncio.CancelledError`` of its own: an ordinary error naming what it raised."""


def describe_error(error: BaseException) -> str:
    """``"Type: message"``, even when the exception's ``__str__`` raises; ``sys.exit(n)``
    reads as such."""
    if isinstance(error, SystemExit):
        return f"SystemExit (sys.exit({error.code!r}))"
    try:
        text = str(error)
    except BaseException:  # noqa: BLE001 - a hostile __str__
        text = "<its str() raised>"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def escaped(error: BaseException, who: str) -> Escaped:
    """``error`` (raised by ``who``, e.g. ``"agent mod:fn"``) as an :class:`Escaped`."""
    return Escaped(f"{who} raised {describe_error(error)}")


def is_own_cancellation() -> bool:
    """Whether the current task is being cancelled by someone (a deadline, a shutdown), as
    opposed to user code having raised ``CancelledError`` itself."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def run_in_daemon_thread(fn: Callable[..., T], *args: Any, name: str = "user-code",
                               **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a daemon thread of its own, with this context's
    contextvars. Unlike ``asyncio.to_thread`` it never takes a thread of the loop's shared
    default executor, so a call that never returns blocks nothing else and not the
    process's exit; cancelling the await abandons the thread. What ``fn`` raises is raised
    here; ``SystemExit``, ``KeyboardInterrupt`` and ``CancelledError`` as :class:`Escaped`."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[tuple[bool, Any]] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not future.done():
            future.set_result(outcome)

    def target() -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, context.run(fn, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (False, e)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop has closed: nobody waits for it any more
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    ok, value = await future
    if ok:
        return value
    if isinstance(value, Exception):
        raise value
    raise escaped(value, getattr(fn, "__qualname__", repr(fn))) from value


async def wait_abandoning(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """``await awaitable`` for at most ``timeout_s`` (DeadlineExceeded after), without waiting
    for a task that ignores its cancellation: it is cancelled and left behind (its outcome
    is collected, so nothing logs "Task exception was never retrieved")."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_collect)
        raise
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(_collect)
    raise DeadlineExceeded(f"not done within {timeout_s} s")


def _collect(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


