"""Typed loading of nested frozen dataclasses from YAML plus ``key=value`` overrides.

Kept apart from ``config.py`` (the schema) so the schema file reads as a list of
settings. Rules:

* every key must be a field of its dataclass, else ``ConfigError`` names the dotted
  key and the allowed keys;
* values are checked against the field's type hint (bool, int, float, str, list,
  dict, Optional, Literal, nested dataclass) and the error names key, value and the
  allowed values;
* each dataclass's own ``__post_init__`` validation runs, and its ``ValueError`` is
  re-raised with the section name in front.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import yaml

from model_defs import ConfigError  # one class: a bad run-config key or model config.json

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a config section


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        alternatives = [a for a in args if a is not type(None)]
        if len(alternatives) == 1:  # Optional[X]: X's own error names the bad key
            return _coerce(value, alternatives[0], key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not a valid {_type_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {list(allowed)}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "2e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if value != value:  # NaN passes every comparison check downstream
            raise ConfigError(f"{key}: expected a number, got nan")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) dict, validating keys and types."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise ConfigError(f"unknown config key {dotted!r}; allowed keys here: {sorted(fields)}")
        if value is None and fields[key].default_factory is list and \
                type(None) not in get_args(hints[key]):
            value = []  # null for a list that defaults to empty (rollout.servers): none
        kwargs[key] = _coerce(value, hints[key], dotted)
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f" in section {prefix!r}" if prefix else ""
        raise ConfigError(f"missing required config key(s){where}: {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e)
        if prefix and not msg.startswith(prefix):
            msg = f"{prefix}: {msg}"
        raise ConfigError(msg) from None


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (YAML-safe)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. train.batch_size=8)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides to a nested dict (in place, returned)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    from areal_jax import storage  # local paths and gs:// URLs alike

    try:
        if not storage.isfile(path):
            raise ConfigError(f"config file {path} does not exist")
        text = storage.read_text(path)
    except (storage.StorageError, OSError) as e:
        raise ConfigError(f"config file {path}: {e}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load ``cls`` from a YAML file (optional) plus overrides."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(data, list(overrides or []))
    return from_dict(cls, data)
