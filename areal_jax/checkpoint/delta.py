"""Serving weights as compressed deltas, for servers that read a shared path or ``gs://``.

    deltas = DeltaPublisher("RUN_DIR/weights", full_every=10)
    path, nbytes = deltas.publish(host_params(model, "bfloat16"), version=7)
    # -> weights/v7.delta: the XOR of v7's bits with v6's, compressed; a server serving v6
    #    applies it with /update_weights_from_delta {"model_path": path, ...}

Between two optimizer steps most bf16 weights keep every bit, so the XOR of a version's
bytes with the previous version's is mostly zeros and compresses to a few percent of the
full bytes (``areal_jax.weight_wire.encode_delta``: zstd level 3, else zlib). A version is
written full (the same file format, no base) every ``full_every`` versions, when there is
no previous version in memory, and on :meth:`full` (for a server that missed one). Each
tensor carries the CRC-32 of its new bytes, so a corrupted file, or a delta applied to
another base, is refused by the server and the served weights stay.

Files are written to ``v{N}.delta`` atomically on a local disk (temporary name, fsync,
rename); on ``gs://`` the object appears whole or not at all. A full version written for a
server that missed one (:meth:`DeltaPublisher.full`) is ``v{N}.full.delta``, written once
per version and only when asked for. The publisher keeps the last version's host arrays
(the serving dtype: 2 bytes per parameter in bf16).

Retention (``keep``, the run's ``checkpoint.keep_weights``): the newest ``keep`` versions'
files stay, and so does every file a kept version is rebuilt from: the chain of deltas
below the oldest kept one, down to a full file (at most ``full_every`` files; deltas are a
few percent of the full bytes each). A server only ever applies the newest file against
what it holds in memory, so it needs no older file; the chain is for whoever rebuilds a
kept version from the files alone (a server restarted mid-run, a later look at the run).
Files of versions above the one a run starts from (an abandoned run that went further
before a resume) are removed when the run starts (:meth:`DeltaPublisher.seed`).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from etils import epath

from areal_jax import storage
from areal_jax.checkpoint.publish import PublishError, ServingWeights
from areal_jax.weight_wire import encode_delta, leaf_name

if TYPE_CHECKING:  # checkpoint/ never imports config
    from areal_jax.config import CheckpointConfig

_DELTA_FILE = re.compile(r"^v(\d+)\.delta$")
_FULL_FILE = re.compile(r"^v(\d+)\.full\.delta$")
_TMP_FILE = re.compile(r"^v\d+(?:\.full)?\.delta\.tmp-(\d+)$")
_UNKNOWN = -1  # the base of a file an earlier process wrote (not read back)


def named_host_arrays(params: Any) -> list[tuple[str, np.ndarray]]:
    """``(name, host array)`` in the engine's layout of a params pytree (a pure dict, an
    ``nnx.State``, ``(name, array)`` pairs already, ``stream.ServingArrays``, whose
    ``host()`` also refuses non-finite weights, or :class:`ServingWeights`)."""
    if isinstance(params, ServingWeights):
        params = params.params
    if callable(getattr(params, "host", None)):  # stream.ServingArrays
        params = params.host()
    if isinstance(params, Sequence) and params and isinstance(params[0], tuple):
        return [(n, np.asarray(a)) for n, a in params]
    return [(leaf_name(path), np.asarray(x))
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]


class DeltaPublisher:
    """Writes each version as a delta against the previous one (see the module doc). Its
    methods may be called from several threads."""

    @classmethod
    def from_config(cls, checkpoint: CheckpointConfig, weights_dir: str) -> DeltaPublisher:
        """The run's publisher (``checkpoint.publish: delta``) in ``weights_dir`` (the
        publish dir): ``checkpoint.delta_full_every``, ``checkpoint.keep_weights``."""
        return cls(weights_dir, full_every=checkpoint.delta_full_every,
                   keep=checkpoint.keep_weights)

    def __init__(self, weights_dir: str | os.PathLike, *, full_every: int = 10, keep: int = 3):
        if full_every < 1 or keep < 1:
            raise ValueError(f"DeltaPublisher needs full_every >= 1 and keep >= 1, got "
                             f"{full_every}, {keep}")
        self.weights_dir = os.fspath(weights_dir)
        self.root = epath.Path(self.weights_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.full_every = full_every
        self.keep = keep
        self._last: tuple[int, dict[str, np.ndarray]] | None = None
        self._lock = threading.Lock()
        self._bases: dict[int, int | None] = {}  # this process's files: version -> base
        self._fulls: dict[int, tuple[str, int]] = {}  # version -> its v{N}.full.delta

    def seed(self, params: Any, version: int) -> None:
        """The version the servers start from (written elsewhere, e.g. as ``v{N}/``), kept
        in memory as the next delta's base. Files of later versions (a run that went past
        its checkpoint before a resume) and leftovers of killed writes are removed."""
        named = named_host_arrays(params)
        with self._lock:
            self._last = (int(version), {n: np.array(a) for n, a in named})
            self._bases[int(version)] = None  # rebuilt from its own files: a chain root
            for name in storage.listdir(self.weights_dir):
                m = _DELTA_FILE.match(name) or _FULL_FILE.match(name)
                tmp = _TMP_FILE.match(name)
                if ((m and int(m.group(1)) > version)
                        or (tmp and not storage.pid_alive(int(tmp.group(1))))):
                    storage.remove(storage.join(self.weights_dir, name))

    def path_for(self, version: int) -> str:
        return os.fspath(self.root / f"v{int(version)}.delta")

    def publish(self, params: Any, version: int, *, full: bool = False) -> tuple[str, int]:
        """Writes ``version`` (a delta against the previous version published, or full:
        every ``full_every`` versions, with ``full``, or without a previous one); returns
        (path, bytes written)."""
        named = named_host_arrays(params)
        version = int(version)
        with self._lock:
            base, base_version = None, None
            if (not full and self._last is not None and self._last[0] == version - 1
                    and version % self.full_every != 0):
                base_version, base = self._last
            data = encode_delta(named, base, version, base_version)
            path = self.root / f"v{version}.delta"
            self._write(path, data)
            self._last = (version, {n: np.array(a) for n, a in named})  # its own copy
            self._bases[version] = base_version
            self._fulls.pop(version, None)
            self._collect(version)
        return os.fspath(path), len(data)

    def full(self, version: int) -> tuple[str, int]:
        """The last published version (``version``) as a full file, ``v{N}.full.delta``,
        for a server that missed a delta or refused it: written on the first call for that
        version (a fresh copy even where ``v{N}.delta`` is full itself, in case that file
        is what was corrupted); returns (path, bytes written: 0 when it already was)."""
        version = int(version)
        with self._lock:
            if version in self._fulls:
                return self._fulls[version][0], 0
            if self._last is None or self._last[0] != version:
                raise PublishError(f"weights v{version} are not the last published version; "
                                   "cannot write it full")
            data = encode_delta(list(self._last[1].items()), None, version, None)
            path = self.root / f"v{version}.full.delta"
            self._write(path, data)
            self._fulls[version] = (os.fspath(path), len(data))
        return os.fspath(path), len(data)

    def _write(self, path: epath.Path, data: bytes) -> None:
        if "://" in self.weights_dir:
            storage.write_bytes(os.fspath(path), data)
            return
        tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.fspath(path))

    def _collect(self, just_written: int) -> None:
        """The newest ``keep`` versions up to ``just_written`` stay, with the chain of files
        the oldest of them is rebuilt from (the module doc); older files go."""
        files: dict[int, list[str]] = {}
        full_files: set[int] = set()
        for name in storage.listdir(self.weights_dir):  # [] for a prefix with no object yet
            if m := _DELTA_FILE.match(name):
                files.setdefault(int(m.group(1)), []).append(name)
            elif m := _FULL_FILE.match(name):
                files.setdefault(int(m.group(1)), []).append(name)
                full_files.add(int(m.group(1)))
        versions = sorted(v for v in files if v <= just_written)
        kept = set(versions[-self.keep:]) | {just_written}
        v = min(kept)
        while v not in full_files:
            base = self._bases.get(v, _UNKNOWN)
            if base is None or base == _UNKNOWN or base not in files:
                break  # a full file, an earlier process's file, or the run's start
            kept.add(base)
            v = base
        for v in versions:
            if v not in kept:
                for name in files[v]:
                    storage.remove(storage.join(self.weights_dir, name))
                self._fulls.pop(v, None)
