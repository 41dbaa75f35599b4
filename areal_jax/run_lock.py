"""One trainer per run dir: process 0 of a run holds an exclusive lock on ``RUN_DIR/.lock``.

A second ``train.py`` on a run dir whose trainer is still running rewrote its
``metrics.jsonl`` on resume and wrote the same ``weights/`` and ``checkpoints/``; it now
stops before touching anything (exit 2), with one line naming the run dir and the holder
(pid, host, start time, as the holder wrote them into the file). The lock is an ``flock``:
the kernel drops it when its process ends however it ends, so a run killed with ``kill -9``
leaves no stale lock (the file stays, with the dead holder's details, and is simply taken).

Local run dirs only: a ``gs://`` run dir has no lock (object stores have no ``flock``);
its run files are written through a local working copy under ``storage.cache_dir``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator

from areal_jax.run_inputs import TrainerError

LOCK_NAME = ".lock"


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = " ".join(f.read().split())[:200]
    except OSError:
        text = ""
    return text or "a process that has not written its details yet"


@contextlib.contextmanager
def lock_run_dir(run_dir: str) -> Iterator[str | None]:
    """Holds the run dir's lock until the context ends; yields its path (None for a URL).
    Raises :class:`TrainerError` when another process holds it."""
    from areal_jax import storage

    if storage.is_url(run_dir):
        yield None
        return
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainerError(
                f"run_dir {os.path.abspath(run_dir)} is in use by another trainer "
                f"({_holder(path)}); wait for it to end or stop it, or pick another "
                "run_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, (f"pid {os.getpid()} on host {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n").encode())
        yield path
    finally:
        os.close(fd)  # closing the descriptor drops the lock
