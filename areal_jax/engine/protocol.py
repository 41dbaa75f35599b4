"""The SGLang-protocol subset: validating request bodies and building replies.

Field names are SGLang's (``/generate`` takes ``input_ids``, ``sampling_params``,
``return_logprob``, ``rid``; replies carry ``text``, ``output_ids`` and ``meta_info``).
Every validation failure raises ``ProtocolError`` with a message that names the field
and the offending value; the server turns it into HTTP 400 ``{"error": message}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from areal_jax.engine.request import EngineRequest
from areal_jax.sampling_params import (
    INT32_MAX,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SEED_MAX,
    SamplingParams,
)
from model_defs import JsonDict


class ProtocolError(ValueError):
    """A malformed request body (HTTP 400)."""


# Top-level /generate fields we accept. Others SGLang knows are rejected with a reason.
_GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "rid", "stream",
                    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                    "lora_path"}
_GENERATE_UNSUPPORTED = {
    "text": "text prompts are not supported by this server; "
            "tokenize on the client and send input_ids",
    "input_embeds": "input_embeds is not supported; send input_ids",
    "image_data": "image_data is not supported (text-only models)",
    "audio_data": "audio_data is not supported (text-only models)",
}
# Sampling params we accept, and SGLang ones accepted only at their no-op default.
_SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                    "ignore_eos", "skip_special_tokens", "sampling_seed",
                    "spaces_between_special_tokens", "no_stop_trim"}
_SAMPLING_NOOP_DEFAULTS: JsonDict = {
    "n": 1, "min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop": None, "json_schema": None,
    "regex": None, "ebnf": None, "logit_bias": None, "custom_params": None,
}
DEFAULT_MAX_NEW_TOKENS = 128
MAX_RID_CHARS = 256  # rids are echoed in every reply and log line
MAX_WEIGHT_VERSION_CHARS = 256  # weight_version is stored and echoed in every reply
MAX_LORA_NAME_CHARS = 256  # lora_name is echoed in replies and errors
SUPPORTED_PAUSE_MODES = ("abort",)


@dataclass(frozen=True)
class GenerateCall:
    input_ids: list[int]
    params: SamplingParams
    rid: str | None
    return_logprob: bool
    return_text_in_logprobs: bool
    lora_name: str | None = None  # SGLang's lora_path: the name of a loaded adapter
    # SGLang's logprob_start_len: with return_logprob, input_token_logprobs from this
    # position (-1: none). score_only: max_new_tokens 0, the input is scored, not continued.
    logprob_start_len: int = -1
    score_only: bool = False


def parse_json_body(raw: bytes, route: str, *, allow_empty: bool = False) -> JsonDict:
    """Parses a JSON object body; an empty body is {} when ``allow_empty``."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise ProtocolError(f"{route}: request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"{route}: request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ProtocolError(f"{route}: request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ProtocolError(
            f"{route}: request body must be a JSON object, got {type(body).__name__}")
    where = lone_surrogate_path(raw, body)
    if where is not None:
        raise ProtocolError(f"{route}: {where} {NOT_TEXT}")
    return body


NOT_TEXT = ("holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
            "not text; send valid Unicode")


def lone_surrogate_path(raw: bytes, body: Any) -> str | None:
    """Where in the parsed ``body`` a string or key holds a lone UTF-16 surrogate (valid
    JSON, but not text: it cannot be encoded, tokenized or echoed back), else None."""
    if b"\\u" not in raw and b"\xed" not in raw:  # only escapes or raw surrogate bytes
        return None
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the body"
        elif isinstance(value, dict):
            for key, item in value.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return f"a key of {path or 'the body'}"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float)) and not isinstance(v, bool)


def _get_bool(d: JsonDict, key: str, default: bool, where: str) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(f"{where}{key} must be true or false, got {v!r}")
    return v


def _get_str(d: JsonDict, key: str, where: str, *, required: bool = False) -> str | None:
    v = d.get(key)
    if v is None:
        if required:
            raise ProtocolError(f"{where}missing required field {key!r}")
        return None
    if not isinstance(v, str):
        raise ProtocolError(f"{where}{key} must be a string, got {type(v).__name__} {v!r}")
    return v


def _check_length(value: str | None, key: str, limit: int, where: str) -> None:
    if value is not None and len(value) > limit:
        raise ProtocolError(f"{where}{key} is {len(value)} characters long; the limit is {limit}")


def _reject_unknown(d: JsonDict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ProtocolError(
            f"{where}unknown field {unknown[0]!r}; supported fields: {', '.join(sorted(allowed))}")


def parse_sampling_params(sp: Any, vocab_size: int) -> SamplingParams:
    where = "sampling_params."
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ProtocolError(f"sampling_params must be a JSON object, got {type(sp).__name__}")
    for key, default in _SAMPLING_NOOP_DEFAULTS.items():
        if key in sp and sp[key] not in (default, None) and not (key == "stop" and sp[key] == []):
            hint = "; use stop_token_ids" if key == "stop" else ""
            raise ProtocolError(
                f"{where}{key}={sp[key]!r} is not supported by this server "
                f"(only {default!r}){hint}")
    _reject_unknown(sp, _SAMPLING_FIELDS | set(_SAMPLING_NOOP_DEFAULTS), where)

    max_new = sp.get("max_new_tokens")
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    if not _is_int(max_new) or not 0 < max_new <= INT32_MAX:
        raise ProtocolError(
            f"{where}max_new_tokens must be an integer in [1, {INT32_MAX}], got {max_new!r} "
            "(0 only scores the input: with return_logprob true and logprob_start_len >= 0)")

    temperature = sp.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_number(temperature) or not (
            temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ProtocolError(f"{where}temperature must be 0 (greedy) or a number in "
                            f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got {temperature!r}")

    top_p = sp.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not (0.0 < top_p <= 1.0):
        raise ProtocolError(f"{where}top_p must be a number in (0, 1], got {top_p!r}")

    top_k = sp.get("top_k", -1)
    if top_k is None:
        top_k = -1
    if not _is_int(top_k) or not (top_k == -1 or 1 <= top_k <= INT32_MAX):
        raise ProtocolError(f"{where}top_k must be -1 (disabled) or an integer in "
                            f"[1, {INT32_MAX}], got {top_k!r}")

    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise ProtocolError(f"{where}stop_token_ids must be a list of integers, got {stop_ids!r}")
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(
            f"{where}stop_token_ids contains {bad[0]}, outside the vocabulary [0, {vocab_size})")

    seed = sp.get("sampling_seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= SEED_MAX):
        raise ProtocolError(
            f"{where}sampling_seed must be an integer in [0, 2**64 - 1], got {seed!r}")
    for key in ("spaces_between_special_tokens", "no_stop_trim"):
        _get_bool(sp, key, False, where)

    return SamplingParams(
        max_new_tokens=max_new,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_get_bool(sp, "ignore_eos", False, where),
        skip_special_tokens=_get_bool(sp, "skip_special_tokens", True, where),
        seed=seed,
    )


def parse_generate(body: JsonDict, vocab_size: int, max_seq_len: int) -> GenerateCall:
    """Validates a /generate body against the served model (vocabulary, context length)."""
    for key, reason in _GENERATE_UNSUPPORTED.items():
        if body.get(key) is not None:
            raise ProtocolError(reason)
    _reject_unknown(body, _GENERATE_FIELDS, "")
    if "input_ids" not in body or body["input_ids"] is None:
        raise ProtocolError("missing required field 'input_ids' (a list of token ids)")
    ids = body["input_ids"]
    if not isinstance(ids, list):
        raise ProtocolError(f"input_ids must be a list of integers, got {type(ids).__name__}")
    if ids and isinstance(ids[0], list):
        raise ProtocolError("batched input_ids (a list of lists) go through "
                            "parse_generate_batch")
    if not ids:
        raise ProtocolError("input_ids is empty; the prompt needs at least one token")
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise ProtocolError(f"input_ids[{i}] must be an integer, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ProtocolError(
                f"input_ids[{i}]={t} is outside the vocabulary [0, {vocab_size})")
    start = body.get("logprob_start_len")
    if start is not None and (not _is_int(start) or not -1 <= start <= INT32_MAX):
        raise ProtocolError(f"logprob_start_len must be an integer in [-1, {INT32_MAX}], "
                            f"got {start!r}")
    return_logprob = _get_bool(body, "return_logprob", False, "")
    sp = body.get("sampling_params")
    # SGLang's scoring request: max_new_tokens 0 with input logprobs asked for.
    score_only = (isinstance(sp, dict) and _is_int(sp.get("max_new_tokens"))
                  and sp["max_new_tokens"] == 0 and return_logprob
                  and start is not None and start >= 0)
    if score_only:
        assert isinstance(sp, dict)
        sp = {**sp, "max_new_tokens": 1}  # the other fields are checked as usual
    if len(ids) > max_seq_len or (len(ids) == max_seq_len and not score_only):
        raise ProtocolError(
            f"prompt has {len(ids)} tokens but the context length is {max_seq_len}; "
            f"prompts may have at most {max_seq_len - 1} tokens ({max_seq_len} to score "
            "with max_new_tokens 0)")
    if body.get("stream"):
        raise ProtocolError("stream=true is not supported by this server; omit it")
    top_logprobs = body.get("top_logprobs_num")
    if top_logprobs not in (None, 0):
        raise ProtocolError(f"top_logprobs_num={top_logprobs!r} is not supported (only 0)")
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise ProtocolError(f"rid must be a non-empty string, got {type(rid).__name__}")
    _check_length(rid, "rid", MAX_RID_CHARS, "")
    lora_name = body.get("lora_path")
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise ProtocolError("lora_path must be the name of a loaded LoRA adapter (a non-empty "
                            f"string), got {lora_name!r}")
    _check_length(lora_name, "lora_path", MAX_LORA_NAME_CHARS, "")
    return GenerateCall(
        input_ids=ids,
        params=parse_sampling_params(sp, vocab_size),
        rid=rid,
        return_logprob=return_logprob,
        return_text_in_logprobs=_get_bool(body, "return_text_in_logprobs", False, ""),
        lora_name=lora_name,
        logprob_start_len=-1 if start is None else int(start),
        score_only=score_only,
    )


MAX_BATCH_ITEMS = 4096


def is_batch(body: Any) -> bool:
    """A /generate body in SGLang's batch form: ``input_ids`` is a list of lists."""
    ids = body.get("input_ids") if isinstance(body, dict) else None
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def parse_generate_batch(body: JsonDict, vocab_size: int, max_seq_len: int
                         ) -> list[GenerateCall]:
    """SGLang's batch form of /generate: ``input_ids`` a list of prompts, ``sampling_params``
    one dict for all or a list with one per prompt, ``rid`` None or a list of distinct
    strings; the other fields apply to every prompt. The reply is a list of single
    replies, in order. Each prompt is checked as a single request would be; errors name
    the prompt's index."""
    ids = body["input_ids"]
    n = len(ids)
    if n > MAX_BATCH_ITEMS:
        raise ProtocolError(f"a batch holds at most {MAX_BATCH_ITEMS} prompts, got {n}")
    per_item: dict[str, list[Any]] = {}
    for key in ("sampling_params", "rid"):
        value = body.get(key)
        if isinstance(value, list):
            if len(value) != n:
                raise ProtocolError(f"{key} is a list of {len(value)} but input_ids holds {n} "
                                    "prompts; send one per prompt (or one dict for all)")
            per_item[key] = value
        elif key == "rid" and value is not None:
            raise ProtocolError("rid must be a list of strings (one per prompt) for batched "
                                f"input_ids, got {type(value).__name__}")
    if "rid" in per_item and len(set(map(str, per_item["rid"]))) != n:
        raise ProtocolError("rid must hold distinct strings, one per prompt")
    calls = []
    for i in range(n):
        item = {**body, "input_ids": ids[i]}
        for key, values in per_item.items():
            item[key] = values[i]
        if not isinstance(ids[i], list):
            raise ProtocolError(f"input_ids[{i}] must be a list of integers (batched "
                                f"input_ids), got {type(ids[i]).__name__}")
        try:
            calls.append(parse_generate(item, vocab_size, max_seq_len))
        except ProtocolError as e:
            raise ProtocolError(f"prompt {i} of the batch: {e}") from None
    return calls


def generate_reply(req: EngineRequest, call: GenerateCall, decode_text: Any) -> JsonDict:
    """SGLang's /generate reply for a finished request."""
    p = req.params
    meta: JsonDict = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": req.prompt_len,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": req.weight_version,
        "e2e_latency": (req.finish_time or 0.0) - req.arrival_time,
    }
    if call.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, decode_text([tok], False) if call.return_text_in_logprobs else None]
            for lp, tok in zip(req.output_logprobs, req.output_ids, strict=True)
        ]
    return {
        "text": decode_text(req.output_ids, p.skip_special_tokens),
        "output_ids": list(req.output_ids),
        "meta_info": meta,
    }


def parse_pause(body: JsonDict) -> str:
    mode = body.get("mode", "abort")
    if mode not in SUPPORTED_PAUSE_MODES:
        raise ProtocolError(
            f"/pause_generation: mode={mode!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_PAUSE_MODES)}")
    _reject_unknown(body, {"mode"}, "/pause_generation: ")
    return mode


# SGLang's UpdateWeightFromDiskReqInput fields; the ones we do not act on are accepted.
_UPDATE_FROM_DISK_FIELDS = {"model_path", "weight_version", "abort_all_requests", "flush_cache",
                            "load_format", "is_async", "torch_empty_cache", "keep_pause",
                            "recapture_cuda_graph", "token_step"}


def parse_update_weights_from_disk(body: JsonDict) -> tuple[str, str | None, bool]:
    where = "/update_weights_from_disk: "
    _reject_unknown(body, _UPDATE_FROM_DISK_FIELDS, where)
    model_path = _get_str(body, "model_path", where, required=True)
    if not model_path:
        raise ProtocolError(f"{where}model_path is empty")
    version = _get_str(body, "weight_version", where)
    _check_length(version, "weight_version", MAX_WEIGHT_VERSION_CHARS, where)
    abort_all = _get_bool(body, "abort_all_requests", False, where)
    _get_bool(body, "flush_cache", True, where)
    load_format = body.get("load_format")
    if load_format not in (None, "auto", "safetensors"):
        raise ProtocolError(
            f"{where}load_format={load_format!r} is not supported (safetensors only)")
    return model_path, version, abort_all


def parse_update_weight_version(body: JsonDict) -> tuple[str, bool]:
    where = "/update_weight_version: "
    _reject_unknown(body, {"new_version", "abort_all_requests"}, where)
    version = _get_str(body, "new_version", where, required=True)
    assert version is not None
    _check_length(version, "new_version", MAX_WEIGHT_VERSION_CHARS, where)
    return version, _get_bool(body, "abort_all_requests", False, where)


def _lora_name(body: JsonDict, where: str) -> str:
    name = _get_str(body, "lora_name", where, required=True)
    if not name:
        raise ProtocolError(f"{where}lora_name is empty")
    _check_length(name, "lora_name", MAX_LORA_NAME_CHARS, where)
    return name


def parse_load_lora_adapter(body: JsonDict) -> tuple[str, str]:
    """(lora_name, lora_path) of SGLang's LoadLoRAAdapterReqInput (``pinned`` accepted)."""
    where = "/load_lora_adapter: "
    _reject_unknown(body, {"lora_name", "lora_path", "pinned"}, where)
    name = _lora_name(body, where)
    path = _get_str(body, "lora_path", where, required=True)
    if not path:
        raise ProtocolError(f"{where}lora_path is empty")
    _get_bool(body, "pinned", False, where)
    return name, path


def parse_unload_lora_adapter(body: JsonDict) -> str:
    where = "/unload_lora_adapter: "
    _reject_unknown(body, {"lora_name"}, where)
    return _lora_name(body, where)


def parse_abort(body: JsonDict) -> tuple[str | None, bool]:
    where = "/abort_request: "
    _reject_unknown(body, {"rid", "abort_all", "abort_message"}, where)
    rid = _get_str(body, "rid", where) or None
    _check_length(rid, "rid", MAX_RID_CHARS, where)
    abort_all = _get_bool(body, "abort_all", False, where)
    if rid is None and not abort_all:
        raise ProtocolError(f"{where}give a rid to abort one request, or abort_all=true")
    return rid, abort_all
