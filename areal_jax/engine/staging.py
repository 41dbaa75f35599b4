"""The receiving end of in-memory weight updates (``areal_jax.weight_wire``'s format).

A transfer goes through four steps, each its own route (``engine/server.py``), while the
engine keeps generating on the weights it serves:

1. ``begin(manifest)``: checked against the served tensors (names, shapes, dtype); host
   arrays for the new weights are set aside. A new transfer replaces an unfinished one.
2. ``write`` / ``end_bucket``: each bucket's bytes go straight into those arrays; its
   length and checksum are checked at its end. Or ``load_file``: the same host's sender
   wrote the stream to a shared-memory file, which is mapped (the new params are views of
   it, no copy) and checked bucket by bucket.
3. ``stage``: every bucket whole, the arrays are placed like the served params (on a CPU
   device: aliased, no copy). Non-finite values are caught on the learner, by the program
   that casts the weights.
4. ``take``: the staged params, for the engine's swap at a step boundary. With the weight
   checks on, the probe forward (finite log-probs on a probe prompt) runs there, in a row
   of the first prefill under the new version, before any of its tokens is released; a
   failure puts the old version back (``GenerationEngine.swap_staged``). Probing at stage
   cost a pass over the weights of its own on cores that were decoding (0.5B shape on 2
   CPU cores: 0.43-0.46 s of every bump), where that prefill's spare row costs nothing.

Any failure drops the transfer: the served weights are never touched until the swap.
A transfer left idle for ``stale_after_s`` (its sender died between buckets) is dropped.
"""

from __future__ import annotations

import gc
import mmap
import os
import stat
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from areal_jax import storage
from areal_jax.engine.weight_check import WeightCheckError, check_probe_forward
from areal_jax.weight_wire import (
    SHM_PREFIX,
    Assembler,
    Manifest,
    WireError,
    apply_delta,
    check_against,
    file_layout,
    leaf_name,
    read_delta_header,
)

if TYPE_CHECKING:
    from areal_jax.engine.runner import ModelRunner

STALE_AFTER_S = 300.0
# A transfer touched this recently (begun, a bucket, loaded, staged) makes the engine decode
# one step per call until its swap (``expecting_swap``); one left longer (its sender gone
# quiet) no longer does.
SWAP_SOON_S = 30.0


class StagingError(ValueError):
    """A transfer the engine refuses (the message says why); the served weights stay."""


def place_named(arrays: Mapping[str, np.ndarray], runner: ModelRunner, check: bool
                ) -> nnx.State:
    """Host arrays by wire name, placed like ``runner``'s params (on a CPU device an
    aligned array is aliased, not copied) and, with ``check``, probed."""
    old = jax.tree_util.tree_leaves_with_path(runner.state)
    leaves = [jax.device_put(arrays[leaf_name(path)], x.sharding) for path, x in old]
    state = jax.tree.unflatten(jax.tree.structure(runner.state), leaves)
    problem = runner.check_compatible(state)
    if problem:
        raise StagingError(f"weights not updated: {problem}")
    if check:
        check_probe_forward(state, runner)
    return state


def _collect_dropped() -> None:
    """Frees dropped staged params now (the caller has let go of them): they sit in a
    reference cycle, so without a collection their arrays, views of a shared-memory file
    the sender would reuse (``held_files``), lived until the collector's next run."""
    gc.collect()


class ServedWeights(Mapping[str, np.ndarray]):
    """The served params as host arrays by wire name, converted one at a time (a CPU
    device's arrays are viewed, not copied): the base a delta applies to."""

    def __init__(self, state: Any):
        self._leaves = {leaf_name(path): x
                        for path, x in jax.tree_util.tree_leaves_with_path(state)}

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(jax.device_get(self._leaves[name]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)


def load_delta(path: str, served_version: str, runner: ModelRunner, check: bool
               ) -> nnx.State:
    """The params of the delta file ``path`` (``areal_jax.weight_wire.encode_delta``)
    applied to the served ones, placed and checked like a transfer's. A delta against
    another version than ``served_version``, or a corrupted one, raises StagingError."""
    try:
        data = storage.read_bytes(path)  # a local file or gs://
    except (OSError, storage.StorageError) as e:
        raise StagingError(f"model_path {path}: {e}") from None
    try:
        header = read_delta_header(data)
        base = header.get("base_version")
        if base is not None and str(base) != str(served_version):
            raise StagingError(
                f"{path} is a delta against v{base}, and this server "
                f"serves v{served_version}: send the full version")
        served = ServedWeights(runner.state)
        arrays = dict(apply_delta(data, served if base is not None else None))
        del data
        check_against_arrays(arrays, runner)
        return place_named(arrays, runner, check)
    except WireError as e:
        raise StagingError(f"{path}: {e}") from None
    except WeightCheckError as e:
        raise StagingError(f"{path}: {e}") from None


def check_against_arrays(arrays: Mapping[str, np.ndarray], runner: ModelRunner) -> None:
    """Raises WireError unless ``arrays`` are exactly the served tensors, shapes, dtype."""
    served = {leaf_name(path): (tuple(x.shape), str(np.dtype(x.dtype)))
              for path, x in jax.tree_util.tree_leaves_with_path(runner.state)}
    have = {n: (tuple(a.shape), str(a.dtype)) for n, a in arrays.items()}
    missing, extra = sorted(set(served) - set(have)), sorted(set(have) - set(served))
    if missing or extra:
        raise WireError(f"the update's tensors differ from the served model's: missing "
                        f"{missing[:3]}, unexpected {extra[:3]}")
    for name, want in served.items():
        if have[name] != want:
            raise WireError(f"tensor {name} is {have[name][1]}{list(have[name][0])}; the "
                            f"server serves {want[1]}{list(want[0])}")


class WeightStaging:
    """One transfer in progress, or one staged and waiting for its swap."""

    def __init__(self, runner: ModelRunner, stale_after_s: float = STALE_AFTER_S):
        self.runner = runner
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._assembler: Assembler | None = None
        self._touched = 0.0
        self._staged: tuple[str, int, nnx.State] | None = None
        # transfers being mapped or placed outside the lock (neither receiving nor staged)
        self._working = 0
        self._short_steps = True  # the current transfer's swap aborts (begin's short_steps)
        self.last_error: str | None = None
        # The shared-memory files this server has mapped, by (st_dev, st_ino): a weak
        # reference to each mapping, alive while any view of it is (served, staged or kept
        # for a revert params alias it). ``held_files`` reports them to the sender, which
        # writes a later version into a file no server holds (``checkpoint/stream.py``).
        self._mapped: dict[tuple[int, int], weakref.ref[mmap.mmap]] = {}
        # the last swapped-in version's probe (set by the engine): transfer, version, "ran"
        # ("in a prefill" or "alone"), finite, verify_s
        self.last_probe: dict[str, Any] | None = None

    def served_layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {leaf_name(path): (tuple(x.shape), str(np.dtype(x.dtype)))
                for path, x in jax.tree_util.tree_leaves_with_path(self.runner.state)}

    def _drop_stale(self) -> None:
        if (self._assembler is not None
                and time.monotonic() - self._touched > self.stale_after_s):
            self._fail(f"transfer {self._assembler.manifest.transfer} idle for "
                       f"{self.stale_after_s:g}s (its sender is gone); dropped")

    def _fail(self, message: str) -> None:
        self._assembler = None
        self.last_error = message

    def _current(self, transfer: str) -> Assembler:
        self._drop_stale()
        a = self._assembler
        if a is None or a.manifest.transfer != transfer:
            raise StagingError(f"no transfer {transfer!r} in progress on this server"
                               + (f" (last error: {self.last_error})" if self.last_error
                                  else ""))
        self._touched = time.monotonic()
        return a

    # ------------------------------------------------------------------ steps
    def begin(self, manifest_json: Any, short_steps: bool = True) -> dict[str, Any]:
        """A new transfer (see the module doc); ``short_steps``: its swap will abort the
        running requests, so the engine decodes one step per call until then."""
        try:
            manifest = Manifest.from_json(manifest_json)
            check_against(manifest, self.served_layout())
        except WireError as e:
            raise StagingError(f"weights not updated: {e}") from None
        with self._lock:
            superseded, self._staged = self._staged, None  # a staged version not swapped in
            self._assembler = Assembler(manifest)
            self._touched = time.monotonic()
            self._short_steps = short_steps
            self.last_error = None
        if superseded is not None:
            superseded = None
            _collect_dropped()
        return {"success": True, "transfer": manifest.transfer,
                "num_buckets": manifest.num_buckets, "total_bytes": manifest.total_bytes,
                "held_files": self.held_files()}

    def held_files(self) -> list[list[int]]:
        """``[st_dev, st_ino]`` of each shared-memory file this server still maps: some
        params (served, staged, or the old ones kept until the new version's probe passes)
        or a transfer in progress are views of it. A mapping is released (unmapped) when
        its last view goes, so a file not listed here is one this server no longer reads:
        the sender may write another version into it."""
        with self._lock:
            return self._held()

    def _held(self) -> list[list[int]]:
        for key in [k for k, ref in self._mapped.items() if ref() is None]:
            del self._mapped[key]
        return sorted([dev, ino] for dev, ino in self._mapped)

    def write(self, transfer: str, index: int, chunk: bytes) -> None:
        with self._lock:
            a = self._current(transfer)
            try:
                a.write(index, chunk)
            except WireError as e:
                self._fail(str(e))
                raise StagingError(f"weights not updated: {e}") from None

    def end_bucket(self, transfer: str, index: int, crc: int) -> None:
        with self._lock:
            a = self._current(transfer)
            try:
                a.end_bucket(index, crc)
            except WireError as e:
                self._fail(str(e))
                raise StagingError(f"weights not updated: {e}") from None

    def load_file(self, transfer: str, path: str, crcs: list[int]) -> float:
        """Every bucket of ``transfer`` from the file ``path`` (its sender wrote the
        stream to shared memory: same host), each checked against ``crcs``. The file
        must be a regular file named ``areal-weights-*`` holding exactly the stream.
        Returns the seconds it took (mapping and checksums)."""
        t0 = time.perf_counter()
        with self._lock:
            a = self._current(transfer)
            self._assembler = None  # nothing else writes it meanwhile
            self._working += 1
        try:
            if not os.path.basename(path).startswith(SHM_PREFIX):
                raise WireError(f"{path} is not a weight stream file ({SHM_PREFIX}*)")
            size = file_layout(a.manifest)[1]
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    raise WireError(f"{path} is not a regular file of the stream's {size} "
                                    "bytes")
                # Mapped, not read: the new params are views of the sender's pages (a CPU
                # device aliases them), so receiving costs one checksum pass and no copy.
                # MAP_POPULATE maps every page up front instead of one fault at a time.
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                    mmap.PROT_READ) if size else b""
            finally:
                os.close(fd)
            if isinstance(mapping, mmap.mmap):
                with self._lock:
                    self._mapped[(st.st_dev, st.st_ino)] = weakref.ref(mapping)
            a.map_file(mapping, crcs)
        except BaseException as e:
            with self._lock:
                self._working -= 1
                self._fail(str(e))
            if isinstance(e, WireError | OSError):
                raise StagingError(f"weights not updated: {e}") from None
            raise
        with self._lock:
            self._working -= 1
            self._assembler = a
            self._touched = time.monotonic()
        return time.perf_counter() - t0

    def abort(self, transfer: str | None = None, reason: str = "aborted by the sender") -> bool:
        """Drops ``transfer`` (None: whatever is in progress or staged); True if it was."""
        superseded = None
        with self._lock:
            dropped = False
            if self._assembler is not None and transfer in (None,
                                                            self._assembler.manifest.transfer):
                self._fail(f"transfer {self._assembler.manifest.transfer}: {reason}")
                dropped = True
            if self._staged is not None and transfer in (None, self._staged[0]):
                superseded, self._staged = self._staged, None
                dropped = True
        if superseded is not None:
            superseded = None
            _collect_dropped()
        return dropped

    def stage(self, transfer: str) -> dict[str, Any]:
        """Places the complete transfer like the served params (see the module doc: its
        probe runs at the swap). Runs in the caller's thread; generation goes on meanwhile."""
        t0 = time.perf_counter()
        with self._lock:
            a = self._current(transfer)
            try:
                arrays = a.complete()
            except WireError as e:
                self._fail(str(e))
                raise StagingError(f"weights not updated: {e}") from None
            self._assembler = None  # from here the arrays belong to the staged params
            self._working += 1
        try:
            state = place_named(arrays, self.runner, False)
        except BaseException:
            with self._lock:
                self._working -= 1
            raise
        del arrays
        with self._lock:
            self._working -= 1
            self._staged = (transfer, a.manifest.version, state)
            self._touched = time.monotonic()
        t_end = time.perf_counter()
        # place_s: placing the tensors like the served ones (the probe runs at the swap)
        return {"success": True, "transfer": transfer, "version": a.manifest.version,
                "stage_s": t_end - t0, "place_s": t_end - t0}

    def put(self, transfer: str, version: int, state: nnx.State) -> None:
        """Stages ``state``, already placed and checked (``place_named``) by another route
        (``engine/distributed_update.py``), for :meth:`take` under ``transfer``; it
        supersedes whatever was in progress or staged."""
        with self._lock:
            self._assembler = None
            self._staged = (transfer, version, state)
            self._touched = time.monotonic()

    def take(self, transfer: str) -> tuple[int, nnx.State]:
        """The staged (version, params) of ``transfer``, handed over once."""
        with self._lock:
            if self._staged is None or self._staged[0] != transfer:
                raise StagingError(f"transfer {transfer!r} is not staged on this server"
                                   + (f" (last error: {self.last_error})" if self.last_error
                                      else ""))
            _, version, state = self._staged
            self._staged = None
            return version, state

    def expecting_swap(self) -> bool:
        """Whether a swap that aborts the running requests is likely soon: a transfer begun
        with ``short_steps`` in progress or staged, touched within ``SWAP_SOON_S`` (the
        engine then decodes one step per call; a swap that waits for the requests to finish
        gains nothing from it, and they would finish slower)."""
        return (self._short_steps
                and (self._assembler is not None or self._staged is not None
                     or self._working > 0)
                and time.monotonic() - self._touched < SWAP_SOON_S)

    def status(self) -> dict[str, Any]:
        with self._lock:
            self._drop_stale()
            a = self._assembler
            return {"receiving": a.manifest.transfer if a is not None else None,
                    "buckets_missing": len(a.missing) if a is not None else 0,
                    "staged": self._staged[0] if self._staged is not None else None,
                    "last_error": self.last_error, "last_probe": self.last_probe,
                    "swap_expected": self.expecting_swap(),
                    "held_files": self._held()}
