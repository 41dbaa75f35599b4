"""Pinning a process to CPU cores, as the trainer (``rollout.learner_cpu_cores``) and the
embedded servers (``--cpu-affinity``) do.

    pin_process_to_cpus([1])      # first thing in the process, before JAX starts

On Linux ``os.sched_setaffinity(0, cpus)`` pins only the calling thread (and the threads
it starts later); threads that already run keep their cores. XLA's CPU backend starts
its thread pools when JAX first touches a device, sized to the cores the process may use
at that moment. Pinning after that leaves XLA's compute threads on every core (and sized
for all of them): the "pinned" learner then competed with the engine for its core.
So :func:`pin_process_to_cpus` pins every thread the process already has, and callers
call it before the JAX backend starts, so XLA sizes its pools for the pinned cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable


def pin_process_to_cpus(cpus: Iterable[int]) -> set[int]:
    """Restricts every thread of this process, and the threads it starts later, to
    ``cpus``. Returns the set applied (empty where the OS has no affinity call). Raises
    ValueError for an empty set or cores this machine does not have (OSError from the
    kernel reworded)."""
    wanted = {int(c) for c in cpus}
    if not hasattr(os, "sched_setaffinity"):  # macOS, Windows: the OS places threads itself
        return set()
    if not wanted:
        raise ValueError("no CPU cores given")
    try:
        os.sched_setaffinity(0, wanted)  # the calling thread first: the kernel checks the set
    except OSError as e:
        raise ValueError(f"cannot pin to CPU cores {sorted(wanted)} (this machine has "
                         f"{os.cpu_count()}): {e.strerror or e}") from None
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, PermissionError):
            os.sched_setaffinity(int(tid), wanted)  # a thread may end meanwhile
    return wanted


def usable_cpu_count() -> int:
    """How many cores this process may run on (its affinity set where the OS has one, else
    the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpus_available(cpus: Iterable[int]) -> None:
    """Raises ValueError if any of ``cpus`` is not a core this process may run on (where
    the OS has an affinity call). For cores another process will pin itself to (the
    embedded servers), checked here, where the error can name the setting."""
    if not hasattr(os, "sched_getaffinity"):
        return
    usable = os.sched_getaffinity(0)
    missing = sorted({int(c) for c in cpus} - usable)
    if missing:
        raise ValueError(f"cannot pin to CPU cores {missing}: this process may run on cores "
                         f"{sorted(usable)} only")
