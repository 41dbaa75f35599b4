"""A SIGINT/SIGTERM request to stop, recorded by the signal handler and acted on at safe
points (``process.install_signal_handlers`` records it; the loop and every blocking wait
of the main thread call :func:`raise_if_interrupted`).

A signal handler never raises: Python runs it between any two bytecodes of the main
thread, including inside a garbage-collector callback or a ``__del__``, where an
exception is printed as "Exception ignored" and thrown away (the run then went on
training). Imports nothing of this package, so any room may check it.
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from typing import Any

__all__ = ["Interrupted", "interrupt_requested", "raise_if_interrupted", "request_interrupt",
           "wait_for_interrupt", "wait_future"]

POLL_S = 0.1  # how often a blocking wait looks at the request


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: the run shuts down gracefully."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_requested = threading.Event()
_signum: list[int] = []  # the first signal received
_raised = threading.Event()  # Interrupted has been raised once: the shutdown is under way


def request_interrupt(signum: int) -> None:
    """Records a stop request (safe in a signal handler: no lock, no exception)."""
    if not _signum:
        _signum.append(signum)
    _requested.set()


def interrupt_requested() -> int | None:
    """The signal number of a pending stop request, else None."""
    return _signum[0] if _requested.is_set() and _signum else None


def wait_for_interrupt(timeout: float | None = None) -> bool:
    """Blocks (another thread than main) until a stop is requested; False on timeout."""
    return _requested.wait(timeout)


def raise_if_interrupted() -> None:
    """A safe point: raises :class:`Interrupted` once, in the main thread, after a stop
    request. Later calls (the shutdown's own waits, bounded by its deadline) return."""
    if (not _requested.is_set() or _raised.is_set()
            or threading.current_thread() is not threading.main_thread()):
        return
    _raised.set()
    raise Interrupted(_signum[0])


def wait_future(future: concurrent.futures.Future, timeout: float | None = None) -> Any:
    """``future.result(timeout)``, checking for a stop request while it waits."""
    if threading.current_thread() is threading.main_thread():
        deadline = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            raise_if_interrupted()
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                break
            concurrent.futures.wait([future], timeout=left)
        timeout = None if deadline is None else 0
    return future.result(timeout)


def reset_for_tests() -> None:
    """Forgets a recorded request (tests that run several interrupted loops in-process)."""
    _signum.clear()
    _requested.clear()
    _raised.clear()
