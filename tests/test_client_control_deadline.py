"""A stalled server (a real engine server, SIGSTOPped) cannot hold a weight update longer
than the retry deadline: every control call is bounded by it in total, the stuck server is
dropped with its reason, and with no server left the update fails with one message."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from areal_jax.rollout.client import NoServerAvailableError, RolloutClient
from areal_jax.rollout.executor import RolloutExecutor
from areal_jax.rollout.weight_sync import WeightSync, WeightSyncError
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.server_fixtures import start_server

DEADLINE_S = 3.0
HANG_GUARD_S = 120.0  # far above the deadline: the old code waited control_timeout (600 s)


@pytest.fixture(scope="module")
def stopped_server(tmp_path_factory):
    ckpt = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("deadline"), seed=0)
    handle = start_server(ckpt, tmp_path_factory, max_slots=4, max_seq_len=64,
                          allowed_weight_dirs=[ckpt.parent])
    os.killpg(handle.pid, signal.SIGSTOP)
    yield handle, ckpt
    os.killpg(handle.pid, signal.SIGCONT)
    handle.terminate()


def _client(url: str) -> RolloutClient:
    # The trainer's construction: control_timeout left at its default (600 s per attempt).
    return RolloutClient([url], retry_deadline_s=DEADLINE_S, retry_backoff_s=0.25,
                         retry_backoff_max_s=1.0, health_check_interval=600.0)


@pytest.mark.parametrize("call", ["pause", "continue_", "update_weights_from_disk",
                                  "load_lora_adapter", "server_infos"])
def test_each_control_call_is_bounded_by_the_retry_deadline(stopped_server, call):
    handle, ckpt = stopped_server
    args = {"update_weights_from_disk": (str(ckpt), 1),
            "load_lora_adapter": ("v1", str(ckpt), 1)}.get(call, ())

    async def run():
        client = _client(handle.url)
        try:
            return await asyncio.wait_for(getattr(client, call)(*args), HANG_GUARD_S), client
        except NoServerAvailableError as e:
            return e, client
        finally:
            await client.aclose()

    result, client = asyncio.run(run())
    server = client.servers[0]
    assert not server.up  # dropped from the fleet, with why
    assert "no reply within" in server.last_error, server.last_error
    if call == "server_infos":
        assert result == [{"url": handle.url, "up": False, "last_error": server.last_error}]
    else:
        assert isinstance(result, NoServerAvailableError)
        assert handle.url in str(result) and "no reply within" in str(result), result


def test_a_weight_update_to_a_stalled_fleet_fails_with_the_cause(stopped_server):
    """The trainer's path: WeightSync on the executor's loop. The error names the version
    and the stuck server (the trainer prints it as ``stopped: weight update to v1 failed``
    and exits 3); the resume of a fleet with no server left does not mask it."""
    handle, ckpt = stopped_server

    async def no_workflow(client, item, ctx):  # no prompts are given: never called
        raise AssertionError

    executor = RolloutExecutor(_client(handle.url), no_workflow, None, batch_size=1).start()
    try:
        sync = WeightSync(executor, write=lambda params, version: str(ckpt))
        sync.publish(None, 1)
        with pytest.raises(WeightSyncError) as info:
            sync.wait()
        assert executor.metrics()["paused"] is False
    finally:
        executor.stop(close_client=True)
    message = str(info.value)
    assert message.startswith("weight update to v1 failed: NoServerAvailableError: "
                              "/pause_generation: every rollout server failed"), message
    assert handle.url in message and "no reply within" in message
