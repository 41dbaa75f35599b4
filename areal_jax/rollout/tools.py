"""Running an agent's tool calls: the ``tool`` messages an OpenAI chat agent sends back.

    runner = ToolRunner({"calculator": calculator}, max_result_chars=256)
    reply = await client.chat.completions.create(..., tools=[CALCULATOR_TOOL])
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    messages += await runner.run(message.tool_calls)

A tool fails as agent frameworks let tools fail: the episode goes on and the model reads
what went wrong as the tool's result. For each call:

- arguments that are not a JSON object, an unknown function, or a tool that raises give
  ``Error: ...`` as the result (at most ``max_error_chars`` characters);
- a result that is not a string (a number, None, a dict, a list) is sent as JSON text
  (``null``, ``{"a": 1}``); what JSON cannot hold is written with ``str``;
- a result longer than ``max_result_chars`` keeps its head and ends with
  ``...[truncated: N of M characters]``, so one huge result cannot fill the context;
- with ``timeout_s``, a tool that takes longer is answered with an error, in ``run`` and
  ``run_sync`` alike. A plain tool runs in a daemon thread of its own (never the event
  loop's shared default executor), which is left to finish on its own: a hung tool holds
  neither other work of the loop (a weight write) nor the process's exit; an async tool
  that ignores its cancellation is left behind the same way;
- an exception whose ``str()`` itself raises is named by its type.

A tool that calls ``sys.exit`` or raises ``KeyboardInterrupt`` or ``asyncio.CancelledError``
is not a failing tool but a broken one: the runner raises :class:`ToolFault` naming the
tool, and the agentic workflow fails the episode with that line even if the agent swallows
the exception (the run's loop goes on).

Inside an :class:`areal_jax.rollout.agent.AgenticWorkflow` episode the runner counts its
calls, errors and truncations; the workflow adds them to the trajectory's ``info`` and the
run's metrics (``tool_calls``, ``tool_errors``, ``tool_results_truncated``).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from areal_jax.rollout.user_code import (
    DeadlineExceeded,
    Escaped,
    describe_error,
    is_own_cancellation,
    run_in_daemon_thread,
    wait_abandoning,
)

TRUNCATED = "...[truncated: {shown} of {total} characters]"
TOOL_COUNTS = ("tool_calls", "tool_errors", "tool_results_truncated")
_EPISODE: contextvars.ContextVar[Counter[str] | None] = contextvars.ContextVar(
    "areal_tool_counts", default=None)
_FAULTS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "areal_tool_faults", default=None)


class ToolFault(Escaped):
    """A tool called ``sys.exit`` or raised ``KeyboardInterrupt``/``CancelledError``."""


@contextmanager
def counting_tools() -> Iterator[Counter[str]]:
    """Counts the tool calls that runners make in this context (the agentic workflow opens
    one per episode; a plain agent's thread inherits it). :func:`tool_faults` holds the
    context's broken tools (see :class:`ToolFault`)."""
    counts: Counter[str] = Counter()
    token = _EPISODE.set(counts)
    faults = _FAULTS.set([])
    try:
        yield counts
    finally:
        _FAULTS.reset(faults)
        _EPISODE.reset(token)


def tool_faults() -> list[str]:
    """The :class:`ToolFault` messages raised in this :func:`counting_tools` context."""
    return list(_FAULTS.get() or ())


def _fault(call_name: str, error: BaseException) -> ToolFault:
    fault = ToolFault(f"tool {call_name!r} raised {describe_error(error)}")
    _count("tool_errors")
    faults = _FAULTS.get()
    if faults is not None:
        faults.append(str(fault))
    return fault


def _count(name: str) -> None:
    counts = _EPISODE.get()
    if counts is not None:
        counts[name] += 1


def as_text(text: str) -> str:
    """``text`` as valid Unicode (encodable as UTF-8, so it can be sent in the next request):
    a file name decoded with ``os.fsdecode`` (``b"report-\\xff.txt"`` -> ``"report-\\udcff.txt"``)
    shows its undecodable bytes as ``\\xff``; any other lone surrogate as ``\\ud800``."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _bounded(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    marker = TRUNCATED.format(shown=limit, total=len(text))
    return text[:limit] + marker, True


async def _awaited(value: Awaitable[Any]) -> Any:
    """Any awaitable as a coroutine (``asyncio.run`` takes only coroutines)."""
    return await value


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


class ToolRunner:
    """Runs tool calls against ``tools`` (function name -> callable taking the call's
    arguments as keywords; plain or async) and returns the ``tool`` messages."""

    def __init__(self, tools: dict[str, Callable[..., Any]], *, max_result_chars: int = 4096,
                 max_error_chars: int = 512, timeout_s: float | None = None) -> None:
        if max_result_chars < 1 or max_error_chars < 1:
            raise ValueError(f"ToolRunner needs max_result_chars >= 1 and max_error_chars >= 1, "
                             f"got {max_result_chars} and {max_error_chars}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"ToolRunner timeout_s must be > 0 or None, got {timeout_s}")
        self.tools = dict(tools)
        self.max_result_chars, self.max_error_chars = max_result_chars, max_error_chars
        self.timeout_s = timeout_s

    def result_text(self, value: Any) -> str:
        """A tool's return value as the ``tool`` message's content (JSON text unless it is
        a string), truncated to ``max_result_chars`` with the marker."""
        if isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value, ensure_ascii=False, default=str)
            except (ValueError, TypeError, RecursionError):  # cycles, odd keys, deep nesting
                text = str(value)
        text, truncated = _bounded(text, self.max_result_chars)
        if truncated:
            _count("tool_results_truncated")
        return text

    def error_text(self, error: str | BaseException) -> str:
        """The result of a call that failed: ``Error: ...``, bounded."""
        if isinstance(error, BaseException):
            error = describe_error(error)
        _count("tool_errors")
        return _bounded(f"Error: {error}", self.max_error_chars)[0]

    def _prepare(self, call: Any) -> tuple[Callable[..., Any] | None, dict[str, Any], str]:
        """(tool, keyword arguments, error): the error is "" when the call can run."""
        fn = _field(call, "function")
        name, raw = _field(fn, "name"), _field(fn, "arguments")
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return None, {}, (f"unknown tool {name!r}; the tools are "
                              f"{', '.join(sorted(self.tools)) or 'none'}")
        try:
            args = json.loads(raw) if isinstance(raw, str) and raw.strip() else (raw or {})
        except (ValueError, RecursionError) as e:
            return None, {}, f"the arguments of {name} are not valid JSON ({e})"
        if not isinstance(args, dict):
            return None, {}, f"the arguments of {name} must be a JSON object, got {raw!r}"
        return tool, args, ""

    def _message(self, call: Any, content: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": _field(call, "id"), "content": as_text(content)}

    async def run_one(self, call: Any) -> dict[str, Any]:
        """The ``tool`` message answering one call (an OpenAI ``tool_calls`` entry, as the
        client's object or a dict). A plain tool runs in a thread."""
        _count("tool_calls")
        tool, args, error = self._prepare(call)
        if tool is None:
            return self._message(call, self.error_text(error))
        name = _field(_field(call, "function"), "name")
        assert tool is not None

        async def call_tool() -> Any:
            try:
                if inspect.iscoroutinefunction(tool):
                    return await tool(**args)
                return await run_in_daemon_thread(_plain_call, tool, args, name=f"tool-{name}")
            except (KeyboardInterrupt, SystemExit, Escaped) as e:
                raise _fault(name, e.__cause__ if isinstance(e, Escaped) and e.__cause__
                             else e) from e

        try:
            value = await wait_abandoning(call_tool(), self.timeout_s)
        except DeadlineExceeded:
            return self._message(call, self.error_text(
                f"the tool did not answer within {self.timeout_s} s"))
        except asyncio.CancelledError as e:
            if is_own_cancellation():
                raise
            raise _fault(name, e) from None
        except ToolFault:
            raise
        except Exception as e:  # noqa: BLE001 - a failing tool is the model's to read
            return self._message(call, self.error_text(e))
        return self._message(call, self.result_text(value))

    async def run(self, calls: Iterable[Any] | None) -> list[dict[str, Any]]:
        """The ``tool`` messages for a reply's calls, in order (run one after another)."""
        return [await self.run_one(call) for call in calls or ()]

    def run_sync(self, calls: Iterable[Any] | None) -> list[dict[str, Any]]:
        """:meth:`run` for plain (non-async) agents; async tools are run to completion."""
        out = []
        for call in calls or ():
            _count("tool_calls")
            tool, args, error = self._prepare(call)
            if tool is None:
                out.append(self._message(call, self.error_text(error)))
                continue
            name = _field(_field(call, "function"), "name")
            try:
                value = self._call_in_thread(tool, args, name)
            except DeadlineExceeded:
                out.append(self._message(call, self.error_text(
                    f"the tool did not answer within {self.timeout_s} s")))
                continue
            except (KeyboardInterrupt, SystemExit, asyncio.CancelledError) as e:
                raise _fault(name, e) from None
            except Exception as e:  # noqa: BLE001 - a failing tool is the model's to read
                out.append(self._message(call, self.error_text(e)))
                continue
            out.append(self._message(call, self.result_text(value)))
        return out

    def _call_in_thread(self, tool: Callable[..., Any], args: dict[str, Any], name: str
                        ) -> Any:
        """``tool(**args)`` (an async tool run to completion) for ``run_sync``: without a
        timeout in this thread; with one in a daemon thread of its own, left behind when
        it runs past (DeadlineExceeded)."""
        if self.timeout_s is None:
            return _plain_call(tool, args)
        box: list[tuple[bool, Any]] = []
        context = contextvars.copy_context()

        def target() -> None:
            try:
                box.append((True, context.run(_plain_call, tool, args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box.append((False, e))

        thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not box:
            raise DeadlineExceeded(f"not done within {self.timeout_s} s")
        ok, value = box[0]
        if ok:
            return value
        raise value


def _plain_call(tool: Callable[..., Any], args: dict[str, Any]) -> Any:
    """A tool called from a thread: a coroutine it returns is run to completion there."""
    value = tool(**args)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return value
