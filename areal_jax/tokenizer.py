"""Tokenizers from HF checkpoint folders, with their chat template, without transformers.

    tok = load_tokenizer("path/to/hf_dir")      # tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode_prompt("What is 2+3?")       # chat template applied when the folder has one
    tok.decode(ids); tok.eos_token_id; tok.pad_token_id; tok.stop_token_ids

The chat template is read from ``chat_template.jinja`` or the ``chat_template`` key of
``tokenizer_config.json`` and rendered in a sandboxed jinja2 environment set up like
transformers' (trim_blocks, lstrip_blocks, ``raise_exception``, ``tojson``). A folder
without a template gets a plain fallback: a string prompt is used as it is; a message list
becomes ``"role: content\\n"`` lines followed by ``"assistant: "``.

Message content is text, never control: a special token's string (``<|im_end|>``,
``<|im_start|>``, ...: the tokenizer's added tokens marked special) inside a message's
content is encoded as the plain characters it is made of, so a user message or a tool
result cannot forge a turn boundary. Only the template's own text yields control tokens.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):  # noqa: ANN001 - jinja2 API
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):  # noqa: ANN001 - jinja2 API
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compiles an HF chat template in a sandboxed environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# Brackets around a special token's string that came from message content: ``encode`` gives
# its plain characters' ids. A per-process nonce: content cannot hold the brackets itself.
_PLAIN_OPEN, _PLAIN_CLOSE = f"\ue000{uuid.uuid4().hex}\ue001", f"\ue001{uuid.uuid4().hex}\ue000"
_PLAIN_RE = re.compile(f"{re.escape(_PLAIN_OPEN)}(.*?){re.escape(_PLAIN_CLOSE)}", re.DOTALL)


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of its folder."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_ids: list[int] | None = None,
                 source: str = "<memory>") -> None:
        self.tokenizer = tokenizer
        self.config = dict(config or {})
        self.source = source
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        self.special_tokens = {
            name: _token_content(self.config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.eos_token_id = self._id_of("eos_token")
        self.pad_token_id = self._id_of("pad_token")
        self.bos_token_id = self._id_of("bos_token")
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        stops += [i for i in (extra_eos_ids or []) if i not in stops]
        self.stop_token_ids: list[int] = stops
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id if self.eos_token_id is not None else 0
        control = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values()
                          if t.special and t.content}, key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, control))) if control else None
        self._plain_tokenizer: Tokenizer | None = None
        self._plain_lock = threading.Lock()

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.source}: {name} {token!r} from tokenizer_config.json is not "
                             "in the vocabulary of tokenizer.json")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if _PLAIN_OPEN not in text:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        ids: list[int] = []
        pos = 0
        for m in _PLAIN_RE.finditer(text):  # content's special strings, as plain text
            ids += self.tokenizer.encode(text[pos:m.start()],
                                         add_special_tokens=add_special_tokens and not ids).ids
            ids += self._plain().encode(m.group(1), add_special_tokens=False).ids
            pos = m.end()
        return ids + self.tokenizer.encode(text[pos:], add_special_tokens=False).ids

    def _plain(self) -> Tokenizer:
        """A copy of the tokenizer that encodes special tokens' strings as plain text."""
        with self._plain_lock:
            if self._plain_tokenizer is None:
                plain = Tokenizer.from_str(self.tokenizer.to_str())
                plain.encode_special_tokens = True
                self._plain_tokenizer = plain
            return self._plain_tokenizer

    def _content_as_text(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with every special token's string inside a string ``content``
        bracketed, so that ``encode`` gives its plain characters (a copy where any is)."""
        pattern = self._control_re
        if pattern is None:
            return messages
        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str) and pattern.search(content):
                m = {**m, "content": pattern.sub(
                    lambda s: f"{_PLAIN_OPEN}{s.group(0)}{_PLAIN_CLOSE}", content)}
            out.append(m)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Renders a message list to text, as transformers'
        ``apply_chat_template(tokenize=False)``; special token strings inside a message's
        content come out bracketed, for ``encode`` to keep as plain text (the module doc)."""
        messages = self._content_as_text(messages)
        if self._template is None:
            lines = [f"{m['role']}: {m['content']}\n" for m in messages]
            return "".join(lines) + ("assistant: " if add_generation_prompt else "")
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **specials, **kwargs)

    def encode_prompt(self, prompt: str | list[dict[str, Any]], *,
                      system: str | None = None) -> list[int]:
        """Token ids for a prompt: a string (one user message) or a list of chat messages.

        With a chat template the string becomes ``[{"role": "user", "content": prompt}]``; without
        one a string is encoded as it is.
        """
        if isinstance(prompt, str):
            if self._template is None and system is None:
                return self.encode(prompt)
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = list(prompt)
        else:
            raise TypeError(f"prompt must be a string or a list of chat messages, "
                            f"got {type(prompt).__name__}")
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}; expected a JSON object "
                         "of settings ({...}), as Hugging Face writes it")
    return value


def _eos_ids_from_model_config(folder: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            value = _read_json(path).get("eos_token_id")
            for v in (value if isinstance(value, list) else [value]):
                if isinstance(v, int) and v not in ids:
                    ids.append(v)
    return ids


def load_tokenizer(path: str | Path) -> ChatTokenizer:
    """Loads ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) from a
    folder.

    The model's ``generation_config.json``/``config.json`` ``eos_token_id`` entries are added to
    ``stop_token_ids``.
    """
    folder = Path(path)
    if folder.is_file() and folder.name == "tokenizer.json":
        folder = folder.parent
    tok_file = folder / "tokenizer.json"
    if not tok_file.exists():
        raise FileNotFoundError(f"tokenizer folder {folder} has no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - the tokenizers error names no file
        raise ValueError(f"{tok_file} could not be loaded by the tokenizers library: {e}") from e
    config_file = folder / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.exists() else {}
    template = None
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        template = jinja_file.read_text()
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in config["chat_template"]}
        template = named.get("default")
    return ChatTokenizer(tokenizer, config, template, _eos_ids_from_model_config(folder),
                         source=str(folder))
