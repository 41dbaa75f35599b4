"""Serving weights straight from the learner's memory to embedded servers, no disk.

    arrays = serving_arrays(model, "bfloat16")        # the learner's wait: a cast, dispatched
    sender = StreamPublisher(["http://127.0.0.1:30000"], api_key=None)
    transfer = sender.send(arrays, version=7)          # every server has v7 staged, or raises
    # then each server swaps at a step boundary: POST /weights/swap {"transfer", ...}

A version goes to every server as ``areal_jax.weight_wire`` lays it out: the manifest
(``POST /weights/begin``, refused at once if a tensor, shape or dtype does not fit what
the server serves), then each bucket (``PUT /weights/bucket?transfer=&index=``, its
checksum in a header: xxh3-64, which the manifest names), then ``POST /weights/stage``:
the server checks it has every bucket whole and places the tensors like its served ones,
while it keeps generating on the old weights (its probe forward runs at the swap, in the
first prefill under the new weights). The manifest goes out as soon as the learner's cast
is dispatched, before its bytes exist: from then to the swap each server decodes one step
per call, so the swap waits for one step instead of a whole call. The servers are sent to
side by side, one thread each.
Servers on this host (127.0.0.1, localhost) get the stream through shared memory instead
of the buckets' HTTP bodies: it is written once to ``/dev/shm/areal-weights-<transfer>``
(mode 0600, each tensor 64-byte aligned: ``weight_wire.file_layout``; removed when the send
ends) and each server maps it and checks every bucket's checksum (``POST
/weights/load_file``); its new params are views of those pages, no copy. Where the file
cannot be written (a full or small ``/dev/shm``, as in a container's 64 MiB default) the
sender uses HTTP buckets from then on; a server that cannot read it (on 127.0.0.1 but in
another container) gets the buckets over HTTP (``shm_fallbacks``).

The shared-memory file's pages are reused (``spare_file``, on by default). A fresh
file's pages are allocated and zeroed by the kernel as they are first written, which was
most of the write (0.5B shape, 0.99 GB, quiet 2-core host: 0.34-0.37 s fresh, 0.13-0.17 s
into allocated pages). So the sender keeps the files it wrote (the last two) and writes a
version into one that no server maps any more: each server lists, in its
``/weights/begin`` reply, the files it still holds (``held_files``: a file stays mapped
while any params are views of it: served, staged, or kept for a revert until the new
version's probe passes), and a file none of them lists is rewritten in place. In steady
state that is the version before the served one: the host holds two versions' bytes in
``/dev/shm`` (served and next), the same as a bump needs anyway, and no write allocates
a page. Until there is such a file (the first two sends), the next one is made ahead by
a background thread that writes its pages (zeros): a spare, made after a send, and
before the first one by :meth:`prepare` (the run calls it when it starts), and only
while the host has twice its size available (``MemAvailable``; under memory pressure
its pages came from reclaim and the writes got slower, not faster). Its pages are
written, not only reserved with ``posix_fallocate``: under a server's load, writing the
0.5B shape's 0.99 GB into reserved pages cost the kernel 2.4-2.7 s, into written ones
0.2 s, into fresh ones 0.8-0.9 s. (Before
the reuse, a spare was made after every send: three versions in ``/dev/shm`` during
each bump, and at the 1.5B shape on a 24 GB host the writes waited on reclaim.)
``spare_file=False`` (``checkpoint.publish_spare_file: false``) turns both off: each
send writes a fresh file and removes its name when the send ends. The kept files and a
spare are named ``areal-weights-kept-<pid>-<transfer>`` and
``areal-weights-spare-<pid>-<random>``; they are removed by :meth:`close` (the run's
exit), at exit, or by the next sender on the host once the owning process is gone. A
server's mapping outlives the name, so removing one never takes weights from a server.

Any failure (a server refusing, a connection dropped, a server gone, a non-finite value
in the learner's weights) aborts the transfer on every server (``POST /weights/abort``):
they all keep serving the old version, whole, and :class:`PublishError` says what failed
where. A sender killed mid-stream leaves its transfer unfinished: the servers drop it when
the connection closes, when the next one begins, or after ``stale_after_s``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import logging
import os
import re
import secrets
import threading
import time
import urllib.parse
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.checkpoint.publish import PublishError, _gather_to_host
from areal_jax.weight_wire import (
    CHECKSUM_HEADER,
    DEFAULT_BUCKET_BYTES,
    SHM_PREFIX,
    Manifest,
    bucket_views,
    checksum,
    file_layout,
    leaf_name,
    manifest_for,
    write_stream_file,
)
from model_defs import CausalLM, merge_lora, parse_dtype

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # noqa: S108 - shared memory, where the same host's servers read it
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServingArrays:
    """A version's serving weights as the learner hands them over: ``(name, array)`` in
    the engine's layout and dtype (device arrays whose cast may still be running, or host
    arrays), and per tensor whether it is finite (a device array, computed by the same
    program as the cast)."""

    named: list[tuple[str, Any]]
    finite: Any = None

    def check_finite(self) -> None:
        """Raises :class:`PublishError` naming the first tensor that holds NaN or Inf as
        cast. The cast's flags are a float32 sum per tensor (see ``_cast_and_check``); a
        flagged tensor is checked element by element here, so a sum that overflowed on
        finite values passes."""
        if self.finite is None:
            return
        flags = np.asarray(jax.device_get(self.finite))
        for i in np.flatnonzero(~flags):
            name, array = self.named[int(i)]
            if not np.isfinite(np.asarray(jax.device_get(array)).astype(np.float32)).all():
                raise PublishError(f"the learner's weights hold NaN or Inf in {name}; not "
                                   "sent (the servers keep the old version)")

    def host(self) -> list[tuple[str, np.ndarray]]:
        """The arrays on the host (on a CPU device: views of the device buffers, no copy).
        Raises :class:`PublishError` naming the first non-finite tensor."""
        self.check_finite()
        return [(name, np.asarray(jax.device_get(a))) for name, a in self.named]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for _, a in self.named)

    @property
    def on_cpu(self) -> bool:
        """Whether every array is a JAX array on CPU devices (``serving_arrays``' reuse)."""
        return bool(self.named) and all(
            isinstance(a, jax.Array) and all(d.platform == "cpu" for d in a.devices())
            for _, a in self.named)


@jax.jit
def _cast_and_check(leaves: list[jax.Array], dtype_probe: jax.Array
                    ) -> tuple[list[jax.Array], jax.Array]:
    """Each floating leaf cast to ``dtype_probe``'s dtype, and per leaf whether its float32
    sum as cast is finite: one program. A NaN or an infinity (a value beyond the serving
    dtype's range is infinite there) makes the sum NaN or infinite; a sum of finite values
    overflows only for values near the dtype's largest, which ``check_finite`` then
    checks element by element. XLA fuses the sum with the cast, where ``all(isfinite(x))``
    on the float32 input read the weights a second time (0.5B shape on a quiet 2-core
    host: 0.36 s against 0.60 s). (A max of magnitudes would be exact, but whether XLA's
    CPU max propagates a NaN depends on the vector instructions it picks.)"""
    want = dtype_probe.dtype
    out = [x.astype(want) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]
    flags = jnp.stack([jnp.isfinite(jnp.sum(x, dtype=jnp.float32))
                       if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)
                       for x in out])
    return out, flags


# The same cast, its outputs written into ``previous``'s buffers (donated; kept as an
# argument although unused, so that XLA aliases them to the outputs).
_cast_and_check_into = jax.jit(lambda leaves, dtype_probe, previous:
                               _cast_and_check(leaves, dtype_probe),
                               donate_argnums=2, keep_unused=True)


def serving_arrays(model: CausalLM | nnx.State, dtype: str,
                   reuse: ServingArrays | None = None) -> ServingArrays:
    """The model's serving weights (LoRA adapters merged) in the engine's layout, cast to
    ``dtype`` on the learner's devices by one program that also checks finiteness. Returns
    as soon as the program is dispatched; with several JAX processes the arrays are
    gathered first (a collective every process joins) and come back on the host.

    ``reuse``: an earlier version's result that nothing reads any more (it has been sent).
    On CPU devices its buffers are donated to the cast, which writes into them: a fresh
    output's pages are allocated and zeroed by the kernel as the cast first writes them,
    which was most of the cast (1.5B shape, quiet 2-core host: 1.3-2.6 s fresh, 0.34 s into
    the reused buffers; under a server's load in ``bench.py weight-sync`` 2.1-2.6 s). It
    is used only where every array matches (name, shape, dtype, placement), and ``reuse``
    is then emptied (its arrays are gone). A buffer something still views on the host (a
    NumPy view of it) is not donated: JAX then allocates a new one, so a reader of the old
    version never sees the new one's bytes. Keep ``reuse`` only on CPU (``on_cpu``): on an
    accelerator the freed output returns to the device allocator's pool at no cost, and
    keeping it would hold half the float32 params' memory between versions."""
    names, leaves = _named_leaves(_serving_state(model))
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        leaves = jax.tree.leaves(_gather_to_host(leaves))
        want = parse_dtype(dtype)
        host = [np.asarray(x, want) if np.issubdtype(np.asarray(x).dtype, np.floating)
                or "bfloat16" in str(np.asarray(x).dtype) else np.asarray(x) for x in leaves]
        return ServingArrays(list(zip(names, host, strict=True)))
    probe = jnp.zeros((), parse_dtype(dtype))
    previous = _reusable(reuse, names, leaves, probe.dtype)
    if previous is not None:
        assert reuse is not None
        reuse.named, reuse.finite = [], None  # donated: its arrays are the new version's
        cast, finite = _cast_and_check_into(leaves, probe, previous)
    else:
        cast, finite = _cast_and_check(leaves, probe)
    return ServingArrays(list(zip(names, cast, strict=True)), finite)


def warm_serving_cast(model: CausalLM | nnx.State, dtype: str) -> ServingArrays | None:
    """The serving cast compiled and run once before the first version is due (both its
    programs on CPU: the fresh one and the one writing into the last cast's buffers), so
    that the first versions' casts neither compile nor write fresh pages (0.5B shape under
    a server's load: the first two learner waits 0.45-0.6 s, later ones 0.003 s). Only
    dispatched: it runs while the learner waits for its first batch. Returns the cast to
    hand the first :func:`serving_arrays` as ``reuse`` on CPU devices; None elsewhere (an
    accelerator's allocator reuses the freed buffers at no cost; the compiled programs
    are kept either way)."""
    arrays = serving_arrays(model, dtype)
    if not arrays.on_cpu:
        return None
    return serving_arrays(model, dtype, reuse=arrays)


def serving_shapes(model: CausalLM | nnx.State, dtype: str) -> list[tuple[str, Any]]:
    """What :func:`serving_arrays` would hand over, without computing it: ``(name,
    jax.ShapeDtypeStruct)`` per tensor, in its order (the LoRA merge and the cast are only
    traced). For :meth:`StreamPublisher.prepare`, before the first version exists."""
    names, leaves = _named_leaves(jax.eval_shape(lambda: _serving_state(model)))
    want = parse_dtype(dtype)
    return [(name, jax.ShapeDtypeStruct(x.shape, _serving_dtype(x.dtype, want)))
            for name, x in zip(names, leaves, strict=True)]


def _serving_state(model: CausalLM | nnx.State) -> nnx.State:
    """The params a version serves: the model's, its LoRA adapters merged."""
    return nnx.state(merge_lora(model)) if isinstance(model, CausalLM) else model


def _named_leaves(state: Any) -> tuple[list[str], list[Any]]:
    """The leaves of ``state`` in order and their serving names."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return [leaf_name(path) for path, _ in flat], [x for _, x in flat]


def _serving_dtype(dtype: Any, want: Any) -> Any:
    """What the serving cast makes of a leaf of ``dtype``: ``want`` for floating ones."""
    return want if jnp.issubdtype(dtype, jnp.floating) else dtype


def _reusable(reuse: ServingArrays | None, names: list[str], leaves: list[Any],
              want: Any) -> list[jax.Array] | None:
    """``reuse``'s arrays if each matches what the cast of ``leaves`` makes (name, shape,
    dtype, sharding) and all are on CPU devices; otherwise None."""
    if reuse is None or not reuse.on_cpu or len(reuse.named) != len(leaves):
        return None
    previous = []
    for name, x, (old_name, old) in zip(names, leaves, reuse.named, strict=True):
        dtype = _serving_dtype(x.dtype, want)
        if (old_name != name or old.is_deleted() or tuple(old.shape) != tuple(x.shape)
                or old.dtype != dtype or not isinstance(x, jax.Array)
                or old.sharding != x.sharding):
            return None
        previous.append(old)
    return previous


# The files a sender keeps between sends (see the module doc): its pid in the name, so
# the next sender on the host removes those of a process that is gone.
_OWNED_NAME = re.compile(re.escape(SHM_PREFIX) + r"(?:spare|kept)-(\d+)-[0-9A-Za-z_-]+$")
KEEP_FILES = 2  # the served version's file and the one the next version is written into
SPARE_CHUNK_BYTES = 16 << 20  # the zeros a spare's pages are written with, per call


def _available_memory() -> int | None:
    """The host's available memory in bytes (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _remove_files(*files: list[Any]) -> None:
    """Unlinks the files in each list of ``(path, ...)`` and empties the lists."""
    for group in files:
        for path, *_ in group:
            with contextlib.suppress(OSError):
                os.unlink(path)
        group.clear()


def remove_orphan_spares(shm_dir: str) -> list[str]:
    """Removes the weight files a sender keeps (spare and kept ones) in ``shm_dir`` whose
    sender process is gone (killed before it could); returns their paths."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(shm_dir):
            m = _OWNED_NAME.match(name)
            if m is None:
                continue
            try:
                os.kill(int(m.group(1)), 0)
                continue  # its process lives (or is another user's)
            except ProcessLookupError:
                pass
            except OSError:
                continue
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(os.path.join(shm_dir, name))
    return removed


class _ServerRefused(Exception):
    pass


def _results(futures: Mapping[str, concurrent.futures.Future[Any]]
             ) -> tuple[dict[str, Any], list[str]]:
    """Each server's result, and one line per server that refused or could not be
    reached (in the servers' order)."""
    done: dict[str, Any] = {}
    errors = []
    for url, fut in futures.items():
        try:
            done[url] = fut.result()
        except _ServerRefused as e:
            errors.append(str(e))
        except (OSError, http.client.HTTPException) as e:
            errors.append(f"{url}: {type(e).__name__}: {e or 'connection dropped'}")
    return done, errors


@dataclass
class SendReport:
    """What one :meth:`StreamPublisher.send` did: its transfer id, bytes per server, and
    seconds (host copy, stream, stage on the slowest server)."""

    transfer: str
    nbytes: int
    host_s: float = 0.0
    stream_s: float = 0.0
    stage_s: float = 0.0
    server_stage_s: dict[str, float] = field(default_factory=dict)
    # the parts of stream_s and stage_s (the slowest server's): writing the shared-memory
    # file, the server's mapping and checksums of it, its placing (its probe runs at the
    # swap: the swap's ``verify_s``)
    write_s: float = 0.0
    load_s: float = 0.0
    place_s: float = 0.0
    # where the shared-memory write went: "reused" (a kept file no server held), "spare"
    # (allocated ahead), "new" (fresh pages); "" when the stream went over HTTP
    shm_file: str = ""
    # of write_s: the wait for the spare file still being made (it starts after the send
    # before, or at ``prepare``; a send that follows at once waits for the rest of it)
    spare_wait_s: float = 0.0
    server_replies: dict[str, dict[str, Any]] = field(default_factory=dict)


class StreamPublisher:
    """Sends serving weights to embedded servers over HTTP (see the module doc)."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0,
                 shm_dir: str | None = SHM_DIR, spare_file: bool = True,
                 swap_aborts: bool = True):
        if not urls:
            raise ValueError("StreamPublisher needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        # Servers on this host read the stream from one shared-memory file (no HTTP copy)
        local = all(urllib.parse.urlsplit(u).hostname in LOOPBACK for u in self.urls)
        self.shm_dir = shm_dir if local and shm_dir and os.path.isdir(shm_dir) else None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = timeout_s
        self.last: SendReport | None = None
        self.shm_fallbacks: list[str] = []  # the last send's servers that got HTTP buckets
        self.spare_file = spare_file and self.shm_dir is not None
        # The swap that follows aborts running requests (rollout.interruptible): the servers
        # then decode one step per call until it (``/weights/begin?swap=abort``).
        self.swap_aborts = swap_aborts
        # The next send's shared-memory file, its pages allocated ahead (see the module
        # doc): (path, size) once ready; the thread making it.
        self._spare: list[tuple[str, int]] = []
        self._spare_thread: threading.Thread | None = None
        self._spare_skipped = False  # a spare was skipped for want of host memory
        # The stream files of the last sends (path, size, st_dev, st_ino), oldest first:
        # the next one is written into one no server holds (see the module doc).
        self._kept: list[tuple[str, int, int, int]] = []
        self._finalizer = weakref.finalize(self, _remove_files, self._spare, self._kept)
        if self.shm_dir is not None:
            remove_orphan_spares(self.shm_dir)

    def close(self) -> None:
        """Removes the shared-memory files it keeps (the servers' mappings of them stay
        whole). The sender may still send."""
        if self._spare_thread is not None:
            self._spare_thread.join()
        _remove_files(self._spare, self._kept)

    def prepare(self, shapes: Sequence[tuple[str, Any]]) -> None:
        """Makes the first version's file ahead (a spare, in the background), so that the
        first send writes into written pages as later ones do, not into fresh ones (0.5B
        shape under the server's load: 0.86-1.2 s fresh, 0.2 s written). ``shapes``: what
        the sends will carry (``serving_shapes``). Does nothing if a file is kept or being
        made already, or without shared memory or ``spare_file``."""
        if self._kept or self._spare or self._spare_thread is not None:
            return
        self._prepare_spare(file_layout(manifest_for(shapes, 0, self.bucket_bytes))[1])

    def _prepare_spare(self, size: int) -> None:
        """In the background: a file of ``size`` bytes in shm_dir, its pages written."""
        if not self.spare_file or self.shm_dir is None or size <= 0:
            return
        shm_dir = self.shm_dir

        def make() -> None:
            available = _available_memory()
            if available is not None and available < 2 * size:
                # Host memory is short: a spare would only push the kernel to reclaim
                # (then the write into fresh pages is the cheaper one). Tried again next time.
                if not self._spare_skipped:
                    logger.info("no spare weight file: %.1f GB of host memory available, "
                                "under twice the %.1f GB it takes", available / 1e9, size / 1e9)
                self._spare_skipped = True
                return
            path = os.path.join(shm_dir, f"{SHM_PREFIX}spare-{os.getpid()}-"
                                         f"{secrets.token_hex(6)}")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError as e:
                logger.warning("no spare weight file in %s (%s); each send allocates its "
                               "pages", shm_dir, e)
                self.spare_file = False
                return
            try:
                # Its pages written (zeros), not only allocated: a write into pages that
                # posix_fallocate reserved cost the kernel 2.4-2.7 s for the 0.5B shape's
                # 0.99 GB under the server's load, against 0.2 s into written ones (and
                # 0.8-0.9 s into fresh ones) (``bench.py weight-sync``, second bump).
                zeros = bytes(min(size, SPARE_CHUNK_BYTES))
                for offset in range(0, size, len(zeros)):
                    if os.pwrite(fd, zeros[:size - offset], offset) <= 0:
                        raise OSError(f"short write at byte {offset}")
            except OSError as e:  # a small /dev/shm: the send itself will tell
                with contextlib.suppress(OSError):
                    os.unlink(path)
                logger.warning("no spare weight file in %s (%s); each send allocates its "
                               "pages", shm_dir, e)
                self.spare_file = False
                return
            finally:
                os.close(fd)
            self._spare.append((path, size))

        self._spare_thread = threading.Thread(target=make, name="weights-spare", daemon=True)
        self._spare_thread.start()

    def _take_kept(self, size: int, held: set[tuple[int, int]] | None) -> str | None:
        """A kept stream file of ``size`` bytes that no server holds (``held``: what the
        servers' begin replies listed; None when a server did not say, then none is
        reused); it is then the caller's. Kept files whose name no longer leads to the
        file written are forgotten."""
        if held is None:
            return None
        for entry in list(self._kept):
            path, n, dev, ino = entry
            if n != size or (dev, ino) in held:
                continue
            self._kept.remove(entry)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue  # removed behind our back
            if (st.st_dev, st.st_ino) == (dev, ino):  # (else replaced behind our back)
                return path
        return None

    def _keep(self, path: str, size: int) -> None:
        """Keeps the file just sent for a later send; the oldest beyond ``KEEP_FILES``
        lose their names (a server still mapping one keeps its pages until it lets go)."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return
        self._kept.append((path, size, st.st_dev, st.st_ino))
        while len(self._kept) > KEEP_FILES:
            old = self._kept.pop(0)[0]
            with contextlib.suppress(OSError):
                os.unlink(old)

    def _take_spare(self, size: int) -> tuple[str | None, float]:
        """The spare file's path if it holds ``size`` bytes (it is then the caller's),
        otherwise None (a spare of another size is removed); and the seconds waited for
        the spare still being made."""
        waited = 0.0
        if self._spare_thread is not None:
            t0 = time.perf_counter()
            self._spare_thread.join()  # being made: finishing it beats starting afresh
            self._spare_thread = None
            waited = time.perf_counter() - t0
        spares, self._spare[:] = list(self._spare), []
        path = None
        for p, n in spares:
            if n == size and path is None:
                path = p
            else:
                with contextlib.suppress(OSError):
                    os.unlink(p)
        return path, waited

    # ------------------------------------------------------------------ HTTP
    def _connect(self, url: str) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(url)
        cls = (http.client.HTTPSConnection if parts.scheme == "https"
               else http.client.HTTPConnection)
        return cls(parts.hostname or "127.0.0.1", parts.port, timeout=self.timeout_s)

    def _request(self, conn: http.client.HTTPConnection, url: str, method: str, route: str,
                 body: Any = None, parts: Sequence[memoryview] = (),
                 headers: dict[str, str] | None = None) -> dict[str, Any]:
        """One request on ``conn``; a JSON ``body`` or raw ``parts`` sent one after
        another. Returns the reply's JSON; a refusal raises _ServerRefused."""
        data = json.dumps(body).encode() if body is not None else None
        length = len(data) if data is not None else sum(len(p) for p in parts)
        conn.putrequest(method, route, skip_accept_encoding=True)
        for k, v in {**self.headers, **(headers or {}),
                     "Content-Type": "application/json" if data is not None
                     else "application/octet-stream",
                     "Content-Length": str(length)}.items():
            conn.putheader(k, v)
        conn.endheaders()
        if data is not None:
            conn.send(data)
        for part in parts:
            conn.send(part)
        reply = conn.getresponse()
        raw = reply.read()
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            obj = {"message": raw[:500].decode(errors="replace")}
        if reply.status >= 400 or (isinstance(obj, dict) and obj.get("success") is False):
            message = (obj.get("error") or obj.get("message") if isinstance(obj, dict)
                       else None) or f"HTTP {reply.status}"
            raise _ServerRefused(f"{url}{route.split('?')[0]}: {message}")
        return obj if isinstance(obj, dict) else {"reply": obj}

    def _begin_route(self) -> str:
        return "/weights/begin?swap=" + ("abort" if self.swap_aborts else "wait")

    def _begin_all(self, manifest: Manifest) -> set[tuple[int, int]] | None:
        """``/weights/begin`` on every server; if any refuses, the transfer is aborted
        everywhere and :class:`PublishError` says why. Returns the shared-memory files
        (st_dev, st_ino) any server still maps, None if a server did not say."""
        def begin(url: str) -> dict[str, Any]:
            conn = self._connect(url)
            try:
                return self._request(conn, url, "POST", self._begin_route(),
                                     manifest.to_json())
            finally:
                conn.close()

        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            done, errors = _results({url: pool.submit(begin, url) for url in self.urls})
        if errors:
            self._fail(manifest, errors)
        held: set[tuple[int, int]] = set()
        for reply in done.values():
            files = reply.get("held_files")
            if not isinstance(files, list):
                return None
            try:
                held.update((int(dev), int(ino)) for dev, ino in files)
            except (TypeError, ValueError):
                return None
        return held

    def _fail(self, manifest: Manifest, errors: list[str]) -> NoReturn:
        self.abort(manifest.transfer)
        raise PublishError(f"weights v{manifest.version} not sent in memory: {errors[0]}"
                           + (f" (and {len(errors) - 1} more server(s))"
                              if len(errors) > 1 else "")
                           + "; every server keeps the old version")

    def _send_one(self, url: str, manifest: Manifest, arrays: Sequence[np.ndarray],
                  crcs: list[concurrent.futures.Future[int]], shm_path: str | None = None
                  ) -> tuple[float, dict[str, Any]]:
        """Every bucket (or the shared-memory file), then stage, on one server that has
        begun the transfer; returns the server's stage seconds and its stage and
        load_file replies merged."""
        conn = self._connect(url)
        loaded: dict[str, Any] = {}
        try:
            if shm_path is not None:
                try:
                    loaded = self._request(conn, url, "POST", "/weights/load_file", {
                        "transfer": manifest.transfer, "path": shm_path,
                        "checksums": [c.result() for c in crcs]})
                except _ServerRefused as e:
                    # A server on 127.0.0.1 that does not see this /dev/shm (another
                    # container) or could not read the file: it gets the buckets instead.
                    logger.warning("%s; sending it the buckets over HTTP", e)
                    self.shm_fallbacks.append(url)
                    self._request(conn, url, "POST", self._begin_route(), manifest.to_json())
                    shm_path = None
            for i in range(manifest.num_buckets if shm_path is None else 0):
                route = f"/weights/bucket?transfer={manifest.transfer}&index={i}"
                self._request(conn, url, "PUT", route,
                              parts=bucket_views(manifest, arrays, i),
                              headers={CHECKSUM_HEADER: str(crcs[i].result())})
            t0 = time.perf_counter()
            staged = self._request(conn, url, "POST", "/weights/stage",
                                   {"transfer": manifest.transfer})
            return time.perf_counter() - t0, {**loaded, **staged}
        finally:
            conn.close()

    def abort(self, transfer: str) -> None:
        """Drops ``transfer`` on every server that still answers (best effort)."""
        for url in self.urls:
            try:
                conn = self._connect(url)
                conn.timeout = 10.0
                try:
                    self._request(conn, url, "POST", "/weights/abort", {"transfer": transfer})
                finally:
                    conn.close()
            except Exception:  # noqa: BLE001, S112 - a server that is gone dropped it already
                continue

    # ------------------------------------------------------------------ send
    def send(self, weights: ServingArrays | Sequence[tuple[str, Any]], version: int) -> str:
        """Streams ``weights`` as ``version`` to every server and has each stage it;
        returns the transfer id the servers swap to. Raises :class:`PublishError` (after
        aborting the transfer everywhere) if any server does not have it staged."""
        if not isinstance(weights, ServingArrays):
            weights = ServingArrays(list(weights))
        # The servers hear of the version first (names, shapes and dtypes are known before
        # the cast is done): a refusal comes before any byte is moved, and each server
        # decodes one step per call from now to the swap, which then waits for one step.
        manifest = manifest_for(weights.named, version, self.bucket_bytes)
        held = self._begin_all(manifest)
        t0 = time.perf_counter()
        try:
            named = weights.host()
        except BaseException:
            self.abort(manifest.transfer)
            raise
        host_s = time.perf_counter() - t0
        arrays = [a for _, a in named]
        report = SendReport(manifest.transfer, manifest.total_bytes, host_s=host_s)
        self.shm_fallbacks = []
        t1 = time.perf_counter()
        shm_path = None
        try:
            if self.shm_dir is not None:
                try:
                    t_write = time.perf_counter()
                    shm_path, report.shm_file, report.spare_wait_s = self._write_shm(
                        manifest, arrays, held)
                    report.write_s = time.perf_counter() - t_write
                except OSError as e:  # e.g. a container's 64 MiB /dev/shm
                    logger.warning("weights v%d: cannot write %s (%s); sending them over "
                                   "HTTP from now on", version, self.shm_dir, e)
                    self.shm_dir = None
            return self._send_all(manifest, arrays, report, shm_path, t1)
        finally:
            if shm_path is not None:
                size = file_layout(manifest)[1]
                if self.spare_file:  # kept for a later send (see the module doc)
                    self._keep(shm_path, size)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(shm_path)
                if len(self._kept) < KEEP_FILES:  # no file to reuse next time: a spare
                    self._prepare_spare(size)
                elif self._spare and (self._spare_thread is None
                                      or not self._spare_thread.is_alive()):
                    _remove_files(self._spare)  # a file is reused from now on

    def _write_shm(self, manifest: Manifest, arrays: Sequence[np.ndarray],
                   held: set[tuple[int, int]] | None) -> tuple[str, str, float]:
        """The stream as one file in shared memory (readable by this user only): written
        into a kept file no server holds (``held``), else the spare, else a new file.
        Returns its path, which of the three it was, and the wait for the spare."""
        assert self.shm_dir is not None
        size = file_layout(manifest)[1]
        path = os.path.join(self.shm_dir,
                            f"{SHM_PREFIX}kept-{os.getpid()}-{manifest.transfer}")
        kind, fd = "reused", self._reopen(self._take_kept(size, held) if self.spare_file
                                          else None, path)
        spare_wait_s = 0.0
        if fd is None:  # the spare is taken only now: it may still be being made
            spare, spare_wait_s = self._take_spare(size)
            kind, fd = "spare", self._reopen(spare, path)
        if fd is None:
            kind, fd = "new", os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_stream_file(fd, manifest, arrays)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return path, kind, spare_wait_s

    @staticmethod
    def _reopen(old: str | None, path: str) -> int | None:
        """``old`` (a file whose pages are allocated: the write only copies) renamed to
        ``path`` and opened for writing; None if there is none or it cannot be (it is then
        removed)."""
        if old is None:
            return None
        try:
            os.rename(old, path)
            return os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(old)
            return None

    def _send_all(self, manifest: Manifest, arrays: Sequence[np.ndarray], report: SendReport,
                  shm_path: str | None, t1: float) -> str:
        # The CRCs are computed ahead of the sends, once for all servers (zlib releases
        # the GIL on large buffers, so this overlaps the socket writes).
        with concurrent.futures.ThreadPoolExecutor(1) as crc_pool, \
                concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            crcs = [crc_pool.submit(checksum, bucket_views(manifest, arrays, i), manifest.checksum)
                    for i in range(manifest.num_buckets)]
            futures: dict[str, concurrent.futures.Future[tuple[float, dict[str, Any]]]] = {
                url: pool.submit(self._send_one, url, manifest, arrays, crcs, shm_path)
                for url in self.urls}
            done, errors = _results(futures)
            for url, (stage_s, reply) in done.items():
                report.server_stage_s[url], report.server_replies[url] = stage_s, reply
            for crc in crcs:
                crc.cancel()
        if errors:
            self._fail(manifest, errors)
        report.stage_s = max(report.server_stage_s.values(), default=0.0)
        for key in ("load_s", "place_s"):  # the slowest server's
            setattr(report, key, max((float(r.get(key, 0.0)) for r in
                                      report.server_replies.values()), default=0.0))
        report.stream_s = time.perf_counter() - t1 - report.stage_s
        self.last = report
        return manifest.transfer
