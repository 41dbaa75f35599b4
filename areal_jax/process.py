"""What a training process does around the loop: exit codes, SIGINT/SIGTERM and the
shutdown deadline. A leaf: it imports no jax and nothing of the run, so scripts/train.py
installs the handlers first thing (the entry point, ``main_guarded``, is ``run.py``'s).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from typing import Any

from areal_jax.interrupt import (
    Interrupted,
    interrupt_requested,
    request_interrupt,
    wait_for_interrupt,
)

__all__ = ["EXIT_CODES", "LIVE_SERVERS", "Interrupted", "arm_shutdown_deadline",
           "install_signal_handlers", "is_peer_gone"]

# scripts/train.py's exit status (docs/training.md, "When things go wrong").
EXIT_CODES = {
    "done": 0,
    "crash": 1,  # an unexpected error (a traceback)
    "bad_input": 2,  # config or input error, found before training starts
    "stopped": 3,  # the run could not go on: no progress, non-finite loss, failed weight update
    "shutdown_timeout": 4,  # shutdown took longer than watchdog.shutdown_timeout_s
}  # and 128 + signal number after SIGINT (130) or SIGTERM (143)


LIVE_SERVERS: list[Any] = []  # embedded servers of the running trainer (for a hard exit)


def _hard_exit(code: int, why: str) -> None:
    """Kills the embedded servers and leaves at once (no cleanup handlers run)."""
    with contextlib.suppress(OSError):  # may run in a signal handler: no print
        os.write(2, f"{why}; exiting now with status {code}\n".encode())
    for handle in list(LIVE_SERVERS):
        with contextlib.suppress(Exception):
            handle.kill()
    os._exit(code)


_deadline_lock = threading.Lock()
_deadline_armed = False


def arm_shutdown_deadline(seconds: float, code: int) -> None:
    """From now on the process has ``seconds`` to exit; then it kills its servers and exits
    with ``code``. Idempotent: the first call sets the deadline."""
    global _deadline_armed
    with _deadline_lock:
        if _deadline_armed:
            return
        _deadline_armed = True
    timer = threading.Timer(seconds, _hard_exit,
                            (code, f"shutdown took longer than {seconds:g}s "
                                   "(watchdog.shutdown_timeout_s)"))
    timer.daemon = True
    timer.start()


_shutdown_timeout_s = [120.0]  # the run's watchdog.shutdown_timeout_s, once its config is read


def install_signal_handlers(shutdown_timeout_s: float | None = None) -> None:
    """SIGINT and SIGTERM: the first only records the request (``interrupt.py``); the
    main thread raises :class:`Interrupted` at its next safe point, and the graceful
    shutdown is bounded by ``shutdown_timeout_s``. A second signal exits at once.
    Idempotent: scripts/train.py installs them first thing, and again with the
    config's timeout."""
    if shutdown_timeout_s is not None:
        _shutdown_timeout_s[0] = shutdown_timeout_s
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        # Only os.write and recording here: the main thread may be anywhere (inside a GC
        # callback, a write to sys.stderr, a lock), so no exception, print or lock.
        name = signal.Signals(signum).name
        if received:
            _hard_exit(128 + signum, f"second signal ({name})")
        received.append(signum)
        request_interrupt(signum)
        with contextlib.suppress(OSError):
            os.write(2, f"{name}: stopping (servers, executor, files; at most "
                        f"{_shutdown_timeout_s[0]:g}s); send it again to exit at once\n".encode())

    current = signal.getsignal(signal.SIGINT)
    if getattr(current, "_areal_jax", False):
        return
    handler._areal_jax = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)

    def arm_on_request() -> None:  # the deadline's timer starts outside the handler
        wait_for_interrupt()
        signum = interrupt_requested() or signal.SIGTERM
        arm_shutdown_deadline(_shutdown_timeout_s[0], 128 + signum)

    threading.Thread(target=arm_on_request, name="signal-deadline", daemon=True).start()


# What a collective (gloo on CPU; NCCL, ICI elsewhere) says when another process is gone.
_PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Gloo [\w -]+? failed")


def is_peer_gone(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another process of the job is gone."""
    return bool(_PEER_GONE.search(str(e)))
