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
rename); on ``gs://`` the object appears whole or not at all. The newest ``keep`` files
stay. The publisher keeps the previous version's host arrays (the serving dtype: 2 bytes
per parameter in bf16).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from areal_jax import storage
from areal_jax.checkpoint.publish import PublishError
from areal_jax.weight_wire import encode_delta, leaf_name

_DELTA_FILE = re.compile(r"^v(\d+)\.delta$")


def named_host_arrays(params: Any) -> list[tuple[str, np.ndarray]]:
    """``(name, host array)`` in the engine's layout of a params pytree (a pure dict, an
    ``nnx.State``, or ``(name, array)`` pairs already)."""
    if isinstance(params, Sequence) and params and isinstance(params[0], tuple):
        return [(n, np.asarray(a)) for n, a in params]
    return [(leaf_name(path), np.asarray(x))
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]


class DeltaPublisher:
    """Writes each version as a delta against the previous one (see the module doc)."""

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

    def path_for(self, version: int) -> str:
        return os.fspath(self.root / f"v{int(version)}.delta")

    def publish(self, params: Any, version: int, *, full: bool = False) -> tuple[str, int]:
        """Writes ``version`` (a delta against the previous version published, or full:
        every ``full_every`` versions, with ``full``, or without a previous one); returns
        (path, bytes written)."""
        named = named_host_arrays(params)
        base, base_version = None, None
        if (not full and self._last is not None and self._last[0] == version - 1
                and version % self.full_every != 0):
            base_version, base = self._last
        data = encode_delta(named, base, version, base_version)
        path = self.root / f"v{int(version)}.delta"
        self._write(path, data)
        self._last = (version, {n: np.array(a) for n, a in named})  # its own copy
        self._collect(version)
        return os.fspath(path), len(data)

    def full(self, version: int) -> tuple[str, int]:
        """Rewrites the last published version (``version``) as a full one, for a server
        that missed a delta."""
        if self._last is None or self._last[0] != version:
            raise PublishError(f"weights v{version} are not the last published version; "
                               "cannot write it full")
        named = list(self._last[1].items())
        data = encode_delta(named, None, version, None)
        path = self.root / f"v{int(version)}.full.delta"
        self._write(path, data)
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
        found = sorted(int(m.group(1)) for p in self.root.iterdir()
                       if (m := _DELTA_FILE.match(p.name)))
        for v in found[:-self.keep]:
            if v != just_written:
                (self.root / f"v{v}.delta").unlink()
