"""scripts/train.py as two JAX processes on this machine (gloo CPU collectives, 127.0.0.1).

Process 0 runs the rollout executor, the embedded server and the metrics; both processes
train one sharded learner and get their rows of each batch through the trajectory pipeline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "scripts" / "train.py"), "--config",
         str(REPO / "configs" / "tiny_demo.yaml")]
SMALL = [
    "train.batch_size=4", "rollout.n_samples=4", "rollout.max_new_tokens=24",
    "rollout.max_slots=16", "train.rows_per_micro_batch=8", "eval.every_versions=0",
    "eval.at_start=false", "eval.at_end=false", "progress_bar=false",
    "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, devices: int, args: list[str], logs: Path,
           per_process: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    logs.mkdir(parents=True, exist_ok=True)
    for pid in range(n):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n),
                   JAX_PROCESS_ID=str(pid))
        out = (logs / f"process{pid}.log").open("w")
        procs.append(subprocess.Popen(TRAIN + args + SMALL + (per_process or {}).get(pid, []),
                                      stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def log(logs: Path, pid: int) -> str:
    return (logs / f"process{pid}.log").read_text()[-4000:]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def hf_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# One device per process (fsdp spans the two processes); two devices per process (fsdp across
# the processes, tensor parallel inside each).
@pytest.mark.parametrize("devices, mesh, publish", [
    (1, "fsdp=2", "background"),
    pytest.param(2, "fsdp=2,tensor=2", "background", marks=pytest.mark.slow),
    # inline: process 1 joins each tensor's gather while 0 writes
    pytest.param(1, "fsdp=2", "inline", marks=pytest.mark.slow)])
def test_two_processes_train_and_match_one_process(tmp_path, devices, mesh, publish):
    from areal_jax.checkpoint import TrainCheckpointer
    from areal_jax.checkpoint.publish import params_to_hf_dir
    from areal_jax.config import load_config
    from areal_jax.data.trajectories import load_batch
    from areal_jax.learner import Learner
    from areal_jax.parallel import make_mesh
    from areal_jax.run import learner_configs
    from areal_jax.run_inputs import resolve_model_path

    run_dir = tmp_path / "run"
    # optim.eps=1e-3: Adam's first step is lr * g / (|g| + eps); with the default 1e-8 a
    # gradient entry near zero turns last-bit reduction-order differences into O(lr) steps.
    args = ["--mesh", mesh, f"run_dir={run_dir}", "train.total_versions=2",
            "checkpoint.every_versions=1", "train.record_batches=true", "optim.warmup_steps=0",
            "optim.eps=1e-3", "checkpoint.async_save=true", "checkpoint.publish=disk",
            f"checkpoint.publish_mode={publish}"]  # every version's files, compared below
    codes = wait_all(launch(2, devices, args, tmp_path / "logs"), timeout=900)
    for pid, code in enumerate(codes):
        assert code == 0, f"process {pid} exited {code}:\n{log(tmp_path / 'logs', pid)}"
    got = rows(run_dir)
    assert [r["version"] for r in got] == [1, 2]  # one writer: one row per version
    assert all(r["n_trajectories"] == 16 for r in got)  # the global batch: 4 prompts x 4

    # The first version's step in one process, on the same (recorded) global batch.
    cfg = load_config(run_dir / "config.yaml")
    optim, algo, loss_kwargs = learner_configs(cfg)
    learner = Learner.from_hf(str(resolve_model_path(cfg.model.path)), optim, algo, **loss_kwargs,
                              mesh=make_mesh("data=1", devices=__import__("jax").devices()[:1]))
    batch = load_batch(str(run_dir / "batches" / "v1.npz"))
    assert batch.micro_batches[0].shape == (8, cfg.train.seq_len)
    metrics = learner.train_step(batch.micro_batches, current_version=0)
    # fp32 sums over ~10^3 tokens in a different order (eps * sqrt(n) ~ 4e-6, relative).
    np.testing.assert_allclose(got[0]["train/loss"], metrics["loss"], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got[0]["train/grad_norm"], metrics["grad_norm"], rtol=2e-5)
    one = tmp_path / "one_process_v1"
    params_to_hf_dir(learner.model, learner.model_cfg, one)
    two = hf_tensors(run_dir / "weights" / "v1")  # what the 2-process run served as v1
    for name, want in hf_tensors(one).items():
        # params ~1, each moved by <= lr = 1e-4 this step; the update differs by lr / eps *
        # |dg| ~ 1e-10, so the fp32 rounding of the params (~1e-7) dominates.
        np.testing.assert_allclose(two[name], want, rtol=1e-6, atol=1e-6, err_msg=name)

    # The 2-process checkpoint restores in this single process (onto 1 device), params and
    # optimizer state, and equals the weights served as v2.
    ckpt = TrainCheckpointer(str(run_dir / "checkpoints"), read_only=True)
    assert ckpt.latest_step() == 2
    st = learner.state_dict()
    params, opt_state, meta = ckpt.restore(params_target=st["params"],
                                           opt_state_target=st["opt_state"])
    ckpt.close()
    assert meta.version == 2 and meta.executor  # process 0's executor accounting
    learner.load_state(params, opt_state, step=meta.step, version=meta.version)
    restored = tmp_path / "restored_v2"
    params_to_hf_dir(learner.model, learner.model_cfg, restored)
    served = hf_tensors(run_dir / "weights" / "v2")
    for name, want in hf_tensors(restored).items():
        np.testing.assert_array_equal(served[name], want, err_msg=name)


def test_a_failing_process_ends_every_process_at_once(tmp_path):
    # Process 1 cannot create its run dir: it reports that and exits; process 0, which
    # would otherwise wait for it in a collective, ends with its error.
    t0 = time.monotonic()
    procs = launch(2, 1, ["--mesh", "fsdp=2", f"run_dir={tmp_path / 'run'}"], tmp_path / "logs",
                   per_process={1: ["run_dir=/proc/not-writable"]})
    codes = wait_all(procs, timeout=240)
    assert time.monotonic() - t0 < 240
    assert codes[1] == 2, log(tmp_path / "logs", 1)
    assert codes[0] != 0, log(tmp_path / "logs", 0)
    assert "process 1 failed: error: run_dir /proc/not-writable" in log(tmp_path / "logs", 0)


@pytest.mark.slow
def test_killing_one_process_ends_the_job_within_seconds(tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    procs = launch(2, 1, ["--mesh", "fsdp=2", f"run_dir={run_dir}", "train.total_versions=100",
                          "distributed.peer_timeout_s=5", "checkpoint.every_versions=0"],
                   tmp_path / "logs")
    try:
        deadline = time.monotonic() + 600
        while not rows(run_dir) and time.monotonic() < deadline:  # training is under way
            assert all(p.poll() is None for p in procs), log(tmp_path / "logs", 0)
            time.sleep(0.5)
        assert rows(run_dir), log(tmp_path / "logs", 0)
        ours = [c.pid for c in psutil.Process(procs[0].pid).children(recursive=True)]
        assert ours  # the embedded rollout server (and reward workers)
        procs[1].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        code = procs[0].wait(120)  # JAX alone would wait in a collective for minutes
        waited = time.monotonic() - t_kill
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert code == 1, log(tmp_path / "logs", 0)
    # Either the collective in progress fails (gloo sees the connection drop), or, when
    # process 0 is not in one (e.g. waiting for rollouts), the job guard's heartbeat.
    text = log(tmp_path / "logs", 0)
    # gloo words a dropped peer either way, depending on which side of the socket saw it.
    assert ("process 1 stopped responding" in text
            or re.search(r"Connection (reset|closed) by peer", text)), text
    # Issue 33: one line naming the dead peer and what to do, not a traceback from XLA.
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert errors and ("process 1 of this job is gone" in errors[-1]
                       or "process 1 stopped responding" in errors[-1]), text
    assert waited < 120
    time.sleep(1)
    left = [pid for pid in ours if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left running: {left}"
