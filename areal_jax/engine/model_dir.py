"""Reading what a served checkpoint directory holds besides weights: EOS ids."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from areal_jax import storage
from model_defs import ModelConfig

logger = logging.getLogger(__name__)


class ModelPathError(ValueError):
    """A model directory that cannot be served (missing, no config.json, incompatible)."""


def check_model_dir(path: str | Path, *, required_file: str = "config.json",
                    field: str = "model_path") -> Path:
    """Returns the path if it looks like an HF checkpoint directory, else raises ModelPathError.

    ``required_file``: the file the directory must hold (a PEFT adapter directory:
    ``adapter_config.json``); ``field``: the request field named in errors.

    A ``gs://`` directory is downloaded first into this process's slot of the local
    weight cache (``<cache>/weights/pid<PID>``, see ``areal_jax.storage``); the slot holds
    one model at a time, as loads are sequential and a loaded model lives in memory.
    """
    try:
        if storage.is_url(path):
            return check_model_dir(_download_to_slot(str(path)), required_file=required_file,
                                   field=field)
    except storage.StorageError as e:
        raise ModelPathError(f"{field} {e}") from None
    path = Path(path)
    if not path.exists():
        raise ModelPathError(f"{field} {path} does not exist")
    if not path.is_dir():
        raise ModelPathError(f"{field} {path} is not a directory")
    if not (path / required_file).is_file():
        raise ModelPathError(f"{field} {path} has no {required_file}")
    _check_json_object(path / required_file, field)
    return path


def _check_json_object(file: Path, field: str) -> None:
    """Raises ModelPathError naming ``file`` unless it holds a JSON object."""
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise ModelPathError(f"{field}: {file} is not readable JSON ({e}); it must hold a "
                             "JSON object of settings, as Hugging Face writes it") from None
    if not isinstance(data, dict):
        raise ModelPathError(f"{field}: {file} holds a JSON {type(data).__name__}, not an "
                             "object; it must hold a JSON object of settings ({...}), as "
                             "Hugging Face writes it")


def _download_to_slot(url: str) -> Path:
    root = storage.cache_root() / "weights"
    slot = root / f"pid{os.getpid()}"
    if root.is_dir():  # slots of processes that are gone
        for other in root.glob("pid*"):
            pid = other.name[3:]
            if other != slot and pid.isdigit() and not storage.pid_alive(int(pid)):
                shutil.rmtree(other, ignore_errors=True)
    shutil.rmtree(slot, ignore_errors=True)
    if not storage.isdir(url):
        raise storage.StorageError(f"{url} does not exist or is not a directory")
    storage.download(url, slot / storage.name_of(url))
    return slot / storage.name_of(url)


def read_eos_token_ids(path: Path, cfg: ModelConfig) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may hold an int or list)."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int) and not isinstance(v, bool))

    add(cfg.eos_token_id)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        try:
            add(json.loads(gen_cfg.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            logger.warning("ignoring unreadable %s", gen_cfg)
    return tuple(sorted(set(ids)))
