"""Step 5 of a version: the new weights reach the rollout servers, off the learner's path.

    sync = WeightSync(executor, write=lambda params, v: publisher.publish(params, cfg, v),
                      interruptible=True)
    sync.publish(host_params, version)   # returns at once; the learner trains on
    sync.publish_inline(model, version)  # or: writes now, from the learner's arrays
    ...
    sync.wait()                          # before the next publish, an eval, a checkpoint

``publish`` runs, as one coroutine on the executor's loop: the write of the serving
weights (in a thread: ``write(params, version)`` returns the directory the servers read),
then the servers' update: the executor stops submitting, the servers pause (in-flight
requests return as aborted and the client resubmits them under the new weights) or, when
not ``interruptible``, the executor waits for its runs to finish; then
``/update_weights_from_disk`` (sent only once the version is completely written),
``executor.set_version`` and the resume. With ``adapter_subdir`` (LoRA adapter mode) the
servers instead load the PEFT adapter in ``<version dir>/<adapter_subdir>`` under the name
``v{N}`` (``client.load_lora_adapter``) onto the base model they serve. In sync mode
(eta = 0) nothing starts under the new version before ``set_version``, so sync runs stay
exactly on-policy.

With ``staged`` (``checkpoint.publish: memory``), ``write(params, version)`` sends the
weights to every server, which stage them while they keep generating, and returns the
transfer id; the update then only swaps: the executor stops submitting, every server swaps
at its next step boundary (``client.swap_staged_weights``: running requests return as
aborted, or, when not ``interruptible``, the executor first waits for its runs to finish),
``executor.set_version`` and the resume. Generation pauses only for the swap.

With ``push`` (``checkpoint.publish: distributed``, ``checkpoint/distributed.py``), the
update is ``push(params, version, abort_all_requests)``: SGLang's own in-memory update
through a torch process group, which returns once every server serves the new weights.
The executor holds back new runs meanwhile; with ``pause_servers`` (SGLang, which loads
each bucket as it arrives) the servers pause around it; an embedded engine assembles the
whole version and swaps it in at a step boundary, generating on the old one meanwhile.

With ``deltas`` (``checkpoint.publish: delta``, ``checkpoint/delta.py``'s
``DeltaPublisher``), the write is ``deltas.publish(params, version)``: ``v{N}.delta`` in
the publish dir, the compressed XOR with v{N-1}; then the executor stops submitting and
every server applies it (``client.update_weights_from_delta``) while it keeps generating,
and swaps at a step boundary (running requests return as aborted if ``interruptible``). A
server that refuses the delta (it missed a version, the file is corrupted) is sent the
full version, ``deltas.full(version)``, written only then; a refusal of that stops the run
(the server keeps its old weights, whole). ``bytes_written[v]``: the bytes the learner
wrote for version v (the delta, plus the full file where one was needed), and
``full_servers[v]`` how many servers needed the full version.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_jax.interrupt import wait_future

if TYPE_CHECKING:
    from areal_jax.rollout.executor import RolloutExecutor
    from model_defs import CausalLM, PyTree


@runtime_checkable
class ServerControl(Protocol):
    """The server-control half of ``RolloutClient`` that a weight update drives (the
    executor's client must have it; a generate-only client cannot take weight updates)."""

    async def pause(self) -> Any: ...
    async def continue_(self) -> Any: ...
    async def update_weights_from_disk(self, path: str, version: int) -> Any: ...
    async def load_lora_adapter(self, name: str, path: str, version: int) -> Any: ...
    async def swap_staged_weights(self, transfer: str, version: int,
                                  abort_all_requests: bool = True) -> Any: ...
    async def update_weights_from_delta(self, path: str, version: int,
                                        full: Callable[[], Awaitable[str]],
                                        abort_all_requests: bool = False) -> Any: ...


@runtime_checkable
class DeltaFiles(Protocol):
    """Writes a version's delta file, or its full file (``checkpoint/delta.py``'s
    ``DeltaPublisher``); each returns (path, bytes written)."""

    def publish(self, params: Any, version: int) -> tuple[str, int]: ...
    def full(self, version: int) -> tuple[str, int]: ...


class WeightSyncError(RuntimeError):
    """Writing the weights or updating a server failed; the message says which version."""


def _failed(version: int, e: BaseException) -> WeightSyncError:
    return WeightSyncError(f"weight update to v{version} failed: {type(e).__name__}: {e}")


class WeightSync:
    def __init__(self, executor: RolloutExecutor, write: Callable[[Any, int], str],
                 *,
                 interruptible: bool = True, adapter_subdir: str | None = None,
                 staged: bool = False,
                 files: Callable[[PyTree | CausalLM, int], str] | None = None,
                 deltas: DeltaFiles | None = None,
                 push: Callable[[Any, int, bool], Any] | None = None,
                 pause_servers: bool = False) -> None:
        if not isinstance(executor.client, ServerControl):
            raise TypeError(f"WeightSync needs a client that controls its servers (pause, "
                            f"update_weights_from_disk, load_lora_adapter, continue_), such "
                            f"as RolloutClient; got {type(executor.client).__name__}")
        self.executor = executor
        self.client: ServerControl = executor.client
        self.adapter_subdir = adapter_subdir
        self.staged = staged  # write() stages the weights on the servers (module doc)
        self.files = files  # staged, deltas: writes a version's files (write_files)
        self.deltas = deltas  # publish: a delta file each version (module doc)
        # publish: push(params, version, abort_all_requests) moves the weights into the
        # servers, which serve them when it returns (checkpoint.publish: distributed);
        # pause_servers: pause them around it (SGLang loads each bucket as it arrives)
        self.push = push
        self.pause_servers = pause_servers
        self.write = write
        self.interruptible = interruptible
        self._pending: tuple[int, Future[tuple[float, float]]] | None = None
        self.write_s: dict[int, float] = {}  # version -> seconds its write took
        self.update_s: dict[int, float] = {}  # version -> seconds its servers' update took
        self.bytes_written: dict[int, int] = {}  # deltas: version -> bytes the learner wrote
        self.full_servers: dict[int, int] = {}  # deltas: version -> servers sent it full

    def publish(self, params: PyTree, version: int) -> None:
        """Starts writing ``params`` as ``version`` and updating the servers to it (after the
        previous publish is done)."""
        self.wait()
        self.executor.announce_version(version)  # the learner's next batch trains at it
        self._pending = (version, self.executor.submit_coroutine(self._write_and_update(
            params, version)))

    def publish_inline(self, model: PyTree | CausalLM, version: int) -> None:
        """Writes ``model`` (e.g. the learner's ``CausalLM``, read one tensor at a time)
        as ``version`` in the calling thread, then starts the servers' update as
        :meth:`publish` does. A failed write raises :class:`WeightSyncError` here."""
        self.wait()
        self.executor.announce_version(version)
        t0 = time.perf_counter()
        try:
            path = self.write(model, version)
        except Exception as e:  # noqa: BLE001 - a storage error
            raise _failed(version, e) from e
        self._pending = (version, self.executor.submit_coroutine(self._update_written(
            path, version, time.perf_counter() - t0)))

    def write_files(self, params: PyTree | CausalLM, version: int) -> str | None:
        """With ``staged`` or ``deltas``: writes ``params`` as ``version``'s files
        (``files``), now, for whoever needs files (the last version of a run); returns
        their path. Otherwise ``write`` wrote every version's files already: None."""
        if not (self.staged or self.deltas is not None or self.push is not None) \
                or self.files is None:
            return None
        try:
            return self.files(params, version)
        except Exception as e:  # noqa: BLE001 - a storage error
            raise _failed(version, e) from e

    def wait(self) -> None:
        """Waits for the last :meth:`publish`; records its seconds in ``write_s`` and
        ``update_s``. Raises :class:`WeightSyncError` if the write or the update failed."""
        if self._pending is None:
            return
        version, future = self._pending
        try:  # SIGINT/SIGTERM end the wait; the publish stays pending (a checkpoint waits)
            self.write_s[version], self.update_s[version] = wait_future(future)
        except Exception as e:  # noqa: BLE001 - a storage, transport or server error
            self._pending = None
            raise _failed(version, e) from e
        self._pending = None

    async def _write_and_update(self, params: PyTree, version: int) -> tuple[float, float]:
        if self.push is not None:
            return await self.push_servers(params, version)
        t0 = time.perf_counter()
        try:
            path = await asyncio.to_thread(self._write_delta if self.deltas is not None
                                           else self.write, params, version)
        except Exception as e:  # noqa: BLE001 - a storage error
            self.executor.fail_waits(_failed(version, e))  # the learner may wait for a batch
            raise
        return await self._update_written(path, version, time.perf_counter() - t0,
                                          delta=self.deltas is not None)

    def _write_delta(self, params: PyTree, version: int) -> str:
        assert self.deltas is not None
        path, nbytes = self.deltas.publish(params, version)
        self.bytes_written[version] = nbytes
        return path

    async def _update_written(self, path: str, version: int, write_s: float,
                              delta: bool = False) -> tuple[float, float]:
        """(write seconds, update seconds) once ``path`` holds ``version`` (``delta``: the
        version's delta file). A failure also fails the learner's wait for its next batch
        (``executor.fail_waits``): in sync mode that batch would never come, and the
        failure would surface only at the next publish."""
        try:
            update = (self.delta_servers(str(path), version) if delta
                      else self.update_servers(str(path), version))
            return write_s, await update
        except Exception as e:  # noqa: BLE001 - a transport or server error
            self.executor.fail_waits(_failed(version, e))
            raise

    async def update_servers(self, path: str, version: int) -> float:
        """Runs on the executor's loop: pause, load ``path`` as ``version``, resume. Returns
        the seconds it took. ``staged``: ``path`` is the transfer id the servers swap to."""
        if self.staged:
            return await self.swap_servers(path, version)
        t0 = time.perf_counter()
        client = self.client
        async with self._runs_held_back():
            try:
                if self.interruptible:
                    await client.pause()  # in-flight requests return as abort, resubmitted
                if self.adapter_subdir is None:  # raises if a server refuses
                    await client.update_weights_from_disk(path, version)
                else:
                    await client.load_lora_adapter(
                        f"v{version}", posixpath.join(path, self.adapter_subdir), version)
                self.executor.set_version(version)
            except BaseException:
                if self.interruptible:  # the servers left (if any) go on; the first error stands
                    with contextlib.suppress(Exception):
                        await client.continue_()
                raise
            if self.interruptible:
                await client.continue_()
        return time.perf_counter() - t0

    async def delta_servers(self, path: str, version: int) -> float:
        """Runs on the executor's loop: every server applies the delta file ``path`` as
        ``version`` (or, where it refuses, the full version); returns the seconds the
        executor held back new runs (the servers apply while they generate, then swap)."""
        assert self.deltas is not None
        deltas = self.deltas
        wrote_full: list[int] = []

        async def full() -> str:
            full_path, nbytes = await asyncio.to_thread(deltas.full, version)
            wrote_full.append(nbytes)
            return full_path

        t0 = time.perf_counter()
        async with self._runs_held_back():
            replies = await self.client.update_weights_from_delta(
                path, version, full, abort_all_requests=self.interruptible)
            self.executor.set_version(version)
        self.full_servers[version] = sum(bool(r.get("full")) for r in replies)
        self.bytes_written[version] = self.bytes_written.get(version, 0) + sum(wrote_full)
        return time.perf_counter() - t0

    async def push_servers(self, params: PyTree, version: int) -> tuple[float, float]:
        """Runs on the executor's loop: ``push`` moves ``params`` into every server as
        ``version`` (checkpoint.publish: distributed) while the executor holds back new runs
        (with ``pause_servers`` the servers pause first: in-flight requests return as
        aborted and are resubmitted under the new weights; when not ``interruptible`` the
        runs finish first). Returns (seconds of the push, seconds new runs were held back)."""
        assert self.push is not None
        t0 = time.perf_counter()
        client = self.client
        async with self._runs_held_back():
            paused = False
            try:
                if self.interruptible and self.pause_servers:
                    await client.pause()
                    paused = True
                t1 = time.perf_counter()
                await asyncio.to_thread(self.push, params, version, self.interruptible)
                push_s = time.perf_counter() - t1
                self.executor.set_version(version)
                if paused:
                    paused = False
                    await client.continue_()
            except Exception as e:  # noqa: BLE001 - a transport or server error
                if paused:  # the servers left (if any) go on; the first error stands
                    with contextlib.suppress(Exception):
                        await client.continue_()
                self.executor.fail_waits(_failed(version, e))
                raise
        return push_s, time.perf_counter() - t0

    @contextlib.asynccontextmanager
    async def _runs_held_back(self) -> AsyncIterator[None]:
        """While the servers take a version: no new runs (the executor pauses until the
        block ends); when not ``interruptible``, the runs in flight first finish under the
        old weights."""
        ex = self.executor
        ex.pause()
        try:
            if not self.interruptible:
                while ex.metrics()["running"] > 0:
                    await asyncio.sleep(0.005)
            yield
        finally:
            ex.resume()

    async def swap_servers(self, transfer: str, version: int) -> float:
        """Runs on the executor's loop: every server swaps to the weights it staged for
        ``transfer``, as ``version``; returns the seconds the executor held back new runs
        (the servers' own pause, abort to swap, is shorter)."""
        t0 = time.perf_counter()
        async with self._runs_held_back():
            await self.client.swap_staged_weights(transfer, version,
                                                  abort_all_requests=self.interruptible)
            self.executor.set_version(version)
        return time.perf_counter() - t0
