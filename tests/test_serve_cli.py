"""scripts/serve.py as a user starts it: a healthy start's console says where it serves and
nothing about backends this host does not have."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from areal_jax.engine.launch import free_port

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "areal_jax" / "data" / "assets" / "arith_sft"


def test_serve_start_does_not_log_the_backend_probe():
    """issue 39 item 2: every start printed ``INFO ... Unable to initialize backend 'tpu'``
    (JAX probes each backend it knows on first use; the server logs at INFO). Started as a
    user would, with no JAX_PLATFORMS, the log holds the serving line and not that one."""
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve.py"), "--model-path",
                             str(MODEL), "--port", str(port), "--max-slots", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO)
    lines: list[str] = []
    serving = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "serving " in line:
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert serving.wait(300), "".join(lines)[-3000:]
    finally:
        proc.terminate()
        proc.wait(60)
        reader.join(10)
    log = "".join(lines)
    assert f"on http://127.0.0.1:{port}" in log
    assert "Unable to initialize backend" not in log, log[-3000:]
