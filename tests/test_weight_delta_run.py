"""checkpoint.publish: delta wired into runs: each version a compressed XOR delta file in the
publish dir that the servers apply (``WeightSync`` with a ``DeltaPublisher``, the run's
own wiring), the full version for a server that missed one or refused its delta, chain-
aware retention, and a real training run that publishes every version as a delta."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest

from areal_jax.checkpoint.delta import DeltaPublisher
from areal_jax.checkpoint.stream import serving_arrays
from areal_jax.rollout.client import RolloutClient
from areal_jax.rollout.executor import RolloutExecutor
from areal_jax.rollout.weight_sync import WeightSync, WeightSyncError
from areal_jax.weight_wire import apply_delta, read_delta_header
from model_defs import load_hf
from tests.gcs_emulator import gcs  # noqa: F401 - the fixture
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.server_fixtures import start_servers
from tests.test_weight_stream import MAX_SEQ_LEN, assert_serves, serving_version


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta_run")
    return make_tiny_hf_checkpoint(root, seed=0), make_tiny_hf_checkpoint(root, seed=1)


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    # The shapes of tests/test_weight_stream.py (the shared compilation cache).
    handles = start_servers(ckpts[0], 2, tmp_path_factory, max_slots=4, max_seq_len=MAX_SEQ_LEN,
                            allowed_weight_dirs=[ckpts[0].parent])
    yield handles
    for h in handles:
        h.terminate()


@pytest.fixture(scope="module")
def learners(ckpts):
    return [load_hf(path)[0] for path in ckpts]


def _idle(_client, _item, _ctx):  # the executor runs no workflow here: weight updates only
    raise AssertionError("no prompts are submitted")


@pytest.fixture
def sync_on_a(servers, ckpts, learners, tmp_path):
    """Both servers serving checkpoint A as v0 (loaded from its HF dir), and the run's
    wiring around them: an executor over both, a ``WeightSync`` with a ``DeltaPublisher``
    seeded with v0 (what ``run.build_trainer`` does)."""
    def make(deltas_cls=DeltaPublisher, **kwargs):
        urls = [h.url for h in servers]
        for u in urls:
            r = httpx.post(f"{u}/update_weights_from_disk", timeout=120, json={
                "model_path": str(ckpts[0]), "weight_version": "0"})
            assert r.status_code == 200, r.text
        folder = ckpts[0].parent / f"weights-{tmp_path.name}"
        deltas = deltas_cls(folder, **kwargs)
        deltas.seed(serving_arrays(learners[0], "float32"), 0)
        ex = RolloutExecutor(RolloutClient(urls), _idle, None, batch_size=1).start()
        made.append(ex)
        return urls, deltas, WeightSync(ex, lambda p, v: "", deltas=deltas, files=None)

    made: list[RolloutExecutor] = []
    yield make
    for ex in made:
        ex.stop(close_client=True)


def test_delta_bumps_serve_the_learners_weights_and_a_server_that_missed_one_gets_it_full(
        sync_on_a, ckpts, learners):
    urls, deltas, weights = sync_on_a(full_every=10, keep=3)
    weights.publish(serving_arrays(learners[1], "float32"), 1)
    weights.wait()
    for u in urls:
        assert_serves(u, learners[1], ckpts[1], 1)
    v1 = deltas.path_for(1)
    assert read_delta_header(open(v1, "rb").read())["base_version"] == 0
    assert weights.bytes_written[1] == os.path.getsize(v1) and weights.full_servers[1] == 0
    # The second server misses v1 -> v2's base: it is made to serve another version.
    r = httpx.post(f"{urls[1]}/update_weights_from_disk", timeout=120, json={
        "model_path": str(ckpts[1]), "weight_version": "7"})
    assert r.status_code == 200, r.text
    weights.publish(serving_arrays(learners[0], "float32"), 2)
    weights.wait()
    for u in urls:  # one applied the delta, the other loaded the full version
        assert_serves(u, learners[0], ckpts[0], 2)
    full = v1.replace("v1.delta", "v2.full.delta")
    assert read_delta_header(open(full, "rb").read())["base_version"] is None
    assert weights.full_servers[2] == 1
    assert weights.bytes_written[2] == os.path.getsize(deltas.path_for(2)) + os.path.getsize(full)


class CorruptingDeltas(DeltaPublisher):
    """A publisher whose files are damaged after they are written (a flipped byte in the
    last tensor's compressed bytes): the delta only, or the full file too."""

    corrupt_full = False

    @staticmethod
    def _damage(path: str) -> None:
        data = bytearray(open(path, "rb").read())
        data[-3] ^= 0xFF
        open(path, "wb").write(bytes(data))

    def publish(self, params, version, *, full=False):
        path, n = super().publish(params, version, full=full)
        self._damage(path)
        return path, n

    def full(self, version):
        path, n = super().full(version)
        if self.corrupt_full:
            self._damage(path)
        return path, n


def test_a_corrupted_delta_is_refused_and_the_servers_fall_back_to_the_full_version(
        sync_on_a, ckpts, learners):
    urls, deltas, weights = sync_on_a(CorruptingDeltas, full_every=10, keep=3)
    weights.publish(serving_arrays(learners[1], "float32"), 1)
    weights.wait()  # both refused the damaged delta and loaded the full v1
    assert weights.full_servers[1] == 2
    for u in urls:
        assert_serves(u, learners[1], ckpts[1], 1)
    # The full version damaged as well: the bump fails, and every server keeps v1, whole.
    deltas.corrupt_full = True
    weights.publish(serving_arrays(learners[0], "float32"), 2)
    with pytest.raises(WeightSyncError, match="weight update to v2 failed.*full version "
                                              "included.*fails its checksum"):
        weights.wait()
    for u in urls:
        assert_serves(u, learners[1], ckpts[1], 1)
        assert serving_version(u) == "1"


def _tensors(seed: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [("a", rng.standard_normal((64,)).astype(np.float32)),
            ("b", rng.standard_normal((8, 8)).astype(np.float32))]


def _rebuild(folder, version: int, bases: dict[int, int | None]) -> dict[str, np.ndarray]:
    """Version ``version`` rebuilt from the files alone: its chain of deltas from a full."""
    chain, v = [], version
    while True:
        chain.append(v)
        if bases[v] is None:
            break
        v = bases[v]
    out: dict[str, np.ndarray] | None = None
    for v in reversed(chain):
        out = dict(apply_delta((folder / f"v{v}.delta").read_bytes(), out))
    assert out is not None
    return out


def test_retention_keeps_what_the_kept_versions_are_rebuilt_from(tmp_path):
    """keep=2, a full version every 4: the newest two versions stay, with the deltas under
    them down to the last full one; each kept version rebuilds bit for bit from the files.
    Full files written for servers go with their version; files of versions above the one a
    run starts from (an abandoned run's) go at start."""
    pub = DeltaPublisher(tmp_path, full_every=4, keep=2)
    versions = {v: _tensors(v) for v in range(12)}
    bases = {}
    for v in range(8):
        path, _ = pub.publish(versions[v], v)
        bases[v] = read_delta_header(open(path, "rb").read())["base_version"]
    assert [bases[v] for v in range(8)] == [None, 0, 1, 2, None, 4, 5, 6]
    pub.full(7)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["v4.delta", "v5.delta", "v6.delta", "v7.delta", "v7.full.delta"]
    for v in (6, 7):
        got = _rebuild(tmp_path, v, bases)
        for name, a in versions[v]:
            np.testing.assert_array_equal(got[name].view(np.uint32), a.view(np.uint32))
    pub.publish(versions[8], 8)  # v7 is rebuilt from its full file: v4-v6 go
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "v7.delta", "v7.full.delta", "v8.delta"]
    pub.publish(versions[9], 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v8.delta", "v9.delta"]
    (tmp_path / "v3.delta.tmp-999999999").write_bytes(b"left by a killed write")
    again = DeltaPublisher(tmp_path, full_every=4, keep=2)  # a resume from version 8
    again.seed(versions[8], 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v8.delta"]
    path, _ = again.publish(versions[9], 9)
    assert read_delta_header(open(path, "rb").read())["base_version"] == 8


def test_a_run_publishes_each_version_as_a_delta_the_server_applies(tmp_path):
    """A training run with checkpoint.publish=delta against a server that outlives it
    (bf16 serving weights of an fp32 learner, a full version every 2): v1 and v3 are
    deltas, v2 is full, no HF files but the first and the last; the server ends at v3
    serving exactly the learner's v3 (its greedy tokens and logprobs are those it gives
    after loading the run's weights/v3 files itself, and those are, tensor for tensor,
    the bf16 cast of the checkpointed v3 params)."""
    from tests.test_trainer import (
        _assert_published_tensors_are_the_learners,
        _checkpointed_weights,
        _external_server,
        _greedy,
        _rows,
        _run,
    )

    run_dir = tmp_path / "run"
    server = _external_server(tmp_path, run_dir, dtype="bfloat16")

    def reload(version: int):
        r = httpx.post(f"{server.url}/update_weights_from_disk", timeout=120, json={
            "model_path": str(run_dir / "weights" / f"v{version}"),
            "weight_version": f"reloaded-v{version}"})
        assert r.status_code == 200 and r.json()["success"], r.text
        return _greedy(server.url)

    try:
        res = _run([f"run_dir={run_dir}", "train.total_versions=3", "rollout.max_staleness=1",
                    "checkpoint.every_versions=3", "checkpoint.publish=delta",
                    "checkpoint.delta_full_every=2", "rollout.engine_dtype=bfloat16",
                    f"rollout.servers=[{server.url}]"])
        assert res.returncode == 0, res.stderr[-4000:]
        served = _greedy(server.url)
        from_file, from_v0 = reload(3), reload(0)
    finally:
        server.terminate()
    assert served[2] == "3" and from_file[2] == "reloaded-v3"
    assert served[0] == from_file[0]
    np.testing.assert_array_equal(served[1], from_file[1])
    assert served[0] != from_v0[0] or not np.array_equal(served[1], from_v0[1])
    want = _checkpointed_weights(run_dir, 3, tmp_path / "want", "bfloat16")
    _assert_published_tensors_are_the_learners(run_dir, 3, want)
    weights = run_dir / "weights"
    assert sorted(p.name for p in weights.iterdir()) == [
        "v0", "v1.delta", "v2.delta", "v3", "v3.delta"]
    bases = [read_delta_header((weights / f"v{v}.delta").read_bytes())["base_version"]
             for v in (1, 2, 3)]
    assert bases == [0, None, 2]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r, v in zip(rows[1:], (1, 2), strict=True):  # row v+1 trained from version v
        assert r["publish_bytes"] == (weights / f"v{v}.delta").stat().st_size
        assert r["publish_full_servers"] == 0 and r["publish_update_s"] > 0
    assert rows[2]["token_version_max"] >= 1


@pytest.mark.slow
def test_deltas_through_a_bucket(gcs, ckpts, learners, tmp_path_factory):  # noqa: F811
    """The publish dir on gs:// (fake-gcs-server): the learner writes each delta as an
    object, the server reads it from the bucket, and retention deletes objects."""
    from areal_jax import storage
    from tests.server_fixtures import start_server

    prefix = "gs://test-bucket/delta-weights"
    with start_server(ckpts[0], tmp_path_factory, max_slots=4, max_seq_len=MAX_SEQ_LEN,
                      allowed_weight_dirs=[prefix]) as server:
        deltas = DeltaPublisher(prefix, full_every=2, keep=2)  # v2 full: v1 may go
        deltas.seed(serving_arrays(learners[0], "float32"), 0)
        ex = RolloutExecutor(RolloutClient([server.url]), _idle, None, batch_size=1).start()
        try:
            weights = WeightSync(ex, lambda p, v: "", deltas=deltas)
            for version, which in ((1, 1), (2, 0), (3, 1)):
                weights.publish(serving_arrays(learners[which], "float32"), version)
                weights.wait()
                assert_serves(server.url, learners[which], ckpts[which], version)
                assert weights.full_servers[version] == 0
        finally:
            ex.stop(close_client=True)
    assert sorted(storage.listdir(prefix)) == ["v2.delta", "v3.delta"]


def test_publish_delta_is_checked_at_load():
    from pathlib import Path

    from areal_jax.config import ConfigError, load_config

    configs = Path(__file__).resolve().parent.parent / "configs"
    demo = configs / "tiny_demo.yaml"
    cfg = load_config(demo, ["checkpoint.publish=delta", "rollout.servers=[http://127.0.0.1:1]"])
    assert cfg.publish_path == "delta" and cfg.checkpoint.delta_full_every == 10
    assert load_config(demo, ["checkpoint.publish=delta"]).publish_path == "delta"
    with pytest.raises(ConfigError, match="checkpoint.delta_full_every must be > 0"):
        load_config(demo, ["checkpoint.publish=delta", "checkpoint.delta_full_every=0"])
    with pytest.raises(ConfigError, match="checkpoint.publish: delta needs servers that apply"):
        load_config(configs / "gsm8k_8gpu_sglang.yaml", ["checkpoint.publish=delta"])


@pytest.mark.slow
def test_a_server_down_during_two_deltas_comes_back_on_the_full_version(ckpts, learners,
                                                                       tmp_path_factory):
    """A server killed before v1 misses v1 and v2; restarted on its port with the old
    weights (v0), the client's probe finds it behind, it refuses the v2 delta (its base is
    v1) and loads the full v2, written only then; the other server applied both deltas."""
    import asyncio
    import time

    from areal_jax.engine.launch import launch_server
    from areal_jax.rollout.types import GenerateRequest
    from areal_jax.sampling_params import SamplingParams
    from tests.server_fixtures import shared_cache

    folder = ckpts[0].parent / "revival"
    deltas = DeltaPublisher(folder, full_every=10, keep=3)
    deltas.seed(serving_arrays(learners[0], "float32"), 0)
    servers = start_servers(ckpts[0], 2, tmp_path_factory, max_slots=4, max_seq_len=MAX_SEQ_LEN,
                            allowed_weight_dirs=[folder])
    port = int(servers[1].url.rsplit(":", 1)[1])

    def full_of(version: int):
        return lambda: asyncio.to_thread(lambda: deltas.full(version)[0])

    async def run() -> None:
        async with RolloutClient([s.url for s in servers], health_check_interval=0.5) as client:
            servers[1].kill()
            servers[1].process.wait(30)
            for version, which in ((1, 1), (2, 0)):
                path, _ = deltas.publish(serving_arrays(learners[which], "float32"), version)
                replies = await client.update_weights_from_delta(path, version, full_of(version))
                assert [r["url"] for r in replies] == [servers[0].url]
                assert not any(r.get("full") for r in replies)
            assert not (folder / "v2.full.delta").exists()
            servers[1] = await asyncio.to_thread(
                launch_server, ckpts[0], port=port, max_slots=4, max_seq_len=MAX_SEQ_LEN,
                allowed_weight_dirs=[folder], compilation_cache_dir=shared_cache(tmp_path_factory))
            req = GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=2, temperature=0.0))
            deadline = time.monotonic() + 60
            while not all(s.up for s in client.servers):
                assert time.monotonic() < deadline, [s.last_error for s in client.servers]
                await client.agenerate(req)
                await asyncio.sleep(0.2)

    try:
        asyncio.run(run())
        assert (folder / "v2.full.delta").exists()
        for s in servers:
            assert_serves(s.url, learners[0], ckpts[0], 2)
    finally:
        for s in servers:
            s.terminate()
