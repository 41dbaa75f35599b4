"""Hugging Face hub ids for models and ``hf://`` datasets: the one place that talks to the hub.

    local_model_dir("Qwen/Qwen2.5-1.5B-Instruct", revision=None)   # -> the cached snapshot dir
    dataset_rows("hf://openai/gsm8k?config=main&split=train")      # -> [{"question", "answer"}]

A model path that is not ``builtin:``, not a URL, not an existing local path and looks like
``org/name`` is a hub id: ``huggingface_hub.snapshot_download`` fetches only the files a
model needs (config, safetensors, tokenizer, generation config) into the hub cache, or finds
them there. A dataset ``hf://REPO?config=C&split=S[&revision=R]`` is read with
``datasets.load_dataset``. Both libraries honour ``HF_HOME``, ``HF_TOKEN``, ``HF_ENDPOINT``
and ``HF_HUB_OFFLINE`` themselves (read when they are first imported); offline, the model
comes from the hub cache and the dataset from the ``datasets`` cache.

Kept apart from ``storage.py``, which moves local and ``gs://`` files through fsspec: the
hub has its own cache, credentials and offline mode, owned by its libraries. Every problem
is a :class:`HubError` with one line naming the user's key, the id and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

DATASET_SCHEME = "hf://"
# What a model needs: weights, config, tokenizer (every format transformers writes), chat
# template and generation config. Not *.bin / *.pth / onnx / original checkpoints.
MODEL_PATTERNS = [
    "config.json", "*.safetensors", "model.safetensors.index.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
]
DATASET_QUERY_KEYS = ("config", "split", "revision")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")


class HubError(RuntimeError):
    """A hub id or ``hf://`` dataset that cannot be resolved; one line saying what to do."""


def looks_like_hub_id(spec: str) -> bool:
    """``org/name`` that is not an existing local path (a local directory always wins)."""
    return (bool(_HUB_ID.fullmatch(spec)) and ".." not in spec and not spec.endswith(".")
            and not os.path.exists(spec))


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def local_model_dir(spec: str, revision: str | None = None, key: str = "model.path") -> str:
    """``spec`` itself unless it is a hub id; then the local snapshot directory of that
    repo at ``revision`` (default ``main``), downloaded if needed (only the files in
    :data:`MODEL_PATTERNS`). Call once per process, before servers start."""
    if not looks_like_hub_id(spec):
        return spec
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision}" if revision else ""
    local = f"or point {key} at a local directory (there is no local directory {spec})"
    try:
        return snapshot_download(spec, revision=revision, allow_patterns=MODEL_PATTERNS)
    except GatedRepoError:
        raise HubError(f"{key} {spec} is a gated repo: accept its terms on its hub page and set "
                       f"HF_TOKEN to a token of that account, {local}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{key} {spec} was not found on the hub: check the id, set HF_TOKEN for a "
                       f"private repo (HF_ENDPOINT={_endpoint()}), {local}") from None
    except RevisionNotFoundError:
        raise HubError(f"{key} {spec}: revision {revision!r} does not exist; fix model.revision "
                       "(a branch, tag or commit of the repo)") from None
    except LocalEntryNotFoundError as e:
        if _offline():
            rev = f" --revision {revision}" if revision else ""
            raise HubError(f"{key} {spec}{at} is not in the Hugging Face cache "
                           f"(HF_HOME={_hf_home()}) and HF_HUB_OFFLINE=1: run "
                           f"`hf download {spec}{rev}` with network access, "
                           f"{local}") from None
        raise HubError(f"{key} {spec}{at}: the hub ({_endpoint()}) cannot be reached and the "
                       f"repo is not in the cache (HF_HOME={_hf_home()}): "
                       f"{_one_line(e)}; check the network or HF_ENDPOINT, {local}") from None
    except HfHubHTTPError as e:
        raise HubError(f"{key} {spec}{at}: the hub answered {_one_line(e)}") from None
    except OSError as e:  # disk full, cache not writable
        raise HubError(f"{key} {spec}{at}: cannot write the Hugging Face cache "
                       f"(HF_HOME={_hf_home()}): {e}; set HF_HOME to a writable "
                       "directory") from None


def _hf_home() -> str:
    from huggingface_hub import constants

    return constants.HF_HOME


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


# ----------------------------------------------------------------------------- datasets
def is_dataset_uri(spec: str) -> bool:
    return spec.startswith(DATASET_SCHEME)


def parse_dataset_uri(spec: str, key: str = "data.train") -> dict[str, Any]:
    """``hf://openai/gsm8k?config=main&split=train`` -> the ``datasets.load_dataset``
    arguments ``{"path": "openai/gsm8k", "name": "main", "split": "train", "revision": None}``.
    ``split`` is required; ``config`` and ``revision`` are optional."""
    parts = urlsplit(spec)
    repo = (parts.netloc + parts.path).strip("/")
    example = "hf://openai/gsm8k?config=main&split=train"
    if parts.scheme != "hf" or not _HUB_ID.fullmatch(repo) or ".." in repo:
        raise HubError(f"{key} {spec} is not a hub dataset of the form {example}")
    query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
    args: dict[str, Any] = {"path": repo, "name": None, "split": None, "revision": None}
    for name, value in query:
        if name not in DATASET_QUERY_KEYS:
            raise HubError(f"{key} {spec}: unknown parameter {name!r}; known: "
                           f"{', '.join(DATASET_QUERY_KEYS)} (e.g. {example})")
        if not value:
            raise HubError(f"{key} {spec}: parameter {name!r} is empty")
        args["name" if name == "config" else name] = value
    if args["split"] is None:
        raise HubError(f"{key} {spec}: name the split, e.g. {repo}?split=train "
                       "(add config=NAME for a dataset with several configs)")
    return args


def load_hf_dataset(spec: str, key: str = "data.train") -> Any:
    """The ``datasets.Dataset`` that ``spec`` (``hf://...``) names, through
    ``datasets.load_dataset`` (offline: from the ``datasets`` cache)."""
    args = parse_dataset_uri(spec, key)
    try:
        import datasets
    except ImportError:
        raise HubError(f"{key} {spec}: the `datasets` package is not installed; "
                       "pip install datasets") from None
    from datasets.exceptions import DatasetNotFoundError

    again = (f"python -c \"import datasets; datasets.load_dataset('{args['path']}'"
             + (f", '{args['name']}'" if args["name"] else "") + ")\"")
    try:
        return datasets.load_dataset(args["path"], args["name"], split=args["split"],
                                     revision=args["revision"])
    except DatasetNotFoundError as e:
        raise HubError(f"{key} {spec}: {_one_line(e)} (set HF_TOKEN for a private or gated "
                       "dataset)") from None
    except ConnectionError:
        if _offline():
            raise HubError(f"{key} {spec} is not in the datasets cache "
                           f"(HF_DATASETS_CACHE={datasets.config.HF_DATASETS_CACHE}) and "
                           f"HF_HUB_OFFLINE=1: run `{again}` with network access, or point "
                           f"{key} at a JSONL or Parquet file") from None
        raise HubError(f"{key} {spec}: the hub ({_endpoint()}) cannot be reached and the "
                       "dataset is not cached; check the network or HF_ENDPOINT") from None
    except ValueError as e:  # unknown config or split
        raise HubError(f"{key} {spec}: {_one_line(e)}") from None
    except OSError as e:
        raise HubError(f"{key} {spec}: {_one_line(e)}") from None


def dataset_rows(spec: str, key: str = "data.train") -> list[dict[str, Any]]:
    """Every row of the ``hf://`` dataset as a dict."""
    return load_hf_dataset(spec, key).to_list()


def write_dataset(spec: str, dest_dir: str | os.PathLike, key: str = "data.train") -> Path:
    """Writes the ``hf://`` dataset to a Parquet file in ``dest_dir`` (the run's data, read
    like any other Parquet file from then on) and returns its path."""
    args = parse_dataset_uri(spec, key)
    ds = load_hf_dataset(spec, key)
    name = "__".join(str(v).replace("/", "__") for v in
                     (args["path"], args["name"], args["split"], args["revision"]) if v)
    dest = Path(dest_dir) / f"hf_{name}.parquet"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    ds.to_parquet(str(tmp))
    os.replace(tmp, dest)
    return dest
