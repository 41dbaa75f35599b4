"""Tool calls for the OpenAI chat route: checking ``tools``/``tool_choice`` and the
messages that carry calls, and parsing the calls a model writes into OpenAI ``tool_calls``.

Two textual forms are understood, picked from the model's chat template
(:func:`tool_call_format`):

- ``hermes`` (Qwen2.5, Qwen3 and most open models): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first call
  is the message's content.
- ``llama3_json`` (Llama 3.1+): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several
  separated by ``;``.

A reply whose calls do not all parse (bad JSON, a missing name, a function that is not in
``tools``, arguments nested deeper than ``MAX_ARGUMENT_DEPTH`` or holding a lone surrogate)
is not a tool call: it stays text, with the normal finish reason. The same limits refuse
such a call in a request's messages (a 400), so every call the server writes can be sent
back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


# Deeper arguments are refused: the chat template's ``tojson`` and Python's JSON recurse
# once per level, and near the interpreter's recursion limit they fail unpredictably.
MAX_ARGUMENT_DEPTH = 64


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests containers more than ``limit`` levels deep;
    iterative, so any depth is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _arguments_problem(args: Any) -> str | None:
    """Why parsed call ``args`` cannot be a call's arguments, else None: nested more than
    ``MAX_ARGUMENT_DEPTH`` levels, or a string or key holding a lone UTF-16 surrogate
    (valid JSON as an escape, but not text: it cannot be encoded, tokenized or sent back).
    The server emits only calls that pass, and refuses calls in a request that do not, so
    every call it writes can be sent back on the next turn."""
    if _depth_over(args, MAX_ARGUMENT_DEPTH):
        return f"is nested too deeply (at most {MAX_ARGUMENT_DEPTH} levels)"
    stack = [args]
    while stack:
        v = stack.pop()
        texts = [v] if isinstance(v, str) else list(v) if isinstance(v, dict) else []
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return "holds a lone UTF-16 surrogate (not text)"
        if isinstance(v, dict | list):
            stack.extend(v.values() if isinstance(v, dict) else v)
    return None


class ToolSpecError(ValueError):
    """Bad ``tools``/``tool_choice``/tool messages; ``param`` is the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """The checked tool part of a chat request."""

    tools: list[dict[str, Any]]  # as sent (OpenAI shape), passed to the chat template
    choice: str  # "auto" | "none" | "required" | "named"
    named: str | None = None  # the function name when choice == "named"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def parse(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def tool_call_format(chat_template: str | None) -> str:
    """``llama3_json`` for Llama-3-style templates, else ``hermes``."""
    t = chat_template or ""
    if HERMES_OPEN in t:
        return HERMES
    if PYTHON_TAG in t or "<|start_header_id|>" in t:
        return LLAMA3_JSON
    return HERMES


def check_tools(tools: Any, tool_choice: Any) -> ToolSpec:
    """Validates ``tools`` and ``tool_choice`` as OpenAI does (ToolSpecError naming the
    field)."""
    if tools is None or tools == []:
        tools = []
    elif not isinstance(tools, list):
        raise ToolSpecError("tools must be a list of {type: function, function: {...}}",
                            "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolSpecError(f"tools[{i}].type must be 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolSpecError(f"tools[{i}].function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ToolSpecError(f"tools[{i}].function.name must be 1-64 letters, digits, "
                                f"'_', '.' or '-', got {name!r}", "tools")
        if name in seen:
            raise ToolSpecError(f"tools[{i}].function.name {name!r} is defined twice", "tools")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str | None):
            raise ToolSpecError(f"tools[{i}].function.description must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolSpecError(f"tools[{i}].function.parameters must be a JSON Schema object",
                                "tools")
    if tool_choice is None:
        return ToolSpec(tools, "auto" if tools else "none")
    if tool_choice in ("auto", "none", "required"):
        if tool_choice != "none" and not tools:
            raise ToolSpecError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ToolSpec(tools, tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if not isinstance(name, str):
            raise ToolSpecError("tool_choice.function.name must be a string naming one of "
                                f"tools, got {type(name).__name__}", "tool_choice")
        if name not in seen:
            raise ToolSpecError(f"tool_choice names function {name!r}, which is not in tools",
                                "tool_choice")
        return ToolSpec(tools, "named", name)
    raise ToolSpecError("tool_choice must be 'auto', 'none', 'required' or "
                        "{type: function, function: {name}}", "tool_choice")


def template_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (OpenAI shape, arguments a JSON string) as chat
    templates expect them: arguments a dict (Qwen's and Llama's templates apply ``tojson``)."""
    if not isinstance(calls, list) or not calls:
        raise ToolSpecError(f"messages[{i}].tool_calls must be a non-empty list", "messages")
    out = []
    for k, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{k}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" or \
                not isinstance(call.get("function"), dict):
            raise ToolSpecError(f"{where} must be {{id, type: function, function: "
                                "{name, arguments}}}", "messages")
        fn = call["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolSpecError(f"{where}.function.name must be a non-empty string", "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ToolSpecError(f"{where}.function.arguments is not valid JSON: "
                                    f"{args[:200]!r}", "messages") from None
            except RecursionError:
                raise ToolSpecError(f"{where}.function.arguments is nested too deeply "
                                    f"(at most {MAX_ARGUMENT_DEPTH} levels)",
                                    "messages") from None
        problem = _arguments_problem(args)
        if problem is not None:
            raise ToolSpecError(f"{where}.function.arguments {problem}", "messages")
        if not isinstance(args, dict):
            raise ToolSpecError(f"{where}.function.arguments must be a JSON object",
                                "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ToolSpecError(f"{where}.id must be a string", "messages")
        out.append({"id": call_id, "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _named_call(obj: Any, names: set[str], args_key: str) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments" if args_key != "arguments" else "parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict) or _arguments_problem(args) is not None:
        return None  # what the next turn would refuse is not a call: it stays text
    return _call(obj["name"], args)


def parse_tool_calls(text: str, fmt: str, names: set[str]
                     ) -> tuple[str | None, list[dict[str, Any]]] | None:
    """``(content, tool_calls)`` when ``text`` holds calls that all parse, else None (the
    text stays the message's content). ``content`` is None when only calls were written."""
    if fmt == LLAMA3_JSON:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return None
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return None
            call = _named_call(obj, names, "parameters")
            if call is None:
                return None
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return (None, calls) if calls else None
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    blocks = _HERMES_RE.findall(text, start)
    rest = _HERMES_RE.sub("", text[start:]).strip()
    if not blocks or rest:  # an unclosed call, or text after the calls
        return None
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):
            return None
        call = _named_call(obj, names, "arguments")
        if call is None:
            return None
        calls.append(call)
    content = text[:start].strip()
    return (content or None, calls)


def forced_prefix(fmt: str, spec: ToolSpec) -> str:
    """The text the reply is started with so that a call is written: for ``required`` the
    call's opening, for a named function also its name. Empty for auto/none."""
    if spec.choice not in ("required", "named"):
        return ""
    if fmt == LLAMA3_JSON:
        return '{"name": ' + json.dumps(spec.named) + ', "parameters": ' \
            if spec.named else '{"name": '
    opening = HERMES_OPEN + "\n"
    return opening + '{"name": ' + json.dumps(spec.named) + ', "arguments": ' \
        if spec.named else opening


class ToolCallStream:
    """Holds streamed text back while it may be a tool call. ``feed`` returns the content
    that can be sent now; ``finish`` returns ``(content, calls)`` for the end of the reply
    (``calls`` None when the held text is not a call)."""

    def __init__(self, fmt: str, names: set[str], prefix: str = ""):
        self.fmt, self.names = fmt, names
        self.text = prefix  # everything generated (with the forced prefix)
        self.sent = 0  # characters already sent as content
        self.holding = bool(prefix)

    def _opening(self) -> str:
        return HERMES_OPEN if self.fmt == HERMES else "{"

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        pending = self.text[self.sent:]
        if self.fmt == LLAMA3_JSON:
            # A Llama call is the whole reply: hold while the reply may still start one.
            stripped = self.text.lstrip()
            if not stripped or stripped.startswith(("{", PYTHON_TAG)) or \
                    PYTHON_TAG.startswith(stripped):
                return ""
            self.sent = len(self.text)
            return pending
        start = self.text.find(HERMES_OPEN, self.sent)
        if start >= 0:
            self.holding = True
            out, self.sent = self.text[self.sent:start], start
            return out
        keep = 0  # hold a tail that may be the start of "<tool_call>"
        for k in range(min(len(HERMES_OPEN) - 1, len(pending)), 0, -1):
            if HERMES_OPEN.startswith(pending[-k:]):
                keep = k
                break
        out = pending[:len(pending) - keep]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        parsed = parse_tool_calls(self.text, self.fmt, self.names)
        if parsed is None:
            return self.text[self.sent:], None
        if self.fmt == LLAMA3_JSON:
            return "", parsed[1]
        head = self.text[:self.text.find(HERMES_OPEN)]  # the content before the first call
        return head[self.sent:], parsed[1]
