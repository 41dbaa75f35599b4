"""The job's notice board: a small key-value store that process 0 serves over TCP.

Several processes need to tell each other small things outside JAX collectives: "the next
batch is ready" (a process must not wait inside a collective for minutes; XLA's CPU
collectives give up after 30 min, and a first collective gives up after 30 s) and the
:class:`~areal_jax.parallel.distributed.JobGuard`'s heartbeats and failures. JAX keeps its
own key-value store private, so process 0 serves this one (a thread, JSON lines over TCP)
and every process, 0 included, is a client. Values are strings; each thread has its own
connection, so a thread waiting on a key never delays another's heartbeat.

The board starts in :func:`~areal_jax.parallel.initialize_distributed`; its address reaches
the other processes in one small collective there (over one device per process), while
every process is at the same point of its start-up.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from typing import Any

# A request or a reply is one JSON line; a waiting ``get`` holds at most this long per request.
_MAX_WAIT_S = 5.0


class BoardError(RuntimeError):
    """The board refused a request (e.g. a key set twice without ``allow_overwrite``)."""


class _Store:
    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self._changed = threading.Condition()

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op, key = req.get("op"), str(req.get("key", ""))
        with self._changed:
            if op == "set":
                if key in self._data and not req.get("overwrite"):
                    return {"error": f"key {key!r} is already set"}
                self._data[key] = str(req["value"])
                self._changed.notify_all()
                return {}
            if op == "get":
                deadline = time.monotonic() + min(float(req.get("wait_s", 0.0)), _MAX_WAIT_S)
                while key not in self._data and self._changed.wait(
                        max(0.0, deadline - time.monotonic())):
                    pass
                return {"value": self._data.get(key)}
            if op == "dir":
                return {"items": sorted((k, v) for k, v in self._data.items() if k.startswith(key))}
            if op == "del":
                for k in [k for k in self._data if k == key or k.startswith(key.rstrip("/") + "/")]:
                    del self._data[k]
                return {}
        return {"error": f"unknown board request {op!r}"}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        store: _Store = self.server.store  # type: ignore[attr-defined]
        try:
            for line in self.rfile:
                try:
                    reply = store.handle(json.loads(line))
                except (ValueError, KeyError, TypeError) as e:
                    reply = {"error": f"bad board request: {type(e).__name__}: {e}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()
        except ConnectionError:  # the process at the other end is gone: the job guard says so
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class BoardServer:
    """Process 0's board, served from a daemon thread on ``host`` (an ephemeral port)."""

    def __init__(self, host: str) -> None:
        server_cls = _Server6 if ":" in host else _Server  # an IPv6 literal, e.g. "::1"
        self._server = server_cls((host, 0), _Handler)
        self._server.store = _Store()  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="areal-board", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class BoardClient:
    """A process's handle on the board at ``host:port``. The method names and meanings are
    those of JAX's own coordination-service client, for the calls this package makes."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        self.address = (host, port)
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _request(self, req: dict[str, Any]) -> dict[str, Any]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._local.conn = (sock, sock.makefile("rb"))
        sock, reader = conn
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
            line = reader.readline()
        except OSError:
            self._local.conn = None
            sock.close()
            raise
        if not line:
            self._local.conn = None
            sock.close()
            raise ConnectionError(f"the job's board at {self.address[0]}:{self.address[1]} "
                                  "(process 0) closed the connection")
        reply = json.loads(line)
        if "error" in reply:
            raise BoardError(reply["error"])
        return reply

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._request({"op": "set", "key": key, "value": value, "overwrite": allow_overwrite})

    def key_value_try_get(self, key: str) -> str | None:
        return self._request({"op": "get", "key": key})["value"]

    def wait_key(self, key: str, timeout_s: float | None = None) -> str | None:
        """The value of ``key`` once it is set; None if ``timeout_s`` passes first (None:
        wait as long as it takes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = _MAX_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
            value = self._request({"op": "get", "key": key, "wait_s": min(left, _MAX_WAIT_S)})
            if value["value"] is not None or (deadline is not None and left <= 0):
                return value["value"]

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [tuple(kv) for kv in self._request({"op": "dir", "key": prefix})["items"]]

    def key_value_delete(self, key: str) -> None:
        self._request({"op": "del", "key": key})
