"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` routes.

The routes turn an OpenAI request into token ids (a chat request through the model's chat
template), generate through a *backend*, and answer in OpenAI's shapes, streaming (SSE)
included. Two backends use them:

- :func:`engine_backend`: the embedded engine (``scripts/serve.py``), registered by the
  engine server. Requests aborted by a weight update are resumed under the new weights
  with their partial output appended, so an OpenAI client never sees the interruption.
- the agentic workflow's per-trajectory endpoint (``areal_jax.rollout.agent``), which
  generates through the rollout client and records every call token-in/token-out.

Bad requests get a 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Supported: ``prompt`` (a string, one
string in a list, or token ids), ``messages`` (string or text-part content),
``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stream``
(+ ``stream_options.include_usage``), ``ignore_eos`` (SGLang's extension), ``logprobs``
(the sampled token's logprob; ``top_logprobs`` only 0), ``n`` = 1, and tool calls:
``tools``, ``tool_choice``, assistant messages with ``tool_calls`` and ``tool`` messages,
rendered by the model's chat template and parsed back by :mod:`areal_jax.engine.tool_calls`
(a reply with calls has ``finish_reason`` ``tool_calls``; ``required`` and a named function
start the reply with the call's opening text). Stop strings, penalties, ``echo``,
``best_of`` and ``logit_bias`` are refused with a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from areal_jax.engine.protocol import NOT_TEXT, lone_surrogate_path
from areal_jax.engine.request import EngineRequest
from areal_jax.engine.tool_calls import (
    ToolCallStream,
    ToolSpec,
    ToolSpecError,
    check_tools,
    forced_prefix,
    parse_tool_calls,
    template_tool_calls,
    tool_call_format,
)
from areal_jax.sampling_params import SEED_MAX, SamplingParams

TokenCallback = Callable[[list[int], list[float]], None]
# backend(key, input_ids, params, on_tokens) -> Generated. ``key`` is the route's {key} path
# parameter ("" without one); ``on_tokens`` (streaming only) gets new tokens as they come.
Backend = Callable[[str, list[int], SamplingParams, TokenCallback | None],
                   Coroutine[Any, Any, "Generated"]]
# renderer(key, messages, tool_spec, prefix) -> prompt ids of a chat request (messages as the
# chat template takes them; ``prefix`` is text the reply is started with).
ChatRenderer = Callable[[str, list[dict[str, Any]], "ToolSpec", str], list[int]]
# on_reply(key, generated, message): the assistant message a chat request was answered with.
ReplyHook = Callable[[str, "Generated", dict[str, Any]], None]
# on_error(key, error): an error a request was answered with.
ErrorHook = Callable[[str, "OpenAIError"], None]

_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stream",
                  "stream_options", "logprobs", "top_logprobs", "n", "user", "stop",
                  "presence_penalty", "frequency_penalty", "logit_bias",
                  "ignore_eos"}  # an SGLang / vLLM extension (extra_body)
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice",
                                "parallel_tool_calls", "response_format", "metadata", "store"}
logger = logging.getLogger(__name__)
NO_TOKENIZER = ("this model has no tokenizer, so chat requests cannot be rendered; use "
                "/v1/completions with token ids")
# A receive that returns something other than a disconnect (a server that does not block
# once the body is read) is retried this often, so the watch never spins.
DISCONNECT_RETRY_S = 0.5


class OpenAIError(Exception):
    """A request error, answered as OpenAI's error body with ``status``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.kind, self.code = kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status)


@dataclass
class Generated:
    """What a backend returns for one completion."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    weight_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedRequest:
    input_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str
    tools: ToolSpec = field(default_factory=lambda: ToolSpec([], "none"))
    prefix: str = ""  # text the reply starts with (a forced tool call's opening)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or \
            not (lo < v if lo_open else lo <= v) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise OpenAIError(f"{key} must be a number in {interval}, got {v!r}", key)
    return float(v)


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON ({e})") from None
    except RecursionError:
        raise OpenAIError("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    where = lone_surrogate_path(raw, body)
    if where is not None:
        raise OpenAIError(f"{where} {NOT_TEXT}", re.split(r"[.\[]", where)[0]
                          if not where.startswith(("the body", "a key of")) else None)
    return body


def _refuse_unsupported(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(f"unsupported field {unknown[0]!r}", unknown[0])
    refusals = {
        "stop": "stop strings are not supported; the model stops at its end-of-turn tokens",
        "presence_penalty": "presence_penalty is not supported (only 0)",
        "frequency_penalty": "frequency_penalty is not supported (only 0)",
        "logit_bias": "logit_bias is not supported",
        "echo": "echo is not supported",
        "suffix": "suffix is not supported",
        "response_format": "response_format is not supported",
    }
    for key, reason in refusals.items():
        if body.get(key) not in (None, 0, 0.0, False, [], {}, "") and \
                not (key == "response_format" and body[key] == {"type": "text"}):
            raise OpenAIError(reason, key)
    if body.get("best_of") is not None and not (_is_int(body["best_of"]) and body["best_of"] == 1):
        raise OpenAIError("best_of must be 1", "best_of")
    if body.get("n") is not None and not (_is_int(body["n"]) and body["n"] == 1):  # not true
        raise OpenAIError("n must be 1; send one request per sample", "n")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise OpenAIError("parallel_tool_calls must be true or false", "parallel_tool_calls")


def _message_text(i: int, m: Any, call_ids: set[str] | None = None) -> dict[str, Any]:
    """One message as chat templates take it. ``call_ids`` collects the ids of earlier
    assistant tool calls, which a ``tool`` message must answer."""
    call_ids = set() if call_ids is None else call_ids
    if not isinstance(m, dict):
        raise OpenAIError(f"messages[{i}] must be an object with role and content", "messages")
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise OpenAIError(f"messages[{i}].role={role!r}; expected system, developer, user, "
                          "assistant or tool", "messages")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise OpenAIError(f"messages[{i}].content: only text parts are supported",
                                  "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if m.get("tool_calls") is not None and role != "assistant":
        raise OpenAIError(f"messages[{i}]: only assistant messages carry tool_calls",
                          "messages")
    if role == "assistant" and m.get("tool_calls") is not None:
        try:
            calls = template_tool_calls(i, m["tool_calls"])
        except ToolSpecError as e:
            raise OpenAIError(str(e), e.param) from None
        if content is not None and not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content must be a string, text parts or null, "
                              f"got {type(content).__name__}", "messages")
        call_ids.update(c["id"] for c in calls if c["id"])
        return {"role": "assistant", "content": content or "", "tool_calls": calls}
    if not isinstance(content, str):
        raise OpenAIError(f"messages[{i}].content must be a string or text parts, got "
                          f"{type(content).__name__}", "messages")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or call_id not in call_ids:
            raise OpenAIError(f"messages[{i}].tool_call_id={call_id!r} does not answer a tool "
                              "call of an earlier assistant message", "messages")
        return {"role": "tool", "content": content, "tool_call_id": call_id}
    return {"role": "system" if role == "developer" else role, "content": content}


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked messages as chat templates take them (an OpenAIError naming the first bad
    one)."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", "messages")
    call_ids: set[str] = set()
    return [_message_text(i, m, call_ids) for i, m in enumerate(messages)]


def render_chat(tokenizer: Any, msgs: list[dict[str, Any]], tools: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> str:
    """The chat template's text for checked messages (``tools`` passed when there are any)."""
    if tokenizer is None:
        raise OpenAIError(NO_TOKENIZER)
    kwargs = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception names the problem
        raise OpenAIError(f"messages cannot be rendered by the chat template: {e}",
                          "messages") from None


def chat_prompt_ids(tokenizer: Any, messages: Any, tools: list[dict[str, Any]] | None = None,
                    prefix: str = "") -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered by the tokenizer's chat template
    with the generation prompt, then ``prefix`` (an OpenAIError for malformed messages)."""
    msgs = template_messages(messages) if tokenizer is not None else messages
    return tokenizer.encode(render_chat(tokenizer, msgs, tools or []) + prefix)


def completion_prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer; send the prompt as token ids", "prompt")
        if not prompt:
            raise OpenAIError("prompt is empty", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    raise OpenAIError("prompt must be a non-empty string, one string in a list, or a list of "
                      "token ids (batches are not supported: one request per prompt)", "prompt")


def parse_request(body: dict[str, Any], *, chat: bool, tokenizer: Any, vocab_size: int,
                  max_seq_len: int, stop_token_ids: tuple[int, ...] = (),
                  default_max_tokens: int = 16, renderer: Callable[..., list[int]] | None = None,
                  cap_max_tokens: bool = False, chat_without_template: bool = True
                  ) -> ParsedRequest:
    """Validates an OpenAI body and turns it into token ids and sampling params.
    ``renderer(messages, tool_spec, prefix)`` makes a chat request's prompt ids (default:
    the chat template's text, tokenized). ``cap_max_tokens``: a ``max_tokens`` past the
    context is lowered to what is left (the agent proxy, whose context is the trajectory's
    token budget), instead of a 400. ``chat_without_template=False``: a chat request to a
    model whose tokenizer has no chat template (not a chat model) is a 400 saying so,
    instead of the plain ``role: content`` fallback a base model answers with nothing."""
    _refuse_unsupported(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("model is required (any name; this server serves one model)", "model")
    spec, prefix = ToolSpec([], "none"), ""
    if chat:
        try:
            spec = check_tools(body.get("tools"), body.get("tool_choice"))
        except ToolSpecError as e:
            raise OpenAIError(str(e), e.param) from None
        if tokenizer is None:
            raise OpenAIError(NO_TOKENIZER)
        if not chat_without_template and getattr(tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model's tokenizer has no chat template: it is not a chat "
                              "model, and /v1/chat/completions cannot format messages for it; "
                              "send text to /v1/completions", "messages",
                              code="not_a_chat_model")
        msgs = template_messages(body.get("messages"))
        prefix = forced_prefix(tool_call_format(getattr(tokenizer, "chat_template", None)), spec)
        if renderer is None:
            ids = tokenizer.encode(render_chat(tokenizer, msgs, spec.tools) + prefix)
        else:
            ids = renderer(msgs, spec, prefix)
    else:
        if "prompt" not in body:
            raise OpenAIError("prompt is required", "prompt")
        ids = completion_prompt_ids(tokenizer, body["prompt"])
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                          "prompt")
    room = max_seq_len - len(ids)
    if room < 1:
        raise OpenAIError(f"the prompt has {len(ids)} tokens but the context length is "
                          f"{max_seq_len}; shorten it", "messages" if chat else "prompt",
                          code="context_length_exceeded")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = room if chat else min(default_max_tokens, room)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise OpenAIError(f"{key} must be a positive integer, got {max_tokens!r}", key)
    if max_tokens > room and cap_max_tokens:
        max_tokens = room  # the agent proxy: capped to what is left of the trajectory
    if max_tokens > room:
        raise OpenAIError(f"{key}={max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                          f"context length {max_seq_len}", key, code="context_length_exceeded")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise OpenAIError(f"seed must be a non-negative integer, got {seed!r}", "seed")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise OpenAIError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise OpenAIError("stream_options supports only include_usage", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise OpenAIError(f"stream_options.include_usage must be true or false, got "
                          f"{options['include_usage']!r}", "stream_options")
    logprobs = body.get("logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise OpenAIError(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
        if body.get("top_logprobs") not in (None, 0):
            raise OpenAIError("top_logprobs is not supported (only 0: the sampled token's "
                              "logprob)", "top_logprobs")
        want_logprobs = bool(logprobs)
    else:
        if logprobs is not None and (not _is_int(logprobs) or logprobs != 0):
            raise OpenAIError("logprobs must be 0 (the sampled token's logprob; alternatives "
                              f"are not returned), got {logprobs!r}", "logprobs")
        want_logprobs = logprobs is not None
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise OpenAIError(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
    try:  # SamplingParams also checks what the device can hold (tiny temperatures, seeds)
        params = SamplingParams(
            max_new_tokens=max_tokens, ignore_eos=bool(ignore_eos),
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            stop_token_ids=() if ignore_eos else tuple(stop_token_ids), seed=seed,
            skip_special_tokens=True)
    except ValueError as e:
        raise OpenAIError(str(e)) from None
    return ParsedRequest(ids, params, bool(stream), bool(options.get("include_usage")),
                         want_logprobs, model, spec, prefix)


async def client_gone(request: Request) -> None:
    """Returns once the client of ``request`` (whose body has been read) has disconnected.
    The ASGI server answers a pending ``receive()`` with ``http.disconnect`` when the
    connection closes, so a waiting request costs nothing until then (polling
    ``is_disconnected`` made every waiting request wake the event loop twice a second:
    with a thousand queued requests that work grew with the square of the burst)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return
        await asyncio.sleep(DISCONNECT_RETRY_S)


async def first_or_disconnect(request: Request, waiting: set[asyncio.Future]) -> bool:
    """Waits until every future in ``waiting`` is done (False) or the client has
    disconnected first (True)."""
    watch = asyncio.ensure_future(client_gone(request))
    try:
        pending = set(waiting)
        while pending:
            done, _ = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                return True
            pending -= done
        return False
    finally:
        watch.cancel()


# ---------------------------------------------------------------------- replies
class _TextDecoder:
    """Incremental detokenisation: text deltas that never split a multi-byte character."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.sent = decode, ""
        self.ids: list[int] = []

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def _finish(gen_reason: str) -> str:
    return "length" if gen_reason == "length" else "stop"


def _wire_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as stream deltas: one entry per call, with its index."""
    return [{"index": k, **c} for k, c in enumerate(calls)]


def _token_strs(decode_one: Callable[[int], str], ids: list[int]) -> list[str]:
    return [decode_one(t) for t in ids]


def _chat_logprobs(strs: list[str], lps: list[float]) -> dict[str, Any]:
    return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                        for s, lp in zip(strs, lps, strict=True)]}


def _completion_logprobs(strs: list[str], lps: list[float], offset0: int) -> dict[str, Any]:
    offsets, pos = [], offset0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strs, "token_logprobs": list(lps), "top_logprobs": None,
            "text_offset": offsets}


def _usage(n_prompt: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out}


def _visible(ids: list[int], lps: list[float], stops: set[int]) -> tuple[list[int], list[float]]:
    """The output without its final stop token (OpenAI does not show the stop)."""
    if ids and ids[-1] in stops:
        return ids[:-1], lps[:-1]
    return ids, lps


class OpenAIRoutes:
    """The two routes over one backend. ``prefix`` may hold a ``{key}`` path parameter,
    which is passed to the backend (the agentic workflow's per-trajectory id)."""

    def __init__(self, backend: Backend, *, tokenizer: Any, vocab_size: int, max_seq_len: int,
                 model_name: str, stop_token_ids: tuple[int, ...] = (),
                 params_hook: Callable[[SamplingParams], SamplingParams] | None = None,
                 renderer: ChatRenderer | None = None, on_reply: ReplyHook | None = None,
                 on_error: ErrorHook | None = None, cap_max_tokens: bool = False,
                 chat_without_template: bool = True):
        self.backend, self.tokenizer = backend, tokenizer
        self.vocab_size, self.max_seq_len, self.model_name = vocab_size, max_seq_len, model_name
        self.stop_token_ids = tuple(stop_token_ids)
        self.params_hook = params_hook
        self.renderer, self.on_reply, self.on_error = renderer, on_reply, on_error
        self.cap_max_tokens = cap_max_tokens  # else max_tokens past the context is a 400
        self.chat_without_template = chat_without_template  # else chat needs a template
        self.tool_format = tool_call_format(getattr(tokenizer, "chat_template", None))

    def register(self, app: FastAPI, prefix: str = "") -> None:
        async def completions(request: Request):
            return await self.handle(request, chat=False)

        async def chat_completions(request: Request):
            return await self.handle(request, chat=True)

        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                "created": 0, "owned_by": "areal-jax"}]}

        app.add_api_route(f"{prefix}/v1/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/chat/completions", chat_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer else ""

    def _decode_one(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer else str(t)

    async def handle(self, request: Request, *, chat: bool):
        key = str(request.path_params.get("key", ""))
        renderer: Callable[..., list[int]] | None = None
        if self.renderer is not None:
            render = self.renderer

            def keyed(msgs: list[dict[str, Any]], spec: ToolSpec, prefix: str) -> list[int]:
                return render(key, msgs, spec, prefix)
            renderer = keyed
        try:
            body = parse_body(await request.body())
            parsed = parse_request(body, chat=chat, tokenizer=self.tokenizer,
                                   vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                                   stop_token_ids=self.stop_token_ids, renderer=renderer,
                                   cap_max_tokens=self.cap_max_tokens,
                                   chat_without_template=self.chat_without_template)
            if self.params_hook:
                parsed = dataclasses.replace(parsed, params=self.params_hook(parsed.params))
            if parsed.stream:
                return StreamingResponse(self._stream(key, parsed, chat),
                                         media_type="text/event-stream")
            gen = await self._until_disconnected(
                request, self.backend(key, parsed.input_ids, parsed.params, None))
        except OpenAIError as e:
            if self.on_error is not None:
                self.on_error(key, e)
            return e.response()
        if gen is None:  # the client went away; its generation was aborted
            return Response(status_code=499)
        return JSONResponse(self._reply(key, parsed, gen, chat))

    @staticmethod
    async def _until_disconnected(request: Request, work: Awaitable[Generated]
                                  ) -> Generated | None:
        """``work``'s result, or None once the client has disconnected: then ``work`` is
        cancelled, which aborts its generation (nobody would read the tokens)."""
        task = asyncio.ensure_future(work)
        try:
            if await first_or_disconnect(request, {task}):
                return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OpenAIError):
                    await task

    def _message(self, key: str, parsed: ParsedRequest, gen: Generated, text: str
                 ) -> tuple[dict[str, Any], str]:
        """The assistant message of a chat reply and its finish reason: the text, or its
        tool calls when tools are on and every call in it parses."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = _finish(gen.finish_reason)
        if parsed.tools.parse:
            calls = parse_tool_calls(text, self.tool_format, parsed.tools.names)
            if calls is not None:
                message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
                finish = "tool_calls"
        if self.on_reply is not None:
            self.on_reply(key, gen, message)
        return message, finish

    def _reply(self, key: str, parsed: ParsedRequest, gen: Generated, chat: bool
               ) -> dict[str, Any]:
        ids, lps = _visible(gen.output_ids, gen.logprobs, set(self.stop_token_ids))
        text = self._decode(ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(gen.finish_reason)}
        logprobs = None
        if parsed.logprobs:
            strs = _token_strs(self._decode_one, ids)
            logprobs = _chat_logprobs(strs, lps) if chat else _completion_logprobs(strs, lps, 0)
        if chat:
            message, choice["finish_reason"] = self._message(key, parsed, gen,
                                                             parsed.prefix + text)
            choice.update(message=message, logprobs=logprobs)
        else:
            choice.update(text=text, logprobs=logprobs)
        reply = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                 "object": "chat.completion" if chat else "text_completion",
                 "created": int(time.time()), "model": parsed.model, "choices": [choice],
                 "usage": _usage(len(parsed.input_ids), len(gen.output_ids)),
                 "weight_version": gen.weight_version}
        if "weight_versions" in gen.extra:  # one per piece, when a weight update interrupted
            reply["weight_versions"] = gen.extra["weight_versions"]
        return reply

    async def _stream(self, key: str, parsed: ParsedRequest, chat: bool) -> AsyncIterator[str]:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        stops = set(self.stop_token_ids)
        queue: asyncio.Queue[tuple[list[int], list[float]]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_tokens(ids: list[int], lps: list[float]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (list(ids), list(lps)))

        def chunk(delta_text: str | None, strs: list[str], lps: list[float], offset: int,
                  finish: str | None, first: bool = False,
                  tool_calls: list[dict[str, Any]] | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            logprobs = None
            if parsed.logprobs and strs:
                logprobs = (_chat_logprobs(strs, lps) if chat
                            else _completion_logprobs(strs, lps, offset))
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if delta_text:
                    delta["content"] = delta_text
                if tool_calls:
                    delta["tool_calls"] = _wire_calls(tool_calls)
                choice.update(delta=delta, logprobs=logprobs)
            else:
                choice.update(text=delta_text or "", logprobs=logprobs)
            out: dict[str, Any] = {
                "id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": parsed.model, "choices": [choice]}
            if parsed.include_usage:
                out["usage"] = None
            return f"data: {json.dumps(out)}\n\n"

        task = asyncio.create_task(self.backend(key, parsed.input_ids, parsed.params, on_tokens))
        decoder, offset = _TextDecoder(self._decode), 0
        held = ToolCallStream(self.tool_format, parsed.tools.names, parsed.prefix) \
            if chat and parsed.tools.parse else None
        if chat:
            yield chunk(None, [], [], 0, None, first=True)
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if queue.empty():
                        break
                    continue
                ids, lps = getter.result()
                ids_vis = [t for t in ids if t not in stops]
                lps_vis = [lp for t, lp in zip(ids, lps, strict=True) if t not in stops]
                delta = decoder.add(ids_vis)
                if held is not None:
                    delta = held.feed(delta)
                if delta or ids_vis:
                    yield chunk(delta, _token_strs(self._decode_one, ids_vis), lps_vis, offset,
                                None)
                    offset += len(delta)
            try:
                gen = task.result()
            except OpenAIError as e:
                if self.on_error is not None:
                    self.on_error(key, e)
                err = {"error": {"message": e.message, "type": e.kind, "param": e.param,
                                 "code": e.code}}
                yield f"data: {json.dumps(err)}\n\n"
                return
            tail = decoder.add([], final=True)
            finish, calls = _finish(gen.finish_reason), None
            if chat:
                message, finish = self._message(key, parsed, gen, parsed.prefix + decoder.sent)
                calls = message.get("tool_calls")
            if held is not None:
                held.feed(tail)
                tail = held.finish()[0] if calls else held.text[held.sent:]
            yield chunk(tail, [], [], offset, finish, tool_calls=calls)
            if parsed.include_usage:
                usage: dict[str, Any] = {"id": rid,
                         "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": parsed.model, "choices": [],
                         "usage": _usage(len(parsed.input_ids), len(gen.output_ids))}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not task.done():
                task.cancel()


# ---------------------------------------------------------------------- engine backend
def engine_backend(engine: Any) -> Backend:
    """Generates on the embedded engine; a request aborted by a weight update is resumed
    under the new weights with its partial output appended (as the rollout client does)."""

    async def generate(key: str, input_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None) -> Generated:
        loop = asyncio.get_running_loop()
        out_ids: list[int] = []
        out_lps: list[float] = []
        versions: list[str] = []
        while True:
            finished: asyncio.Future[EngineRequest] = loop.create_future()

            def on_finish(req: EngineRequest, fut: asyncio.Future = finished) -> None:
                def settle() -> None:
                    if not fut.done():
                        fut.set_result(req)
                loop.call_soon_threadsafe(settle)

            remaining = params.max_new_tokens - len(out_ids)
            # Each resumed piece samples with the next seed, wrapping within the seed range.
            seed = None if params.seed is None else (params.seed + len(versions)) % (SEED_MAX + 1)
            sub = SamplingParams(**{**params.__dict__, "max_new_tokens": remaining, "seed": seed})
            progressed = asyncio.Event()  # streaming: set when the engine appended tokens

            def on_progress(req: EngineRequest, event: asyncio.Event = progressed) -> None:
                loop.call_soon_threadsafe(event.set)

            try:
                req = engine.submit(input_ids + out_ids, sub, on_finish=on_finish,
                                    on_tokens=on_progress if on_tokens else None)
            except ValueError as e:  # EngineRequestError: a bad prompt
                raise OpenAIError(str(e), "prompt") from None
            except RuntimeError as e:  # the engine stopped
                raise OpenAIError(str(e), status=503, kind="server_error") from None
            sent = 0
            try:
                if on_tokens is None:
                    await asyncio.wait({finished})
                # Streaming: woken by the engine, never polling.
                while on_tokens is not None and not finished.done():
                    waiter = asyncio.ensure_future(progressed.wait())
                    either: set[asyncio.Future[Any]] = {finished, waiter}
                    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    progressed.clear()
                    n = len(req.output_ids)
                    if n > sent:
                        on_tokens(req.output_ids[sent:n], req.output_logprobs[sent:n])
                        sent = n
            except asyncio.CancelledError:
                await asyncio.to_thread(engine.abort, req.rid)
                raise
            if req.error is not None and req.error_status < 500:
                raise OpenAIError(req.error, status=req.error_status)
            if req.error is not None:
                raise OpenAIError(f"generation failed: {req.error}", status=500,
                                  kind="server_error")
            if on_tokens is not None and len(req.output_ids) > sent:
                on_tokens(req.output_ids[sent:], req.output_logprobs[sent:])
            out_ids += req.output_ids
            out_lps += req.output_logprobs
            versions.append(req.weight_version)
            reason = req.finish_reason or {}
            kind = reason.get("type")
            if kind == "abort" and "/abort_request" in str(reason.get("message", "")):
                raise OpenAIError("the request was aborted by /abort_request", status=409,
                                  kind="server_error", code="aborted")
            if kind != "abort":  # pause / weight-update aborts resume under the new weights
                return Generated(out_ids, out_lps, "length" if kind == "length" else "stop",
                                 req.weight_version, {"weight_versions": versions})
            if len(out_ids) >= params.max_new_tokens:
                return Generated(out_ids, out_lps, "length", req.weight_version,
                                 {"weight_versions": versions})

    return generate


def register_engine_routes(app: FastAPI, engine: Any) -> None:
    """Adds the OpenAI routes for the embedded engine to its server app. Text goes through
    the model directory's tokenizer and chat template (the engine's, loaded by
    areal_jax.tokenizer); without one, text requests get a clear 400, and so do chat
    requests to a model without a chat template (a base model: use /v1/completions)."""
    tok = engine.tokenizer
    stops = tuple(dict.fromkeys([*(getattr(tok, "stop_token_ids", None) or []),
                                 *engine.eos_token_ids]))
    OpenAIRoutes(engine_backend(engine), tokenizer=tok, vocab_size=engine.vocab_size,
                 max_seq_len=engine.max_seq_len, model_name=str(engine.model_path),
                 stop_token_ids=stops, chat_without_template=False).register(app)
