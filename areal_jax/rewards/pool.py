"""A pool of reward worker processes with a per-call timeout that kills hung workers.

    pool = RewardPool(num_workers=2, timeout_s=5.0)
    reward = await pool.score(math_reward, completion_text, answer)   # float, or None
    reward = await pool.score("my_pkg.rewards:judge", text, answer)   # "module:function" works too

``score`` never raises for a bad sample: an exception in the reward function, a result
that is not a real finite number within ``[-max_abs, max_abs]`` (a string such as
``"1.0"`` included; bools count as 0/1), a worker that dies (segfault, ``os._exit``) or a call that
runs past ``timeout_s`` all give None and are counted in :meth:`RewardPool.metrics`.
The timeout covers the call itself; importing the function's module in a fresh worker
(at most ``startup_timeout_s``) is not counted against it, and an import that runs past
that limit is reported as such, not as the call's timeout.

Every request carries an id that its answers repeat, and a worker answers only from its
own process: a reward function that forks and returns (or raises) in the child too, as a
sandbox that fails before its ``os._exit`` does, has the child end silently when it comes
back, so one sample's reward can never reach another sample. An answer to another request
is treated as a crash (the worker is replaced).
A worker that times out is SIGKILLed and replaced. Reward functions must be picklable
(defined at module level) or given as ``"module:function"`` strings.

Workers are fresh interpreters (not forks), so they never inherit the JAX runtime or the
event-loop threads of the parent, and they die with it. They import reward functions by
module name, so a function defined in a script's ``__main__`` cannot be used: put it in a
module. The pool can be used from any event loop and thread.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from areal_jax.plugins import import_callable

if TYPE_CHECKING:  # annotations only: this room never loads the run config
    from areal_jax.config import RewardConfig

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float] | str


def resolve_reward_fn(spec: RewardFn) -> Callable[..., Any]:
    """A callable from a callable, a ``"module:function"`` string or a short name (``"math"``)."""
    if callable(spec):
        return spec
    from areal_jax.rewards import REWARD_FUNCTIONS

    if isinstance(spec, str) and spec in REWARD_FUNCTIONS:
        spec = REWARD_FUNCTIONS[spec]
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward function {spec!r} must be a callable, a 'module:function' "
                         f"string (e.g. 'areal_jax.rewards.math:math_reward') or one of "
                         f"{sorted(REWARD_FUNCTIONS)}")
    return import_callable(spec, "reward function")


DEFAULT_MAX_ABS = 1.0e6  # |reward| above this is a failure (RewardConfig.max_abs)


def check_reward_value(value: Any, max_abs: float = DEFAULT_MAX_ABS) -> float:
    """``value`` as a float if it is a real, finite number within ``[-max_abs, max_abs]``.

    Python and NumPy ints, floats and bools (and 0-d NumPy arrays of them) pass; strings,
    None, complex numbers, arrays with more than one element and anything else raise
    ValueError with a message that names what was returned.
    """
    import numbers

    if hasattr(value, "ndim") and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # 0-d NumPy / JAX arrays
    if isinstance(value, bool) or (isinstance(value, numbers.Real) and not isinstance(value, str)):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"reward {value!r} is not a usable number ({e})") from None
    else:
        raise ValueError(f"reward must be a real number (int, float or bool), got "
                         f"{type(value).__name__} {value!r:.80}")
    if not math.isfinite(number):
        raise ValueError(f"reward is not finite: {number}")
    if abs(number) > max_abs:
        raise ValueError(f"reward {number:g} is outside [-{max_abs:g}, {max_abs:g}] "
                         "(raise reward.max_abs if that is intended)")
    return number


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def _worker_main(fd: int, parent_pid: int, preload: tuple[str, ...] = (),
                 max_abs: float = DEFAULT_MAX_ABS) -> None:
    """Runs in the worker process: ``(request id, pickled (fn, args, kwargs))`` in;
    ``("started", id)`` then ``("ok", id, float)`` | ``("err", id, str)`` out.

    A reward function that forks and returns (or raises) in both processes must not leave
    two workers on one socket: the process that is not this worker ends at once, without
    answering, whenever the function comes back in it (see the module doc).
    """
    if os.getppid() != parent_pid:
        return
    my_pid = os.getpid()
    # Die with the parent, even when it is SIGKILLed. (PR_SET_PDEATHSIG would fire when the
    # *thread* that started this worker exits, e.g. an executor loop thread being restarted.)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    conn = Connection(fd)
    for module_name in preload:
        importlib.import_module(module_name)
    conn.send(("ready", None))
    while True:
        try:
            request_id, payload = conn.recv()
        except (EOFError, OSError):
            return
        except Exception:  # noqa: BLE001 - not a message of the parent: nothing to answer
            return
        if payload is None:
            return
        try:
            fn_spec, args, kwargs = pickle.loads(payload)  # imports the function's module
            fn = resolve_reward_fn(fn_spec)
        except BaseException as e:  # noqa: BLE001 - e.g. the module cannot be imported
            if os.getpid() != my_pid:
                os._exit(0)  # a fork made while importing: never answer from it
            conn.send(("started", request_id))
            conn.send(("err", request_id, f"cannot load the reward function: "
                                          f"{type(e).__name__}: {_describe(e)}"))
            continue
        conn.send(("started", request_id))  # the timeout runs from here: loading is not counted
        reply: tuple[str, int, float | str]  # ("ok", id, reward) or ("err", id, what failed)
        try:
            reply = ("ok", request_id, check_reward_value(fn(*args, **kwargs), max_abs))
        except BaseException as e:  # noqa: BLE001 - report every failure to the parent
            reply = ("err", request_id, f"{type(e).__name__}: {_describe(e)}")
        if os.getpid() != my_pid:  # the function forked and came back in the child
            os._exit(0)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


def _describe(error: BaseException) -> str:
    """``str(error)``, even when the exception's ``__str__`` itself raises."""
    try:
        return str(error)
    except BaseException:  # noqa: BLE001 - a hostile __str__
        return f"<{type(error).__name__} whose str() raised>"


class _Worker:
    """A fresh interpreter (``python -c``) talking to the parent over a socket pair.

    A plain subprocess rather than multiprocessing's spawn: it never re-imports the
    parent's ``__main__``, so scripts need no ``if __name__ == "__main__"`` guard.
    """

    def __init__(self, preload: tuple[str, ...], max_abs: float = DEFAULT_MAX_ABS) -> None:
        self.ready = False
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        code = (f"from areal_jax.rewards.pool import _worker_main; "
                f"_worker_main({child_sock.fileno()}, {os.getpid()}, {preload!r}, "
                f"float({str(float(max_abs))!r}))")  # repr(inf) is not Python
        self.process = subprocess.Popen([sys.executable, "-c", code], env=env,
                                        pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL)
        child_sock.close()
        self.conn = Connection(parent_sock.detach())

    def kill(self) -> None:
        """SIGKILL without waiting: this runs on event loops, and a loaded machine can take
        seconds to reap a process; a daemon thread collects the exit status."""
        try:
            self.process.kill()
        except OSError:
            pass
        finally:
            self.conn.close()
        threading.Thread(target=self.process.wait, name="reward-worker-reaper", daemon=True).start()

    def stop(self) -> None:
        try:
            self.conn.send((0, None))
            self.process.wait(timeout=2)
        except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
            self.kill()
            return
        self.conn.close()


class RewardPool:
    """Runs reward functions in ``num_workers`` processes, each call limited to ``timeout_s``."""

    @classmethod
    def from_config(cls, reward: RewardConfig) -> RewardPool:
        """The run's pool, from its ``reward`` section."""
        return cls(reward.num_workers, reward.timeout_s, max_abs=reward.max_abs)

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, *,
                 preload: tuple[str, ...] = (), startup_timeout_s: float = 120.0,
                 max_abs: float = DEFAULT_MAX_ABS) -> None:
        if num_workers < 1:
            raise ValueError(f"RewardPool num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool timeout_s must be > 0, got {timeout_s}")
        if not max_abs > 0:
            raise ValueError(f"RewardPool max_abs must be > 0, got {max_abs}")
        self.max_abs = float(max_abs)  # |reward| above this counts as an error
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.preload = tuple(preload)  # modules each worker imports before its first call
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._waiters: list[asyncio.Future] = []
        self._num_started = 0
        self._request_ids = itertools.count(1)  # every reply names the request it answers
        self._closed = False
        self._counts = {"calls": 0, "ok": 0, "errors": 0, "timeouts": 0, "crashes": 0,
                        "workers_replaced": 0}
        self._busy_s = 0.0
        self.last_errors: list[str] = []  # the 20 most recent error messages

    # --- worker bookkeeping -------------------------------------------------------------
    async def _acquire(self) -> _Worker:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            if self._idle:
                return self._idle.pop()
            if self._num_started < self.num_workers:
                self._num_started += 1
                start_new = True
            else:
                start_new = False
                fut: asyncio.Future = loop.create_future()
                self._waiters.append(fut)
        if start_new:
            return _Worker(self.preload, self.max_abs)
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled after a worker was handed over (the future done, the task not yet
            # resumed): give the worker back. _release takes the lock itself, so it is
            # called after this block: the lock is not re-entrant, and calling it inside
            # hung the cancelling shutdown forever.
            handed = None
            with self._lock:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                elif fut.done() and not fut.cancelled():
                    handed = fut.result()
            if handed is not None:
                self._release(handed)
            raise

    def _release(self, worker: _Worker) -> None:
        """Hands a worker to the oldest waiter (on its own loop) or back to the idle list."""
        with self._lock:
            if self._closed:
                worker.stop()
                return
            while self._waiters:
                fut = self._waiters.pop(0)
                if fut.done():
                    continue
                fut.get_loop().call_soon_threadsafe(self._deliver, fut, worker)
                return
            self._idle.append(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._counts["workers_replaced"] += 1
        self._release(_Worker(self.preload, self.max_abs))

    def _record_error(self, kind: str, message: str) -> None:
        self._counts[kind] += 1
        self.last_errors = (self.last_errors + [message])[-20:]
        logger.warning("reward %s: %s", {"timeouts": "timeout", "crashes": "crash",
                                         "errors": "error"}[kind], message)

    # --- public API ---------------------------------------------------------------------
    async def score(self, fn: RewardFn, *args: Any, **kwargs: Any) -> float | None:
        """The reward, or None when the call raised, crashed or timed out (counted)."""
        return (await self.score_or_error(fn, *args, **kwargs))[0]

    async def score_or_error(self, fn: RewardFn, *args: Any, **kwargs: Any
                             ) -> tuple[float | None, str | None]:
        """``(reward, None)``, or ``(None, why)`` when the call raised, returned something
        that is not a finite number within ``max_abs``, crashed or timed out (counted)."""
        if not (callable(fn) or isinstance(fn, str)):
            raise TypeError(f"reward function must be callable or 'module:function', got {fn!r}")
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as e:  # noqa: BLE001 - pickling errors come in many types
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(f"reward function {name} or its arguments cannot be pickled ({e}); "
                            "define it at module level or pass 'module:function'") from e
        if callable(fn) and getattr(fn, "__module__", None) == "__main__":
            raise TypeError(f"reward function {fn.__qualname__} is defined in __main__, which "
                            "reward workers cannot import; move it into a module")
        self._counts["calls"] += 1
        worker = await self._acquire()
        t0 = time.monotonic()
        request_id = next(self._request_ids)
        loading = True
        try:
            if not worker.ready:
                await self._start(worker)
            worker.conn.send((request_id, payload))
            # first "started" (after the worker has imported the function), then the result
            status, value = await _recv(worker, self.startup_timeout_s, request_id)
            if status == "started":
                loading = False
                status, value = await _recv(worker, self.timeout_s, request_id)
        except TimeoutError:
            if loading:
                message = (f"loading {_name(fn)} (importing its module) did not finish within "
                           f"the reward workers' start-up limit of {self.startup_timeout_s:g}s; "
                           "worker killed")
            else:
                message = f"{_name(fn)} ran past {self.timeout_s}s; worker killed"
            self._record_error("timeouts", message)
            self._replace(worker)
            return None, f"reward timeout: {message}"
        except _CrossedReply as e:  # e.g. a forked copy of the worker answered
            message = f"{_name(fn)}: {e}; worker killed"
            self._record_error("crashes", message)
            self._replace(worker)
            return None, f"reward crash: {message}"
        except (EOFError, OSError) as e:
            message = (f"{_name(fn)}: worker died ({type(e).__name__}, "
                       f"exit code {worker.process.poll()})")
            self._record_error("crashes", message)
            self._replace(worker)
            return None, f"reward crash: {message}"
        except BaseException:  # cancelled, or failed to start: never reuse a half-read worker
            self._replace(worker)
            raise
        finally:
            self._busy_s += time.monotonic() - t0
        self._release(worker)
        if status == "ok":
            self._counts["ok"] += 1
            return value, None
        self._record_error("errors", f"{_name(fn)}: {value}")
        return None, f"reward {_name(fn)} failed: {value}"

    async def _start(self, worker: _Worker) -> None:
        try:
            status, _ = await _recv(worker, self.startup_timeout_s)
        except (TimeoutError, EOFError, OSError) as e:
            raise RuntimeError(f"reward worker failed to start within {self.startup_timeout_s}s "
                               f"(preload={self.preload}, exit code {worker.process.poll()}): "
                               f"{type(e).__name__}; see its stderr above") from None
        if status != "ready":
            raise RuntimeError(f"reward worker sent {status!r} instead of 'ready'")
        worker.ready = True

    def score_sync(self, fn: RewardFn, *args: Any, **kwargs: Any) -> float | None:
        """``score`` for code without an event loop."""
        return asyncio.run(self.score(fn, *args, **kwargs))

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = dict(self._counts)
        out["busy_s"] = round(self._busy_s, 3)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            waiters, self._waiters = self._waiters, []
        for w in idle:
            w.stop()
        for fut in waiters:
            fut.get_loop().call_soon_threadsafe(_cancel, fut)

    def _deliver(self, fut: asyncio.Future, worker: _Worker) -> None:
        """On the waiter's loop: hand it the worker (or, cancelled meanwhile, release it)."""
        if fut.done():
            self._release(worker)
        else:
            fut.set_result(worker)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _name(fn: RewardFn) -> str:
    return fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))


class _CrossedReply(RuntimeError):
    """A worker answered another request than the one it was given."""


async def _recv(worker: _Worker, timeout_s: float, request_id: int | None = None
                ) -> tuple[str, Any]:
    """The worker's next message ``(status, value)``, waiting on its socket without blocking
    the event loop; with ``request_id``, the message must answer that request."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future = loop.create_future()
    fd = worker.conn.fileno()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)
    loop.add_reader(fd, ready)
    try:
        await asyncio.wait_for(readable, timeout_s)
    finally:
        loop.remove_reader(fd)
    message = worker.conn.recv()
    if request_id is None:
        return message
    if (not isinstance(message, tuple) or len(message) not in (2, 3)
            or message[1] != request_id):
        raise _CrossedReply(f"the worker answered {message!r:.120} to request {request_id}")
    return message[0], (message[2] if len(message) == 3 else None)


def _cancel(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.cancel()
