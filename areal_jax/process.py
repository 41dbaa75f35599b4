"""What a training process does around the loop: exit codes, SIGINT/SIGTERM, the
shutdown deadline, and one-line errors instead of tracebacks (``main_guarded``, the
entry point of scripts/train.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from areal_jax.interrupt import (
    Interrupted,
    interrupt_requested,
    request_interrupt,
    wait_for_interrupt,
)

if TYPE_CHECKING:  # imports nothing heavy: scripts/train.py installs the handlers first thing
    from areal_jax.config import TrainConfig

__all__ = ["EXIT_CODES", "LIVE_SERVERS", "Interrupted", "arm_shutdown_deadline",
           "install_signal_handlers", "main_guarded"]

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


def main_guarded(cfg: TrainConfig, resume: bool | None) -> int:
    """Entry point used by scripts/train.py: runs training and returns its exit status
    (``EXIT_CODES``; 128 + signal number after SIGINT/SIGTERM). Errors for users are
    printed as one line, never a traceback. With several processes, a process that fails
    tells the others (which exit at once with status 1) and exits without waiting in
    JAX's shutdown barrier."""
    from areal_jax.parallel import job_guard

    code, message = _run_for_status(cfg, resume)
    guard = job_guard()
    if guard is not None:
        if code == EXIT_CODES["done"]:
            guard.done()
        else:
            guard.fail(message, code)  # does not return
    return code


# What a collective (gloo on CPU; NCCL, ICI elsewhere) says when another process is gone.
_PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Gloo [\w -]+? failed")


def is_peer_gone(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another process of the job is gone."""
    return bool(_PEER_GONE.search(str(e)))


def _lost_peer_message(e: BaseException, guard: Any) -> str | None:
    """One line for a collective that failed because another process of the job died (a
    bare traceback from deep inside XLA before), naming the peer; None for other errors."""
    text = " ".join(str(e).split())
    if not is_peer_gone(e):
        return None
    peers = guard.silent_peers(wait_s=3 * guard.interval_s + 1.0)
    who = (f"process {', '.join(map(str, peers))} of this job is gone" if peers
           else "another process of this job is gone")
    return (f"error: {who} (a collective of process {guard.process_id} failed: "
            f"{type(e).__name__}: {text[:200]}). Look in {'its' if len(peers) == 1 else 'their'} "
            "log for why it ended, then restart every process of the job: the run resumes "
            "from its last checkpoint")


def _run_for_status(cfg: TrainConfig, resume: bool | None) -> tuple[int, str]:
    from areal_jax.parallel import job_guard
    from areal_jax.run_inputs import TrainerError
    from areal_jax.trainer import RunStopped, run_training

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threading.current_thread() is threading.main_thread():
        install_signal_handlers(cfg.watchdog.shutdown_timeout_s)
    try:
        run_training(cfg, resume, exit_deadline=True)
    except Interrupted as e:
        saved = " (and a checkpoint of this version)" if cfg.checkpoint.on_interrupt else ""
        message = (f"interrupted by {signal.Signals(e.signum).name}: servers, executor and files "
                   f"closed; the last completed checkpoint is kept{saved}")
        code = 128 + e.signum
    except RunStopped as e:
        message, code = f"stopped: {e}", EXIT_CODES["stopped"]
    except TrainerError as e:
        message, code = f"error: {e}", EXIT_CODES["bad_input"]
    except Exception as e:  # with several processes the others must hear of it
        guard = job_guard()
        if guard is None:
            raise
        lost = _lost_peer_message(e, guard)
        if lost:
            message, code = lost, EXIT_CODES["crash"]
        else:
            import traceback

            traceback.print_exc()
            message, code = f"error: {type(e).__name__}: {e}", EXIT_CODES["crash"]
    else:
        return EXIT_CODES["done"], ""
    print(message, file=sys.stderr, flush=True)
    return code, message
