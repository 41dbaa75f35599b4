"""Agentic workflows: a user's agent, written against the OpenAI API, becomes trajectories.

    async def my_agent(base_url: str, item: dict) -> float:      # or a plain function
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
        r = await client.chat.completions.create(model="policy", messages=[...])
        ...  # call tools, call the model again, ...
        return reward

    workflow = AgenticWorkflow(my_agent, n_samples=8, gconfig=..., tokenizer=...)

Each sample gets its own endpoint ``{proxy}/traj/{id}/v1`` on a small OpenAI-compatible
server in this process (the routes of :mod:`areal_jax.engine.openai_api`). Every call to it
is generated through the rollout client, so weight-update interruptions, server failover
and the executor's staleness gate work as for single-turn workflows, and is recorded
token-in/token-out: prompt ids, output ids, behaviour logprobs and per-token weight
versions.

**Exact tokens across turns.** When a chat agent sends the conversation back, each
assistant message is compared with the replies this trajectory's endpoint gave (content and
tool calls, call ids aside). The prompt of the new call is then built from tokens, not
from re-tokenized text: the recorded prompt and output ids of the call that wrote the last
matching assistant message (which were built the same way), followed by the chat
template's text after that message (its end-of-turn marker dropped when the model
generated it), tokenized. So the model's turns enter later prompts exactly as generated,
whatever the tokenizer would make of their text. An assistant message that matches no
reply (the agent edited it, or wrote it) is rendered and tokenized as text and counted in
the trajectory's ``info["assistant_mismatch"]``; if the template renders the history before
the matched turn differently from how it rendered that turn's prompt, the whole prompt is
re-tokenized and counted in ``info["history_retokenized"]``.

**The trajectory** is the *last* call's prompt + output. Tokens of earlier calls are found
in it by position: an earlier call whose prompt ids are a prefix of the final sequence
contributes its output tokens (loss mask 1, their logprobs and versions) as far as they
appear there unchanged. Everything else (the prompt, tool output, template tokens between
turns) has loss mask 0. So a multi-turn agent that resends the growing conversation gets
one sequence with the model's turns masked in; a call whose output the agent edited, or a
side conversation, is counted in ``agent_calls_unmatched`` and not trained on.

Sampling is the run's: temperature, top-p and top-k come from ``gconfig`` whatever the agent
asks (the learner recomputes logprobs at that temperature), ``max_tokens`` is capped by
``gconfig.max_new_tokens``. More than ``max_turns`` calls, or a prompt reaching
``max_total_tokens``, get a 400 with ``code`` ``turn_limit`` / ``context_length_exceeded``.
If the agent raises or returns no valid reward, or made no call, the group is rejected
(counted as ``agent_failed_groups``), as a failed reward rejects a single-turn group.

**An episode that outgrows the context** ends there: once a call has been refused with
``context_length_exceeded``, the trajectory (the calls made until then) gets the finish
reason ``context_length`` (counted in ``agent_context_exceeded``), with the agent's reward,
or 0 if the agent raised. Tools run through :class:`areal_jax.rollout.tools.ToolRunner`
are counted per episode (``tool_calls``, ``tool_errors``, ``tool_results_truncated``, in
the trajectory's ``info`` and the metrics).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from areal_jax.engine.openai_api import Generated, OpenAIError, OpenAIRoutes, render_chat
from areal_jax.engine.tool_calls import ToolSpec
from areal_jax.plugins import import_callable
from areal_jax.rewards.pool import check_reward_value
from areal_jax.rollout.tools import TOOL_COUNTS, counting_tools, tool_faults
from areal_jax.rollout.types import FINISH_LENGTH, FINISH_STOP
from areal_jax.rollout.user_code import (
    Escaped,
    describe_error,
    is_own_cancellation,
    run_in_daemon_thread,
)
from areal_jax.rollout.workflows import WorkflowContext, keep_group, sample_request
from areal_jax.sampling_params import SamplingParams
from areal_jax.trajectory import FINISH_CONTEXT, Trajectory

logger = logging.getLogger(__name__)
AgentFn = Callable[..., Any]


@dataclass
class RecordedCall:
    """One completion request of an agent, token-in/token-out."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    n_interruptions: int = 0
    prompt_text: str | None = None  # a chat call's rendered messages (without a forced prefix)
    reply: dict[str, Any] | None = None  # the assistant message it was answered with
    assistant_mismatch: int = 0  # assistant messages in its history that match no reply
    history_retokenized: bool = False  # its prompt was re-tokenized from text


@dataclass(frozen=True)
class _Rendered:
    text: str
    assistant_mismatch: int
    history_retokenized: bool


def _same_turn(message: dict[str, Any], reply: dict[str, Any] | None) -> bool:
    """Whether an assistant message the agent sent is the reply it was given: the same
    content and the same calls (names and arguments; call ids aside)."""
    if reply is None or (message.get("content") or "") != (reply.get("content") or ""):
        return False
    sent = [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []]
    given = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in reply.get("tool_calls") or []]
    return sent == given


@dataclass
class _Recorder:
    client: Any
    loop: asyncio.AbstractEventLoop
    gconfig: SamplingParams
    seed: int
    rid: str
    max_turns: int
    max_total_tokens: int
    calls: list[RecordedCall] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    rendered: dict[tuple[int, ...], _Rendered] = field(default_factory=dict)
    context_exceeded: str | None = None  # the first call refused for not fitting


@dataclass
class _Episode:
    """What one sample's agent run left: its reward (None with ``problem``), its calls,
    and how it ended."""

    reward: float | None
    calls: list[RecordedCall]
    problem: str | None
    context_exceeded: bool = False
    tool_counts: dict[str, int] = field(default_factory=dict)


def assemble_trajectory(calls: list[RecordedCall], reward: float, **fields: Any
                        ) -> tuple[Trajectory, int]:
    """The trajectory of an agent run (see the module docstring) and how many earlier
    calls did not match the final sequence."""
    if not calls:
        raise ValueError("the agent made no model call, so there is nothing to train on")
    final = calls[-1]
    ids = list(final.prompt_ids) + list(final.output_ids)
    n_prompt = len(final.prompt_ids)
    mask = [0] * n_prompt + [1] * len(final.output_ids)
    logp = [0.0] * n_prompt + list(final.logprobs)
    versions = [-1] * n_prompt + list(final.versions)
    unmatched = 0
    for call in calls[:-1]:
        start = len(call.prompt_ids)
        if start > n_prompt or ids[:start] != list(call.prompt_ids):
            unmatched += 1
            continue
        for j, token in enumerate(call.output_ids):
            pos = start + j
            if pos >= n_prompt or ids[pos] != token:
                break
            mask[pos], logp[pos], versions[pos] = 1, call.logprobs[j], call.versions[j]
    info = {"turns": len(calls), "calls_unmatched": unmatched,
            "n_interruptions": sum(c.n_interruptions for c in calls),
            "assistant_mismatch": final.assistant_mismatch,
            "history_retokenized": int(final.history_retokenized), **fields.pop("info", {})}
    traj = Trajectory(input_ids=np.asarray(ids, np.int32), loss_mask=np.asarray(mask, np.int32),
                      behav_logp=np.asarray(logp, np.float32),
                      versions=np.asarray(versions, np.int32), reward=float(reward),
                      finish_reason=final.finish_reason, info=info, **fields)
    return traj, unmatched


class AgentProxy:
    """The per-trajectory OpenAI endpoints: one HTTP server on 127.0.0.1 (its own thread and
    event loop), routing ``/traj/{key}/v1/...`` to the recorder registered under ``key``."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_seq_len: int,
                 host: str = "127.0.0.1") -> None:
        import uvicorn
        from fastapi import FastAPI

        self._recorders: dict[str, _Recorder] = {}
        self.tokenizer = tokenizer
        stops = tuple(getattr(tokenizer, "stop_token_ids", None) or ())
        self._stops = set(stops)
        app = FastAPI(title="areal-jax agent proxy", docs_url=None, redoc_url=None)
        self._routes = OpenAIRoutes(
            self._generate, tokenizer=tokenizer, vocab_size=vocab_size,
            max_seq_len=max_seq_len, model_name="policy", stop_token_ids=stops,
            renderer=self._render, on_reply=self._on_reply, on_error=self._on_error,
            cap_max_tokens=True)  # as rollout.max_new_tokens caps it (docs/rollout.md)
        self._routes.register(app, prefix="/traj/{key}")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                     timeout_keep_alive=30))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="agent-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent proxy server did not start")
            time.sleep(0.01)

    def open(self, recorder: _Recorder) -> str:
        key = uuid.uuid4().hex
        self._recorders[key] = recorder
        return key

    def base_url(self, key: str) -> str:
        return f"{self.url}/traj/{key}/v1"

    def release(self, key: str) -> None:
        self._recorders.pop(key, None)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)

    def _render(self, key: str, msgs: list[dict[str, Any]], spec: ToolSpec, prefix: str
                ) -> list[int]:
        """A chat call's prompt ids, with the recorded tokens of the model's earlier turns
        (see the module docstring)."""
        tok = self.tokenizer
        text = render_chat(tok, msgs, spec.tools)
        rec = self._recorders.get(key)
        ids, mismatch, retokenized = None, 0, False
        if rec is not None:
            with rec.lock:
                done = [c for c in rec.calls if c is not None and c.reply is not None]
            last: tuple[int, list[RecordedCall]] | None = None
            for i, m in enumerate(msgs):
                if m["role"] == "assistant":
                    same = [c for c in done if _same_turn(m, c.reply)]
                    if same:
                        last = (i, same)
                    else:
                        mismatch += 1
            if last is not None:
                ids = self._splice(msgs, spec, last[0], last[1])
                retokenized = ids is None
        if ids is None:
            ids = tok.encode(text + prefix)
        elif prefix:
            ids = ids + tok.encode(prefix)
        if rec is not None:
            with rec.lock:
                rec.rendered[tuple(ids)] = _Rendered(text, mismatch, retokenized)
        return ids

    def _splice(self, msgs: list[dict[str, Any]], spec: ToolSpec, index: int,
                calls: list[RecordedCall]) -> list[int] | None:
        """Prompt ids (without a forced prefix) with ``msgs[index]`` as the recorded tokens
        of the call that wrote it, or None when the template's text before it is not that
        call's prompt text."""
        tok = self.tokenizer
        marker = f"<<areal-turn-{uuid.uuid4().hex}>>"
        marked = [*msgs[:index], {"role": "assistant", "content": marker}, *msgs[index + 1:]]
        pieces = render_chat(tok, marked, spec.tools).split(marker)
        if len(pieces) != 2:
            return None
        before, after = pieces
        for call in reversed(calls):  # the latest call that wrote this reply
            if call.prompt_text != before:
                continue
            if call.output_ids and call.output_ids[-1] in self._stops:
                end = tok.decode([call.output_ids[-1]], skip_special_tokens=False)
                if not after.startswith(end):
                    continue
                after = after[len(end):]
            return list(call.prompt_ids) + list(call.output_ids) + tok.encode(after)
        return None

    def _on_reply(self, key: str, gen: Generated, message: dict[str, Any]) -> None:
        rec = self._recorders.get(key)
        turn = gen.extra.get("turn")
        if rec is not None and turn is not None:
            with rec.lock:
                rec.calls[turn].reply = message

    def _on_error(self, key: str, error: OpenAIError) -> None:
        rec = self._recorders.get(key)
        if rec is not None and error.code == "context_length_exceeded":
            with rec.lock:
                rec.context_exceeded = rec.context_exceeded or error.message

    async def _generate(self, key: str, input_ids: list[int], params: SamplingParams,
                        on_tokens: Any) -> Generated:
        rec = self._recorders.get(key)
        if rec is None:
            raise OpenAIError(f"no running trajectory {key!r} (it has finished)", status=404,
                              code="unknown_trajectory")
        with rec.lock:
            turn = len(rec.calls)
            if turn >= rec.max_turns:
                raise OpenAIError(f"turn limit reached: this trajectory allows {rec.max_turns} "
                                  "model calls", code="turn_limit")
            rec.calls.append(None)  # type: ignore[arg-type]  # reserves the turn
        room = rec.max_total_tokens - len(input_ids)
        if room < 1:
            raise OpenAIError(f"the prompt has {len(input_ids)} tokens; this trajectory allows "
                              f"{rec.max_total_tokens} in all", "messages",
                              code="context_length_exceeded")
        stops = list(dict.fromkeys([*rec.gconfig.stop_token_ids, *params.stop_token_ids]))
        gconfig = replace(rec.gconfig, stop_token_ids=tuple(stops))
        request = sample_request(gconfig, input_ids, seed=rec.seed + turn,
                                 rid=f"{rec.rid}.{turn}",
                                 max_new_tokens=min(params.max_new_tokens,
                                                    rec.gconfig.max_new_tokens, room))
        future = None
        try:
            future = asyncio.run_coroutine_threadsafe(rec.client.agenerate(request), rec.loop)
            resp = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future is not None and future.cancelled():  # the executor is stopping
                raise OpenAIError("the rollout is stopping; this trajectory is cancelled",
                                  status=503, kind="server_error") from None
            if future is not None:  # the agent went away: stop its generation too
                future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - answered to the agent as a 5xx
            raise OpenAIError(f"generation failed: {type(e).__name__}: {e}", status=502,
                              kind="server_error") from None
        call = RecordedCall(list(input_ids), list(resp.output_ids), list(resp.output_logprobs),
                            list(resp.output_versions), resp.finish_reason, resp.n_interruptions)
        if call.output_ids:  # ids the model writes are valid in prompts (a model's vocabulary
            # may be larger than its tokenizer's: rows past it are padding it can sample)
            top = max(call.output_ids) + 1
            if top > self._routes.vocab_size:
                self._routes.vocab_size = top
        with rec.lock:
            rendered = rec.rendered.pop(tuple(input_ids), None)
            if rendered is not None:
                call.prompt_text = rendered.text
                call.assistant_mismatch = rendered.assistant_mismatch
                call.history_retokenized = rendered.history_retokenized
            rec.calls[turn] = call
        if on_tokens is not None and call.output_ids:
            on_tokens(call.output_ids, call.logprobs)
        finish = FINISH_LENGTH if resp.finish_reason == FINISH_LENGTH else FINISH_STOP
        return Generated(call.output_ids, call.logprobs, finish,
                         str(max(call.versions, default=-1)), {"turn": turn})


def resolve_agent(agent: AgentFn | str) -> AgentFn:
    """A callable, or ``"module:function"`` imported now (ValueError naming what is wrong)."""
    if callable(agent):
        return agent
    if not isinstance(agent, str) or ":" not in agent:
        raise ValueError(f"agent {agent!r} must be a callable or a 'module:function' string "
                         "(e.g. 'areal_jax.rollout.agent_examples:arith_retry_agent')")
    return import_callable(agent, "agent")


class AgenticWorkflow:
    """Runs ``agent(base_url, item, **agent_kwargs) -> reward`` ``n_samples`` times per
    prompt, each against its own recording endpoint; returns the group of trajectories.

    ``agent`` may be async (run on the executor's loop) or plain (run in a thread). Token
    budgets: ``max_turns`` model calls and ``max_total_tokens`` per trajectory.
    ``group_filter`` may reject a finished group, as in ``RLVRWorkflow``.
    """

    def __init__(self, agent: AgentFn | str, *, n_samples: int = 1,
                 gconfig: SamplingParams | None = None, tokenizer: Any = None,
                 max_turns: int = 4, max_total_tokens: int = 1024, vocab_size: int | None = None,
                 reward_max_abs: float | None = None,
                 group_filter: Callable[[list[Trajectory]], bool] | None = None,
                 agent_kwargs: dict[str, Any] | None = None) -> None:
        if n_samples < 1 or max_turns < 1 or max_total_tokens < 2:
            raise ValueError(f"AgenticWorkflow needs n_samples >= 1, max_turns >= 1, "
                             f"max_total_tokens >= 2; got {n_samples}, {max_turns}, "
                             f"{max_total_tokens}")
        self.agent = resolve_agent(agent)
        self.n_samples, self.max_turns = n_samples, max_turns
        self.max_total_tokens = max_total_tokens
        self.gconfig = gconfig or SamplingParams()
        self.tokenizer = tokenizer
        if tokenizer is not None and not self.gconfig.stop_token_ids:
            self.gconfig = replace(self.gconfig,
                                   stop_token_ids=tuple(tokenizer.stop_token_ids))
        self.vocab_size = vocab_size
        self.reward_max_abs = reward_max_abs
        self.group_filter = group_filter
        self.agent_kwargs = dict(agent_kwargs or {})
        self._proxy: AgentProxy | None = None
        self._proxy_lock = threading.Lock()

    def for_eval(self, gconfig: SamplingParams, n_samples: int) -> AgenticWorkflow:
        """The same agent, tools and budgets with the evaluation's sampling (no group
        filter): what the run's eval runs (its own recording endpoint; close it too)."""
        if not gconfig.stop_token_ids and self.gconfig.stop_token_ids:
            gconfig = replace(gconfig, stop_token_ids=self.gconfig.stop_token_ids)
        return AgenticWorkflow(self.agent, n_samples=n_samples, gconfig=gconfig,
                               tokenizer=self.tokenizer, max_turns=self.max_turns,
                               max_total_tokens=self.max_total_tokens,
                               vocab_size=self.vocab_size, reward_max_abs=self.reward_max_abs,
                               agent_kwargs=self.agent_kwargs)

    def proxy(self, tokenizer: Any) -> AgentProxy:
        """The recording server, started on first use."""
        with self._proxy_lock:
            if self._proxy is None:
                vocab = self.vocab_size or (tokenizer.vocab_size if tokenizer else 2**31 - 1)
                self._proxy = AgentProxy(tokenizer, vocab_size=vocab,
                                         max_seq_len=self.max_total_tokens)
            return self._proxy

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None

    async def _sample(self, client: Any, item: dict[str, Any], ctx: WorkflowContext,
                      index: int) -> _Episode:
        proxy = self.proxy(self.tokenizer or ctx.tokenizer)
        rec = _Recorder(client=client, loop=asyncio.get_running_loop(), gconfig=self.gconfig,
                        seed=ctx.seed + 1000 * index, rid=f"{ctx.group_id}/{index}",
                        max_turns=self.max_turns, max_total_tokens=self.max_total_tokens)
        key = proxy.open(rec)
        max_abs = self.reward_max_abs or ctx.reward_max_abs
        reward: float | None = None
        problem: str | None = None
        with counting_tools() as tool_counts:
            try:
                if inspect.iscoroutinefunction(self.agent):
                    value = await self.agent(proxy.base_url(key), item, **self.agent_kwargs)
                else:  # a plain agent blocks: it runs in a daemon thread of its own (never
                    # the loop's shared executor, which a hung agent would hold)
                    value = await run_in_daemon_thread(
                        self.agent, proxy.base_url(key), item, name=f"agent-{self.name}",
                        **self.agent_kwargs)
                reward = check_reward_value(value, max_abs)
            except asyncio.CancelledError:
                if is_own_cancellation():  # a deadline or a shutdown: the run's to handle
                    raise
                problem = f"agent {self.name} failed: it raised CancelledError itself"
            except Escaped as e:  # a plain agent's sys.exit, as its thread reported it
                problem = f"agent {self.name} failed: {describe_error(e.__cause__ or e)}"
            except BaseException as e:  # noqa: BLE001 - one bad episode (sys.exit, ^C
                # raised by the agent, an exception) must not stop the run
                problem = f"agent {self.name} failed: {describe_error(e)}"
            finally:
                proxy.release(key)
            faults = tool_faults()
        if faults:  # a broken tool fails the episode, even if the agent swallowed it
            reward, problem = None, f"agent {self.name}: {faults[0]}"
        calls = [c for c in rec.calls if c is not None]
        if problem is None and not calls:
            problem = "the agent made no model call"
        overflow = rec.context_exceeded is not None and bool(calls)
        if overflow and reward is None:
            # The conversation outgrew the context and the agent gave up with an error (the
            # 400 it was answered): the episode ends there, scored 0, rather than the group
            # being rejected and the prompt retried into the same wall.
            logger.info("agent sample %s/%d ended at the context limit: %s (%s)",
                        ctx.group_id, index, rec.context_exceeded, problem)
            reward, problem = 0.0, None
        return _Episode(reward, calls, problem, overflow, dict(tool_counts))

    @property
    def name(self) -> str:
        """The agent as ``module:function``, as the run's config names it."""
        module = getattr(self.agent, "__module__", None)
        qualname = getattr(self.agent, "__qualname__", None) or repr(self.agent)
        return f"{module}:{qualname}" if module else qualname

    def __repr__(self) -> str:
        return f"AgenticWorkflow(agent {self.name})"

    async def arun(self, client: Any, item: dict[str, Any],
                   ctx: WorkflowContext) -> list[Trajectory] | None:
        episodes = await asyncio.gather(*(self._sample(client, item, ctx, i)
                                          for i in range(self.n_samples)))
        for ep in episodes:  # every episode's turns and tools, failed ones included
            for name, n in ep.tool_counts.items():
                ctx.count(name, n)
            ctx.count("agent_turns", len(ep.calls))
        group = []
        for i, ep in enumerate(episodes):
            if ep.problem is not None or ep.reward is None:
                logger.warning("agent sample %s/%d: %s", ctx.group_id, i, ep.problem)
                ctx.count("agent_failed_groups")
                ctx.note_problem(ep.problem or "the agent returned no reward")
                return None
            info = {"sample_index": i, **{k: ep.tool_counts.get(k, 0) for k in TOOL_COUNTS}}
            traj, unmatched = assemble_trajectory(ep.calls, ep.reward, info=info)
            if ep.context_exceeded:
                traj.finish_reason = FINISH_CONTEXT
                ctx.count("agent_context_exceeded")
            if unmatched:
                ctx.count("agent_calls_unmatched", unmatched)
            if traj.info["assistant_mismatch"]:
                ctx.count("agent_assistant_mismatch", traj.info["assistant_mismatch"])
            if traj.info["history_retokenized"]:
                ctx.count("agent_history_retokenized")
            group.append(traj)
        if not keep_group(self.group_filter, group, ctx):
            return None
        return group
