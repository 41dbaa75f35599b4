"""Pinning a process to CPU cores pins every thread it has, JAX's compute threads
included, and refuses cores the machine does not have."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal_jax.cpu_affinity import pin_process_to_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="the OS has no CPU affinity call")

# Starts JAX's CPU backend (its thread pools) and runs a matmul, THEN pins: the case of a
# process that pins late. Prints each thread's allowed cores afterwards.
_CHILD = r"""
import json, os, sys
import jax, jax.numpy as jnp
x = jnp.ones((256, 256))
(x @ x).block_until_ready()
before = len(os.listdir("/proc/self/task"))
from areal_jax.cpu_affinity import pin_process_to_cpus
pin_process_to_cpus([int(sys.argv[1])])
import threading
t = threading.Thread(target=lambda: None); t.start(); t.join()
(x @ x).block_until_ready()
print(json.dumps({"threads_before": before,
                  "affinity": [sorted(os.sched_getaffinity(int(tid)))
                               for tid in os.listdir("/proc/self/task")]}))
"""


def test_pins_every_thread_even_after_jax_started():
    core = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    res = subprocess.run([sys.executable, "-c", _CHILD, str(core)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["threads_before"] > 1  # JAX had started threads of its own before the pin
    assert out["affinity"] and all(cores == [core] for cores in out["affinity"])


def test_bad_cores_are_refused_and_change_nothing():
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"cannot pin to CPU cores \[4096\]"):
        pin_process_to_cpus([4096])
    with pytest.raises(ValueError, match="no CPU cores given"):
        pin_process_to_cpus([])
    assert os.sched_getaffinity(0) == before
