"""scripts/launch_ray.py on a local Ray cluster started here (127.0.0.1 only): two trainer
processes (one JAX job) and one embedded rollout server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "train.batch_size=4", "rollout.n_samples=4", "rollout.max_new_tokens=24",
    "rollout.max_slots=16", "rollout.max_seq_len=96", "train.rows_per_micro_batch=8",
    "eval.every_versions=0", "eval.at_start=false", "eval.at_end=false", "progress_bar=false",
    "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(temp_dir: str) -> list[psutil.Process]:
    """The Ray processes of this test's cluster (their command lines name its temp dir)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", RAY_USAGE_STATS_ENABLED="0")
    env.pop("XLA_FLAGS", None)
    cmd = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
           "--num-cpus=2", '--resources={"trainer": 2, "rollout": 1}', "--include-dashboard=false",
           f"--temp-dir={temp_dir}", "--disable-usage-stats",
           f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
           f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}"]
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert head.poll() is None, "ray start --head failed"
            r = subprocess.run(["ray", "status", f"--address={address}"], env=env,
                               capture_output=True, text=True)
            if r.returncode == 0 and "trainer" in r.stdout:
                break
            assert time.monotonic() < deadline, r.stdout + r.stderr
            time.sleep(2)
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        for p in _ours(temp_dir):  # anything of this cluster's that outlived the head
            p.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def launcher(address: str, env: dict, run_dir: Path, pid_file: Path, versions: int) -> list[str]:
    return [sys.executable, str(REPO / "scripts" / "launch_ray.py"), "--address", address,
            "--config", str(REPO / "configs" / "tiny_demo.yaml"),
            "--trainers", "2", "--servers", "1",
            "--mesh", "fsdp=2", "--env", "XLA_FLAGS=--xla_force_host_platform_device_count=1",
            "--env", "JAX_PLATFORMS=cpu", "--grace-s", "5", "--pid-file", str(pid_file),
            f"run_dir={run_dir}", f"train.total_versions={versions}",
            "checkpoint.every_versions=0", *SMALL]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_ray_launcher_runs_two_trainers_and_a_server(cluster, tmp_path):
    address, env = cluster
    run_dir, pid_file = tmp_path / "run", tmp_path / "pids.json"
    res = subprocess.run(launcher(address, env, run_dir, pid_file, 2), env=env, capture_output=True,
                         text=True, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert [r["version"] for r in rows(run_dir)] == [1, 2]
    host = socket.gethostname()
    for role in ("trainer0", "trainer1", "server0"):
        assert f"[{role} @ {host}] " in out, out[-3000:]
    started = json.loads(pid_file.read_text())
    assert sorted(s["role"] for s in started) == ["server0", "trainer0", "trainer1"]
    assert not alive([s["pid"] for s in started]), "processes left after the launcher exited"


@pytest.mark.slow
def test_killing_a_trainer_ends_the_ray_job_nonzero(cluster, tmp_path):
    address, env = cluster
    run_dir, pid_file = tmp_path / "run", tmp_path / "pids.json"
    proc = subprocess.Popen(launcher(address, env, run_dir, pid_file, 100), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not rows(run_dir):  # both trainers are training
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(1)
        started = {s["role"]: s["pid"] for s in json.loads(pid_file.read_text())}
        descendants = [c.pid for pid in started.values()
                       for c in psutil.Process(pid).children(recursive=True)]
        os.kill(started["trainer1"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-4000:]
    assert "trainer1 ended with status -9" in out
    time.sleep(1)
    assert not alive(list(started.values()) + descendants), (
        "processes left after the launcher exited")
