"""Async client for a fleet of SGLang-protocol servers (the embedded engine or real SGLang).

    client = RolloutClient(["http://127.0.0.1:30000", "http://127.0.0.1:30001"])
    resp = await client.agenerate(GenerateRequest([...], SamplingParams(max_new_tokens=256)))
    await client.pause(); await client.update_weights_from_disk("ckpt/v3", 3)
    await client.continue_()
    # or, LoRA adapter mode: every later request carries "lora_path": "v3"
    await client.load_lora_adapter("v3", "ckpt/v3/adapter", 3)

What it does beyond one HTTP call:

* **Scheduling.** Each request goes to the up server with the fewest of this client's
  requests in flight (``least_loaded``) or to the next up server (``round_robin``).
* **Interruption.** A reply with ``finish_reason.type == "abort"`` (the server was paused
  or its weights were swapped) is resubmitted to the same server with the partial output
  appended to the prompt and ``max_new_tokens`` reduced, until the request ends in
  ``stop`` or ``length``. Each output token carries the ``weight_version`` (parsed as an
  int) of the reply that delivered it.
* **Slow is not dead.** A timeout, a 5xx reply or a dropped connection is retried on the
  same server with exponential backoff (``retry_backoff_s`` doubling up to
  ``retry_backoff_max_s``) for up to ``retry_deadline_s`` seconds; 5xx replies and dropped
  connections at most ``max_retries`` times in a row (a server that keeps failing one way
  is broken, not slow). This holds for generation and for weight updates alike. A call's
  first retry is logged at info (one failure the next attempt heals is normal on a loaded
  host); each further one is a warning. Idle connections are closed after ``KEEPALIVE_S``,
  before any server would close them under a request.
* **Failover.** A server that refuses connections (nothing listens: it is gone), or that
  is still failing when its retries run out, is marked down; a request moves to another
  server, keeping the tokens already received. Down servers are re-probed on ``/health``
  every ``health_check_interval`` seconds; one that comes back is brought to the fleet's
  latest weights (and paused, if the fleet is) before it gets requests again.
* **Every SGLang reply shape.** An abort of a request still in the server's waiting queue
  comes back, depending on the SGLang version, without ``output_ids`` /
  ``output_token_logprobs`` / ``weight_version`` (up to 0.5.3: ``"Abort before
  prefill"``), with empty lists, or with empty lists and a ``weight_version``. Each is an
  interruption with no new tokens, resubmitted as usual. Tokens in a reply get the reply's
  ``weight_version``; a reply that carries tokens but no version gets the version this
  client last loaded (with one warning).

HTTP goes through aiohttp, one keep-alive connection pool for the client's lifetime. (It
was httpx until profiling the trainer showed httpcore's connection-pool bookkeeping
taking most of a core at ~60 concurrent requests, GIL time that the learner thread in
the same process then lacked.)

Only SGLang's documented fields are used: ``/generate`` with ``input_ids``,
``sampling_params``, ``return_logprob``, ``rid``; tokens and logprobs are read from
``meta_info.output_token_logprobs`` (entries ``[logprob, token_id, text_or_null]``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import aiohttp

from areal_jax.rollout.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    GenerateResponse,
)

if TYPE_CHECKING:  # annotations only: this room never loads the run config
    from areal_jax.config import RolloutConfig
    from model_defs import JsonDict

logger = logging.getLogger(__name__)

SCHEDULES = ("least_loaded", "round_robin")


class RolloutError(RuntimeError):
    """A request or fleet operation that could not be completed."""


class RolloutRequestError(RolloutError):
    """A server rejected the request itself (HTTP 4xx); retrying elsewhere would not help."""


class NoServerAvailableError(RolloutError):
    """Every server is down (and stayed down for ``no_server_timeout`` seconds)."""


@dataclass
class ServerState:
    url: str
    up: bool = True
    inflight: int = 0
    down_since: float = 0.0
    last_probe: float = 0.0
    last_error: str = ""
    completed: int = 0


def _normalize_address(address: str) -> str:
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"server address must be a non-empty string, got {address!r}")
    address = address.strip().rstrip("/")
    if "://" not in address:
        address = f"http://{address}"
    return address


# What a failed connection, a reset or a timeout raises.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
KEEPALIVE_S = 4.0  # below every server's keep-alive timeout (see _Http._get_session)


class _ServerDown(Exception):
    """A server that is gone (refuses connections) or still failing after its retries."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Reply:
    """A whole HTTP reply (the body is read before the connection goes back to the pool)."""

    status_code: int
    body: bytes
    reason_phrase: str = ""

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:  # a server's JSON, of any shape until checked: Any
        """The JSON body; ValueError if it is not JSON."""
        return json.loads(self.body)


class _Http:
    """The few HTTP calls the client makes, on one aiohttp session created lazily inside
    the running event loop."""

    def __init__(self, request_timeout: float, connect_timeout: float, headers: dict[str, str]):
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, connect=connect_timeout)
        self._connect_timeout = self.connect_timeout = connect_timeout
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # An idle connection is dropped after KEEPALIVE_S, before any server closes it
            # (ours after 30 s, uvicorn's default, SGLang's, after 5 s): reusing a connection
            # the server is closing failed with ServerDisconnectedError or "Can not write
            # request body", a retry and a warning on a healthy run.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                             keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  headers=self._headers)
        return self._session

    async def request(self, method: str, url: str, json_body: JsonDict | None = None,
                      timeout: float | None = None) -> _Reply:
        kwargs: JsonDict = {}
        if json_body is not None:
            kwargs["data"] = json.dumps(json_body)
            kwargs["headers"] = {"Content-Type": "application/json"}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout,
                                                      connect=min(timeout, self._connect_timeout))
        async with self._get_session().request(method, url, **kwargs) as resp:
            return _Reply(resp.status, await resp.read(), resp.reason or "")

    async def post(self, url: str, json: JsonDict | None = None, timeout: float | None = None
                   ) -> _Reply:
        return await self.request("POST", url, {} if json is None else json, timeout)

    async def get(self, url: str, timeout: float | None = None) -> _Reply:
        return await self.request("GET", url, None, timeout)

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _error_message(resp: _Reply) -> str:
    """The message of an error reply, in our shape ({"error": msg}) or SGLang's."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        for key in ("error", "error_message", "message", "detail"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


def _finish_type(finish_reason: object) -> str | None:
    if isinstance(finish_reason, dict):
        return finish_reason.get("type")
    if isinstance(finish_reason, str):
        return finish_reason
    return None


def _checked_finish(finish_reason: object, server: ServerState, rid: str) -> str:
    """stop, length or abort (an interruption to resume); an abort for a bad request (4xx
    status) or an unknown reason raises."""
    kind = _finish_type(finish_reason)
    if kind == FINISH_ABORT and isinstance(finish_reason, dict):
        status = finish_reason.get("status_code")
        if isinstance(status, int) and 400 <= status < 500:
            raise RolloutRequestError(
                f"{server.url} aborted request {rid}: {finish_reason.get('message')}")
    elif kind not in (FINISH_STOP, FINISH_LENGTH):
        raise RolloutError(f"{server.url} replied with unknown finish_reason {finish_reason!r}")
    return kind


class RolloutClient:
    """Async client over several SGLang-protocol servers. Use from one event loop."""

    @classmethod
    def from_config(cls, rollout: RolloutConfig, addresses: list[str]) -> RolloutClient:
        """The run's client over ``addresses``, from its ``rollout`` section."""
        return cls(addresses, request_timeout=rollout.request_timeout_s, api_key=rollout.api_key,
                   retry_deadline_s=rollout.request_retry_deadline_s)

    def __init__(
        self,
        addresses: list[str],
        *,
        schedule: str = "least_loaded",
        request_timeout: float = 3600.0,
        connect_timeout: float = 10.0,
        control_timeout: float = 600.0,
        max_retries: int = 3,
        api_key: str | None = None,
        health_check_interval: float = 5.0,
        no_server_timeout: float = 60.0,
        max_interruptions: int = 10_000,
        retry_deadline_s: float = 300.0,
        retry_backoff_s: float = 0.5,
        retry_backoff_max_s: float = 10.0,
    ):
        if isinstance(addresses, str):
            addresses = [addresses]
        if not addresses:
            raise ValueError("RolloutClient needs at least one server address")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if not retry_deadline_s >= 0:
            raise ValueError(f"retry_deadline_s must be >= 0, got {retry_deadline_s}")
        if not 0 < retry_backoff_s <= retry_backoff_max_s:
            raise ValueError(f"need 0 < retry_backoff_s <= retry_backoff_max_s, got "
                             f"{retry_backoff_s} and {retry_backoff_max_s}")
        self.retry_deadline_s = retry_deadline_s
        self.retry_backoff_s = retry_backoff_s
        self.retry_backoff_max_s = retry_backoff_max_s
        urls = [_normalize_address(a) for a in addresses]
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server addresses in {urls}")
        self.servers = [ServerState(u) for u in urls]
        self.schedule = schedule
        self.max_retries = max_retries
        self.health_check_interval = health_check_interval
        self.no_server_timeout = no_server_timeout
        self.max_interruptions = max_interruptions
        self.control_timeout = control_timeout
        self.request_timeout = request_timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = _Http(request_timeout, connect_timeout, headers)
        self._rr = itertools.count()
        self._paused = False
        self._latest_weights: tuple[str, int] | None = None
        # Delta updates: writes the latest version's full file and returns its path (a
        # revived server that cannot apply the latest delta loads it).
        self._latest_full: Callable[[], Awaitable[str]] | None = None
        # Adapter mode: the loaded LoRA adapter (name, path, version); requests carry
        # "lora_path": name.
        self._latest_adapter: tuple[str, str, int] | None = None
        self._warned_versions: set[str] = set()
        self._probing: set[str] = set()
        self._background: set[asyncio.Task] = set()

    # ================================================================== generation
    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        """Generates one sample, resuming across interruptions and failing over servers."""
        return (await self._generate([req], batch_form=False))[0]

    async def agenerate_batch(self, reqs: Sequence[GenerateRequest]) -> list[GenerateResponse]:
        """Generates one sample per request, all in one /generate call (SGLang's batch form:
        a list of prompts, one sampling_params and rid per prompt) to one server: one HTTP
        round trip for a group instead of one per sample. Interruptions and server failures
        are handled as in :meth:`agenerate`: the unfinished samples are resubmitted together,
        each with its partial output appended; the finished ones keep their result."""
        return await self._generate(list(reqs), batch_form=len(reqs) > 1)

    async def _generate(self, reqs: list[GenerateRequest], *, batch_form: bool
                        ) -> list[GenerateResponse]:
        """The loop behind both: send what is unfinished to one server (a single body, or
        the batch form), append each reply's tokens, resubmit the aborted samples to the
        same server (its cache holds the prefix), and go to another server when it is
        down."""
        t0 = time.monotonic()
        n = len(reqs)
        rids = [r.rid or uuid.uuid4().hex for r in reqs]
        what = f"batch {rids[0]}.." if batch_form else f"request {rids[0]}"
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_logprobs: list[list[float]] = [[] for _ in range(n)]
        out_versions: list[list[int]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        interruptions = [0] * n
        failures = attempt = 0
        server: ServerState | None = None
        while True:
            for i, r in enumerate(reqs):
                if finish[i] is None and len(out_ids[i]) >= r.params.max_new_tokens:
                    finish[i] = FINISH_LENGTH
            pending = [i for i in range(n) if finish[i] is None]
            if not pending:
                break
            if server is None or not server.up:
                server = await self._choose_server()
            suffix = "" if attempt == 0 else f"#{attempt}"
            bodies = [{
                "input_ids": list(reqs[i].input_ids) + out_ids[i],
                "sampling_params": reqs[i].sampling_params(
                    max_new_tokens=reqs[i].params.max_new_tokens - len(out_ids[i])),
                "rid": rids[i] + suffix,
            } for i in pending]
            payload: JsonDict = (
                {key: [b[key] for b in bodies] for key in bodies[0]} if batch_form
                else dict(bodies[0]))
            payload["return_logprob"] = True
            attempt += 1
            resp = await self._send_generate(server, payload, len(pending))
            if resp is None:
                failures += 1
                if failures > self.max_retries:
                    raise RolloutError(
                        f"{what} failed {failures} times; last server "
                        f"{server.url}: {server.last_error}")
                server = None
                continue
            sent_adapter = payload.get("lora_path")
            if (resp.status_code == 400 and sent_adapter is not None
                    and self._latest_adapter is not None
                    and self._latest_adapter[0] != sent_adapter):
                # The adapter it named was replaced while it waited (a version update):
                # the server refused to run it on other weights; resubmit on the new one.
                for i in pending:
                    interruptions[i] += 1
                continue
            if resp.status_code >= 400:
                raise RolloutRequestError(
                    f"{server.url} rejected {what} (HTTP {resp.status_code}): "
                    f"{_error_message(resp)}")
            failures = 0
            where = f"{server.url} sent a {'batched ' if batch_form else ''}/generate reply"
            try:
                data = resp.json()
            except ValueError:
                raise RolloutError(f"{where} that is not JSON: {resp.text[:200]!r}") from None
            items = data if batch_form else [data]
            if not isinstance(items, list) or len(items) != len(pending):
                raise RolloutError(f"{where} that is not a list of {len(pending)} replies "
                                   f"(got {type(items).__name__})")
            for i, item in zip(pending, items, strict=True):
                tokens, logprobs, version, finish_reason = self._parse_item(item, server, where)
                out_ids[i] += tokens
                out_logprobs[i] += logprobs
                out_versions[i] += [version] * len(tokens)
                kind = _checked_finish(finish_reason, server, rids[i])
                if kind == FINISH_ABORT:
                    interruptions[i] += 1
                    if interruptions[i] > self.max_interruptions:
                        raise RolloutError(
                            f"request {rids[i]} was interrupted {interruptions[i]} times")
                else:
                    finish[i] = kind
                    server.completed += 1
        latency = time.monotonic() - t0
        return [GenerateResponse(
            input_ids=list(r.input_ids), output_ids=out_ids[i], output_logprobs=out_logprobs[i],
            output_versions=out_versions[i], finish_reason=cast(str, finish[i]),  # all set
            n_interruptions=interruptions[i], server=server.url if server is not None else None,
            latency_s=latency, rid=rids[i]) for i, r in enumerate(reqs)]

    async def _send_generate(self, server: ServerState, payload: JsonDict, n: int
                             ) -> _Reply | None:
        """POSTs a /generate (``n`` samples) to ``server`` with the current LoRA adapter;
        None when the server is down (it is marked so)."""
        if self._latest_adapter is not None:  # the adapter current at each (re)submission
            payload["lora_path"] = self._latest_adapter[0]
        server.inflight += n
        try:
            return await self._call(server, "/generate", payload, None, vary_rid=True)
        except _ServerDown as e:
            self._mark_down(server, e.reason)
            return None
        finally:
            server.inflight -= n

    def _parse_item(self, data: Any, server: ServerState, where: str  # a reply's JSON: Any
                    ) -> tuple[list[int], list[float], int, object]:
        """(tokens, logprobs, weight version, finish_reason) of one /generate reply object."""
        meta = data.get("meta_info") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            raise RolloutError(f"{where} without a meta_info object")
        finish_reason = meta.get("finish_reason")
        entries: Any = meta.get("output_token_logprobs")  # JSON; checked by iterating it
        output_ids = data.get("output_ids")
        if entries is None and not output_ids and _finish_type(finish_reason) == FINISH_ABORT:
            entries = []  # SGLang <= 0.5.3 aborting a queued request ("Abort before prefill")
        try:
            tokens = [int(e[1]) for e in entries]
            logprobs = [float(e[0]) for e in entries]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise RolloutError(
                f"{where} without meta_info.output_token_logprobs ([logprob, token_id, text] "
                f"entries; send return_logprob): {type(e).__name__}: {e}") from None
        if output_ids is not None and (
                not isinstance(output_ids, list) or [int(t) for t in output_ids] != tokens):
            raise RolloutError(
                f"{server.url}: output_ids and output_token_logprobs disagree "
                f"({len(output_ids) if isinstance(output_ids, list) else output_ids!r} vs "
                f"{len(tokens)} tokens)")
        version = self._parse_version(meta.get("weight_version")) if tokens else -1
        return tokens, logprobs, version, finish_reason

    def _parse_version(self, version: Any) -> int:  # a reply's JSON value
        """SGLang's weight_version is a string; ours are decimal integers."""
        try:
            return int(version)
        except (TypeError, ValueError):
            fallback = self.latest_version if self.latest_version is not None else 0
            if str(version) not in self._warned_versions:
                self._warned_versions.add(str(version))
                if version is None:
                    logger.warning("server replies carry no weight_version (an SGLang without "
                                   "it); recording the version this client loaded last, %d",
                                   fallback)
                else:
                    logger.warning("server weight_version %r is not an integer; recording %d "
                                   "(launch SGLang with --weight-version 0)", version, fallback)
            return fallback

    async def _call(self, server: ServerState, route: str, body: JsonDict,
                    timeout: float | None, vary_rid: bool = False,
                    total_s: float | None = None) -> _Reply:
        """POSTs ``body`` to one server, retrying transient trouble (see the module doc).

        Returns any reply below 500. Raises _ServerDown if the server refuses connections
        or is still failing when its retries run out. ``vary_rid`` gives each retry its own
        rid (the abandoned attempt may still hold the old one on the server). ``total_s``
        (control calls) bounds the whole call, every attempt and wait included.
        """
        url = f"{server.url}{route}"
        first_failure: float | None = None
        in_a_row = 0
        delay = self.retry_backoff_s
        end = None if total_s is None else time.monotonic() + total_s
        for attempt in itertools.count():
            if vary_rid and attempt:
                rid = body["rid"]
                body = {**body, "rid": [f"{r}~{attempt}" for r in rid] if isinstance(rid, list)
                        else f"{rid}~{attempt}"}
            waited = timeout if timeout is not None else self.request_timeout
            if end is not None:
                waited = max(min(waited, end - time.monotonic()), 0.001)
            try:
                reply = await self._http.post(url, json=body, timeout=waited)
            except aiohttp.ConnectionTimeoutError:  # no connection (a SYN backlog, a busy host)
                if end is not None and time.monotonic() >= end:
                    raise _ServerDown(f"{route}: no connection within {total_s:g}s") from None
                reason, counted = (f"{route}: no connection within "
                                   f"{min(waited, self._http.connect_timeout):g}s"), False
            except TimeoutError:  # slow, not dead (aiohttp's timeouts subclass it)
                if end is not None and time.monotonic() >= end:
                    raise _ServerDown(f"{route}: no reply within {total_s:g}s (the retry "
                                      "deadline bounds every control call)") from None
                reason, counted = f"{route}: no reply within {waited:g}s", False
            except aiohttp.ClientConnectorError as e:  # nothing listens: the server is gone
                raise _ServerDown(f"{route}: cannot connect: {e}") from None
            except TRANSPORT_ERRORS as e:  # dropped or reset connection
                reason, counted = f"{route}: {type(e).__name__}: {e}", True
            else:
                if reply.status_code < 500:
                    return reply
                reason = f"{route}: HTTP {reply.status_code}: {_error_message(reply)}"
                counted = True
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            in_a_row += counted
            if (in_a_row > self.max_retries or now + delay - first_failure > self.retry_deadline_s
                    or (end is not None and now + delay >= end)):
                raise _ServerDown(reason)
            # One failure that the next attempt heals is the weather of a loaded host (a
            # connect held up while the process compiles, a keep-alive race): said at info;
            # a call that fails again is trouble worth a warning.
            log = logger.warning if attempt else logger.info
            log("rollout server %s: %s; retrying in %.1fs (gives up %.0fs after the first "
                "failure)", server.url, reason, delay, self.retry_deadline_s)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.retry_backoff_max_s)
        raise AssertionError("unreachable")

    # ================================================================== scheduling
    async def _choose_server(self) -> ServerState:
        self._schedule_probes()
        deadline = time.monotonic() + self.no_server_timeout
        while True:
            up = [s for s in self.servers if s.up]
            if up:
                if self.schedule == "round_robin":
                    return up[next(self._rr) % len(up)]
                start = next(self._rr) % len(up)
                rotated = up[start:] + up[:start]
                return min(rotated, key=lambda s: s.inflight)
            if time.monotonic() > deadline:
                detail = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
                raise NoServerAvailableError(
                    f"no rollout server is up after {self.no_server_timeout}s ({detail})")
            await asyncio.gather(*(self._probe(s) for s in self.servers if not s.up))
            if not any(s.up for s in self.servers):
                await asyncio.sleep(min(1.0, self.health_check_interval))

    def _mark_down(self, server: ServerState, reason: str) -> None:
        if server.up:
            logger.warning("marking rollout server %s down: %s", server.url, reason)
            server.down_since = time.monotonic()
        server.up = False
        server.last_error = reason
        server.last_probe = time.monotonic()

    def _schedule_probes(self) -> None:
        now = time.monotonic()
        for s in self.servers:
            if (not s.up and s.url not in self._probing
                    and now - s.last_probe >= self.health_check_interval):
                task = asyncio.get_running_loop().create_task(self._probe(s))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _probe(self, server: ServerState) -> None:
        """Brings a down server back if /health answers and it can be synced to the fleet."""
        if server.up or server.url in self._probing:
            return
        self._probing.add(server.url)
        try:
            server.last_probe = time.monotonic()
            try:
                r = await self._http.get(f"{server.url}/health", timeout=5.0)
                if r.status_code != 200:
                    server.last_error = f"/health answered {r.status_code}"
                    return
                if self.latest_version is not None:
                    info = (await self._http.get(f"{server.url}/get_server_info",
                                                 timeout=10.0)).json()
                    if str(info.get("weight_version")) != str(self.latest_version):
                        error = await self._sync_revived(server)
                        if error:
                            server.last_error = f"weight sync failed: {error}"
                            return
                if self._paused:
                    await self._post(server, "/pause_generation", {"mode": "abort"})
            except (*TRANSPORT_ERRORS, ValueError) as e:
                server.last_error = f"{type(e).__name__}: {e}"
                return
            logger.info("rollout server %s is back up", server.url)
            server.up = True
        finally:
            self._probing.discard(server.url)

    async def _sync_revived(self, server: ServerState) -> str | None:
        """Brings a revived server to the fleet's latest weights; the error, or None."""
        if self._latest_adapter is not None:
            name, path, version = self._latest_adapter
            r = await self._post(server, "/load_lora_adapter",
                                 {"lora_name": name, "lora_path": path})
            if r.status_code == 200:
                r = await self._post(server, "/update_weight_version",
                                     {"new_version": str(version), "abort_all_requests": True})
        else:
            assert self._latest_weights is not None
            path, version = self._latest_weights
            if not path:  # sent from the learner's memory: no copy a server could load
                return (f"the fleet serves v{version}, sent from the learner's memory, which "
                        "a restarted server cannot load (checkpoint.publish: disk lets it)")
            body = {"model_path": path, "weight_version": str(version),
                    "abort_all_requests": True}
            if self._latest_full is None:
                r = await self._post(server, "/update_weights_from_disk", body)
            else:  # a delta: applies if the server holds its base, else the full version
                r = await self._post(server, "/update_weights_from_delta", body)
                if r.status_code != 200:
                    try:
                        full = await self._latest_full()
                    except Exception as e:  # noqa: BLE001 - e.g. a newer version moved on
                        return f"the full v{version} could not be written: {e}"
                    r = await self._post(server, "/update_weights_from_delta",
                                         {**body, "model_path": full})
        return None if r.status_code == 200 else _error_message(r)

    @property
    def latest_version(self) -> int | None:
        """The weight version this client last loaded on the fleet (None: none yet)."""
        if self._latest_adapter is not None:
            return self._latest_adapter[2]
        return self._latest_weights[1] if self._latest_weights is not None else None

    # ================================================================== fleet control
    @property
    def control_deadline_s(self) -> float:
        """What one control call (pause, continue, weight update, adapter load, server
        info) may take in total, retries included: the retry deadline (``control_timeout``
        when that is 0). Each attempt within it waits at most ``control_timeout``."""
        return self.retry_deadline_s or self.control_timeout

    async def _post(self, server: ServerState, route: str, body: JsonDict | None = None
                    ) -> _Reply:
        return await self._http.post(f"{server.url}{route}", json=body or {},
                                     timeout=self.control_deadline_s)

    async def _broadcast(self, route: str, body: JsonDict | None = None
                         ) -> list[JsonDict]:
        """POSTs to every up server; unreachable ones are marked down (synced on revival).
        Raises RolloutError if a server refuses."""
        replies = await self._broadcast_replies(route, body)
        failed = [r for r in replies if r.get("success") is False]
        if failed:
            detail = "; ".join(f"{r['url']}: {r.get('message')}" for r in failed)
            raise RolloutError(f"{route} failed on {len(failed)} server(s): {detail}")
        return replies

    async def _broadcast_replies(self, route: str, body: JsonDict | None = None,
                                 only: set[str] | None = None) -> list[JsonDict]:
        """POSTs to every up server (of ``only``, the URLs, if given); unreachable ones are
        marked down. Returns the replies, each with its ``url``, refusals with ``success``
        False; raises NoServerAvailableError if none replied."""
        up = [s for s in self.servers if s.up and (only is None or s.url in only)]
        if not up:
            raise NoServerAvailableError(f"{route}: no rollout server is up")

        async def one(s: ServerState) -> JsonDict | None:
            try:
                r = await self._call(s, route, body or {}, self.control_timeout,
                                     total_s=self.control_deadline_s)
            except _ServerDown as e:
                self._mark_down(s, e.reason)
                return None
            try:
                reply = r.json()
            except ValueError:
                reply = {"message": r.text}
            if not isinstance(reply, dict):
                reply = {"reply": reply}
            reply["url"] = s.url
            if r.status_code >= 400 or reply.get("success") is False:
                reply["success"] = False
                reply.setdefault("message", _error_message(r))
            return reply

        replies = [r for r in await asyncio.gather(*(one(s) for s in up)) if r is not None]
        if not replies:
            detail = "; ".join(f"{s.url}: {s.last_error}" for s in up)
            raise NoServerAvailableError(f"{route}: every rollout server failed and was dropped "
                                         f"({detail})")
        return replies

    async def pause(self) -> list[JsonDict]:
        """Pauses every server: running requests return as ``abort`` with partial output
        (this client resubmits them, where they wait until ``continue_``)."""
        self._paused = True
        return await self._broadcast("/pause_generation", {"mode": "abort"})

    async def continue_(self) -> list[JsonDict]:
        self._paused = False
        return await self._broadcast("/continue_generation", {})

    async def update_weights_from_disk(self, path: str, version: int,
                                       abort_all_requests: bool = False) -> list[JsonDict]:
        """Loads an HF checkpoint directory on every server and sets ``weight_version``."""
        body = {"model_path": str(path), "weight_version": str(version),
                "abort_all_requests": abort_all_requests, "flush_cache": True}
        replies = await self._broadcast("/update_weights_from_disk", body)
        self._latest_weights = (str(path), int(version))
        self._latest_full = None
        self._latest_adapter = None  # merged weights: requests carry no lora_path
        return replies

    async def update_weights_from_delta(self, path: str, version: int,
                                        full: Callable[[], Awaitable[str]],
                                        abort_all_requests: bool = False) -> list[JsonDict]:
        """Every server applies the weight delta file ``path`` (the embedded engine's
        ``/update_weights_from_delta``: the XOR with the version it serves, compressed)
        and serves ``version``. A server that refuses it (it does not serve the delta's
        base: it missed a version; or the file is corrupted) gets the full version
        instead: ``full()`` writes it (once, only then) and returns its path; such a
        server's reply carries ``"full": True``. A refused update leaves that server's
        weights as they were; raises RolloutError if a server refuses the full version
        too. Running requests return as aborted at the swap if ``abort_all_requests``."""
        body = {"model_path": str(path), "weight_version": str(version),
                "abort_all_requests": abort_all_requests}
        route = "/update_weights_from_delta"
        replies = await self._broadcast_replies(route, body)
        refused = {r["url"]: r for r in replies if r.get("success") is False}
        if refused:
            for r in refused.values():
                logger.info("rollout server %s refused delta v%d (%s); sending the full "
                            "version", r["url"], version, r.get("message"))
            full_path = await full()
            again = await self._broadcast_replies(route, {**body, "model_path": full_path},
                                                  only=set(refused))
            for r in again:
                r["full"] = True
            replies = [r for r in replies if r["url"] not in refused] + again
        failed = [r for r in replies if r.get("success") is False]
        if failed:
            detail = "; ".join(f"{r['url']}: {r.get('message')}" for r in failed)
            raise RolloutError(f"{route} failed on {len(failed)} server(s), the full version "
                               f"included: {detail}")
        self._latest_weights = (str(path), int(version))
        self._latest_full = full
        self._latest_adapter = None
        return replies

    async def swap_staged_weights(self, transfer: str, version: int,
                                  abort_all_requests: bool = True) -> list[JsonDict]:
        """Every server serves the weights it has staged for in-memory transfer
        ``transfer`` (the embedded engine's ``/weights/swap``) as ``version``, from its next
        step boundary on; running requests return as aborted first if
        ``abort_all_requests`` (this client resubmits them)."""
        replies = await self._broadcast("/weights/swap", {
            "transfer": transfer, "weight_version": str(version),
            "abort_all_requests": abort_all_requests})
        self._latest_weights = ("", int(version))  # no path: see _sync_revived
        self._latest_full = None
        self._latest_adapter = None
        return replies

    async def load_lora_adapter(self, name: str, path: str, version: int
                                ) -> list[JsonDict]:
        """Adapter mode: loads the PEFT adapter ``path`` as ``name`` on every server, sets
        ``weight_version`` (SGLang's ``/load_lora_adapter`` leaves it unchanged) and
        unloads the adapter loaded before it where the server still holds it (SGLang keeps
        several; the embedded engine keeps one, so its load already replaced it). From now
        on every request carries ``"lora_path": name``."""
        replies = await self._broadcast("/load_lora_adapter",
                                        {"lora_name": name, "lora_path": str(path)})
        await self._broadcast("/update_weight_version", {"new_version": str(version)})
        previous = self._latest_adapter[0] if self._latest_adapter is not None else None
        self._latest_adapter = (name, str(path), int(version))
        if previous is not None and previous != name:
            still = [r["url"] for r in replies
                     if previous in (r.get("loaded_adapters") or {})]
            for server in [s for s in self.servers if s.url in still]:
                r = await self._post(server, "/unload_lora_adapter", {"lora_name": previous})
                if r.status_code != 200:
                    logger.warning("%s: could not unload LoRA adapter %s: %s", server.url,
                                   previous, _error_message(r))
        return replies

    async def server_infos(self) -> list[JsonDict]:
        """``/get_server_info`` of every server (``{"url", "up": False, ...}`` if down)."""

        async def one(s: ServerState) -> JsonDict:
            if not s.up:
                return {"url": s.url, "up": False, "last_error": s.last_error}
            try:
                r = await self._http.get(f"{s.url}/get_server_info",
                                         timeout=self.control_deadline_s)
                info = r.json() if r.status_code == 200 else {"error": _error_message(r)}
            except TimeoutError:
                self._mark_down(s, "/get_server_info: no reply within "
                                   f"{self.control_deadline_s:g}s")
                return {"url": s.url, "up": False, "last_error": s.last_error}
            except (*TRANSPORT_ERRORS, ValueError) as e:
                self._mark_down(s, f"/get_server_info: {type(e).__name__}: {e}")
                return {"url": s.url, "up": False, "last_error": s.last_error}
            return {**info, "url": s.url, "up": True, "client_inflight": s.inflight}

        return list(await asyncio.gather(*(one(s) for s in self.servers)))

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._http.aclose()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
