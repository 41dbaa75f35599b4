"""RolloutClient against a stand-in for SGLang: a small real HTTP server (aiohttp, on
127.0.0.1) that batches requests with a waiting queue and replies in the shapes SGLang
versions send. It stands in for SGLang, not for any component of ours.

Shapes of an abort of a request still in the waiting queue, by SGLang version:
  "0.5.3": ``{"text": "", "meta_info": {"id", "finish_reason": {"type": "abort", "message":
           "Abort before prefill"}, "prompt_tokens": 0, "completion_tokens": 0}}`` (no
           output_ids, output_token_logprobs or weight_version);
  "0.5.4": the same with ``output_ids: []`` and ``output_token_logprobs: []``;
  "2026":  also with ``weight_version``.
Pause modes: ``abort`` returns running requests with their partial output and queued ones
in the shape above; ``retract`` and ``in_place`` keep them and finish them after
``/continue_generation`` in one reply.

Tokens follow a fixed function of the sequence so far, so a resubmitted request continues
exactly where it stopped; each logprob encodes the weight version that produced the
token, so per-token versions are checked exactly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from areal_jax.engine.launch import free_port
from areal_jax.rollout.client import NoServerAvailableError, RolloutClient
from areal_jax.rollout.types import GenerateRequest
from areal_jax.sampling_params import SamplingParams

TICK_S = 0.002


def next_token(seq: list[int]) -> int:
    return (seq[-1] * 31 + len(seq) * 7) % 97 + 3


def logprob_of(token: int, version: int) -> float:
    """Negative, exact in float64 and JSON, and its integer part is -version - 1."""
    return -version - 0.5 - (token % 8) / 16


def version_of(logprob: float) -> int:
    return int(-logprob - 0.5)


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    max_new: int
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reply: dict | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StandIn:
    """The stand-in SGLang server (see the module doc)."""

    def __init__(self, shape: str, pause_mode: str = "abort", capacity: int = 3):
        self.shape, self.pause_mode, self.capacity = shape, pause_mode, capacity
        self.version = 0
        self.paused = False
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.queued_aborts = 0
        self.running_aborts = 0
        self.generated = 0
        self.app = web.Application()
        self.app.add_routes([
            web.post("/generate", self.generate), web.post("/pause_generation", self.pause),
            web.post("/continue_generation", self.cont),
            web.post("/update_weights_from_disk", self.update), web.get("/health", self.health),
        ])

    async def start(self) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.stepper = asyncio.get_running_loop().create_task(self.step_loop())
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.stepper.cancel()
        await self.runner.cleanup()

    # -- replies
    def _finish(self, req: _Req, finish: dict) -> None:
        meta = {"id": req.rid, "finish_reason": finish, "prompt_tokens": len(req.input_ids),
                "completion_tokens": len(req.out),
                "output_token_logprobs": [[lp, t, None] for lp, t
                                          in zip(req.logprobs, req.out, strict=True)],
                "weight_version": str(self.version)}
        req.reply = {"text": "", "output_ids": list(req.out), "meta_info": meta}
        req.done.set()

    def _abort_queued(self, req: _Req) -> None:
        meta = {"id": req.rid,
                "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                "prompt_tokens": 0, "completion_tokens": 0}
        reply = {"text": "", "meta_info": meta}
        if self.shape in ("0.5.4", "2026"):
            reply["output_ids"] = []
            meta["output_token_logprobs"] = []
        if self.shape == "2026":
            meta["weight_version"] = str(self.version)
        req.reply = reply
        self.queued_aborts += 1
        req.done.set()

    # -- scheduling
    async def step_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if self.paused:
                continue
            while self.waiting and len(self.running) < self.capacity:
                self.running.append(self.waiting.pop(0))
            for req in list(self.running):
                token = next_token(req.input_ids + req.out)
                req.out.append(token)
                req.logprobs.append(logprob_of(token, self.version))
                self.generated += 1
                if len(req.out) >= req.max_new:
                    self.running.remove(req)
                    self._finish(req, {"type": "length", "length": len(req.out)})

    # -- routes
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["return_logprob"] is True
        req = _Req(body["rid"], body["input_ids"], body["sampling_params"]["max_new_tokens"])
        self.waiting.append(req)
        await req.done.wait()
        return web.json_response(req.reply)

    async def pause(self, request: web.Request) -> web.Response:
        self.paused = True
        if self.pause_mode == "abort":
            for req in self.running:
                self.running_aborts += 1
                self._finish(req, {"type": "abort", "message": "Abort in waiting queue"
                                   if not req.out else "Abort running request"})
            for req in self.waiting:
                self._abort_queued(req)
            self.running, self.waiting = [], []
        elif self.pause_mode == "retract":
            self.waiting = self.running + self.waiting
            self.running = []
        return web.json_response({"success": True})

    async def cont(self, request: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({"success": True})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.version = int(body["weight_version"])
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


PROMPTS = [[5 + i, 6, 7] for i in range(12)]
MAX_NEW = 60


async def run_with_updates(stand_in: StandIn, n_updates: int = 2):
    url = await stand_in.start()
    try:
        async with RolloutClient([url], health_check_interval=0.2) as client:
            tasks = [asyncio.create_task(client.agenerate(
                GenerateRequest(p, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0))))
                for p in PROMPTS]
            for v in range(1, n_updates + 1):
                target = stand_in.generated + 20
                while stand_in.generated < target:  # some running, some queued
                    await asyncio.sleep(TICK_S)
                await client.pause()
                await client.update_weights_from_disk("/weights/v", v)
                await client.continue_()
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await stand_in.stop()


def check_exact(results, per_token_versions: bool) -> None:
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.output_ids == reference(prompt, MAX_NEW)
        assert res.finish_reason == "length"
        assert res.output_logprobs == [logprob_of(t, version_of(lp))
                                       for t, lp in zip(res.output_ids, res.output_logprobs,
                                                        strict=True)]
        produced_by = [version_of(lp) for lp in res.output_logprobs]
        if per_token_versions:
            assert res.output_versions == produced_by
        else:  # one reply spans the update: every token gets the reply's (final) version
            assert res.output_versions == [max(produced_by)] * MAX_NEW
        assert res.output_versions == sorted(res.output_versions)


@pytest.mark.parametrize("shape", ["0.5.3", "0.5.4", "2026"])
def test_abort_pause_loses_no_request_in_any_sglang_shape(shape, caplog):
    stand_in = StandIn(shape)
    with caplog.at_level(logging.WARNING, logger="areal_jax.rollout.client"):
        results = asyncio.run(run_with_updates(stand_in))
    assert stand_in.queued_aborts > 0 and stand_in.running_aborts > 0  # both forms happened
    check_exact(results, per_token_versions=True)
    versions = {v for r in results for v in r.output_versions}
    assert versions == {0, 1, 2}
    assert sum(r.n_interruptions for r in results) >= stand_in.queued_aborts
    assert not [r for r in caplog.records if "weight_version" in r.getMessage()]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_retract_and_in_place_pauses_finish_requests_in_one_reply(mode):
    stand_in = StandIn("2026", pause_mode=mode)
    results = asyncio.run(run_with_updates(stand_in, n_updates=1))
    assert stand_in.queued_aborts == 0 and stand_in.running_aborts == 0
    check_exact(results, per_token_versions=False)
    assert all(r.n_interruptions == 0 for r in results)
    spans = [r for r in results if len({version_of(lp) for lp in r.output_logprobs}) > 1]
    assert spans  # some requests really were generated under both versions


def test_reply_without_logprobs_that_is_not_an_abort_is_an_error():
    class NoLogprobs(StandIn):
        def _finish(self, req, finish):
            super()._finish(req, finish)
            del req.reply["meta_info"]["output_token_logprobs"]

    async def run():
        stand_in = NoLogprobs("2026")
        url = await stand_in.start()
        try:
            async with RolloutClient([url]) as client:
                await client.agenerate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=3)))
        finally:
            await stand_in.stop()

    with pytest.raises(Exception, match="output_token_logprobs"):
        asyncio.run(run())


# ---------------------------------------------------------------------- transient trouble
class Flaky(StandIn):
    """Answers the first ``n_bad`` calls of every route except /health badly: ``stall``
    (no reply for 2 s), ``500`` (an internal error), or ``drop`` (closes the connection)."""

    def __init__(self, fault: str, n_bad: int):
        super().__init__("2026")
        self.fault, self.n_bad, self.calls = fault, n_bad, {}

    @web.middleware
    async def faults(self, request, handler):
        n = self.calls[request.path] = self.calls.get(request.path, 0) + 1
        if request.path != "/health" and n <= self.n_bad:
            if self.fault == "stall":
                await asyncio.sleep(2.0)
            elif self.fault == "500":
                return web.json_response({"error": "internal"}, status=500)
            else:
                request.transport.close()
                return web.Response()
        return await handler(request)

    async def start(self) -> str:
        self.app.middlewares.append(self.faults)
        return await super().start()


def _fleet_op(stand_in: StandIn, **client_kwargs):
    async def run():
        url = await stand_in.start()
        try:
            async with RolloutClient([url], control_timeout=0.5, request_timeout=0.5,
                                     retry_backoff_s=0.05, retry_backoff_max_s=0.2,
                                     **client_kwargs) as client:
                t0 = time.monotonic()
                try:
                    await client.update_weights_from_disk("/weights/v", 4)
                    res = await client.agenerate(
                        GenerateRequest([1, 2], SamplingParams(max_new_tokens=4)))
                    outcome = res.output_versions
                except Exception as e:  # noqa: BLE001 - returned for the asserts
                    outcome = e
                return outcome, time.monotonic() - t0, client.servers[0].up
        finally:
            await stand_in.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("fault", ["stall", "500", "drop"])
def test_transient_trouble_is_retried_on_the_same_server(fault):
    stand_in = Flaky(fault, n_bad=2)
    outcome, _, up = _fleet_op(stand_in, max_retries=3, retry_deadline_s=60.0)
    assert outcome == [4] * 4, outcome
    assert up
    assert stand_in.calls["/update_weights_from_disk"] == 3
    assert stand_in.calls["/generate"] == 3


def test_repeated_500s_mark_the_server_down_after_max_retries():
    stand_in = Flaky("500", n_bad=100)
    outcome, _, up = _fleet_op(stand_in, max_retries=2, retry_deadline_s=60.0)
    assert isinstance(outcome, NoServerAvailableError), outcome
    assert not up and stand_in.calls["/update_weights_from_disk"] == 3


def test_a_stall_longer_than_the_deadline_marks_the_server_down():
    stand_in = Flaky("stall", n_bad=100)
    outcome, took, up = _fleet_op(stand_in, max_retries=2, retry_deadline_s=2.0)
    assert isinstance(outcome, NoServerAvailableError), outcome
    # Attempts of 0.5 s are retried until the next one would pass the 2 s deadline.
    assert not up and 1.5 <= took < 30


def test_a_refused_connection_is_dropped_without_waiting_for_the_deadline():
    async def run():
        async with RolloutClient([f"127.0.0.1:{free_port()}"], retry_deadline_s=600.0,
                                 max_retries=100) as client:
            t0 = time.monotonic()
            with pytest.raises(NoServerAvailableError):
                await client.update_weights_from_disk("/weights/v", 1)
            return time.monotonic() - t0, client.servers[0]

    took, server = asyncio.run(run())
    assert not server.up and "cannot connect" in server.last_error
    assert took < 30
