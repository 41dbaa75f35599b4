"""Multi-host start-up: ``jax.distributed.initialize`` from config or the environment.

Every process runs the same program (JAX multi-controller). Settings come from the
arguments, else from ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
(and ``JAX_LOCAL_DEVICE_IDS``, read by JAX itself). With none of them set, or one process,
this is a no-op, unless ``auto_detect=True`` lets JAX detect a cluster (SLURM, TPU pods,
Open MPI, ...). Must run before anything else touches JAX devices.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import jax

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _is_initialized() -> bool:
    return bool(jax.distributed.is_initialized())


def detected_cluster() -> str | None:
    """The multi-process cluster this process was started in, as JAX can auto-detect it:
    "slurm" (srun with several tasks), "tpu" (a multi-host TPU VM slice), "mpi"
    (mpirun with several ranks); None otherwise."""
    def more_than_one(name: str) -> bool:
        try:
            return int(os.environ.get(name, "1").split("(")[0]) > 1
        except ValueError:
            return False

    if "SLURM_JOB_ID" in os.environ and (more_than_one("SLURM_STEP_NUM_TASKS")
                                         or more_than_one("SLURM_NTASKS")):
        return "slurm"
    if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        return "tpu"
    if more_than_one("OMPI_COMM_WORLD_SIZE"):
        return "mpi"
    return None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, auto_detect: bool = False,
                           cpu_collectives: str = "gloo",
                           initialization_timeout_s: int = 300) -> bool:
    """Join the JAX multi-process job; returns True when running with several processes.

    Args:
      coordinator_address: "host:port" of process 0's coordinator service.
      num_processes: total processes.
      process_id: this process's rank, 0..num_processes-1.
      auto_detect: with nothing configured, let ``jax.distributed.initialize()`` detect a
        cluster environment instead of running single-process.
      cpu_collectives: cross-process collectives on CPU ("gloo" or "mpi").
    """
    if _is_initialized():
        _start_board(None)
        return jax.process_count() > 1
    address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    n = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)

    if address is None and n is None and pid is None:
        if not auto_detect:
            return False
        jax.distributed.initialize()
        _start_board(None)
        return jax.process_count() > 1
    if n is not None and n < 1:
        raise ValueError(f"num_processes ({ENV_NUM_PROCESSES}) must be >= 1, got {n}")
    if n == 1 and pid in (None, 0):
        return False
    if address is None or n is None or pid is None:
        missing = [name for name, v in ((f"coordinator_address ({ENV_COORDINATOR})", address),
                                        (f"num_processes ({ENV_NUM_PROCESSES})", n),
                                        (f"process_id ({ENV_PROCESS_ID})", pid)) if v is None]
        raise ValueError(f"multi-process JAX needs all of coordinator_address, num_processes and "
                         f"process_id; missing: {', '.join(missing)}")
    if not 0 <= pid < n:
        raise ValueError(f"process_id must be in [0, {n}), got {pid}")
    if ":" not in address:
        raise ValueError(f"coordinator_address must be host:port, got {address!r}")
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=pid,
                                   initialization_timeout=initialization_timeout_s)
    except RuntimeError as e:
        raise RuntimeError(f"jax.distributed.initialize(coordinator_address={address!r}, "
                           f"num_processes={n}, process_id={pid}) failed: {e}. It must run before "
                           "any JAX computation or device query in this process.") from e
    _start_board(address.rsplit(":", 1)[0])
    return jax.process_count() > 1


def is_main_process() -> bool:
    return jax.process_index() == 0


# ----------------------------------------------------------------------------- one job, one fate
# Keys on the job's board (areal_jax.parallel.board, served by process 0).
_KV_PREFIX = "areal_jax"


_board: Any = None  # (BoardServer on process 0 or None, BoardClient)


def _start_board(coordinator_host: str | None) -> None:
    """Starts the job's notice board (:mod:`areal_jax.parallel.board`) on process 0 and tells
    every process its address, in one collective; a no-op single-process or when started.

    Every process calls it right after ``jax.distributed.initialize`` (so all arrive within
    seconds). The board listens on the coordinator's host when one was given (process 0 runs
    the coordinator), else on every interface of process 0, found by its host name.
    """
    global _board
    if _board is not None or jax.process_count() < 2:
        return
    import socket

    import numpy as np

    from areal_jax.parallel.board import BoardClient, BoardServer

    server, address = None, np.zeros(256, np.uint8)
    if jax.process_index() == 0:
        host = coordinator_host.strip("[]") if coordinator_host else None
        try:
            server = BoardServer(host or "")
        except OSError:  # e.g. a name that is not this machine's own address
            server = BoardServer("")
        if not host or host in ("0.0.0.0", "::"):
            host = socket.getfqdn()
        text = f"{host} {server.port}".encode()
        address[:len(text)] = np.frombuffer(text, np.uint8)
    # Over one device per process: the other devices' collectives are first set up by the
    # learner's own programs, as without the board.
    mesh = _process_mesh()
    spec = jax.sharding.PartitionSpec("process")
    local = address.astype(np.int32)[None]
    blocks = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, spec),
                                                    local, (jax.process_count(), 256))
    summed = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "process"), mesh=mesh,
                                   in_specs=spec, out_specs=spec))(blocks)
    address = np.asarray(summed.addressable_shards[0].data)[0]
    host, port = bytes(address.astype(np.uint8)).rstrip(b"\0").decode().rsplit(" ", 1)
    _board = (server, BoardClient(host, int(port)))


def _process_mesh() -> jax.sharding.Mesh:
    """One device per process (its lowest id), in process order."""
    import numpy as np

    firsts: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        firsts.setdefault(d.process_index, d)
    return jax.sharding.Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))


def board_client() -> Any:
    """This process's client of the job's board; RuntimeError when there is none (a
    single-process run, or :func:`initialize_distributed` was not used)."""
    if _board is None:
        raise RuntimeError("the job's board is started by areal_jax.parallel."
                           "initialize_distributed with several processes; it was not")
    return _board[1]


def _kv_client() -> Any:
    """The job's key-value store (the board); None when single-process."""
    return None if _board is None else _board[1]


class JobGuard:
    """Ends every process of a multi-process job within seconds when one of them fails.

    Without it, a process that dies leaves the others blocked in a collective until JAX's
    shutdown barrier aborts them minutes later. A daemon thread on every process writes a
    heartbeat to the job's board (process 0) every ``interval_s`` and reads everyone else's:

    * a process that raises calls :meth:`fail`: it publishes its error, runs its cleanups
      and exits at once (skipping JAX's shutdown barrier);
    * every other process sees that error on its next tick, prints it, runs its cleanups
      and exits with status 1;
    * a process that stops beating for ``peer_timeout_s`` (killed, hung) counts as failed;
      losing the coordinator (process 0) is a failure at once.

    A process that finished cleanly calls :meth:`done` first, so that its silence afterwards
    is not taken for a failure.
    """

    def __init__(self, *, peer_timeout_s: float = 15.0, interval_s: float = 0.5) -> None:
        import threading

        if peer_timeout_s <= interval_s:
            raise ValueError(
                f"peer_timeout_s ({peer_timeout_s}) must exceed interval_s ({interval_s})")
        self.process_id, self.num_processes = jax.process_index(), jax.process_count()
        self.peer_timeout_s, self.interval_s = peer_timeout_s, interval_s
        self._client = _kv_client()
        if self._client is None:
            raise RuntimeError("JobGuard needs jax.distributed to be initialised")
        self._cleanups: list[Callable[[], Any]] = []
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last heartbeat, when it changed)
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="areal-job-guard", daemon=True)
        self._thread.start()

    def add_cleanup(self, fn: Callable[[], Any]) -> None:
        """Runs ``fn`` before this process exits because of a failure (e.g. stop servers)."""
        self._cleanups.append(fn)

    def fail(self, message: str, exit_code: int = 1) -> NoReturn:
        """Tells every process that this one failed with ``message``, then exits."""
        with contextlib.suppress(Exception):
            self._client.key_value_set(f"{_KV_PREFIX}/guard/failed/{self.process_id}",
                                       message[:4000], allow_overwrite=True)
        self._exit(exit_code, None)

    def done(self) -> None:
        """This process finished cleanly: stop watching, and let the others not wait on it."""
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s)
        with contextlib.suppress(Exception):
            self._client.key_value_set(f"{_KV_PREFIX}/guard/done/{self.process_id}", "1",
                                       allow_overwrite=True)

    def silent_peers(self, wait_s: float) -> list[int]:
        """Peers whose heartbeat has not changed for 3 intervals (killed or hung), waiting
        up to ``wait_s`` for one to show (a collective may notice a death first)."""
        import time

        end = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            silent = sorted(p for p, (_, since) in list(self._seen.items())
                            if now - since > 3 * self.interval_s)
            if silent or now >= end:
                return silent
            time.sleep(self.interval_s / 2)

    def _exit(self, exit_code: int, message: str | None) -> NoReturn:
        self._exiting.acquire()  # one exit path; a second caller blocks until the process ends
        if message:
            print(f"error: {message}", file=sys.stderr, flush=True)
        for fn in reversed(self._cleanups):
            with contextlib.suppress(Exception):
                fn()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)

    def _watch(self) -> None:
        import time

        beat = 0
        seen = self._seen
        start = time.monotonic()
        while not self._stop.wait(self.interval_s):
            beat += 1
            try:
                self._client.key_value_set(f"{_KV_PREFIX}/guard/alive/{self.process_id}", str(beat),
                                           allow_overwrite=True)
                entries = dict(self._client.key_value_dir_get(f"{_KV_PREFIX}/guard/"))
            except Exception as e:  # noqa: BLE001 - any transport error: the coordinator is gone
                if self._stop.is_set():
                    return
                self._exit(1, f"process {self.process_id}: lost the job's coordinator (process 0 "
                              f"died or is unreachable): {type(e).__name__}: {str(e)[:300]}")
            now = time.monotonic()
            for key, value in entries.items():
                if "/failed/" in key and not key.endswith(f"/failed/{self.process_id}"):
                    self._exit(1, f"process {key.rsplit('/', 1)[1]} failed: {value}")
            for peer in range(self.num_processes):
                if peer == self.process_id or f"{_KV_PREFIX}/guard/done/{peer}" in entries:
                    continue
                value = entries.get(f"{_KV_PREFIX}/guard/alive/{peer}", "")
                last, since = seen.get(peer, ("", start))
                if value != last:
                    seen[peer] = (value, now)
                elif now - since > self.peer_timeout_s:
                    self._exit(1, f"process {peer} stopped responding for "
                                  f"{now - since:.0f} s (killed or hung); ending process "
                                  f"{self.process_id} too")


_guard: JobGuard | None = None


def start_job_guard(peer_timeout_s: float = 15.0) -> JobGuard | None:
    """Starts this process's :class:`JobGuard` (once); None when running single-process."""
    global _guard
    if _guard is None and _is_initialized() and jax.process_count() > 1:
        _guard = JobGuard(peer_timeout_s=peer_timeout_s)
    return _guard


def job_guard() -> JobGuard | None:
    """The running :class:`JobGuard`, if any."""
    return _guard
