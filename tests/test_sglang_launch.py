"""engine/sglang_launch.py: the SGLang command line rollout.sglang gives, and the watcher that
ends the server's process group when the trainer dies (even by SIGKILL). SGLang itself is
not installed here: the watched command is a plain Python process serving /health."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from areal_jax.engine.launch import free_port, wait_healthy
from areal_jax.engine.sglang_launch import sglang_command

REPO = Path(__file__).resolve().parent.parent

# A stand-in server: answers /health, records its pid, and would run for ten minutes.
SERVER = """
import http.server, os, sys
open(sys.argv[2], "w").write(str(os.getpid()))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# The trainer's side: launch under the watcher, wait until healthy, report, then sleep.
PARENT = """
import sys, time
from pathlib import Path
from areal_jax.engine.launch import wait_healthy
from areal_jax.engine.sglang_launch import launch_sglang
port, pidfile, log = sys.argv[1], sys.argv[2], Path(sys.argv[3])
h = launch_sglang([sys.executable, "-c", sys.argv[4], port, pidfile],
                  url=f"http://127.0.0.1:{port}", env={"CUDA_VISIBLE_DEVICES": "4"},
                  log_path=log)
wait_healthy([h], 60)
print(h.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_sglang_command_has_the_flags_servers_md_lists():
    cmd = sglang_command("/env/bin/python", "/w/v3", port=30001, weight_version=3,
                         dtype="bfloat16", context_length=2048,
                         placement_args=("--tp-size", "2", "--mem-fraction-static", "0.85"),
                         api_key="k", extra_args=["--chunked-prefill-size", "4096"])
    assert cmd[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    line = " ".join(cmd)
    for flags in ("--model-path /w/v3", "--host 127.0.0.1", "--port 30001",
                  "--weight-version 3", "--skip-tokenizer-init", "--dtype bfloat16",
                  "--context-length 2048", "--tp-size 2", "--mem-fraction-static 0.85",
                  "--api-key k", "--chunked-prefill-size 4096"):
        assert flags in line, flags


def test_the_watcher_ends_the_server_when_the_trainer_is_killed(tmp_path):
    port, pidfile = free_port(), tmp_path / "server.pid"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(port), str(pidfile),
                               str(tmp_path / "sglang0.log"), SERVER],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        watcher_pid = int(parent.stdout.readline())
        server_pid = int(pidfile.read_text())
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        # The server got the placement's environment.
        environ = Path(f"/proc/{server_pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=4" in environ
        parent.send_signal(signal.SIGKILL)  # the trainer dies without any cleanup
        parent.wait(10)
        deadline = time.monotonic() + 30
        while (_alive(server_pid) or _alive(watcher_pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the server outlived its trainer"
        assert not _alive(watcher_pid)
        assert "parent process" in (tmp_path / "sglang0.log").read_text()
    finally:
        parent.kill()
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_terminate_ends_the_server_and_its_watcher(tmp_path):
    from areal_jax.engine.sglang_launch import launch_sglang

    port, pidfile = free_port(), tmp_path / "server.pid"
    handle = launch_sglang([sys.executable, "-c", SERVER, str(port), str(pidfile)],
                           url=f"http://127.0.0.1:{port}", env={}, log_path=tmp_path / "l.log")
    try:
        wait_healthy([handle], 60)
        server_pid = int(pidfile.read_text())
        handle.terminate(timeout=15)  # the run's shutdown: SIGTERM to the group
        assert not handle.alive()
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid)
    finally:
        handle.kill()
