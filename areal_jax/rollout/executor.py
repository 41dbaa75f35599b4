"""The rollout executor: workflows on a background asyncio loop, behind a staleness gate.

    executor = RolloutExecutor(client, RLVRWorkflow(...), iter(prompt_ds), batch_size=B,
                               max_concurrent=64, max_staleness=2)
    executor.start()
    for v in range(n_versions):
        groups = executor.prepare_batch(B)      # the B oldest accepted groups
        ...train...
        executor.pause(); <pause servers, update weights>; executor.set_version(v + 1)
        <continue servers>; executor.resume()

Units: B counts prompts (groups). One workflow run handles one prompt and returns a
group (list[Trajectory]) or None (rejected).

**The gate.** A new run is submitted only while the :class:`StalenessGate`
(``rollout/staleness.py``) has capacity:
``min(max_concurrent - running, (eta + (v - v0) + 1) * B - (accepted + running)) > 0``,
with ``v`` the version set with :meth:`set_version` and ``eta = max_staleness`` (None:
unbounded). Rejected and failed runs free their capacity.

**The guarantee.** A batch returned by ``prepare_batch`` at version v (the learner will
train on it to produce v + 1) holds no group with ``start_version < v - eta``, where
``start_version`` is the version when the group's run was submitted. To make this hold
whatever the generation times, ``prepare_batch`` returns groups oldest first, by
(start_version, submission order), and waits until no run that started at or before
``v - eta`` is still in flight (the gate guarantees at most B such groups exist when the
learner consumes B groups per version). A group that nonetheless became too stale
(e.g. the learner consumed fewer than B per version) is never returned: its prompt is
regenerated (counted as ``stale_requeued``). With eta = 0 this is synchronous RL: batch v
is generated entirely at version v, and nothing is generated while the learner trains.

**Failures.** A workflow exception never stops the loop: the attempt counts in
``attempt_errors`` and the prompt is retried (a fresh run, new start version) up to
``max_retries`` times, then dropped and counted in ``failed`` (logged with its prompt id).
Every prompt taken from the iterator ends up exactly once as consumed, rejected or
failed, or is still accepted/in flight/queued. Whatever a workflow (or the agent and tools
it runs) raises is such a failure, named in the log and the watchdog's message:
``SystemExit`` and ``KeyboardInterrupt`` (which would otherwise end the loop) and a
``CancelledError`` it raised itself (which would otherwise leave its run "running" for
good, holding its capacity) included.

**Deadline.** Each run must end within ``episode_timeout_s`` (``rollout.episode_timeout_s``;
0: no limit); one that does not is cancelled, without waiting for a coroutine that ignores
the cancellation, and counts as a failed attempt (:class:`EpisodeTimeout`, naming the
workflow). So one stuck episode cannot hold a batch for longer than that.

**Progress watchdog.** A run that can never progress must not look like one that is
running. ``prepare_batch`` raises :class:`NoProgressError` when
``max_attempts_without_progress`` runs in a row ended without an accepted group
(failed, or rejected: e.g. every request refused by the server, a reward that always
raises), or when it has waited ``max_seconds_without_progress`` without any group being
accepted. The message names the cause seen most often since the last accepted group:
the server's or the reward's error with its type, or "all samples rejected by the
workflow". 0 disables either limit.

**Checkpoints.** :meth:`state_dict` is JSON-serialisable: the counters, the prompt
iterator's state, the accepted-but-unconsumed groups (as data), and the prompt items of
every run in flight or queued for retry. :meth:`load_state_dict` restores all of it into a
fresh executor; accepted groups come back as they were, and in-flight prompts are
*replayed*: submitted again from scratch (their partial generations are discarded), before
any new prompt. So a resumed run neither loses a prompt nor counts one twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from areal_jax.interrupt import POLL_S, raise_if_interrupted, wait_future
from areal_jax.rewards.pool import RewardPool
from areal_jax.rollout.staleness import StalenessGate
from areal_jax.rollout.user_code import (
    DeadlineExceeded,
    Escaped,
    describe_error,
    escaped,
    is_own_cancellation,
    wait_abandoning,
)
from areal_jax.rollout.workflows import (
    GenerateClient,
    PromptItem,
    Workflow,
    WorkflowContext,
    as_workflow_fn,
)
from areal_jax.trajectory import Trajectory

if TYPE_CHECKING:  # annotations only: this room never loads the run config (nor data/)
    from areal_jax.config import TrainConfig
    from areal_jax.tokenizer import ChatTokenizer
    from model_defs import JsonDict

T = TypeVar("T")

logger = logging.getLogger(__name__)

_MAX_LOGGED_TRACEBACKS = 5
_STOP_GRACE_S = 10.0  # stop(): how long cancelled tasks and the client's close may take


class PromptsExhausted(RuntimeError):
    """The prompt iterator ended and fewer groups than requested can still be produced."""


class EpisodeTimeout(TimeoutError):
    """A workflow run did not finish within ``episode_timeout_s``."""


class NoProgressError(RuntimeError):
    """No group was accepted for too many attempts or too long (see the module doc)."""


_REJECTED = "all samples rejected by the workflow"
_CAUSE_CHARS = 500


def _cause_key(cause: str) -> str:
    """Causes are counted by their shape: quoted text and words holding digits (request
    ids, addresses, values) are blanked, so "prompt 'p3' ... rid a1#2" and "prompt 'p9'
    ... rid b4#0" count as one cause."""
    return re.sub(r"'[^']*'|\"[^\"]*\"|\S*\d\S*", "_", cause)[:200]


STATE_FORMAT = 1  # of state_dict()


@dataclass
class _AcceptedGroup:
    """A group waiting for the learner, with where it came from."""

    seq: int  # submission order of its run
    start_version: int
    item: PromptItem
    group: list[Trajectory]

    @property
    def order(self) -> tuple[int, int]:
        """Oldest first: by start version, then submission order."""
        return (self.start_version, self.seq)


@dataclass
class _Run:
    seq: int  # submission order, unique over the executor's (restored) lifetime
    item: PromptItem
    attempt: int
    start_version: int
    task: asyncio.Task | None = None
    problem: str | None = None  # why the run may end without a group (ctx.note_problem)


class RolloutExecutor:
    """Runs workflows asynchronously under the staleness gate described in the module doc."""

    @classmethod
    def from_config(cls, cfg: TrainConfig, client: GenerateClient, workflow: Workflow,
                    prompts: Iterable[PromptItem] | None, *, reward_pool: RewardPool | None,
                    tokenizer: ChatTokenizer | None) -> RolloutExecutor:
        """The run's executor: the gate from ``train.batch_size``, ``rollout.max_concurrent``
        and η, the reward timeout from ``reward``, the no-progress limits from
        ``watchdog``."""
        wd = cfg.watchdog
        return cls(client, workflow, prompts, batch_size=cfg.train.batch_size,
                   max_concurrent=cfg.max_concurrent, max_staleness=cfg.eta, seed=cfg.seed,
                   reward_pool=reward_pool, tokenizer=tokenizer,
                   reward_timeout_s=cfg.reward.timeout_s,
                   episode_timeout_s=cfg.rollout.episode_timeout_s,
                   max_attempts_without_progress=wd.max_attempts_without_progress,
                   max_seconds_without_progress=wd.max_seconds_without_progress)

    def __init__(self, client: GenerateClient, workflow: Workflow,
                 prompts: Iterable[PromptItem] | None = None, *,
                 batch_size: int, max_concurrent: int = 64, max_staleness: int | None = 0,
                 seed: int = 0, max_retries: int = 2, reward_pool: RewardPool | None = None,
                 tokenizer: ChatTokenizer | None = None, reward_timeout_s: float = 30.0,
                 reward_max_abs: float | None = None, episode_timeout_s: float = 0.0,
                 max_attempts_without_progress: int = 0,
                 max_seconds_without_progress: float = 0.0) -> None:
        self._gate = StalenessGate(batch_size, max_staleness, max_concurrent)  # validates them
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if max_attempts_without_progress < 0 or not max_seconds_without_progress >= 0:
            raise ValueError("max_attempts_without_progress and max_seconds_without_progress "
                             f"must be >= 0 (0: no limit), got {max_attempts_without_progress} "
                             f"and {max_seconds_without_progress}")
        self.client = client
        self.workflow = workflow
        self._workflow_fn = as_workflow_fn(workflow)
        self._prompts: Iterator[dict] | None = iter(prompts) if prompts is not None else None
        self.seed = seed
        self.max_retries = max_retries
        self.reward_pool = reward_pool
        self.tokenizer = tokenizer
        self.reward_timeout_s = reward_timeout_s
        self.reward_max_abs = (reward_max_abs if reward_max_abs is not None
                               else getattr(reward_pool, "max_abs", None))
        self.max_attempts_without_progress = max_attempts_without_progress
        self.max_seconds_without_progress = max_seconds_without_progress
        if not episode_timeout_s >= 0:
            raise ValueError(f"episode_timeout_s must be >= 0 (0: no limit), got "
                             f"{episode_timeout_s}")
        self.episode_timeout_s = episode_timeout_s

        self._cond = threading.Condition()
        self._next_seq = 0
        self._running: dict[int, _Run] = {}
        self._pending: deque[tuple[PromptItem, int]] = deque()  # (item, attempt)
        self._accepted: list[_AcceptedGroup] = []
        self._exhausted = prompts is None
        self._paused = False
        self._stopping = False
        self._close_client = False
        self._error: BaseException | None = None
        self._wait_error: BaseException | None = None  # fail_waits()
        self._counts: Counter[str] = Counter()
        self._staleness_hist: Counter[int] = Counter()
        self.last_errors: deque[str] = deque(maxlen=20)
        # Progress: finished runs since the last accepted group, and why they ended so.
        self._attempts_without_progress = 0
        self._causes: Counter[str] = Counter()  # _cause_key -> count
        self._cause_example: dict[str, str] = {}  # _cause_key -> the latest full message
        self._last_progress = time.monotonic()

        self._learner_version = 0  # announce_version
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup: asyncio.Event | None = None

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> RolloutExecutor:
        """Starts the background loop thread (idempotent)."""
        if self._thread is not None:
            return self
        with self._cond:  # runs cancelled by an earlier stop() are replayed first
            for run in sorted(self._running.values(), key=lambda r: r.seq, reverse=True):
                self._pending.appendleft((run.item, run.attempt))
            self._running.clear()
            self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._wakeup = asyncio.Event()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,),
                                        name="rollout-executor", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def stop(self, timeout: float = 30.0, close_client: bool = False) -> None:
        """Cancels in-flight runs (they stay recorded, so a later state_dict replays them).

        ``close_client`` also awaits ``client.aclose()`` on the executor's loop, where the
        client's connections live.
        """
        if self._thread is None:
            return
        with self._cond:
            self._close_client = close_client
            self._stopping = True
            self._cond.notify_all()
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            frame = sys._current_frames().get(self._thread.ident or -1)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            logger.warning("rollout executor thread did not stop within %ss; it is at:\n%s",
                           timeout, where)
        self._thread = None

    def __enter__(self) -> RolloutExecutor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self, ready: threading.Event) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        ready.set()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _main(self) -> None:
        assert self._wakeup is not None
        try:
            while not self._stopping:
                self._submit_ready()
                await self._wakeup.wait()
                self._wakeup.clear()
        except BaseException as e:  # noqa: BLE001 - surface loop bugs to the trainer
            logger.exception("rollout executor loop died")
            with self._cond:
                self._error = e
                self._cond.notify_all()
        await self._cancel_everything()

    async def _cancel_everything(self) -> None:
        """Cancels every task on this loop, not only the workflow runs: a coroutine handed
        over with ``submit_coroutine`` (a weight update, an eval) or a client probe left
        pending would otherwise keep running, or be destroyed mid-request when the loop
        closes. Each wait is bounded; a task that ignores its cancellation is logged with
        its stack, not waited for."""
        grace = _STOP_GRACE_S
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=grace)
            for task in stuck:
                stack = "".join(f"\n  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                                for f in task.get_stack())
                logger.warning("rollout executor: task %s ignored cancellation for %ss; "
                               "leaving it%s", task.get_name(), grace, stack)
        if self._close_client and hasattr(self.client, "aclose"):
            try:
                await asyncio.wait_for(self.client.aclose(), grace)
            except Exception:  # noqa: BLE001 - closing is best effort
                logger.exception("closing the rollout client failed")

    def _wake(self) -> None:
        loop, event = self._loop, self._wakeup
        if loop is None or event is None or loop.is_closed():
            return
        if threading.current_thread() is self._thread:
            event.set()
        else:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop closed meanwhile
                pass

    def run_coroutine(self, coro: Coroutine[object, object, T], timeout: float | None = None
                      ) -> T:
        """Runs ``coro`` on the executor's loop and waits (e.g. ``client.pause()``).

        Async clients hold connections bound to one loop; use this for every call the
        trainer makes on the client while the executor runs.
        """
        try:
            return wait_future(self.submit_coroutine(coro), timeout)  # SIGINT/SIGTERM end it
        except concurrent.futures.CancelledError:
            with self._cond:  # the loop died under it: say why, not "CancelledError"
                self._raise_if_dead_locked()
            raise

    def submit_coroutine(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedules ``coro`` on the executor's loop; the executor must be running."""
        if self._thread is None or self._loop is None:
            coro.close()
            raise RuntimeError("the rollout executor is not running; call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # --- the gate -----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self._gate.batch_size

    @property
    def max_staleness(self) -> int | None:
        return self._gate.max_staleness

    def _capacity_locked(self) -> int:
        return self._gate.capacity(len(self._running))

    def capacity(self) -> int:
        with self._cond:
            return self._capacity_locked()

    def _next_item_locked(self) -> tuple[PromptItem, int] | None:
        if self._pending:
            return self._pending.popleft()
        if self._prompts is None or self._exhausted:
            return None
        try:
            item = next(self._prompts)
        except StopIteration:
            self._exhausted = True
            self._cond.notify_all()
            return None
        if not isinstance(item, dict) or "prompt_id" not in item:
            raise TypeError(f"prompt items must be dicts with a 'prompt_id' key, got {item!r:.200}")
        self._counts["prompts_taken"] += 1
        return item, 0

    def _submit_ready(self) -> None:
        with self._cond:
            while not self._paused and not self._stopping and self._capacity_locked() > 0:
                nxt = self._next_item_locked()
                if nxt is None:
                    break
                item, attempt = nxt
                run = _Run(self._next_seq, item, attempt, self._gate.version)
                self._next_seq += 1
                self._running[run.seq] = run
                self._counts["submitted"] += 1
                run.task = asyncio.get_running_loop().create_task(self._execute(run))

    def _context(self, run: _Run) -> WorkflowContext:
        return WorkflowContext(
            start_version=run.start_version, seed=(self.seed * 1_000_003 + run.seq * 7919) % 2**31,
            group_id=f"{run.item['prompt_id']}#{run.seq}", attempt=run.attempt,
            reward_pool=self.reward_pool, tokenizer=self.tokenizer,
            reward_timeout_s=self.reward_timeout_s, _count=self._count,
            _note=lambda cause: setattr(run, "problem", cause),
            **({} if self.reward_max_abs is None else {"reward_max_abs": self.reward_max_abs}))

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts[name] += n

    @property
    def workflow_name(self) -> str:
        """The workflow as its failures name it (an agent workflow names its agent)."""
        wf = self.workflow
        if type(wf).__repr__ is not object.__repr__:
            return repr(wf)
        if hasattr(wf, "arun"):
            return f"workflow {type(wf).__module__}.{type(wf).__qualname__}"
        return f"workflow {getattr(wf, '__module__', '?')}.{getattr(wf, '__qualname__', wf)}"

    async def _execute(self, run: _Run) -> None:
        try:
            result = await self._attempt(run)
            group = _validate_group(result, self.workflow)
        except asyncio.CancelledError:
            if self._stopping or is_own_cancellation():
                raise  # stop(): the run stays in _running and is replayed after a restore
            # The workflow raised CancelledError itself: a failed attempt, not a run
            # left "running" for good, holding its capacity.
            self._on_failure(run, Escaped(f"{self.workflow_name} raised CancelledError itself"))
        except Exception as e:  # noqa: BLE001 - workflow errors never stop the executor
            self._on_failure(run, e)
        else:
            self._on_result(run, group)
        self._wake()

    async def _attempt(self, run: _Run) -> object:
        """One run of the workflow, within ``episode_timeout_s``. What it raises comes out
        as an Exception: ``SystemExit``/``KeyboardInterrupt`` (which would end the loop) and
        a ``CancelledError`` nobody asked for as :class:`Escaped` naming the workflow."""
        async def guarded() -> object:
            try:
                return await self._workflow_fn(self.client, run.item, self._context(run))
            except asyncio.CancelledError:
                if self._stopping or is_own_cancellation():
                    raise
                raise Escaped(f"{self.workflow_name} raised CancelledError itself") from None
            except (SystemExit, KeyboardInterrupt) as e:
                raise escaped(e, self.workflow_name) from None

        if not self.episode_timeout_s:
            return await guarded()
        try:
            return await wait_abandoning(guarded(), self.episode_timeout_s)
        except DeadlineExceeded:
            raise EpisodeTimeout(
                f"{self.workflow_name} did not finish within rollout.episode_timeout_s="
                f"{self.episode_timeout_s:g}s; cancelled") from None

    def _on_result(self, run: _Run, group: list[Trajectory] | None) -> None:
        with self._cond:
            self._running.pop(run.seq, None)
            if group is None:
                self._counts["rejected"] += 1
                self._no_progress_locked(run.problem or _REJECTED)
            else:
                _stamp_group(group, run)
                self._accepted.append(_AcceptedGroup(run.seq, run.start_version, run.item,
                                                     group))
                self._gate.accept()
                self._counts["accepted"] += 1
                self._progress_locked()
            self._cond.notify_all()

    def _progress_locked(self) -> None:
        self._attempts_without_progress = 0
        self._causes.clear()
        self._cause_example.clear()
        self._last_progress = time.monotonic()

    def _no_progress_locked(self, cause: str) -> None:
        self._attempts_without_progress += 1
        key = _cause_key(cause)
        self._causes[key] += 1
        self._cause_example[key] = cause[:_CAUSE_CHARS]

    def _record_failure(self, run: _Run, error: Exception) -> bool:
        """Counts and logs a failed attempt; True when the prompt gets another attempt."""
        prompt_id = run.item.get("prompt_id")
        what = describe_error(error)  # even when the error's __str__ raises
        message = f"prompt {prompt_id!r} attempt {run.attempt}: {what}"
        with self._cond:
            self._no_progress_locked(what)
            self._counts["attempt_errors"] += 1
            self.last_errors.append(message)
            retry = run.attempt < self.max_retries
            self._counts["retried" if retry else "failed"] += 1
            show_traceback = self._counts["attempt_errors"] <= _MAX_LOGGED_TRACEBACKS
        outcome = "retrying" if retry else f"dropped after {run.attempt + 1} attempts"
        logger.warning("workflow failed, %s: %s", outcome, message,
                       exc_info=error if show_traceback else None)
        return retry

    def _on_failure(self, run: _Run, error: Exception) -> None:
        retry = self._record_failure(run, error)
        with self._cond:
            self._running.pop(run.seq, None)
            if retry:
                self._pending.appendleft((run.item, run.attempt + 1))
            self._cond.notify_all()

    # --- the trainer's side -------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._gate.version

    def set_version(self, version: int) -> None:
        """The learner's current version (new runs record it as their start version)."""
        with self._cond:
            fresh = self._counts["submitted"] == 0 and self._gate.accepted == 0
            self._gate.set_version(version, fresh=fresh)
            self._cond.notify_all()
        self._wake()

    def pause(self) -> None:
        """Stops submitting new runs; runs in flight continue (pause the servers separately)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
        self._wake()

    def announce_version(self, version: int) -> None:
        """The learner is at ``version`` (its next batch trains there), while the servers
        may still be updating to it (``set_version`` follows then). ``prepare_batch`` judges
        staleness by the learner's version: judged by the servers' version, one behind
        while an update runs in the background, a batch could skip a group still in flight
        that the next check, at a version the learner had waited for (an eval, a
        checkpoint), found too stale and regenerated."""
        with self._cond:
            self._learner_version = max(self._learner_version, version)
            self._cond.notify_all()

    def _batch_version_locked(self) -> int:
        """The version the next batch trains at (see :meth:`announce_version`)."""
        return max(self._gate.version, self._learner_version)

    def _is_stale_locked(self, start_version: int) -> bool:
        eta = self._gate.max_staleness
        return eta is not None and start_version < self._batch_version_locked() - eta

    def _requeue_stale_locked(self) -> None:
        stale = [a for a in self._accepted if self._is_stale_locked(a.start_version)]
        if not stale:
            return
        self._accepted = [a for a in self._accepted if not self._is_stale_locked(a.start_version)]
        for a in sorted(stale, key=lambda a: a.order):
            self._pending.append((a.item, 0))
        self._gate.release(len(stale))
        self._counts["stale_requeued"] += len(stale)
        logger.warning("%d accepted groups became older than max_staleness=%d at version %d; "
                       "their prompts are regenerated", len(stale), self.max_staleness,
                       self._batch_version_locked())
        self._wake()

    def _old_runs_in_flight_locked(self) -> bool:
        if self._gate.max_staleness is None:
            return False
        oldest_allowed = self._batch_version_locked() - self._gate.max_staleness
        return any(r.start_version <= oldest_allowed for r in self._running.values())

    def fail_waits(self, error: BaseException) -> None:
        """Makes every ``prepare_batch``, now and later, raise ``error``: the run cannot go
        on (e.g. a weight update failed in the background, after which, in sync mode, no
        batch can ever be ready)."""
        with self._cond:
            self._wait_error = error
            self._cond.notify_all()

    def _raise_if_dead_locked(self) -> None:
        if self._wait_error is not None:
            raise self._wait_error
        if self._error is not None:
            raise RuntimeError(f"the rollout executor loop died: {type(self._error).__name__}: "
                               f"{self._error}") from self._error

    def no_progress_report(self) -> str:
        """Finished runs since the last accepted group, and their most frequent cause."""
        with self._cond:
            return self._no_progress_report_locked()

    def _no_progress_report_locked(self) -> str:
        n = self._attempts_without_progress
        if not self._causes:
            return f"{n} attempts ended without an accepted group"
        key, count = self._causes.most_common(1)[0]
        return (f"{n} attempts in a row ended without an accepted group; most frequent cause "
                f"({count}x): {self._cause_example[key]}")

    def _raise_if_stalled_locked(self, t_wait: float) -> None:
        """NoProgressError when the watchdog limits of the module doc are reached. The clock
        runs only while the learner waits: a long train step is not a stall."""
        limit_n, limit_s = self.max_attempts_without_progress, self.max_seconds_without_progress
        if limit_n and self._attempts_without_progress >= limit_n:
            raise NoProgressError(f"no progress: {self._no_progress_report_locked()} "
                                  f"(watchdog.max_attempts_without_progress={limit_n})")
        waited = time.monotonic() - max(self._last_progress, t_wait)
        if limit_s and waited >= limit_s:
            raise NoProgressError(f"no progress: no group accepted for {waited:.0f}s while the "
                                  f"learner waited; {self._no_progress_report_locked()} "
                                  f"(watchdog.max_seconds_without_progress={limit_s:g})")

    def prepare_batch(self, batch_size: int | None = None, timeout: float | None = None,
                      allow_partial: bool = False) -> list[list[Trajectory]]:
        """The ``batch_size`` oldest accepted groups (default B); generation goes on meanwhile.

        Blocks until they are ready (see the guarantee in the module doc). Raises
        TimeoutError after ``timeout`` seconds, and :class:`PromptsExhausted` when the prompt
        iterator has ended and too few groups remain (with ``allow_partial``, returns the
        remainder instead while there is one).
        """
        n = self.batch_size if batch_size is None else batch_size
        if n < 1:
            raise ValueError(f"prepare_batch needs batch_size >= 1, got {n}")
        self.start()
        t_wait = time.monotonic()
        deadline = None if timeout is None else t_wait + timeout
        with self._cond:
            while True:
                raise_if_interrupted()  # a safe point for SIGINT/SIGTERM (main thread only)
                self._raise_if_dead_locked()
                self._requeue_stale_locked()
                if len(self._accepted) >= n and not self._old_runs_in_flight_locked():
                    break
                self._raise_if_stalled_locked(t_wait)
                if (self._exhausted and not self._running and not self._pending):
                    if allow_partial and self._accepted:
                        n = len(self._accepted)
                        break
                    raise PromptsExhausted(
                        f"the prompt iterator is exhausted: {len(self._accepted)} accepted groups "
                        f"remain, {n} requested")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"prepare_batch({n}) timed out after {timeout}s: {len(self._accepted)} "
                        f"accepted, {len(self._running)} running, paused={self._paused}, "
                        f"capacity={self._capacity_locked()}")
                self._cond.wait(min(remaining, POLL_S) if remaining is not None else POLL_S)
            self._accepted.sort(key=lambda a: a.order)
            batch, self._accepted = self._accepted[:n], self._accepted[n:]
            self._counts["consumed"] += len(batch)
            for a in batch:
                self._staleness_hist[self._batch_version_locked() - a.start_version] += 1
        self._wake()
        return [a.group for a in batch]

    # --- metrics and checkpoints --------------------------------------------------------
    def metrics(self) -> JsonDict:
        with self._cond:
            out: JsonDict = {
                "version": self._gate.version, "running": len(self._running),
                "pending": len(self._pending), "accepted_unconsumed": len(self._accepted),
                "capacity": self._capacity_locked(), "paused": self._paused,
                "prompts_exhausted": self._exhausted,
            }
            for name in ("prompts_taken", "submitted", "accepted", "rejected", "failed",
                         "attempt_errors", "retried", "stale_requeued", "consumed"):
                out[name] = self._counts.get(name, 0)
            out.update({k: v for k, v in self._counts.items() if k not in out})
            hist = dict(sorted(self._staleness_hist.items()))
        total = sum(hist.values())
        out["staleness_hist"] = hist
        out["staleness_max"] = max(hist) if hist else 0
        out["staleness_mean"] = sum(k * v for k, v in hist.items()) / total if total else 0.0
        if self.reward_pool is not None:
            out.update({f"reward_pool/{k}": v for k, v in self.reward_pool.metrics().items()})
        return out

    def state_dict(self) -> JsonDict:
        """A JSON-serialisable snapshot (see "Checkpoints" in the module doc): the gate,
        the counters, the prompt iterator's state, every accepted-but-unconsumed group as
        data, and the prompt item of every run in flight or queued for retry."""
        with self._cond:
            iterator_state = None
            if self._prompts is not None:
                get_state = getattr(self._prompts, "get_state", None)
                if get_state is None:
                    raise TypeError("the prompt iterator has no get_state(); use a grain "
                                    "DatasetIterator (iter(load_prompt_dataset(...)))")
                iterator_state = get_state()
            in_flight = [{"item": r.item, "attempt": r.attempt}
                         for r in sorted(self._running.values(), key=lambda r: r.seq)]
            in_flight += [{"item": item, "attempt": attempt} for item, attempt in self._pending]
            state = {
                "format": STATE_FORMAT,
                **self._gate.state_dict(),
                "next_seq": self._next_seq,
                "counts": dict(self._counts),
                "staleness_hist": {str(k): v for k, v in self._staleness_hist.items()},
                "prompt_iterator": iterator_state,
                "prompts_exhausted": self._exhausted,
                "accepted": [{"seq": a.seq, "start_version": a.start_version, "item": a.item,
                              "group": [t.to_dict() for t in a.group]}
                             for a in sorted(self._accepted, key=lambda a: a.order)],
                "in_flight": in_flight,
            }
        try:
            json.dumps(state)
        except TypeError as e:
            raise TypeError(f"executor state is not JSON-serialisable ({e}); prompt items and "
                            "Trajectory.info must hold only JSON types") from e
        return state

    def load_state_dict(self, state: JsonDict) -> None:
        """Restores a :meth:`state_dict` snapshot into this (not yet started) executor:
        accepted groups come back as they were; in-flight prompts are queued to be
        replayed from scratch, before any new prompt."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"executor state has format {state.get('format')!r}, "
                             f"this version reads {STATE_FORMAT}")
        missing = {"version", "base_version", "next_seq", "counts", "prompt_iterator",
                   "accepted", "in_flight"} - set(state)
        if missing:
            raise KeyError(f"executor state lacks keys {sorted(missing)}")
        if state["prompt_iterator"] is not None:
            set_state = getattr(self._prompts, "set_state", None)
            if set_state is None:
                raise TypeError("the executor state holds a prompt-iterator state, but this "
                                "executor's prompt iterator has no set_state()")
            set_state(state["prompt_iterator"])
        with self._cond:
            self._next_seq = int(state["next_seq"])
            self._counts = Counter(state["counts"])
            self._staleness_hist = Counter({int(k): v
                                            for k, v in state.get("staleness_hist", {}).items()})
            self._exhausted = bool(state.get("prompts_exhausted", False))
            self._accepted = [_AcceptedGroup(a["seq"], a["start_version"], a["item"],
                                             [Trajectory.from_dict(t) for t in a["group"]])
                              for a in state["accepted"]]
            self._pending = deque((f["item"], int(f["attempt"])) for f in state["in_flight"])
            self._running = {}
            self._gate.load_state_dict(
                state, default_accepted=self._counts.get("consumed", 0) + len(self._accepted))
            self._counts["replayed"] += len(self._pending)


def _stamp_group(group: list[Trajectory], run: _Run) -> None:
    """Records where each trajectory came from (the executor owns these fields)."""
    for traj in group:
        traj.start_version = run.start_version
        traj.prompt_id = str(run.item["prompt_id"])
        traj.group_id = traj.group_id or f"{run.item['prompt_id']}#{run.seq}"
        for key in ("epoch", "stream_index"):
            if key in run.item:
                traj.info.setdefault(key, run.item[key])


def _validate_group(result: object, workflow: Workflow) -> list[Trajectory] | None:
    if result is None:
        return None
    if not isinstance(result, list) or not all(isinstance(t, Trajectory) for t in result):
        raise TypeError(f"workflow {workflow!r} returned {type(result).__name__}; expected "
                        "list[Trajectory] or None")
    return result or None
