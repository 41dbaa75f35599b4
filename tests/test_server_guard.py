"""The server's guard middleware over real HTTP (uvicorn on 127.0.0.1): a bug of ours is a
500 whose keep-alive connection stays open (FastAPI's own Exception handler re-raised,
and uvicorn then dropped the connection, which a client must take for a dead server)."""

from __future__ import annotations

import http.client
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from areal_jax.engine.launch import free_port
from areal_jax.engine.server import _Guard


@pytest.fixture(scope="module")
def url():
    app = FastAPI()

    @app.post("/boom")
    async def boom():
        raise KeyError("a bug of ours")

    @app.post("/ok")
    async def ok():
        return {"ok": True}

    app.add_middleware(_Guard, api_key=None, max_body_bytes=1024)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def test_a_500_keeps_the_connection_and_a_413_too(url):
    conn = http.client.HTTPConnection("127.0.0.1", url, timeout=30)
    conn.connect()
    sock = conn.sock
    for path, body, status in [("/boom", b"{}", 500), ("/ok", b"{}", 200),
                               ("/ok", b"x" * 5000, 413), ("/boom", b"{}", 500),
                               ("/ok", b"{}", 200)]:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        assert resp.status == status, (path, text)
        assert not resp.will_close and conn.sock is sock, f"{path}: connection closed"
        if status == 500:
            assert "KeyError" in text and "a bug of ours" in text
    conn.close()
