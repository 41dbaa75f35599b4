"""One weight version on the wire: the tensors' layout, buckets, checksums and deltas.

The learner (``checkpoint/stream.py``) sends a version's serving weights in the engine's
own layout, the leaves of the model's ``nnx.State`` named by their dotted paths
(``layers.attn.q_kernel_dhk``), in one dtype, as one byte stream:

* a :class:`Manifest` (JSON) lists every tensor (name, shape, dtype, its offset in the
  stream) and the bucket size; the receiver checks it against what it serves before any
  byte moves (a missing or extra tensor, a shape or a dtype that does not fit is refused);
* the stream is cut into buckets of ``bucket_bytes`` (the last one shorter); a tensor may
  span buckets. Each bucket travels with its checksum (``checksum``: xxh3-64, or CRC-32
  where xxhash is missing; the manifest names it); a bucket whose bytes
  or length differ is refused and the whole version with it;
* an :class:`Assembler` writes each bucket's bytes straight into the receiver's tensors
  (64-byte aligned host arrays, which a CPU device takes without a copy) and says when the
  version is complete.

Deltas (``encode_delta`` / ``apply_delta``) carry a version as the bitwise XOR of its bf16
(or any) bytes with the previous version's, compressed (zstd, else zlib): between two
optimizer steps most bits stay, so the delta is a few percent of the full bytes. They are
exact bit for bit and checksummed (CRC-32 of the new version's bytes per tensor).

This module imports only numpy and the standard library: ``checkpoint/`` (sender),
``engine/`` (receiver) and the benchmarks share it; ``rollout/weight_sync.py``
orchestrates a version without importing any of them.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WIRE_FORMAT = "areal-weights/1"
DELTA_FORMAT = "areal-delta/1"
DEFAULT_BUCKET_BYTES = 64 << 20
ALIGN = 64  # host arrays a CPU device can alias (zero copy)
CHECKSUM_HEADER = "x-areal-checksum"  # a bucket's checksum travels in this HTTP header
# Bucket checksums: xxh3-64 (xxhash, ~30 GB/s on one core) where it is installed (it is a
# dependency), else CRC-32 (~3 GB/s); the manifest names the one its sender used.
CHECKSUMS = ("xxh3_64", "crc32")
xxhash: Any
try:
    import xxhash

    DEFAULT_CHECKSUM = "xxh3_64"
except ImportError:  # pragma: no cover - xxhash is a dependency
    xxhash = None
    DEFAULT_CHECKSUM = "crc32"
SHM_PREFIX = "areal-weights-"  # same host: the stream in a shared-memory file of this name


class WireError(ValueError):
    """A manifest, bucket or delta that does not fit (the message says which and why)."""


# ---------------------------------------------------------------- names, dtypes, arrays
def leaf_name(path: Sequence[Any]) -> str:
    """The dotted name of a pytree leaf's key path (``jax.tree_util`` keys): dict keys,
    attributes and indices joined by '.', a trailing ``.value`` (an nnx Variable) dropped."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    if len(parts) > 1 and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def dtype_of(name: str) -> np.dtype:
    """numpy dtype of a wire dtype name (``bfloat16`` needs ml_dtypes, which JAX ships)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise WireError(f"unknown dtype {name!r}") from None


def dtype_name(dtype: Any) -> str:
    return str(np.dtype(dtype))


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``ALIGN``-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(tuple(shape))


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat memoryview (no copy)."""
    array = np.ascontiguousarray(array)
    return memoryview(array.reshape(-1).view(np.uint8).data)


class Hasher:
    """A bucket's running checksum (``algo``: one of :data:`CHECKSUMS`)."""

    def __init__(self, algo: str = DEFAULT_CHECKSUM):
        if algo not in CHECKSUMS:
            raise WireError(f"unknown checksum {algo!r} (this end knows {list(CHECKSUMS)})")
        if algo == "xxh3_64" and xxhash is None:
            raise WireError("the sender checksums with xxh3_64 and xxhash is not installed "
                            "here (pip install xxhash)")
        self.algo = algo
        self._xxh = xxhash.xxh3_64() if algo == "xxh3_64" else None
        self._crc = 0

    def update(self, data: bytes | memoryview) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc


def checksum(data: bytes | memoryview | Sequence[memoryview],
             algo: str = DEFAULT_CHECKSUM) -> int:
    """The checksum (``algo``) of ``data``: one buffer, or several in order."""
    h = Hasher(algo)
    for part in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
        h.update(part)
    return h.value()


# ---------------------------------------------------------------- the manifest
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # first byte in the version's stream
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """A version's layout on the wire; ``transfer`` names this one sending of it."""

    transfer: str
    version: int
    tensors: tuple[TensorSpec, ...]
    bucket_bytes: int
    total_bytes: int
    checksum: str = DEFAULT_CHECKSUM  # the buckets' checksum (CHECKSUMS)

    @property
    def num_buckets(self) -> int:
        return max(1, math.ceil(self.total_bytes / self.bucket_bytes))

    def bucket_range(self, index: int) -> tuple[int, int]:
        """[start, end) of bucket ``index`` in the stream."""
        if not 0 <= index < self.num_buckets:
            raise WireError(f"bucket {index} is outside 0..{self.num_buckets - 1}")
        start = index * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"format": WIRE_FORMAT, "transfer": self.transfer, "version": self.version,
                "bucket_bytes": self.bucket_bytes, "total_bytes": self.total_bytes,
                "checksum": self.checksum,
                "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors]}

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """The manifest a receiver got; a malformed one raises :class:`WireError`."""
        if not isinstance(obj, Mapping):
            raise WireError("the manifest must be a JSON object")
        if obj.get("format") != WIRE_FORMAT:
            raise WireError(f"manifest format {obj.get('format')!r}; this server reads "
                            f"{WIRE_FORMAT!r}")
        transfer, version = obj.get("transfer"), obj.get("version")
        bucket_bytes, tensors = obj.get("bucket_bytes"), obj.get("tensors")
        if not isinstance(transfer, str) or not transfer:
            raise WireError("manifest 'transfer' must be a non-empty string")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise WireError(f"manifest 'version' must be an int >= 0, got {version!r}")
        if (not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool)
                or bucket_bytes < 1):
            raise WireError(f"manifest 'bucket_bytes' must be an int >= 1, got {bucket_bytes!r}")
        if not isinstance(tensors, list) or not tensors:
            raise WireError("manifest 'tensors' must be a non-empty list")
        specs = []
        for item in tensors:
            if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str)
                    or not isinstance(item[1], list) or not all(_is_int(d) and d >= 0
                                                                for d in item[1])
                    or not isinstance(item[2], str)):
                raise WireError(f"manifest tensor {item!r} is not [name, [dims], dtype]")
            specs.append((item[0], tuple(item[1]), item[2]))
        algo = obj.get("checksum", "crc32")
        Hasher(algo)  # known here, and its library installed
        manifest = layout(specs, int(version), int(bucket_bytes), transfer, algo)
        if obj.get("total_bytes") != manifest.total_bytes:
            raise WireError(f"manifest 'total_bytes' {obj.get('total_bytes')!r} does not match "
                            f"its tensors ({manifest.total_bytes})")
        return manifest


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def layout(tensors: Sequence[tuple[str, Sequence[int], str]], version: int,
           bucket_bytes: int = DEFAULT_BUCKET_BYTES, transfer: str | None = None,
           checksum: str = DEFAULT_CHECKSUM) -> Manifest:
    """The manifest of ``(name, shape, dtype name)`` tensors laid end to end, in order."""
    specs, offset, seen = [], 0, set()
    for name, shape, dtype in tensors:
        if name in seen:
            raise WireError(f"tensor {name} appears twice")
        seen.add(name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype_of(dtype).itemsize
        specs.append(TensorSpec(name, tuple(int(d) for d in shape), dtype, offset, nbytes))
        offset += nbytes
    return Manifest(transfer or uuid.uuid4().hex, version, tuple(specs), bucket_bytes, offset,
                    checksum)


def manifest_for(named: Sequence[tuple[str, np.ndarray]], version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    return layout([(n, a.shape, dtype_name(a.dtype)) for n, a in named], version, bucket_bytes)


def check_against(manifest: Manifest, served: Mapping[str, tuple[tuple[int, ...], str]]
                  ) -> None:
    """Raises :class:`WireError` unless ``manifest`` holds exactly the ``served`` tensors
    ({name: (shape, dtype name)}) with their shapes and dtypes."""
    have = {t.name: t for t in manifest.tensors}
    missing, extra = sorted(set(served) - set(have)), sorted(set(have) - set(served))
    if missing or extra:
        raise WireError(f"the update's tensors differ from the served model's: missing "
                        f"{missing[:3]}, unexpected {extra[:3]}")
    for name, (shape, dtype) in served.items():
        t = have[name]
        if t.shape != tuple(shape):
            raise WireError(f"tensor {name} has shape {list(t.shape)}; the served model has "
                            f"{list(shape)}")
        if t.dtype != dtype:
            raise WireError(f"tensor {name} has dtype {t.dtype}; the server serves {dtype} "
                            "(send the serving dtype)")


def file_layout(manifest: Manifest) -> tuple[list[int], int]:
    """Where each tensor starts in a same-host stream file, and the file's size: the
    manifest's tensors in order, each start rounded up to ``ALIGN`` bytes (zeros between),
    so that the receiver's device can alias the mapped file instead of copying it. The
    buckets and their CRC-32s are the stream's, without the padding."""
    offsets, pos = [], 0
    for t in manifest.tensors:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += t.nbytes
    return offsets, pos


def write_stream_file(fd: int, manifest: Manifest, arrays: Sequence[np.ndarray]) -> None:
    """Writes ``arrays`` (the manifest's tensors, in order) to the open file ``fd`` as
    :func:`file_layout` lays them out. Raises OSError (e.g. ENOSPC on a small /dev/shm)."""
    offsets, size = file_layout(manifest)
    os.ftruncate(fd, size)  # the padding reads as zeros
    for offset, array in zip(offsets, arrays, strict=True):
        view = byte_view(array)
        while view:
            n = os.pwrite(fd, view, offset)
            if n <= 0:
                raise OSError(f"short write at byte {offset}")
            view, offset = view[n:], offset + n


def bucket_views(manifest: Manifest, arrays: Sequence[np.ndarray], index: int
                 ) -> list[memoryview]:
    """The sender's side: the parts of ``arrays`` (the manifest's tensors, in order) that
    make bucket ``index``, as memoryviews (no copy)."""
    start, end = manifest.bucket_range(index)
    views = []
    for spec, array in zip(manifest.tensors, arrays, strict=True):
        lo, hi = max(start, spec.offset), min(end, spec.offset + spec.nbytes)
        if lo < hi:
            views.append(byte_view(array)[lo - spec.offset:hi - spec.offset])
    return views


class Assembler:
    """The receiver's side: bucket bytes written straight into host arrays of the
    manifest's tensors. Buckets may arrive in any order, each one's bytes in order."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.arrays = {t.name: aligned_empty(t.shape, dtype_of(t.dtype))
                       for t in manifest.tensors}
        self._views = [byte_view(self.arrays[t.name]) for t in manifest.tensors]
        self._starts = [t.offset for t in manifest.tensors]
        self._done: set[int] = set()
        self._open: dict[int, tuple[int, Hasher]] = {}  # bucket -> (bytes so far, checksum)

    def write(self, index: int, chunk: bytes | memoryview) -> None:
        """Appends ``chunk`` to bucket ``index``."""
        start, end = self.manifest.bucket_range(index)
        if index in self._done:
            raise WireError(f"bucket {index} was already received")
        got, hasher = self._open.get(index) or (0, Hasher(self.manifest.checksum))
        pos, n = start + got, len(chunk)
        if pos + n > end:
            raise WireError(f"bucket {index} is longer than its {end - start} bytes")
        data = memoryview(chunk)
        i = bisect.bisect_right(self._starts, pos) - 1
        done = 0
        while done < n:
            spec = self.manifest.tensors[i]
            if spec.nbytes == 0:
                i += 1
                continue
            at = pos + done - spec.offset
            take = min(spec.nbytes - at, n - done)
            self._views[i][at:at + take] = data[done:done + take]
            done += take
            i += 1
        hasher.update(data)
        self._open[index] = (got + n, hasher)

    def end_bucket(self, index: int, crc: int) -> None:
        """Bucket ``index`` is complete: its length and checksum must match."""
        start, end = self.manifest.bucket_range(index)
        got, hasher = self._open.pop(index) if index in self._open else (
            0, Hasher(self.manifest.checksum))
        if got != end - start:
            raise WireError(f"bucket {index} has {got} bytes, expected {end - start}")
        self._check(index, hasher.value(), crc)

    def _check(self, index: int, have: int, want: int) -> None:
        if have != int(want):
            raise WireError(f"bucket {index} is corrupted: {self.manifest.checksum} "
                            f"{have:x}, expected {int(want):x}")
        self._done.add(index)

    def map_file(self, buffer: Any, crcs: Sequence[int]) -> None:
        """Takes every tensor as a read-only view of ``buffer`` (a same-host stream file,
        mapped: :func:`file_layout`), no copy, after checking each bucket's checksum against
        ``crcs``: a device on this host can then serve straight from the mapping."""
        offsets, size = file_layout(self.manifest)
        data = memoryview(buffer).cast("B")
        if len(data) != size:
            raise WireError(f"the stream file holds {len(data)} bytes; the manifest's "
                            f"tensors laid out for a file take {size}")
        if len(crcs) != self.manifest.num_buckets:
            raise WireError(f"{len(crcs)} checksums for {self.manifest.num_buckets} buckets")
        views = [data[o:o + t.nbytes] for t, o in zip(self.manifest.tensors, offsets,
                                                         strict=True)]
        for index, crc in enumerate(crcs):
            start, end = self.manifest.bucket_range(index)
            hasher = Hasher(self.manifest.checksum)
            i = max(bisect.bisect_right(self._starts, start) - 1, 0)
            for spec, view in zip(self.manifest.tensors[i:], views[i:], strict=True):
                if spec.offset >= end:
                    break
                lo, hi = max(start, spec.offset), min(end, spec.offset + spec.nbytes)
                if lo < hi:
                    hasher.update(view[lo - spec.offset:hi - spec.offset])
            self._check(index, hasher.value(), crc)
        self.arrays = {t.name: np.frombuffer(v, dtype_of(t.dtype)).reshape(t.shape)
                       for t, v in zip(self.manifest.tensors, views, strict=True)}
        self._views = views
        self._open.clear()
        self._done = set(range(self.manifest.num_buckets))

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.manifest.num_buckets) if i not in self._done]

    def complete(self) -> dict[str, np.ndarray]:
        """The tensors, once every bucket arrived whole."""
        missing = self.missing
        if missing:
            raise WireError(f"{len(missing)} of {self.manifest.num_buckets} buckets never "
                            f"arrived (first: {missing[0]})")
        return self.arrays


def nonfinite(named: Mapping[str, np.ndarray] | Sequence[tuple[str, np.ndarray]],
              chunk_elems: int = 1 << 20) -> str | None:
    """The first tensor holding a NaN or Inf (IEEE floats, read by their exponent bits, in
    chunks, so bf16 needs no conversion), or None."""
    items = named.items() if isinstance(named, Mapping) else named
    for name, array in items:
        if array.dtype.kind not in "fV" and "float" not in str(array.dtype):
            continue
        bits = {2: (np.uint16, 0x7C00 if array.dtype == np.float16 else 0x7F80),
                4: (np.uint32, 0x7F800000), 8: (np.uint64, 0x7FF0000000000000)}
        if array.dtype.itemsize not in bits:
            continue
        utype, mask = bits[array.dtype.itemsize]
        flat = np.ascontiguousarray(array).reshape(-1).view(utype)
        m = utype(mask)
        for lo in range(0, flat.size, chunk_elems):
            part = flat[lo:lo + chunk_elems]
            if np.any((part & m) == m):
                return name
    return None


# ---------------------------------------------------------------- deltas
def _compressor() -> tuple[str, Any, Any]:
    try:
        import zstandard

        return ("zstd", zstandard.ZstdCompressor(level=3).compress,
                zstandard.ZstdDecompressor().decompress)
    except ImportError:
        return "zlib", lambda b: zlib.compress(b, 1), zlib.decompress


def _decompressor(codec: str) -> Any:
    if codec == "zlib":
        return zlib.decompress
    if codec == "zstd":
        try:
            import zstandard
        except ImportError:
            raise WireError("this delta is zstd-compressed and zstandard is not installed "
                            "(pip install zstandard)") from None
        return lambda b: zstandard.ZstdDecompressor().decompress(b)
    raise WireError(f"unknown delta codec {codec!r}")


def _uint_view(array: np.ndarray) -> np.ndarray:
    utype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize]
    return np.ascontiguousarray(array).reshape(-1).view(utype)


_DELTA_MAGIC = b"AJDELTA1"


def encode_delta(named: Sequence[tuple[str, np.ndarray]],
                 base: Mapping[str, np.ndarray] | None, version: int,
                 base_version: int | None) -> bytes:
    """One file holding version ``version``: with ``base`` (the previous version's arrays,
    same names, shapes and dtypes) the XOR of each tensor's bits with its base's,
    compressed; without, the full bytes, compressed. Each tensor carries the CRC-32 of its
    new bytes, checked on :func:`apply_delta`."""
    codec, compress, _ = _compressor()
    header: dict[str, Any] = {"format": DELTA_FORMAT, "version": version, "codec": codec,
                              "base_version": base_version if base is not None else None,
                              "tensors": []}
    blobs = []
    offset = 0
    for name, array in named:
        new = _uint_view(array)
        if base is not None:
            if name not in base:
                raise WireError(f"delta base has no tensor {name}")
            old = base[name]
            if old.shape != array.shape or old.dtype != array.dtype:
                raise WireError(f"delta base tensor {name} is {old.dtype}{list(old.shape)}, "
                                f"the new one {array.dtype}{list(array.shape)}")
            payload = np.bitwise_xor(new, _uint_view(old))
        else:
            payload = new
        blob = compress(payload.tobytes())
        header["tensors"].append({"name": name, "shape": list(array.shape),
                                  "dtype": dtype_name(array.dtype), "offset": offset,
                                  "nbytes": len(blob), "crc32": zlib.crc32(byte_view(new))})
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    return b"".join([_DELTA_MAGIC, struct.pack("<Q", len(head)), head, *blobs])


def read_delta_header(data: bytes | memoryview) -> dict[str, Any]:
    """The header of an :func:`encode_delta` file (its version, base version, tensors)."""
    data = memoryview(data)
    if bytes(data[:8]) != _DELTA_MAGIC or len(data) < 16:
        raise WireError("not a weight delta file (bad magic)")
    (n,) = struct.unpack("<Q", data[8:16])
    try:
        header = json.loads(bytes(data[16:16 + n]))
    except ValueError as e:
        raise WireError(f"weight delta header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != DELTA_FORMAT:
        raise WireError(f"weight delta format {header.get('format')!r}, expected "
                        f"{DELTA_FORMAT!r}" if isinstance(header, dict) else
                        "weight delta header is not an object")
    header["_body"] = 16 + n
    return header


def apply_delta(data: bytes | memoryview, base: Mapping[str, np.ndarray] | None
                ) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of a delta file, one at a time (name, new array): each XORed onto
    ``base``'s (None for a full version) and checked against its CRC-32. A corrupted or
    mismatched delta raises :class:`WireError` (before the caller has all the tensors)."""
    header = read_delta_header(data)
    data = memoryview(data)
    body = header["_body"]
    decompress = _decompressor(header.get("codec", ""))
    if header.get("base_version") is not None and base is None:
        raise WireError(f"delta v{header.get('version')} is against v{header['base_version']}, "
                        "and no base was given")
    for t in header["tensors"]:
        name, dtype = t["name"], dtype_of(t["dtype"])
        shape = tuple(t["shape"])
        blob = data[body + t["offset"]: body + t["offset"] + t["nbytes"]]
        if len(blob) != t["nbytes"]:
            raise WireError(f"weight delta is truncated at tensor {name}")
        try:
            raw = decompress(bytes(blob))
        except Exception as e:  # noqa: BLE001 - zstd and zlib raise their own types
            raise WireError(f"weight delta tensor {name} does not decompress: {e}") from None
        out = aligned_empty(shape, dtype)
        flat = _uint_view(out)
        if len(raw) != flat.nbytes:
            raise WireError(f"weight delta tensor {name} has {len(raw)} bytes, expected "
                            f"{flat.nbytes}")
        flat[:] = np.frombuffer(raw, flat.dtype)
        if header.get("base_version") is not None:
            assert base is not None
            old = base.get(name)
            if old is None or old.shape != shape or old.dtype != dtype:
                raise WireError(f"delta base tensor {name} does not fit "
                                f"({dtype}{list(shape)})")
            np.bitwise_xor(flat, _uint_view(old), out=flat)
        if zlib.crc32(byte_view(out)) != t["crc32"]:
            raise WireError(f"weight delta tensor {name} fails its checksum (corrupted, or "
                            f"applied to a base other than v{header.get('base_version')})")
        yield name, out
