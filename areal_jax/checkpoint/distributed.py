"""Serving weights to SGLang (or the embedded engine) through SGLang's own in-memory update:
a torch process group, the learner at rank 0 (``checkpoint.publish: distributed``).

    arrays = serving_arrays(model, "bfloat16")      # checkpoint/stream.py: cast + finiteness
    sender = DistributedPublisher(["http://10.0.0.5:30000"], model_cfg, backend="nccl")
    sender.send(arrays, version=7)                  # every server serves v7, or raises
    sender.close()

The first send makes the group: every server is asked, side by side, to join it
(``POST /init_weights_update_group``, rank 1 + its index, world size 1 + the servers)
while the learner hosts the rendezvous at ``master_address:master_port`` as rank 0. Then
each version goes out in buckets of about ``bucket_bytes``: the learner's tensors, HF-named
and HF-shaped (one per layer, e.g. ``model.layers.0.self_attn.q_proj.weight``: the
``model_defs`` HF table that ``save_hf`` uses), are announced to every server (``POST
/update_weights_from_distributed`` with their names, dtypes and shapes, in a thread each)
while the learner broadcasts them one after another. jax arrays become torch tensors
through DLPack (no copy; on a GPU they stay on it), or through numpy where DLPack cannot.
SGLang loads each bucket as it arrives; the embedded engine assembles the buckets and swaps
the whole version in at once, after the last (``engine/distributed_update.py``).

Any failure (a server refusing, a server gone, a broadcast that fails or outlasts
``timeout_s``) raises :class:`PublishError` naming the server; the learner leaves the group,
and the next send makes it again. An embedded server then still serves the old version,
whole; SGLang may hold the buckets it loaded before the failure (SGLang's own behaviour), so
a run stops or sends the version again.

torch is imported only here and only when a send begins (it is not a core dependency;
``areal_jax.weight_group`` says how to install it). NCCL needs torch with CUDA on the
learner's host and the servers' GPUs; gloo runs anywhere (CPU).
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from areal_jax.checkpoint.publish import PublishError
from areal_jax.checkpoint.stream import LOOPBACK, SendReport, ServingArrays
from areal_jax.weight_group import (
    DEFAULT_GROUP_NAME,
    WeightGroupError,
    destroy_group,
    init_group,
    to_torch,
    torch_modules,
)
from areal_jax.weight_wire import DEFAULT_BUCKET_BYTES
from model_defs import ModelConfig
from model_defs.hf_io import hf_shape, ours_to_hf, param_table

logger = logging.getLogger(__name__)

INIT_ROUTE = "/init_weights_update_group"
UPDATE_ROUTE = "/update_weights_from_distributed"
DESTROY_ROUTE = "/destroy_weights_update_group"


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now (the rendezvous binds it right after)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def address_towards(url: str) -> str:
    """This host's address as the server at ``url`` reaches it: 127.0.0.1 for a server on
    this host, else the local address of the route to it."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if host in LOOPBACK:
        return "127.0.0.1"
    port = urllib.parse.urlsplit(url).port or 80
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


HfEntry = tuple[str, tuple[int, ...], str, Callable[[], Any]]  # name, shape, dtype, produce


def hf_entries(named: Sequence[tuple[str, Any]], model_cfg: ModelConfig) -> list[HfEntry]:
    """The HF tensors of serving weights ``named`` (the engine's layout, by wire name), in
    ``model_defs``' table order: (HF name, HF shape, dtype, a function returning the tensor
    as a jax or numpy array, converted on demand)."""
    by_name = dict(named)
    entries: list[HfEntry] = []
    covered = set()
    for hf_key, nnx_path, transform, layer in param_table(model_cfg):
        wire = ".".join(str(p) for p in nnx_path)
        if wire not in by_name:
            continue
        covered.add(wire)
        array = by_name[wire]
        ours = tuple(array.shape) if layer is None else tuple(array.shape[1:])

        if isinstance(array, jax.Array) and all(d.platform == "cpu" for d in array.devices()):
            array = np.asarray(array)  # a view: on the host, numpy slices without compiling

        def produce(array: Any = array, layer: int | None = layer, transform: Any = transform
                    ) -> Any:  # a jax array on an accelerator stays there (DLPack later)
            return ours_to_hf(array if layer is None else array[layer], transform)

        entries.append((hf_key, hf_shape(ours, transform), np.dtype(array.dtype).name, produce))
    if covered != set(by_name):
        raise PublishError(f"the serving weights {sorted(set(by_name) - covered)[:3]} have "
                           "no HF name; they cannot go through a distributed update")
    return entries


def buckets(entries: Sequence[HfEntry], bucket_bytes: int) -> list[list[HfEntry]]:
    """``entries`` in order, cut into runs of at most ``bucket_bytes`` (a larger tensor is
    a bucket of its own)."""
    out: list[list[HfEntry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * np.dtype(entry[2]).itemsize
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return [b for b in out if b]


class _Refused(Exception):
    pass


class DistributedPublisher:
    """Sends serving weights through SGLang's distributed update routes (module doc)."""

    def __init__(self, urls: Sequence[str], model_cfg: ModelConfig, *, backend: str = "gloo",
                 master_address: str | None = None, master_port: int = 0,
                 group_name: str = DEFAULT_GROUP_NAME, api_key: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0,
                 server_timeout_s: float | None = None):
        """``server_timeout_s``: sent to the servers as ``timeout_s`` (the embedded engine's
        bound on its group operations; SGLang ignores it); None: their default."""
        if not urls:
            raise ValueError("DistributedPublisher needs at least one server URL")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.model_cfg = model_cfg
        self.backend = backend
        self.master_address = master_address or address_towards(self.urls[0])
        self.master_port = master_port
        self.group_name = group_name
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = timeout_s
        self.server_timeout_s = server_timeout_s
        self.last: SendReport | None = None
        self.last_replies: dict[str, dict[str, Any]] = {}  # the last bucket's, per server
        self._pg: Any = None

    # ------------------------------------------------------------------ HTTP
    def _post(self, url: str, route: str, body: dict[str, Any], timeout: float
              ) -> dict[str, Any]:
        """One JSON POST; a refusal (HTTP >= 400 or ``success: false``) raises _Refused."""
        parts = urllib.parse.urlsplit(url)
        cls = (http.client.HTTPSConnection if parts.scheme == "https"
               else http.client.HTTPConnection)
        conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
        try:
            data = json.dumps(body).encode()
            conn.request("POST", route, body=data, headers={
                **self.headers, "Content-Type": "application/json"})
            reply = conn.getresponse()
            raw = reply.read()
        finally:
            conn.close()
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            obj = {"message": raw[:500].decode(errors="replace")}
        if not isinstance(obj, dict):
            obj = {"message": str(obj)[:500]}
        if reply.status >= 400 or obj.get("success") is False:
            message = obj.get("message") or obj.get("error") or f"HTTP {reply.status}"
            raise _Refused(f"{url}{route}: {message}")
        return obj

    def _posts(self, pool: concurrent.futures.ThreadPoolExecutor, route: str,
               body_of: Callable[[int], dict[str, Any]]
               ) -> dict[str, concurrent.futures.Future[dict[str, Any]]]:
        # The server answers after the group operation: allow it the whole group timeout.
        return {url: pool.submit(self._post, url, route, body_of(i), self.timeout_s + 60.0)
                for i, url in enumerate(self.urls)}

    @staticmethod
    def _errors(futures: dict[str, concurrent.futures.Future[dict[str, Any]]]) -> list[str]:
        errors = []
        for url, fut in futures.items():
            try:
                fut.result()
            except _Refused as e:
                errors.append(str(e))
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"{url}: {type(e).__name__}: {e or 'connection dropped'}")
        return errors

    # ------------------------------------------------------------------ group
    def _ensure_group(self) -> None:
        """Makes the group unless it exists (module doc)."""
        if self._pg is not None:
            return
        port = self.master_port or free_port(self.master_address)
        world = 1 + len(self.urls)
        made: dict[str, Any] = {}

        def host_rank_0() -> None:  # blocks until every rank joined (or the timeout)
            try:
                made["pg"] = init_group(self.backend, self.master_address, port, 0, world,
                                        self.group_name, self.timeout_s)
            except WeightGroupError as e:
                made["error"] = e

        joiner = threading.Thread(target=host_rank_0, name="weight-group-rank0", daemon=True)
        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            futures = self._posts(pool, INIT_ROUTE, lambda i: {
                "master_address": self.master_address, "master_port": port,
                "rank_offset": 1 + i, "world_size": world, "group_name": self.group_name,
                "backend": self.backend,
                **({"timeout_s": self.server_timeout_s} if self.server_timeout_s else {})})
            joiner.start()
            errors = self._wait_all(futures, joiner.is_alive)
        joiner.join(timeout=0 if errors else None)
        if "error" in made:
            errors.insert(0, f"rank 0 (this learner): {made['error']}")
        if errors or "pg" not in made:
            destroy_group(made.get("pg"))
            reason = errors[0] if errors else "rank 0 did not join"
            raise PublishError(f"cannot make the weight update group: {reason}; every server "
                               "keeps the old version")
        self._pg = made["pg"]

    def _wait_all(self, futures: dict[str, concurrent.futures.Future[dict[str, Any]]],
                  busy: Callable[[], bool]) -> list[str]:
        """Waits for the servers' replies and for ``busy()`` (the learner's own part) to end;
        a server that refuses ends the wait at once. Returns the errors."""
        while True:
            failed = [f for f in futures.values() if f.done() and f.exception() is not None]
            if failed:
                return self._errors({u: f for u, f in futures.items() if f.done()})
            if not busy() and all(f.done() for f in futures.values()):
                return self._errors(futures)
            time.sleep(0.002)

    def close(self) -> None:
        """Leaves the group and asks the servers to leave it (best effort)."""
        if self._pg is None:
            return
        destroy_group(self._pg)
        self._pg = None
        for url in self.urls:
            try:
                self._post(url, DESTROY_ROUTE, {"group_name": self.group_name}, 10.0)
            except Exception:  # noqa: BLE001, S112 - a server that is gone left it already
                continue

    def _leave(self) -> None:
        destroy_group(self._pg)
        self._pg = None

    # ------------------------------------------------------------------ send
    def send(self, weights: ServingArrays | Sequence[tuple[str, Any]], version: int,
             abort_all_requests: bool = True) -> str:
        """Every server serves ``weights`` as ``version`` when this returns (module doc);
        returns a name for the transfer. Raises :class:`PublishError` otherwise."""
        if not isinstance(weights, ServingArrays):
            weights = ServingArrays(list(weights))
        try:
            torch, dist = torch_modules()
        except WeightGroupError as e:
            raise PublishError(f"checkpoint.publish: distributed: {e}") from None
        t0 = time.perf_counter()
        weights.check_finite()  # NaN or Inf: nothing sent, the servers keep theirs
        entries = hf_entries(weights.named, self.model_cfg)
        report = SendReport(f"distributed-v{version}",
                            sum(math.prod(e[1]) * np.dtype(e[2]).itemsize for e in entries))
        self._ensure_group()
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        try:
            with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
                for bucket in buckets(entries, self.bucket_bytes):
                    t1 = time.perf_counter()
                    tensors = [to_torch(produce(), torch).to(device).contiguous()
                               for _, _, _, produce in bucket]
                    report.host_s += time.perf_counter() - t1
                    body: dict[str, Any] = {
                        "names": [e[0] for e in bucket], "dtypes": [e[2] for e in bucket],
                        "shapes": [list(e[1]) for e in bucket], "group_name": self.group_name,
                        "flush_cache": True, "abort_all_requests": abort_all_requests,
                        "weight_version": str(version)}
                    futures = self._posts(pool, UPDATE_ROUTE, functools.partial(_same, body))
                    works = [dist.broadcast(t, src=0, group=self._pg, async_op=True)
                             for t in tensors]
                    deadline = time.monotonic() + self.timeout_s
                    sent: list[float] = []
                    errors = self._wait_all(futures, functools.partial(
                        self._broadcasting, works, deadline, sent))
                    if errors:
                        raise _Refused(errors[0] + (f" (and {len(errors) - 1} more server(s))"
                                                    if len(errors) > 1 else ""))
                    for w in works:
                        w.wait()  # done: raises if the broadcast failed
                    self.last_replies = {u: f.result() for u, f in futures.items()}
                    report.stage_s = time.perf_counter() - (sent[0] if sent else t1)
                    del tensors, works
        except (_Refused, RuntimeError) as e:
            self._leave()
            raise PublishError(f"weights v{version} not sent through the weight update group: "
                               f"{e}; an embedded server keeps the old version (SGLang may "
                               "hold the buckets it loaded)") from None
        report.stream_s = time.perf_counter() - t0 - report.host_s - report.stage_s
        self.last = report
        return report.transfer

    @staticmethod
    def _broadcasting(works: list[Any], deadline: float, sent: list[float]) -> bool:
        """True while the learner's broadcasts run (``sent`` gets the time they ended);
        RuntimeError past ``deadline``."""
        if all(w.is_completed() for w in works):
            if not sent:
                sent.append(time.perf_counter())
            return False
        if time.monotonic() > deadline:
            raise RuntimeError("the broadcast outlasted checkpoint timeout; a server stalled")
        return True


def _same(body: dict[str, Any], _server: int) -> dict[str, Any]:
    return body

