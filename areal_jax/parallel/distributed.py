"""Multi-host start-up: ``jax.distributed.initialize`` from config or the environment.

Every process runs the same program (JAX multi-controller). Settings come from the
arguments, else from ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
(and ``JAX_LOCAL_DEVICE_IDS``, read by JAX itself). With none of them set, or one process,
this is a no-op, unless ``auto_detect=True`` lets JAX detect a cluster (SLURM, TPU pods,
Open MPI, ...). Must run before anything else touches JAX devices.
"""

from __future__ import annotations

import os

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
        return jax.process_count() > 1
    address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    n = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)

    if address is None and n is None and pid is None:
        if not auto_detect:
            return False
        jax.distributed.initialize()
        return jax.process_count() > 1
    if n is not None and n < 1:
        raise ValueError(f"num_processes ({ENV_NUM_PROCESSES}) must be >= 1, got {n}")
    if n == 1 and pid in (None, 0):
        return False
    missing = [name for name, v in ((f"coordinator_address ({ENV_COORDINATOR})", address),
                                    (f"num_processes ({ENV_NUM_PROCESSES})", n),
                                    (f"process_id ({ENV_PROCESS_ID})", pid)) if v is None]
    if missing:
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
    return jax.process_count() > 1


def is_main_process() -> bool:
    return jax.process_index() == 0
