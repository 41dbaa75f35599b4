"""Training runs with faults injected, through scripts/train.py in real subprocesses: they
fail loudly with one line and a documented exit status, never hang, and lose nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_trainer import REPO, SMALL, TRAIN, _env, _rows

STOPPED, BAD_INPUT = 3, 2  # areal_jax.trainer.EXIT_CODES


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(TRAIN + SMALL + args, capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=REPO)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(TRAIN + SMALL + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO, start_new_session=True)


def _children(pid: int) -> list[int]:
    """Direct child processes (the embedded server, reward workers)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for_version(proc: subprocess.Popen, run_dir: Path, version: int, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("version", 0) >= version for r in _rows(run_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"version {version} not reached in {timeout}s")


# ----------------------------------------------------------------------------- signals
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_gracefully(tmp_path, sig):
    """SIGTERM (Kubernetes, Slurm, `timeout`) and SIGINT (Ctrl-C) take the same graceful
    path: servers and reward workers stopped, files closed, exit 128 + signal number, and,
    since the config asks for it, a checkpoint of the current version."""
    run_dir = tmp_path / "run"
    proc = _start([f"run_dir={run_dir}", "train.total_versions=200", "checkpoint.every_versions=0",
                   "checkpoint.on_interrupt=true"])
    try:
        _wait_for_version(proc, run_dir, 1)
        children = _children(proc.pid)
        assert children, "the embedded server should be a child process"
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert f"interrupted by {sig.name}" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not any(_alive(c) for c in children)
    # checkpoint.on_interrupt: the version reached is saved, and the run resumes from it.
    ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    done = max(r["version"] for r in _rows(run_dir))
    assert ckpts and ckpts[-1] >= done, (ckpts, done)


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start([f"run_dir={run_dir}", "train.total_versions=200",
                   "checkpoint.every_versions=0"])
    try:
        _wait_for_version(proc, run_dir, 1)
        children = _children(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        seen = []
        for line in proc.stderr:  # signals sent back to back would be delivered as one
            seen.append(line)
            if "SIGTERM: stopping" in line:
                break
        os.kill(proc.pid, signal.SIGTERM)
        _, rest = proc.communicate(timeout=300)
        stderr = "".join(seen) + rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "second signal (SIGTERM); exiting now" in stderr
    deadline = time.monotonic() + 30  # the server dies with SIGKILL: only reaping is left
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children)
