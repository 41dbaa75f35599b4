"""SGLang's in-memory weight update, end to end on CPU: a real embedded server on 127.0.0.1
joins a real torch process group (gloo) with the learner at rank 0
(``/init_weights_update_group``), receives the learner's HF-named tensors by broadcast
(``/update_weights_from_distributed``, SGLang's request fields), and serves them; every
fault leaves the old version serving, whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import httpx
import numpy as np
import pytest

from areal_jax.checkpoint.distributed import DistributedPublisher, free_port, hf_entries
from areal_jax.checkpoint.publish import PublishError
from areal_jax.checkpoint.stream import serving_arrays
from areal_jax.weight_group import WeightGroupError, destroy_group, init_group, torch_modules
from model_defs import load_hf
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.server_fixtures import start_servers
from tests.test_weight_stream import MAX_SEQ_LEN, assert_serves, serving_version

torch = pytest.importorskip("torch")
GROUP_TIMEOUT_S = 20.0  # every group operation's bound (a dead sender is noticed by it)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    return make_tiny_hf_checkpoint(root, seed=0), make_tiny_hf_checkpoint(root, seed=1)


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    # Same shapes as tests/test_weight_stream.py (the shared compilation cache).
    (handle,) = start_servers(ckpts[0], 1, tmp_path_factory, max_slots=4,
                              max_seq_len=MAX_SEQ_LEN)
    yield handle.url
    handle.terminate()


@pytest.fixture(scope="module")
def learners(ckpts):
    return [load_hf(path) for path in ckpts]  # (fp32 CausalLM, ModelConfig) each


@pytest.fixture(scope="module")
def sender(server, learners):
    s = DistributedPublisher([server], learners[0][1], backend="gloo", bucket_bytes=10_000,
                             timeout_s=GROUP_TIMEOUT_S, server_timeout_s=GROUP_TIMEOUT_S)
    yield s
    s.close()


@pytest.fixture
def on_a(server, sender, learners):
    """The server on checkpoint A at version 0 (through the distributed update)."""
    if serving_version(server) != "0":
        sender.close()  # a test's own group replaced the sender's on the server
        sender.send(serving_arrays(learners[0][0], "float32"), 0)
    return server


def test_a_distributed_bump_serves_the_learners_weights(on_a, sender, ckpts, learners):
    assert_serves(on_a, learners[0][0], ckpts[0], 0)
    sender.send(serving_arrays(learners[1][0], "float32"), 1)
    assert sender.last is not None and sender.last.nbytes > 3 * sender.bucket_bytes  # buckets
    assert_serves(on_a, learners[1][0], ckpts[1], 1)
    # bf16 on the wire: the server casts to the dtype it serves (fp32 here)
    sender.send(serving_arrays(learners[0][0], "bfloat16"), 2)
    assert serving_version(on_a) == "2"


class RawGroup:
    """The learner's side of the protocol by hand: rank 0 of a gloo group with the server
    at rank 1, and SGLang's request bodies, to send what a correct sender never would."""

    def __init__(self, url: str, timeout_s: float = GROUP_TIMEOUT_S):
        self.url = url
        port = free_port("127.0.0.1")
        reply: dict = {}
        t = threading.Thread(target=lambda: reply.update(r=httpx.post(
            f"{url}/init_weights_update_group", timeout=60, json={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": "raw", "backend": "gloo",
                "timeout_s": timeout_s})))
        t.start()
        self.pg = init_group("gloo", "127.0.0.1", port, 0, 2, "raw", timeout_s)
        t.join()
        assert reply["r"].status_code == 200, reply["r"].text
        assert set(reply["r"].json()) == {"success", "message"}

    def update(self, tensors: list[tuple[str, torch.Tensor]], version: int):
        """POSTs the update in a thread while broadcasting ``tensors``; returns the reply."""
        _, dist = torch_modules()
        reply: dict = {}
        t = threading.Thread(target=lambda: reply.update(r=httpx.post(
            f"{self.url}/update_weights_from_distributed", timeout=60, json={
                "names": [n for n, _ in tensors],
                "dtypes": [str(x.dtype).removeprefix("torch.") for _, x in tensors],
                "shapes": [list(x.shape) for _, x in tensors], "group_name": "raw",
                "flush_cache": True, "abort_all_requests": True,
                "weight_version": str(version)})))
        t.start()
        for _, x in tensors:
            dist.broadcast(x, src=0, group=self.pg)
        t.join()
        return reply["r"]

    def close(self):
        destroy_group(self.pg)


def hf_tensors(model_and_cfg) -> list[tuple[str, torch.Tensor]]:
    model, cfg = model_and_cfg
    return [(name, torch.from_numpy(np.array(produce())))
            for name, _, _, produce in hf_entries(serving_arrays(model, "float32").host(), cfg)]


def test_a_version_in_two_requests_is_served_only_when_whole(on_a, ckpts, learners):
    group = RawGroup(on_a)
    try:
        tensors = hf_tensors(learners[1])
        assert "model.layers.0.self_attn.q_proj.weight" in dict(tensors)  # HF names, per layer
        half = len(tensors) // 2
        r = group.update(tensors[:half], 3)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert "still to come" in r.json()["message"]
        assert_serves(on_a, learners[0][0], ckpts[0], 0)  # half a version is never served
        r = group.update(tensors[half:], 3)
        assert r.status_code == 200 and set(r.json()) == {"success", "message"}, r.text
        assert_serves(on_a, learners[1][0], ckpts[1], 3)
    finally:
        group.close()


@pytest.mark.parametrize("fault", ["wrong-shape", "unknown-name"])
def test_a_tensor_that_does_not_fit_is_refused_and_v0_keeps_serving(on_a, ckpts, learners,
                                                                    fault):
    group = RawGroup(on_a)
    try:
        tensors = hf_tensors(learners[1])
        name, x = tensors[3]
        if fault == "wrong-shape":
            tensors[3] = (name, x.T.contiguous() if x.dim() == 2 else torch.cat([x, x]))
            expect = f"tensor {name} has shape"
        else:
            tensors[3] = ("model.layers.0.self_attn.qkv_proj.weight", x)
            expect = "unknown tensor 'model.layers.0.self_attn.qkv_proj.weight'"
        r = group.update(tensors, 4)
        assert r.status_code == 400 and r.json()["success"] is False
        assert expect in r.json()["message"]
        assert_serves(on_a, learners[0][0], ckpts[0], 0)
        # the declared tensors were received: the group is still in step and usable
        r = group.update(hf_tensors(learners[1]), 4)
        assert r.status_code == 200, r.text
        assert_serves(on_a, learners[1][0], ckpts[1], 4)
    finally:
        group.close()


def test_a_sender_killed_mid_broadcast_leaves_v0_and_the_next_bump_works(on_a, sender, ckpts,
                                                                         learners):
    script = textwrap.dedent(f"""
        import os, threading, httpx, numpy as np, torch
        from areal_jax.checkpoint.distributed import free_port, hf_entries
        from areal_jax.checkpoint.stream import serving_arrays
        from areal_jax.weight_group import init_group, torch_modules
        from model_defs import load_hf
        model, cfg = load_hf({str(ckpts[1])!r})
        entries = hf_entries(serving_arrays(model, "float32").host(), cfg)
        port = free_port("127.0.0.1")
        url = {on_a!r}
        t = threading.Thread(target=lambda: httpx.post(url + "/init_weights_update_group",
            timeout=60, json={{"master_address": "127.0.0.1", "master_port": port,
            "rank_offset": 1, "world_size": 2, "group_name": "doomed", "backend": "gloo",
            "timeout_s": 3}}))
        t.start()
        pg = init_group("gloo", "127.0.0.1", port, 0, 2, "doomed", 3)
        t.join()
        threading.Thread(target=lambda: httpx.post(url + "/update_weights_from_distributed",
            timeout=60, json={{"names": [e[0] for e in entries],
            "dtypes": ["float32"] * len(entries), "shapes": [list(e[1]) for e in entries],
            "group_name": "doomed", "weight_version": "5"}}), daemon=True).start()
        _, dist = torch_modules()
        for _, _, _, produce in entries[:len(entries) // 2]:
            dist.broadcast(torch.from_numpy(np.ascontiguousarray(produce())), 0, group=pg)
        print("half sent", flush=True)
        os._exit(9)  # killed mid-broadcast
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 9 and "half sent" in proc.stdout, proc.stderr[-2000:]
    # the server notices within its group timeout (3 s), drops the half version and the group
    for _ in range(300):
        if httpx.get(f"{on_a}/health", timeout=30).status_code == 200 and not _busy(on_a):
            break
        time.sleep(0.1)
    assert_serves(on_a, learners[0][0], ckpts[0], 0)
    sender.close()  # the doomed group replaced the module sender's on the server
    sender.send(serving_arrays(learners[1][0], "float32"), 6)
    assert_serves(on_a, learners[1][0], ckpts[1], 6)


def _busy(url: str) -> bool:
    """Whether the server's group is still busy with the dead sender's update."""
    r = httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": "doomed"},
                   timeout=30)
    return "in progress" in r.json()["message"]


def test_nccl_without_cuda_fails_the_send_at_once_with_one_clear_line(server, learners):
    s = DistributedPublisher([server], learners[0][1], backend="nccl", timeout_s=5.0)
    with pytest.raises(PublishError, match="no NCCL.*use the gloo backend"):
        s.send(serving_arrays(learners[1][0], "float32"), 7)
    assert serving_version(server) != "7"
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_a_malformed_request_is_a_400_naming_the_field(server):
    r = httpx.post(f"{server}/init_weights_update_group", timeout=30, json={
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2})
    assert r.status_code == 400 and "rank_offset" in r.json()["error"]
    r = httpx.post(f"{server}/update_weights_from_distributed", timeout=30,
                   json={"names": ["a"], "dtypes": [], "shapes": []})
    assert r.status_code == 400 and "'names', 'dtypes' and 'shapes'" in r.json()["error"]
    r = httpx.post(f"{server}/update_weights_from_distributed", timeout=30, json={
        "names": [], "dtypes": [], "shapes": [], "group_name": "nobody"})
    assert r.status_code == 400 and "no weight update group 'nobody'" in r.json()["message"]


def test_without_torch_the_error_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(WeightGroupError, match="not a core dependency.*pip install torch"):
        torch_modules()


def test_weight_sync_pushes_through_the_group_and_the_executor_follows(on_a, sender, ckpts,
                                                                       learners):
    """``WeightSync(push=...)`` (checkpoint.publish: distributed): publish returns at once,
    the push runs on the executor's loop, and the executor's version follows the server."""
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.executor import RolloutExecutor
    from areal_jax.rollout.weight_sync import WeightSync
    from tests.test_weight_delta_run import _idle

    ex = RolloutExecutor(RolloutClient([on_a]), _idle, None, batch_size=1).start()
    try:
        weights = WeightSync(ex, lambda p, v: "", push=sender.send, pause_servers=True)
        weights.publish(serving_arrays(learners[1][0], "float32"), 8)
        weights.wait()
        assert weights.write_s[8] > 0 and weights.update_s[8] >= weights.write_s[8]
        assert ex.version == 8
        assert_serves(on_a, learners[1][0], ckpts[1], 8)
    finally:
        ex.stop(close_client=True)


def test_publish_distributed_is_checked_at_load():
    from pathlib import Path

    from areal_jax.config import ConfigError, load_config

    demo = Path(__file__).resolve().parent.parent / "configs" / "tiny_demo.yaml"
    cfg = load_config(demo, ["checkpoint.publish=distributed"])
    assert cfg.publish_path == "distributed" and cfg.checkpoint.distributed_backend == "gloo"
    assert load_config(demo, ["checkpoint.publish=distributed",
                              "rollout.servers=[http://127.0.0.1:1]"]).publish_path \
        == "distributed"
    assert load_config(demo).publish_path == "memory"  # auto is unchanged
    with pytest.raises(ConfigError, match="checkpoint.distributed_backend: 'mpi' is not "
                                          "allowed"):
        load_config(demo, ["checkpoint.publish=distributed",
                           "checkpoint.distributed_backend=mpi"])
    with pytest.raises(ConfigError, match="checkpoint.distributed_timeout_s"):
        load_config(demo, ["checkpoint.distributed_timeout_s=0"])


def test_a_run_publishes_each_version_through_the_group(tmp_path):
    """A training run with checkpoint.publish=distributed against a server that outlives
    it: every version goes through the weight update group (no HF files but the first and
    the last), and the server ends at v3 serving exactly the learner's v3 (its greedy
    tokens and logprobs are those it gives after loading the run's weights/v3 files, and
    those are, tensor for tensor, the checkpointed v3 params)."""
    from tests.test_trainer import (
        _assert_published_tensors_are_the_learners,
        _checkpointed_weights,
        _external_server,
        _greedy,
        _rows,
        _run,
    )

    run_dir = tmp_path / "run"
    server = _external_server(tmp_path, run_dir)
    try:
        res = _run([f"run_dir={run_dir}", "train.total_versions=3", "rollout.max_staleness=1",
                    "checkpoint.every_versions=3", "checkpoint.publish=distributed",
                    f"rollout.servers=[{server.url}]"])
        assert res.returncode == 0, res.stderr[-4000:]
        served = _greedy(server.url)
        r = httpx.post(f"{server.url}/update_weights_from_disk", timeout=120, json={
            "model_path": str(run_dir / "weights" / "v3"), "weight_version": "reloaded-v3"})
        assert r.status_code == 200 and r.json()["success"], r.text
        from_file = _greedy(server.url)
    finally:
        server.terminate()
    assert served[2] == "3" and from_file[2] == "reloaded-v3"
    assert served[0] == from_file[0]
    np.testing.assert_array_equal(served[1], from_file[1])
    want = _checkpointed_weights(run_dir, 3, tmp_path / "want", "float32")
    _assert_published_tensors_are_the_learners(run_dir, 3, want)
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v0", "v3"]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["publish_write_s"] > 0 and r["publish_update_s"] > 0 for r in rows[1:])
    assert rows[2]["token_version_max"] >= 1
