"""In-memory weight updates against real engine servers on 127.0.0.1: the learner's weights
streamed in checksummed buckets (``checkpoint/stream.py``, ``areal_jax.weight_wire``),
staged while the servers generate, swapped at a step boundary. After a bump the servers'
greedy tokens and logprobs are the learner's; every fault leaves the old version serving."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.checkpoint.delta import DeltaPublisher
from areal_jax.checkpoint.publish import PublishError
from areal_jax.checkpoint.stream import (
    StreamPublisher,
    serving_arrays,
    serving_shapes,
    warm_serving_cast,
)
from areal_jax.weight_wire import (
    CHECKSUM_HEADER,
    bucket_views,
    checksum,
    file_layout,
    manifest_for,
    read_delta_header,
    write_stream_file,
)
from model_defs import load_hf
from tests.hf_fixtures import make_tiny_hf_checkpoint, token_logprob_tolerance
from tests.server_fixtures import start_servers

MAX_SEQ_LEN = 64
PROMPT = [5, 9, 17, 3, 44]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return make_tiny_hf_checkpoint(root, seed=0), make_tiny_hf_checkpoint(root, seed=1)


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    # Same shapes as tests/test_client_stall.py (the shared compilation cache).
    handles = start_servers(ckpts[0], 2, tmp_path_factory, max_slots=4, max_seq_len=MAX_SEQ_LEN,
                            allowed_weight_dirs=[ckpts[0].parent])
    yield handles
    for h in handles:
        h.terminate()


@pytest.fixture(scope="module")
def learners(ckpts):
    """The 'learner' models: model_defs' fp32 CausalLM of each checkpoint."""
    return [load_hf(path)[0] for path in ckpts]


_FORWARD: dict = {}


def learner_logprobs(model, path, output):
    """The learner's recomputation: log p(output[i] | prefix) and the greedy choice at each
    position, from model_defs' full forward of ``model``."""
    key = id(model)
    if key not in _FORWARD:
        _FORWARD[key] = jax.jit(lambda ids: model(ids)[0])
    seq = PROMPT + list(output)
    ids = np.zeros((1, MAX_SEQ_LEN), np.int32)
    ids[0, :len(seq)] = seq
    logp = np.asarray(jax.nn.log_softmax(_FORWARD[key](jnp.asarray(ids)), axis=-1))
    rows = logp[len(PROMPT) - 1:len(seq) - 1]
    return rows[np.arange(len(output)), np.asarray(output)], rows.argmax(-1)


def generate(url):
    r = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = body["output_ids"]
    logprobs = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
    return tokens, np.asarray(logprobs), body["meta_info"]["weight_version"]


def assert_serves(url, model, path, version):
    """``url``'s greedy tokens are the learner model's argmax and its logprobs the
    learner's recomputation (fp32 tolerance), at weight version ``version``."""
    tokens, logprobs, served = generate(url)
    assert served == str(version)
    ref, argmax = learner_logprobs(model, path, tokens)
    np.testing.assert_array_equal(tokens, argmax)
    tol = token_logprob_tolerance(path, PROMPT + tokens, 0.0)
    np.testing.assert_allclose(logprobs, ref, rtol=0, atol=tol)


def swap(url, transfer, version):
    return httpx.post(f"{url}/weights/swap", timeout=120, json={
        "transfer": transfer, "weight_version": str(version), "abort_all_requests": True})


def status(url):
    return httpx.get(f"{url}/weights/status", timeout=30).json()


def serving_version(url):
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["weight_version"]


@pytest.fixture
def on_a(servers, ckpts, learners):
    """Both servers on checkpoint A at version 0 (restored through the memory path)."""
    urls = [h.url for h in servers]
    if any(serving_version(u) != "0" for u in urls):
        transfer = StreamPublisher(urls).send(serving_arrays(learners[0], "float32"), 0)
        for u in urls:
            assert swap(u, transfer, 0).status_code == 200
    return urls


@pytest.mark.parametrize("shm_dir", ["/dev/shm", None, "/proc"],
                         ids=["shared-memory", "http", "unwritable-shm-falls-back-to-http"])
def test_a_memory_bump_serves_the_learners_weights_on_every_server(on_a, ckpts, learners,
                                                                   shm_dir):
    urls = on_a
    for u in urls:
        assert_serves(u, learners[0], ckpts[0], 0)
    # several buckets, tensors span them
    sender = StreamPublisher(urls, bucket_bytes=10_000, shm_dir=shm_dir)
    assert sender.shm_dir == shm_dir  # the servers are on this host
    transfer = sender.send(serving_arrays(learners[1], "float32"), 1)
    assert sender.last is not None and sender.last.nbytes > 3 * 10_000
    # /proc takes no new file: that send, and the ones after it, went over HTTP
    assert sender.shm_dir == (None if shm_dir == "/proc" else shm_dir)
    assert sender.shm_fallbacks == []  # the servers on this host read the shared memory
    for u in urls:  # staged, not served yet: the servers still generate on v0
        assert status(u)["staged"] == transfer
        assert_serves(u, learners[0], ckpts[0], 0)
    for u in urls:
        reply = swap(u, transfer, 1).json()
        assert reply["success"] and reply["paused_s"] >= 0
        assert_serves(u, learners[1], ckpts[1], 1)
    assert swap(urls[0], transfer, 1).status_code == 400  # staged weights are handed over once


def _shm_files(shm):
    return sorted(n for n in os.listdir(shm) if n.startswith("areal-weights-"))


def _inode(shm, name):
    st = os.stat(os.path.join(shm, name))
    return st.st_dev, st.st_ino


def test_a_send_writes_into_the_file_no_server_holds_any_more(on_a, ckpts, learners):
    """The first send writes a new file and a spare is made after it; the second writes
    into the spare (the first file is served); from the third on, each is written into
    the file of the version before the served one, which no server maps any more. /dev/shm
    then holds two versions' files, the servers serve each version bit for bit, close()
    removes the files, and those left by a dead sender are removed by the next one."""
    urls = on_a
    import tempfile

    shm = tempfile.mkdtemp(prefix="areal-test-shm-", dir="/dev/shm")
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
        orphans = [os.path.join(shm, f"areal-weights-spare-{dead}-abcdef"),
                   os.path.join(shm, f"areal-weights-kept-{dead}-0123abcd")]
        mine = os.path.join(shm, f"areal-weights-kept-{os.getpid()}-abcdef")
        for path in (*orphans, mine):
            open(path, "wb").close()
        sender = StreamPublisher(urls, bucket_bytes=10_000, shm_dir=shm)
        assert not any(map(os.path.exists, orphans)) and os.path.exists(mine)  # it lives
        os.unlink(mine)
        kinds, inodes = [], []
        plan = [(1, learners[1]), (2, learners[0]), (3, learners[1]), (4, learners[0]),
                (5, learners[1])]
        for version, model in plan:
            transfer = sender.send(serving_arrays(model, "float32"), version)
            kinds.append(sender.last.shm_file)
            # only the spare's write can have waited for the spare being made, within it
            assert (0.0 <= sender.last.spare_wait_s <= sender.last.write_s
                    if sender.last.shm_file == "spare" else sender.last.spare_wait_s == 0.0)
            name = next(n for n in _shm_files(shm) if n.endswith(transfer))
            inodes.append(_inode(shm, name))
            assert os.path.getsize(os.path.join(shm, name)) >= sender.last.nbytes
            assert sender.shm_fallbacks == []
            for u in urls:
                assert swap(u, transfer, version).json()["success"]
                assert_serves(u, model, ckpts[1 if model is learners[1] else 0], version)
                assert list(_inode(shm, name)) in status(u)["held_files"]
            if sender._spare_thread is not None:
                sender._spare_thread.join()
            assert len(_shm_files(shm)) <= 2  # two versions' files, never three
        assert kinds == ["new", "spare", "reused", "reused", "reused"]
        # each reuse took the file of the version before the served one
        assert inodes[2] == inodes[0] and inodes[3] == inodes[1] and inodes[4] == inodes[0]
        sender.close()
        assert _shm_files(shm) == []
        # the servers' mappings outlive the names: v5 still serves, bit for bit
        for u in urls:
            assert_serves(u, learners[1], ckpts[1], 5)
        # a spare of another size (another model) is dropped, not written into
        sender._prepare_spare(123)
        sender._spare_thread.join()
        assert len(_shm_files(shm)) == 1
        transfer = sender.send(serving_arrays(learners[0], "float32"), 6)
        assert sender.last.shm_file == "new"
        for u in urls:
            assert swap(u, transfer, 6).json()["success"]
            assert_serves(u, learners[0], ckpts[0], 6)
        sender.close()
        assert os.listdir(shm) == []
        # spare_file off: a fresh file every send, its name gone when the send ends
        plain = StreamPublisher(urls, bucket_bytes=10_000, shm_dir=shm, spare_file=False)
        for version, model in ((7, learners[1]), (8, learners[0])):
            transfer = plain.send(serving_arrays(model, "float32"), version)
            assert plain.last.shm_file == "new" and os.listdir(shm) == []
            for u in urls:
                assert swap(u, transfer, version).json()["success"]
        assert_serves(urls[0], learners[0], ckpts[0], 8)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def test_serving_shapes_are_what_serving_arrays_hands_over(ckpts):
    """Names, shapes and dtypes in the same order, for a plain model and one with LoRA
    adapters (merged into the kernels), without computing either."""
    from model_defs.lora import LoraConfig, add_lora

    plain = load_hf(ckpts[0])[0]
    adapted = load_hf(ckpts[0])[0]
    add_lora(adapted, LoraConfig(rank=2, target_modules=("q_proj", "down_proj")),
             rngs=nnx.Rngs(0))
    for model in (plain, adapted):
        for dtype in ("bfloat16", "float32"):
            real = [(n, tuple(a.shape), str(a.dtype))
                    for n, a in serving_arrays(model, dtype).named]
            traced = [(n, tuple(a.shape), str(a.dtype)) for n, a in serving_shapes(model, dtype)]
            assert traced == real
    assert not any("lora" in n for n, _ in serving_shapes(adapted, "bfloat16"))


def test_prepare_makes_the_first_versions_file_ahead(on_a, ckpts, learners):
    """``prepare`` writes a spare of the first version's size before any send: the first
    send writes into it (the second into the next spare, the third reuses a file), every
    version served bit for bit; a second ``prepare`` makes nothing more, and a sender
    without ``spare_file`` makes nothing."""
    urls = on_a
    import tempfile

    shm = tempfile.mkdtemp(prefix="areal-test-shm-", dir="/dev/shm")
    try:
        sender = StreamPublisher(urls, bucket_bytes=10_000, shm_dir=shm)
        sender.prepare(serving_shapes(learners[1], "float32"))
        sender.prepare(serving_shapes(learners[1], "float32"))  # one is being made
        sender._spare_thread.join()
        (spare,) = _shm_files(shm)
        size = os.path.getsize(os.path.join(shm, spare))
        expect = file_layout(manifest_for(serving_arrays(learners[1], "float32").named, 1))[1]
        assert "-spare-" in spare and size == expect
        with open(os.path.join(shm, spare), "rb") as f:  # zeros until a version
            assert not any(f.read())
        kinds = []
        for version, model in ((1, learners[1]), (2, learners[0]), (3, learners[1])):
            transfer = sender.send(serving_arrays(model, "float32"), version)
            kinds.append(sender.last.shm_file)
            for u in urls:
                assert swap(u, transfer, version).json()["success"]
                assert_serves(u, model, ckpts[1 if model is learners[1] else 0], version)
            if sender._spare_thread is not None:
                sender._spare_thread.join()
        assert kinds == ["spare", "spare", "reused"]
        before, thread = _shm_files(shm), sender._spare_thread
        sender.prepare(serving_shapes(learners[1], "float32"))  # files are kept: nothing
        assert sender._spare_thread is thread and _shm_files(shm) == before
        sender.close()
        assert _shm_files(shm) == []
        off = StreamPublisher(urls, bucket_bytes=10_000, shm_dir=shm, spare_file=False)
        off.prepare(serving_shapes(learners[1], "float32"))
        assert off._spare_thread is None and os.listdir(shm) == []
        off.close()
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def test_a_file_a_server_still_serves_from_is_never_written_into(on_a, ckpts, learners):
    """Sends without a swap between them: the served version's file is held, so the next
    versions go elsewhere (a staged version superseded by the next transfer lets go of
    its file at once, so that one is reused); the servers keep serving their version bit
    for bit throughout, and a refused version (probe failed at the swap) leaves the old
    version's file held."""
    urls = on_a
    import tempfile

    shm = tempfile.mkdtemp(prefix="areal-test-shm-", dir="/dev/shm")
    try:
        sender = StreamPublisher(urls, bucket_bytes=10_000, shm_dir=shm)
        t1 = sender.send(serving_arrays(learners[1], "float32"), 1)
        for u in urls:
            assert swap(u, t1, 1).json()["success"]
        served = _inode(shm, next(n for n in _shm_files(shm) if n.endswith(t1)))
        t2 = sender.send(serving_arrays(learners[0], "float32"), 2)  # staged, not swapped
        assert sender.last.shm_file == "spare"
        staged = _inode(shm, next(n for n in _shm_files(shm) if n.endswith(t2)))
        for version in (3, 4):
            transfer = sender.send(serving_arrays(learners[0], "float32"), version)
            # v1's file is served: never written into; the superseded staged one is reused
            assert sender.last.shm_file == "reused"
            now = _inode(shm, next(n for n in _shm_files(shm) if n.endswith(transfer)))
            assert now == staged and now != served
            for u in urls:
                assert list(served) in status(u)["held_files"]
                assert_serves(u, learners[1], ckpts[1], 1)
        for u in urls:
            assert swap(u, transfer, 4).json()["success"]
            assert_serves(u, learners[0], ckpts[0], 4)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def put_bucket(url, manifest, arrays, index, crc=None, data=None):
    parts = bucket_views(manifest, arrays, index)
    return httpx.put(
        f"{url}/weights/bucket", params={"transfer": manifest.transfer, "index": index},
        content=data if data is not None else b"".join(bytes(p) for p in parts),
        headers={CHECKSUM_HEADER: str(checksum(parts) if crc is None else crc)}, timeout=60)


def begin(url, named, version, bucket_bytes=10_000):
    manifest = manifest_for(named, version, bucket_bytes)
    r = httpx.post(f"{url}/weights/begin", json=manifest.to_json(), timeout=60)
    return manifest, r


def test_the_server_generates_on_the_old_weights_while_it_receives(on_a, ckpts, learners):
    url = on_a[0]
    named = serving_arrays(learners[1], "float32").host()
    manifest, r = begin(url, named, 2)
    assert r.status_code == 200, r.text
    arrays = [a for _, a in named]
    for i in range(manifest.num_buckets // 2):
        assert put_bucket(url, manifest, arrays, i).status_code == 200
    assert status(url)["receiving"] == manifest.transfer
    # mid-transfer: v0, unchanged, decoded one step per call (the swap is due)
    assert status(url)["swap_expected"]
    assert_serves(url, learners[0], ckpts[0], 0)
    for i in range(manifest.num_buckets // 2, manifest.num_buckets):
        assert put_bucket(url, manifest, arrays, i).status_code == 200
    assert httpx.post(f"{url}/weights/stage", json={"transfer": manifest.transfer},
                      timeout=120).status_code == 200
    assert status(url)["swap_expected"]
    assert swap(url, manifest.transfer, 2).status_code == 200
    assert not status(url)["swap_expected"]  # whole calls again
    assert_serves(url, learners[1], ckpts[1], 2)
    # A transfer whose swap will wait for the running requests keeps whole calls (one-step
    # calls would only make them finish later); an unknown swap mode is a 400.
    r = httpx.post(f"{url}/weights/begin", params={"swap": "wait"},
                   json=manifest_for(named, 3, 10_000).to_json(), timeout=60)
    assert r.status_code == 200 and not status(url)["swap_expected"]
    r = httpx.post(f"{url}/weights/begin", params={"swap": "later"},
                   json=manifest_for(named, 3, 10_000).to_json(), timeout=60)
    assert r.status_code == 400 and "'abort' or 'wait'" in r.text
    assert httpx.post(f"{url}/weights/abort", json={}, timeout=60).status_code == 200


def test_a_corrupted_bucket_is_refused_and_v0_keeps_serving(on_a, ckpts, learners):
    url = on_a[0]
    named = serving_arrays(learners[1], "float32").host()
    manifest, _ = begin(url, named, 3)
    arrays = [a for _, a in named]
    good = b"".join(bytes(p) for p in bucket_views(manifest, arrays, 0))
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01  # one bit
    r = put_bucket(url, manifest, arrays, 0, crc=checksum(memoryview(good)), data=bytes(flipped))
    assert r.status_code == 400 and "corrupted" in r.json()["error"]
    r = httpx.post(f"{url}/weights/stage", json={"transfer": manifest.transfer}, timeout=60)
    assert r.status_code == 400 and "corrupted" in r.json()["error"]
    assert swap(url, manifest.transfer, 3).status_code == 400
    assert_serves(url, learners[0], ckpts[0], 0)


def test_a_corrupted_shared_memory_file_is_refused(on_a, ckpts, learners, tmp_path):
    url = on_a[0]
    named = serving_arrays(learners[1], "float32").host()
    manifest, _ = begin(url, named, 3)
    arrays = [a for _, a in named]
    crcs = [checksum(bucket_views(manifest, arrays, i)) for i in range(manifest.num_buckets)]
    path = tmp_path / f"areal-weights-{manifest.transfer}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    write_stream_file(fd, manifest, arrays)
    os.close(fd)
    data = bytearray(path.read_bytes())
    offsets, _ = file_layout(manifest)
    big = int(np.argmax([t.nbytes for t in manifest.tensors]))
    data[offsets[big] + manifest.tensors[big].nbytes // 3] ^= 0x01  # one bit of a tensor
    path.write_bytes(bytes(data))
    r = httpx.post(f"{url}/weights/load_file", timeout=60, json={
        "transfer": manifest.transfer, "path": str(path), "checksums": crcs})
    assert r.status_code == 400 and "is corrupted" in r.json()["error"]
    manifest, _ = begin(url, named, 3)
    other = tmp_path / "secrets.bin"
    other.write_bytes(bytes(data))
    r = httpx.post(f"{url}/weights/load_file", timeout=60, json={
        "transfer": manifest.transfer, "path": str(other), "checksums": crcs})
    assert r.status_code == 400 and "not a weight stream file" in r.json()["error"]
    assert_serves(url, learners[0], ckpts[0], 0)


def test_a_missing_bucket_or_short_bucket_is_refused(on_a, ckpts, learners):
    url = on_a[0]
    named = serving_arrays(learners[1], "float32").host()
    manifest, _ = begin(url, named, 3)
    arrays = [a for _, a in named]
    whole = b"".join(bytes(p) for p in bucket_views(manifest, arrays, 0))
    r = put_bucket(url, manifest, arrays, 0, data=whole[:-4])
    assert r.status_code == 400 and f"expected {len(whole)}" in r.json()["error"]
    manifest, _ = begin(url, named, 3)
    assert put_bucket(url, manifest, arrays, 0).status_code == 200
    r = httpx.post(f"{url}/weights/stage", json={"transfer": manifest.transfer}, timeout=60)
    assert r.status_code == 400 and "never arrived" in r.json()["error"]
    assert_serves(url, learners[0], ckpts[0], 0)


def test_a_size_or_dtype_that_does_not_fit_is_refused_before_any_byte(on_a, ckpts, learners):
    urls = on_a
    with pytest.raises(PublishError, match="has dtype bfloat16; the server serves float32"):
        StreamPublisher(urls).send(serving_arrays(learners[1], "bfloat16"), 4)
    named = serving_arrays(learners[1], "float32").host()
    wide = [(n, np.zeros((a.shape[0] + 1, *a.shape[1:]), a.dtype) if n == "embed_vd" else a)
            for n, a in named]
    _, r = begin(urls[0], wide, 4)
    assert r.status_code == 400 and "tensor embed_vd has shape" in r.json()["error"]
    _, r = begin(urls[0], named[1:], 4)
    assert r.status_code == 400 and "missing ['embed_vd']" in r.json()["error"]
    for u in urls:
        assert status(u)["receiving"] is None
        assert_serves(u, learners[0], ckpts[0], 0)


def test_a_connection_dropped_mid_bucket_drops_the_transfer(on_a, ckpts, learners):
    url = on_a[0]
    named = serving_arrays(learners[1], "float32").host()
    manifest, _ = begin(url, named, 5)
    arrays = [a for _, a in named]
    data = b"".join(bytes(p) for p in bucket_views(manifest, arrays, 0))
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall((f"PUT /weights/bucket?transfer={manifest.transfer}&index=0 HTTP/1.1\r\n"
                      f"Host: {parts.netloc}\r\nContent-Length: {len(data)}\r\n"
                      f"{CHECKSUM_HEADER}: {checksum(memoryview(data))}\r\n\r\n").encode())
        sock.sendall(data[:len(data) // 2])
    for _ in range(100):  # the server notices the closed connection
        if status(url)["receiving"] is None:
            break
        import time

        time.sleep(0.1)
    assert "connection dropped" in status(url)["last_error"]
    assert_serves(url, learners[0], ckpts[0], 0)


def test_a_learner_killed_mid_stream_leaves_v0_and_the_next_bump_works(on_a, ckpts, learners):
    """A sender process SIGKILLed after its first bucket: the server keeps v0, refuses to
    swap to the unfinished transfer, and takes the next version whole."""
    url = on_a[0]
    script = textwrap.dedent(f"""
        import os, signal, httpx
        from areal_jax.checkpoint.stream import serving_arrays
        from areal_jax.weight_wire import CHECKSUM_HEADER, bucket_views, checksum, manifest_for
        from model_defs import load_hf
        named = serving_arrays(load_hf({str(ckpts[1])!r})[0], "float32").host()
        m = manifest_for(named, 6, 10_000)
        httpx.post({url!r} + "/weights/begin", json=m.to_json(), timeout=60).raise_for_status()
        parts = bucket_views(m, [a for _, a in named], 0)
        httpx.put({url!r} + "/weights/bucket", params={{"transfer": m.transfer, "index": 0}},
                  content=b"".join(bytes(p) for p in parts),
                  headers={{CHECKSUM_HEADER: str(checksum(parts))}}, timeout=60).raise_for_status()
        print(m.transfer, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    transfer = proc.stdout.split()[-1]
    assert status(url)["receiving"] == transfer
    r = swap(url, transfer, 6)
    assert r.status_code == 400 and "not staged" in r.json()["error"]
    assert_serves(url, learners[0], ckpts[0], 0)
    transfer = StreamPublisher([url]).send(serving_arrays(learners[1], "float32"), 7)
    assert swap(url, transfer, 7).status_code == 200
    assert_serves(url, learners[1], ckpts[1], 7)


def test_non_finite_weights_are_refused_on_the_learner_and_at_the_swap(on_a, ckpts, learners):
    urls = on_a
    state = nnx.state(learners[1])
    nan = jax.tree.map(lambda x: x, state.to_pure_dict())
    nan["layers"]["mlp"]["up_kernel_df"] = nan["layers"]["mlp"]["up_kernel_df"].at[0, 0, 0].set(
        jnp.nan)
    with pytest.raises(PublishError, match="NaN or Inf in layers.mlp.up_kernel_df"):
        StreamPublisher(urls).send(serving_arrays(nnx.State(nan), "float32"), 8)
    for u in urls:
        assert status(u)["staged"] is None
    # Finite weights that overflow in use: only the servers' probe forward sees it, at the
    # swap, in the first prefill under them (here a request that arrives meanwhile, and on
    # the other server alone, the engine idle). Each server puts v0 back: the request's
    # tokens are v0's, and v0 serves on.
    huge = jax.tree.map(lambda x: x, state.to_pure_dict())
    huge["final_norm"]["scale"] = jnp.full_like(huge["final_norm"]["scale"], 3e38)
    transfer = StreamPublisher(urls).send(serving_arrays(nnx.State(huge), "float32"), 8)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        swapping = pool.submit(swap, urls[0], transfer, 8)
        time.sleep(0.05)  # the swap is in: the request below comes after it
        tokens, logprobs, served = generate(urls[0])
        r = swapping.result()
    assert r.status_code == 400 and "probe prompt gives non-finite" in r.json()["error"], r.text
    assert served == "0"
    ref, argmax = learner_logprobs(learners[0], ckpts[0], tokens)
    np.testing.assert_array_equal(tokens, argmax)
    r = swap(urls[1], transfer, 8)
    assert r.status_code == 400 and "probe prompt gives non-finite" in r.json()["error"], r.text
    for u in urls:
        assert "probe prompt" in status(u)["last_error"]
        assert_serves(u, learners[0], ckpts[0], 0)
    # and the next good version swaps in as usual, its probe in the first prefill
    transfer = StreamPublisher(urls).send(serving_arrays(learners[1], "float32"), 9)
    for u in urls:
        reply = swap(u, transfer, 9).json()
        assert reply["success"] and reply["verify_s"] >= 0
        assert_serves(u, learners[1], ckpts[1], 9)


class _Load:
    """Greedy requests back to back on ``url`` from 8 threads; one the server aborts is
    resubmitted with its partial output (as the rollout client does). Keeps each whole
    reply: (output ids, [(first, end, weight version) of each part])."""

    def __init__(self, url):
        self.url, self.replies, self.stop = url, [], False
        self.pool = concurrent.futures.ThreadPoolExecutor(8)  # the 4 slots stay busy
        self.futures = [self.pool.submit(self._run) for _ in range(8)]

    def _run(self):
        while not self.stop:
            prompt, output, parts = list(PROMPT), [], []
            while True:
                r = httpx.post(f"{self.url}/generate", timeout=120, json={
                    "input_ids": prompt + output, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 40 - len(output),
                                        "temperature": 0.0, "ignore_eos": True}})
                assert r.status_code == 200, r.text
                body = r.json()
                parts.append((len(output), len(output) + len(body["output_ids"]),
                              body["meta_info"]["weight_version"]))
                output += body["output_ids"]
                if body["meta_info"]["finish_reason"]["type"] != "abort":
                    self.replies.append((output, parts))
                    break

    def close(self):
        self.stop = True
        for f in self.futures:
            f.result()
        self.pool.shutdown()


def test_the_probe_rides_in_the_prefill_of_the_requests_the_swap_aborted(on_a, ckpts,
                                                                       learners):
    """A swap that aborts running requests probes the new version in the prefill of those
    requests when they come back (no pass of its own): a good version serves them; one
    whose probe fails is put back before any of their tokens leaves, and they run on v0."""
    url = on_a[0]
    state = nnx.state(learners[1]).to_pure_dict()
    huge = jax.tree.map(lambda x: x, state)
    huge["final_norm"]["scale"] = jnp.full_like(huge["final_norm"]["scale"], 3e38)
    for version, weights, good in ((11, nnx.State(huge), False), (12, learners[1], True)):
        for _attempt in range(5):  # until the swap found requests running
            transfer = StreamPublisher([url]).send(serving_arrays(weights, "float32"), version)
            load = _Load(url)
            try:
                while len(load.replies) < 2:
                    time.sleep(0.01)
                r = swap(url, transfer, version)
                seen = len(load.replies)
                while len(load.replies) < seen + 4:
                    time.sleep(0.01)
            finally:
                load.close()
            probe = status(url)["last_probe"]
            assert probe["transfer"] == transfer and probe["finite"] == good
            if good:
                assert r.status_code == 200 and r.json()["success"], r.text
                paused = r.json()["num_paused_requests"]
            else:
                assert r.status_code == 400 and "probe prompt" in r.json()["error"], r.text
                paused = None
            if probe["ran"] == "in a prefill":
                break
            assert paused in (0, None)  # it ran alone only when the swap aborted none
        assert probe["ran"] == "in a prefill"
        # Every token is the greedy choice of the version its part reports: v0 or the new
        # one if it is good; never the refused one.
        models = {"0": learners[0], str(version): learners[1]}
        for output, parts in load.replies[seen:]:
            for first, end, served in parts:
                assert served in (("0", str(version)) if good else ("0",))
                _, argmax = learner_logprobs(models[served], None, output)
                np.testing.assert_array_equal(output[first:end], argmax[first:end])
        model, path = (learners[1], ckpts[1]) if good else (learners[0], ckpts[0])
        assert_serves(url, model, path, version if good else 0)


def delta_update(url, path, version):
    return httpx.post(f"{url}/update_weights_from_delta", timeout=120, json={
        "model_path": str(path), "weight_version": str(version), "abort_all_requests": True})


def test_a_delta_bump_serves_the_learners_weights_and_a_bad_one_is_refused(on_a, ckpts,
                                                                           learners):
    """Deltas on a shared path: v1 as the XOR of its bits with v0's; a delta against a
    version the server does not serve, and a corrupted one, are refused (the server keeps
    its version); the full version then applies."""
    url = on_a[0]
    folder = ckpts[0].parent / "deltas"
    deltas = DeltaPublisher(folder, full_every=10)
    a, b = (serving_arrays(m, "float32").host() for m in learners)
    deltas.publish(a, 0)  # the base the servers hold
    path, _ = deltas.publish(b, 1)
    assert read_delta_header(open(path, "rb").read())["base_version"] == 0
    assert delta_update(url, path, 1).status_code == 200
    assert_serves(url, learners[1], ckpts[1], 1)
    deltas.publish(a, 2)
    path, _ = deltas.publish(b, 3)  # against v2, which this server never got
    r = delta_update(url, path, 3)
    assert r.status_code == 400 and "a delta against v2" in r.json()["error"]
    full, _ = deltas.full(3)
    corrupted = bytearray(open(full, "rb").read())
    corrupted[-20] ^= 0xFF
    (folder / "corrupted.delta").write_bytes(bytes(corrupted))
    r = delta_update(url, folder / "corrupted.delta", 3)
    assert r.status_code == 400 and "weights not updated" in r.json()["error"]
    assert_serves(url, learners[1], ckpts[1], 1)
    assert delta_update(url, full, 3).status_code == 200
    assert_serves(url, learners[1], ckpts[1], 3)
    assert delta_update(url, "/etc/hostname", 4).status_code == 403


def test_swaps_during_short_requests_never_stall_generation(on_a, ckpts, learners):
    """A swap that lands just as the running requests finish (a decode call still in
    flight, no slot busy) must leave generation running: the engine once kept refusing to
    dispatch decode calls after such a swap, and every later request hung."""
    import threading

    url = on_a[0]
    stop = threading.Event()
    errors: list[str] = []

    def short_requests(seed):
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    r = c.post(f"{url}/generate", json={
                        "input_ids": PROMPT, "sampling_params": {
                            "max_new_tokens": int(rng.integers(1, 12)), "temperature": 0.0,
                            "ignore_eos": True}})
                except httpx.TimeoutException:
                    errors.append("a request hung for 60 s")
                    return
                if r.status_code != 200:
                    errors.append(r.text)

    threads = [threading.Thread(target=short_requests, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        sender = StreamPublisher([url])
        for v in range(1, 21):
            transfer = sender.send(serving_arrays(learners[v % 2], "float32"), v)
            assert swap(url, transfer, v).status_code == 200
            tokens, _, served = generate(url)  # a request after the swap completes
            assert served == str(v) and len(tokens) == 12
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    assert not errors, errors[:3]
    assert_serves(url, learners[0], ckpts[0], 20)


def test_a_server_killed_leaves_the_others_on_v0(servers, on_a, ckpts, learners):
    """The last test of the module: it kills the second server."""
    urls = on_a
    servers[1].kill()
    servers[1].process.wait(30)
    with pytest.raises(PublishError, match="every server keeps the old version") as e:
        StreamPublisher(urls).send(serving_arrays(learners[1], "float32"), 9)
    assert urls[1] in str(e.value)
    assert status(urls[0])["staged"] is None and status(urls[0])["receiving"] is None
    assert_serves(urls[0], learners[0], ckpts[0], 0)



def test_the_casts_finiteness_flags_are_exact():
    """The learner's check is a float32 sum per tensor, fused with the cast: a NaN, an
    infinity, or a value beyond the serving dtype's range (infinite once cast) is refused;
    finite values whose sum overflows are not."""
    from areal_jax.checkpoint.stream import ServingArrays, _cast_and_check

    base = [jnp.ones((64, 8), jnp.float32), jnp.arange(16, dtype=jnp.int32)]

    def flags(leaf, dtype):
        cast, finite = _cast_and_check([leaf, base[1]], jnp.zeros((), dtype))
        return ServingArrays([("w", cast[0]), ("ids", cast[1])], finite)

    big = jnp.full((64, 8), 3e38, jnp.float32)  # finite in both; the sum overflows
    for dtype in (jnp.float32, jnp.bfloat16):
        flags(base[0], dtype).check_finite()
        flags(big, dtype).check_finite()
        for bad in (jnp.nan, jnp.inf, -jnp.inf):
            with pytest.raises(PublishError, match="NaN or Inf in w"):
                flags(base[0].at[5, 3].set(bad), dtype).check_finite()
    # float32's largest value rounds past bfloat16's: infinite as served
    edge = base[0].at[0, 0].set(np.finfo(np.float32).max)
    flags(edge, jnp.float32).check_finite()
    with pytest.raises(PublishError, match="NaN or Inf in w"):
        flags(edge, jnp.bfloat16).check_finite()


def test_the_next_cast_writes_into_the_last_versions_buffers(learners):
    """serving_arrays(reuse=...) on CPU: the cast writes into the earlier version's
    buffers (same addresses) and gives exactly what a fresh cast gives, finiteness flags
    included; the earlier result is emptied. A buffer still viewed on the host is not
    written into (the old version's bytes stay), and a result of another dtype or model
    is not reused."""
    model = learners[0]
    fresh = serving_arrays(model, "bfloat16")
    want = [(n, np.asarray(a).copy()) for n, a in fresh.named]
    other = serving_arrays(learners[1], "bfloat16")
    assert other.on_cpu
    addresses = [a.unsafe_buffer_pointer() for _, a in other.named]
    got = serving_arrays(model, "bfloat16", reuse=other)
    assert other.named == [] and other.finite is None  # donated: its arrays are got's
    assert [a.unsafe_buffer_pointer() for _, a in got.named] == addresses
    for (name, a), (want_name, b) in zip(got.named, want, strict=True):
        assert name == want_name
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), b.view(np.uint16))
    got.check_finite()
    assert np.asarray(got.finite).all()
    # a NumPy view of the old version is alive: that version's bytes are left alone
    views = [np.asarray(a) for _, a in got.named]
    kept = [v.copy() for v in views]
    again = serving_arrays(learners[1], "bfloat16", reuse=got)
    for v, k in zip(views, kept, strict=True):
        np.testing.assert_array_equal(v.view(np.uint16), k.view(np.uint16))
    for (_, a), (_, b) in zip(again.named, serving_arrays(learners[1], "bfloat16").named,
                              strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                      np.asarray(b).view(np.uint16))
    del views
    # another dtype: nothing reused, the earlier result untouched
    f32 = serving_arrays(model, "float32", reuse=again)
    assert again.named and not any(a.is_deleted() for _, a in again.named)
    assert all(a.dtype == jnp.float32 for _, a in f32.named)


def test_the_warm_cast_is_what_the_first_versions_cast_writes_into(learners):
    """warm_serving_cast compiles both casts (fresh, and into donated buffers) and hands
    back a CPU cast: the first version's cast writes into its buffers, compiling nothing,
    and gives exactly a fresh cast's bytes."""
    warm = warm_serving_cast(learners[1], "bfloat16")
    assert warm is not None and warm.on_cpu
    addresses = [a.unsafe_buffer_pointer() for _, a in warm.named]
    compiles = []

    def count(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        got = serving_arrays(learners[0], "bfloat16", reuse=warm)
        jax.block_until_ready([a for _, a in got.named])
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []
    assert [a.unsafe_buffer_pointer() for _, a in got.named] == addresses
    for (_, a), (_, b) in zip(got.named, serving_arrays(learners[0], "bfloat16").named,
                              strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                      np.asarray(b).view(np.uint16))


def test_no_spare_file_while_host_memory_is_short(tmp_path, monkeypatch):
    """The spare is made only while the host has twice its size available: under memory
    pressure its pages would come from reclaim."""
    from areal_jax.checkpoint import stream

    sender = StreamPublisher(["http://127.0.0.1:9"], shm_dir=str(tmp_path))
    assert sender.shm_dir == str(tmp_path)

    def spares():
        sender._spare_thread.join()
        return [p.name for p in tmp_path.iterdir()]

    monkeypatch.setattr(stream, "_available_memory", lambda: 1500)
    sender._prepare_spare(1000)
    assert spares() == [] and sender._spare_skipped
    monkeypatch.setattr(stream, "_available_memory", lambda: 2500)
    sender._prepare_spare(1000)
    (name,) = spares()
    assert name.startswith(f"areal-weights-spare-{os.getpid()}-")
    assert (tmp_path / name).stat().st_size == 1000
    sender.close()
    assert spares() == []
