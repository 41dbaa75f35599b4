"""Slow recovery paths with real servers: a killed server restarted on its port is brought
back by the client's health re-check and synced to the fleet's latest weights; a server
whose launcher dies goes away with it; a request whose client gives up is aborted."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from areal_jax.engine.launch import launch_server
from areal_jax.rollout.client import RolloutClient
from areal_jax.rollout.types import GenerateRequest
from areal_jax.sampling_params import SamplingParams
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.server_fixtures import shared_cache, start_servers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    return make_tiny_hf_checkpoint(root, seed=0), make_tiny_hf_checkpoint(root, seed=1)


def info(url):
    return httpx.get(f"{url}/get_server_info", timeout=30).json()


def test_restarted_server_is_resynced_and_reused(ckpts, tmp_path_factory):
    ckpt_a, ckpt_b = ckpts
    cache = shared_cache(tmp_path_factory)
    servers = start_servers(ckpt_a, 2, tmp_path_factory, max_slots=8, max_seq_len=128,
                            allowed_weight_dirs=[ckpt_b.parent])
    victim_port = int(servers[1].url.rsplit(":", 1)[1])
    try:
        async def run():
            async with RolloutClient([s.url for s in servers], health_check_interval=0.5,
                                     schedule="round_robin") as client:
                await client.update_weights_from_disk(str(ckpt_b), 3)
                servers[1].kill()
                reqs = [GenerateRequest([3, 4, 5 + i],
                                        SamplingParams(max_new_tokens=8, temperature=0.0))
                        for i in range(4)]
                first = await asyncio.gather(*(client.agenerate(r) for r in reqs))
                assert {s.up for s in client.servers} == {True, False}
                # Restart on the same port with the *old* weights (version "0").
                servers[1] = await asyncio.to_thread(
                    launch_server, ckpt_a, port=victim_port, max_slots=8, max_seq_len=128,
                    allowed_weight_dirs=[ckpt_b.parent],
                    compilation_cache_dir=cache)
                deadline = time.monotonic() + 60
                while not all(s.up for s in client.servers):
                    assert time.monotonic() < deadline, [s.last_error for s in client.servers]
                    await client.agenerate(reqs[0])
                    await asyncio.sleep(0.2)
                second = await asyncio.gather(*(client.agenerate(r) for r in reqs))
                return first, second

        first, second = asyncio.run(run())
        assert info(servers[1].url)["weight_version"] == "3"  # synced on revival
        assert [r.output_ids for r in first] == [r.output_ids for r in second]
        assert {r.server for r in second} == {s.url for s in servers}
        assert all(v == 3 for r in second for v in r.output_versions)
    finally:
        for s in servers:
            s.terminate()


def test_server_dies_with_its_launcher(ckpts, tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.getcwd()!r})\n"
        "from areal_jax.engine.launch import launch_server\n"
        f"s = launch_server({str(ckpts[0])!r}, max_slots=2, max_seq_len=32)\n"
        "print(s.pid, flush=True)\n"
        "import time; time.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server_pid = int(launcher.stdout.readline())
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{server_pid}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.2)
    else:
        os.kill(server_pid, signal.SIGKILL)
        raise AssertionError("the server outlived its launcher")


def test_request_abandoned_by_its_client_is_aborted(ckpts):
    with launch_server(ckpts[0], max_slots=2, max_seq_len=64) as server:
        # Paused, so the request is certainly still queued when its client gives up.
        httpx.post(f"{server.url}/pause_generation", json={"mode": "abort"}, timeout=30)
        body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 8}}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/generate", json=body, timeout=httpx.Timeout(1.0, connect=30))
        deadline = time.monotonic() + 30
        while info(server.url)["num_waiting_reqs"]:
            assert time.monotonic() < deadline, "abandoned request still queued"
            time.sleep(0.2)
        assert info(server.url)["aborted_requests"] == 1
        httpx.post(f"{server.url}/continue_generation", timeout=30)
        ok = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 8
