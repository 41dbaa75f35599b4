"""The weight wire format (areal_jax.weight_wire) on its own: buckets reassemble bit for bit
in any order, a wrong bucket is refused; deltas reconstruct bit for bit, stay small when
few bits change, and a corrupted or misapplied one is refused."""

from __future__ import annotations

import mmap
import os

import ml_dtypes
import numpy as np
import pytest

from areal_jax.checkpoint.delta import DeltaPublisher
from areal_jax.weight_wire import (
    Assembler,
    Manifest,
    WireError,
    apply_delta,
    bucket_views,
    checksum,
    encode_delta,
    file_layout,
    manifest_for,
    nonfinite,
    read_delta_header,
    write_stream_file,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    return [("embed", (rng.standard_normal((50, 16)) * 0.02).astype(BF16)),
            ("layers.w", (rng.standard_normal((3, 16, 24)) * 0.02).astype(BF16)),
            ("norm", np.ones((16,), BF16)), ("empty", np.zeros((0, 4), BF16))]


def bits(a):
    return a.view(np.uint16)


def test_buckets_reassemble_bit_for_bit_in_any_order():
    named = tensors()
    manifest = Manifest.from_json(manifest_for(named, 3, bucket_bytes=333).to_json())
    arrays = [a for _, a in named]
    asm = Assembler(manifest)
    order = list(range(manifest.num_buckets))[::-1]
    assert len(order) > 5  # tensors span buckets
    for i in order:
        views = bucket_views(manifest, arrays, i)
        data = b"".join(bytes(v) for v in views)
        for lo in range(0, len(data), 100):  # in chunks, as a socket delivers it
            asm.write(i, data[lo:lo + 100])
        asm.end_bucket(i, checksum(views))
    out = asm.complete()
    for name, a in named:
        np.testing.assert_array_equal(bits(out[name]), bits(a))
        assert out[name].ctypes.data % 64 == 0 or out[name].size == 0


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])
def test_a_mapped_stream_file_gives_aligned_views_and_a_flipped_bit_is_refused(tmp_path, algo):
    """The same-host path: the stream written to a file with every tensor 64-byte aligned
    (odd sizes pad), mapped, checked bucket by bucket, read as views (no copy)."""
    named = tensors() + [("odd", np.arange(7, dtype=np.float32).astype(BF16))]
    named.insert(1, ("bias", np.full((3,), 0.5, BF16)))  # 6 bytes: the next tensor pads
    manifest = Manifest.from_json(manifest_for(named, 3, bucket_bytes=333).to_json()
                                  | {"checksum": algo})
    assert manifest.checksum == algo
    arrays = [a for _, a in named]
    crcs = [checksum(bucket_views(manifest, arrays, i), algo)
            for i in range(manifest.num_buckets)]
    offsets, size = file_layout(manifest)
    assert all(o % 64 == 0 for o in offsets) and size > manifest.total_bytes
    path = tmp_path / "stream"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    write_stream_file(fd, manifest, arrays)
    mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    asm = Assembler(manifest)
    asm.map_file(mapped, crcs)
    out = asm.complete()
    for name, a in named:
        np.testing.assert_array_equal(bits(out[name]), bits(a))
        assert not out[name].flags.writeable  # views of the mapping
    big = int(np.argmax([t.nbytes for t in manifest.tensors]))
    os.pwrite(fd, bytes([arrays[big].view(np.uint8).reshape(-1)[5] ^ 0x04]),
              offsets[big] + 5)
    with pytest.raises(WireError, match="is corrupted"):
        Assembler(manifest).map_file(mapped, crcs)
    with pytest.raises(WireError, match="holds"):
        Assembler(manifest).map_file(mapped[:size - 1], crcs)
    os.close(fd)
    with pytest.raises(WireError, match="unknown checksum"):
        Manifest.from_json(manifest.to_json() | {"checksum": "md5"})


def test_a_wrong_bucket_is_refused():
    named = tensors()
    manifest = manifest_for(named, 3, bucket_bytes=333)
    arrays = [a for _, a in named]
    data = bytearray(b"".join(bytes(v) for v in bucket_views(manifest, arrays, 0)))
    crc = checksum(memoryview(bytes(data)))
    data[7] ^= 0x10
    asm = Assembler(manifest)
    asm.write(0, bytes(data))
    with pytest.raises(WireError, match="bucket 0 is corrupted"):
        asm.end_bucket(0, crc)
    asm = Assembler(manifest)
    asm.write(0, bytes(data[:100]))
    with pytest.raises(WireError, match="bucket 0 has 100 bytes, expected 333"):
        asm.end_bucket(0, crc)
    with pytest.raises(WireError, match="longer than"):
        Assembler(manifest).write(0, bytes(400))
    with pytest.raises(WireError, match="never arrived"):
        Assembler(manifest).complete()
    bad = manifest.to_json()
    bad["total_bytes"] += 2
    with pytest.raises(WireError, match="total_bytes"):
        Manifest.from_json(bad)


def test_nonfinite_reads_the_exponent_bits():
    named = tensors()
    assert nonfinite(named) is None
    named[1][1][1, 2, 3] = np.inf
    assert nonfinite(named) == "layers.w"
    assert nonfinite([("x", np.array([1.0, np.nan], np.float32))]) == "x"
    assert nonfinite([("x", np.array([65504.0], np.float16))]) is None


def step(named, lr, seed):
    """An AdamW-like first step of every weight: w - lr * sign(g), in fp32, cast back."""
    rng = np.random.default_rng(seed)
    return [(n, (a.astype(np.float32) - lr * np.sign(rng.standard_normal(a.shape))).astype(
        a.dtype)) for n, a in named]


def test_a_delta_reconstructs_bit_for_bit_and_is_small():
    rng = np.random.default_rng(1)
    old = [("w", (rng.standard_normal((256, 256)) * 0.05).astype(BF16))]
    new = step(old, 1e-5, 2)
    changed = np.mean(bits(new[0][1]) != bits(old[0][1]))
    assert 0 < changed < 0.5
    data = encode_delta(new, dict(old), version=5, base_version=4)
    header = read_delta_header(data)
    assert header["version"] == 5 and header["base_version"] == 4
    out = dict(apply_delta(data, dict(old)))
    np.testing.assert_array_equal(bits(out["w"]), bits(new[0][1]))
    full = encode_delta(new, None, version=5, base_version=None)
    assert len(data) < 0.6 * len(full)  # most bits stay: the XOR compresses
    out = dict(apply_delta(full, None))
    np.testing.assert_array_equal(bits(out["w"]), bits(new[0][1]))


def test_a_corrupted_or_misapplied_delta_is_refused():
    old = tensors(0)
    new = step(old, 1e-3, 3)
    data = bytearray(encode_delta(new, dict(old), version=1, base_version=0))
    for at in (len(data) - 5, len(data) // 2 + 40):
        bad = bytearray(data)
        bad[at] ^= 0x01
        with pytest.raises(WireError):
            dict(apply_delta(bytes(bad), dict(old)))
    with pytest.raises(WireError, match="checksum"):  # applied to another base
        dict(apply_delta(bytes(data), dict(tensors(9))))
    with pytest.raises(WireError, match="no base was given"):
        dict(apply_delta(bytes(data), None))
    with pytest.raises(WireError, match="truncated|not a weight delta|decompress"):
        dict(apply_delta(bytes(data[:len(data) // 2]), dict(old)))
    with pytest.raises(WireError, match="bad magic"):
        read_delta_header(b"not a delta at all")


def test_the_delta_publisher_writes_full_versions_every_k_and_after_a_gap(tmp_path):
    pub = DeltaPublisher(tmp_path, full_every=3, keep=2)
    versions = [tensors(0)]
    for v in range(1, 6):
        versions.append(step(versions[-1], 1e-3, v))
    bases = {}
    for v in (0, 1, 2, 3, 5):  # 4 is skipped: 5 cannot be a delta
        path, nbytes = pub.publish(versions[v], v)
        bases[v] = read_delta_header(open(path, "rb").read())["base_version"]
        assert nbytes == len(open(path, "rb").read())
    assert bases == {0: None, 1: 0, 2: 1, 3: None, 5: None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3.delta", "v5.delta"]
    path, _ = pub.full(5)
    out = dict(apply_delta(open(path, "rb").read(), None))
    for name, a in versions[5]:
        np.testing.assert_array_equal(bits(out[name]), bits(a))
