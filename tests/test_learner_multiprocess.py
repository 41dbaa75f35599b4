"""Two processes joined by jax.distributed (gloo CPU collectives, localhost) train like one."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _learner_data import single_device_reference

WORKER = Path(__file__).with_name("_multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
    port, out = free_port(), tmp_path / "result"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(pid), "2", str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for pid, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {pid} failed:\n{log[-3000:]}"

    want = single_device_reference()  # the same training on one device of this process
    assert want["metrics"][1]["loss"] != want["metrics"][0]["loss"]  # the steps did train
    for pid in range(2):
        got = np.load(f"{out}.{pid}.npz")
        for step, metrics in enumerate(want["metrics"]):
            for k in ("loss", "grad_norm", "clip_frac", "n_loss_tokens"):
                np.testing.assert_allclose(got[f"step{step}_{k}"], metrics[k], rtol=1e-5,
                                           atol=1e-7, err_msg=f"process {pid} step {step} {k}")
        np.testing.assert_allclose(got["logp0"], want["logp0"], rtol=1e-5, atol=1e-6)
        for i, w in enumerate(want["grads0"]):
            np.testing.assert_allclose(got[f"grad{i}"], w, rtol=1e-5, atol=1e-5 * np.abs(w).max(),
                                       err_msg=f"process {pid} grad {i}")
        for i, w in enumerate(want["params"]):
            np.testing.assert_allclose(got[f"param{i}"], w, rtol=1e-5, atol=1e-6,
                                       err_msg=f"process {pid} param {i}")
        # Process-local feeding: the same training; logprobs come back for own rows only.
        for step, metrics in enumerate(want["metrics"]):
            np.testing.assert_allclose(got[f"local_step{step}_loss"], metrics["loss"], rtol=1e-5)
        rows = slice(4 * pid, 4 * pid + 4)  # process pid holds batch shards 4*pid .. 4*pid+3
        np.testing.assert_allclose(got["local_logp0"], want["logp0"][rows], rtol=1e-5, atol=1e-6)
        for i, w in enumerate(want["params"]):
            np.testing.assert_allclose(got[f"local_param{i}"], w, rtol=1e-5, atol=1e-6,
                                       err_msg=f"process {pid} process-local param {i}")
