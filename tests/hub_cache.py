"""A Hugging Face cache laid out by the tests, as ``huggingface_hub`` and ``datasets`` lay it
out after a download, so that their real code resolves hub ids from it offline.

    snap = add_hub_model(hf_home, "areal-test/arith-sft", ASSET_DIR)       # a model repo
    add_hub_dataset(hf_home, "areal-test/gsm8k", "main", {"train": rows})  # a dataset repo
    env = offline_env(hf_home)       # HF_HOME, HF_HUB_OFFLINE=1, an unreachable HF_ENDPOINT

Both libraries read ``HF_HOME`` and ``HF_HUB_OFFLINE`` when first imported, so the code under
test runs in a subprocess with ``offline_env``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ASSET_DIR = REPO / "areal_jax" / "data" / "assets" / "arith_sft"  # config, safetensors, tokenizer
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _repo_dir(hf_home: Path, kind: str, repo_id: str) -> Path:
    return Path(hf_home) / "hub" / f"{kind}--{repo_id.replace('/', '--')}"


def add_hub_model(hf_home: Path, repo_id: str, src: Path = ASSET_DIR, commit: str = COMMIT,
                  ref: str | None = "main", extra: dict[str, bytes] | None = None) -> Path:
    """``hub/models--ORG--NAME``: each file of ``src`` (and ``extra``) a blob named by its
    sha256, linked from ``snapshots/COMMIT/``; ``refs/REF`` holds the commit. Returns the
    snapshot directory."""
    root = _repo_dir(hf_home, "models", repo_id)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    files = {f.name: f.read_bytes() for f in Path(src).iterdir() if f.is_file()}
    files.update(extra or {})
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snap


def add_hub_dataset(hf_home: Path, repo_id: str, config: str,
                    splits: dict[str, list[dict[str, Any]]], commit: str = COMMIT) -> Path:
    """A dataset repo as ``load_dataset(repo_id, config)`` leaves it after one online load:
    the repo's Parquet files in ``hub/datasets--ORG--NAME/snapshots/COMMIT/CONFIG/`` and the
    prepared Arrow cache ``datasets/ORG___SNAKE/CONFIG/0.0.0/COMMIT/`` (``SNAKE-SPLIT.arrow``
    + ``dataset_info.json``, SNAKE being NAME in datasets' snake_case), which is what
    ``datasets`` reads offline. The Arrow cache is
    written by datasets' own Parquet builder from those files. Returns the snapshot dir."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    root = _repo_dir(hf_home, "datasets", repo_id)
    data_dir = root / "snapshots" / commit / config
    data_dir.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    files = {}
    for split, rows in splits.items():
        files[split] = str(data_dir / f"{split}-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(rows), files[split])
    org, name = repo_id.split("/")
    # Online, datasets names the builder (repo_id, dataset_name=NAME) and its files hf://...;
    # offline the same layout comes from the local files, built under a folder of their own
    # and moved to where datasets keeps a hub dataset: ORG___SNAKE/ with SNAKE-SPLIT.arrow,
    # SNAKE being datasets' snake_case of NAME ("MATH-500" -> "math-500").
    from datasets.naming import camelcase_to_snakecase

    snake = camelcase_to_snakecase(name)
    cache = Path(hf_home) / "datasets"
    builder = Parquet(cache_dir=str(cache / "_build"), dataset_name=f"{org}___{name}",
                      config_name=config, config_id=config, hash=commit, data_files=files)
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    out = cache / f"{org}___{snake}" / built.relative_to(built.parents[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    built.rename(out)
    prefix = f"{builder.dataset_name}-"
    for f in out.glob(f"{prefix}*"):
        f.rename(out / f"{snake}-{f.name[len(prefix):]}")
    shutil.rmtree(cache / "_build", ignore_errors=True)
    shutil.rmtree(cache / "downloads", ignore_errors=True)
    return data_dir


def offline_env(hf_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that must find everything in ``hf_home``: offline, and
    an endpoint nothing listens on, should anything try the network anyway."""
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1",
               HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_DISABLE_TELEMETRY="1",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    for key in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN",
                "HF_DATASETS_OFFLINE", "XLA_FLAGS"):
        env.pop(key, None)
    env.update(extra)
    return env
