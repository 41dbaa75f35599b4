"""A run's inputs, resolved and checked before long work starts: the model and tokenizer
directories (``builtin:``, local or ``gs://``), datasets, the run directory, external
servers, the prompts' lengths against the packed row. Also used by scripts/eval.py and
scripts/launch_ray.py. Every problem is a :class:`TrainerError` with one clear line; an
error from below (a path that does not exist, a malformed file) becomes one through
:func:`input_error`, which names the config key it came from.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_jax import hub, storage
from areal_jax.config import TrainConfig, to_dict

if TYPE_CHECKING:
    from areal_jax.checkpoint.meta import CheckpointMeta

ASSETS_DIR = Path(__file__).resolve().parent / "data" / "assets"


class TrainerError(RuntimeError):
    """A problem with the run's inputs or environment, reported before long work starts."""


class RunStopped(TrainerError):
    """The run started but cannot go on (no progress, a non-finite loss, a failed weight
    update); the message says why. scripts/train.py exits with status 3."""


@contextlib.contextmanager
def input_error(key: str, *errors: type[Exception], what: str | None = None,
                hint: str = "") -> Iterator[None]:
    """Turns one of ``errors`` raised in the block into a :class:`TrainerError` naming the
    run's input ``key``, one line: ``"WHAT: cause; HINT"``.

    WHAT is the key unless given (give the value too where it helps, ``reward.fn
    'pkg:fn'``; "" where the cause names the input itself). The cause is the error's own
    text (an OSError's reason and file, without the errno); a cause that already starts
    with the key (storage, hub and mesh errors do) stands alone, so neither the key nor a
    path is named twice. Usage::

        with input_error("data.eval", ValueError, FileNotFoundError):
            rows = read_records(eval_path)
    """
    try:
        yield
    except errors as e:
        what = key if what is None else what
        if isinstance(e, OSError) and e.strerror:  # its file, unless WHAT names it already
            named = not e.filename or str(e.filename) in what
            cause = e.strerror if named else f"{e.strerror}: {e.filename}"
        else:
            cause = str(e).strip() or type(e).__name__
        message = cause if not what or cause.startswith(key) else f"{what}: {cause}"
        raise TrainerError(f"{message}; {hint}" if hint else message) from None


def check_optional_packages(cfg: TrainConfig) -> None:
    """The packages of the optional extras (pyproject.toml) that this config needs, checked
    before anything starts: the OpenAI client for an agent whose module imports it (the
    shipped examples do), gcsfs for ``gs://`` paths. TrainerError naming the key and the
    extra to install."""
    needs: list[tuple[str, str, str]] = []  # (package, extra, the key that needs it)
    agent = cfg.rollout.agent if cfg.rollout.workflow == "agent" else None
    if agent and _module_imports(agent.split(":", 1)[0], "openai"):
        needs.append(("openai", "agent", f"rollout.agent {agent}"))
    for key, value in _flat_items(to_dict(cfg)):
        if isinstance(value, str) and value.startswith("gs://"):
            needs.append(("gcsfs", "gcs", f"{key} {value}"))
            break
    if cfg.logging.wandb is not None and cfg.logging.wandb.mode != "disabled":
        needs.append(("wandb", "wandb", "logging.wandb"))
    for package, extra, why in needs:
        try:
            importlib.import_module(package)
        except ImportError:
            raise TrainerError(f"{why} needs the {package} package, which is not installed: "
                               f"pip install -e '.[{extra}]' (or pip install "
                               f"'areal-jax[{extra}]')") from None


def _module_imports(module: str, package: str) -> bool:
    """Whether ``module``'s source imports ``package`` (at any depth: agents import their
    client inside the function), read without running the module."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False  # an unknown module: the agent's own check names it
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    try:
        source = Path(spec.origin).read_text(encoding="utf-8")
    except OSError:
        return False
    return re.search(rf"^\s*(import|from)\s+{re.escape(package)}\b", source, re.M) is not None


def _flat_items(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for k, v in data.items():
        items += _flat_items(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
    return items


def resolve_model_path(spec: str, cache_dir: str | None = None, key: str = "model.path",
                       revision: str | None = None) -> Path:
    """``builtin:NAME`` -> the packaged asset; a ``gs://`` HF directory -> its local cached
    copy (downloaded once, see ``storage.local_copy``); a Hugging Face hub id (``org/name``,
    not a local path) -> its snapshot in the hub cache at ``revision`` (see ``hub.py``);
    otherwise a local HF directory."""
    if spec.startswith("builtin:"):
        path = ASSETS_DIR / spec.split(":", 1)[1]
        if not path.is_dir():
            known = (sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir())
                     if ASSETS_DIR.is_dir() else [])
            raise TrainerError(f"{key} {spec!r}: no packaged model of that name; known: {known}")
        return path
    with input_error(key, storage.StorageError, hub.HubError):
        if storage.is_url(spec):
            url = storage.check_location(spec, key, must_exist=True)
            if not storage.isfile(storage.join(url, "config.json")):
                raise TrainerError(
                    f"{key} {spec} has no config.json (expected an HF model directory)")
            path = storage.local_copy(url, cache_dir, kind="models")
        else:
            path = Path(storage.normalize(hub.local_model_dir(spec, revision, key)))
    if not path.is_dir():
        raise TrainerError(f"{key} {spec} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise TrainerError(f"{key} {spec} has no config.json (expected an HF model directory)")
    return path


def saved_run_config(ckpt_dir: str, meta: CheckpointMeta | None) -> dict[str, Any] | None:
    """The config of the run that wrote a checkpoint: from its meta (``run_config``), else
    the ``config.yaml`` next to the checkpoint directory (the run dir); None if neither."""
    if meta is not None and meta.run_config is not None:
        return meta.run_config
    import yaml

    path = storage.join(storage.parent_of(ckpt_dir), "config.yaml")
    try:
        if storage.exists(path):
            data = yaml.safe_load(storage.read_text(path))
            return data if isinstance(data, dict) else None
    except (OSError, yaml.YAMLError, storage.StorageError):
        return None
    return None


def resolve_dataset(spec: str, run_dir: Path, key: str) -> str:
    """``builtin:SPLIT`` (train, eval, longtail_train, longtail_eval; for SFT train_sft,
    longtail_train_sft) -> a JSONL written into
    the (local) run dir; ``hf://REPO?...`` -> the hub dataset (``datasets.load_dataset``)
    written as Parquet into the run dir; else the path (local or ``gs://``), checked to exist."""
    if spec.startswith("builtin:"):
        from areal_jax.data import builtin_task

        split = spec.split(":", 1)[1]
        splits = (*builtin_task.SPLITS, *builtin_task.SFT_SPLITS)
        if split not in splits:
            raise TrainerError(f"{key} {spec!r}: the builtin task has splits {', '.join(splits)}")
        return str(builtin_task.write_split(run_dir / "data" / f"builtin_{split}.jsonl", split))
    with input_error(key, hub.HubError, storage.StorageError):
        if hub.is_dataset_uri(spec):
            return str(hub.write_dataset(spec, run_dir / "data", key))
        return storage.check_location(spec, key, must_exist=True)


def check_writable(path: Path, key: str) -> None:
    """Creates ``path`` if needed and proves a file can be written there."""
    with input_error(key, OSError, what=f"{key} {path} is not writable"):
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()


def load_eval_items(cfg: TrainConfig, eval_path: str | None) -> list[dict[str, Any]]:
    """The eval prompts of ``data.eval`` (at most ``data.max_eval_prompts``), each row with
    ``prompt`` and ``answer`` from the run's keys; a row without them names ``data.eval``
    and the key's option."""
    from areal_jax.data.prompts import prompt_problem, read_records

    if not eval_path:
        return []
    data = cfg.data
    with input_error("data.eval", ValueError, FileNotFoundError):
        rows = read_records(eval_path)
    items = []
    for i, row in enumerate(rows[: data.max_eval_prompts or None]):
        for key, option in ((data.prompt_key, "data.prompt_key"),
                            (data.answer_key, "data.answer_key")):
            if key not in row:
                raise TrainerError(f"data.eval {eval_path}: row {i} has no {key!r} key "
                                   f"({option}); keys: {sorted(row)}")
        problem = prompt_problem(row[data.prompt_key])
        if problem is not None:
            raise TrainerError(f"data.eval {eval_path}: row {i}: {data.prompt_key!r} "
                               f"(data.prompt_key) {problem}")
        items.append({**row, "prompt": row[data.prompt_key], "answer": row[data.answer_key]})
    if not items:
        raise TrainerError(f"data.eval {eval_path} holds no prompts")
    return items


def check_prompt_lengths(cfg: TrainConfig, tokenizer: Any, train_path: str,
                         max_rows: int = 512) -> None:
    """The longest of the first ``max_rows`` prompts + ``rollout.max_new_tokens`` must fit a
    packed row (``train.seq_len``) and, with embedded servers, their context. (A longer
    prompt further on stops the run when it is packed, naming train.seq_len.)"""
    from areal_jax.data.prompts import prompt_problem, read_records

    rows = read_records(train_path)[:max_rows]
    key, ro = cfg.data.prompt_key, cfg.rollout
    longest, where = 0, None
    for i, row in enumerate(rows):
        if key not in row:
            raise TrainerError(f"data.train {train_path}: row {i} has no {key!r} key "
                               f"(data.prompt_key); keys: {sorted(row)}")
        problem = prompt_problem(row[key])
        if problem is not None:
            raise TrainerError(f"data.train {train_path}: row {i}: {key!r} (data.prompt_key) "
                               f"{problem}")
        n = len(tokenizer.encode_prompt(row[key]))
        if n > longest:
            longest, where = n, i
    if where is None:
        raise TrainerError(f"data.train {train_path} holds no prompts")
    if not ro.servers and longest >= ro.max_seq_len:
        raise TrainerError(f"rollout.max_seq_len ({ro.max_seq_len}) is too small: prompt {where} "
                           f"of data.train has {longest} tokens; raise rollout.max_seq_len above "
                           f"{longest + ro.max_new_tokens}")
    need = longest + ro.max_new_tokens
    if not ro.servers:  # the embedded engine stops a sequence at its context length
        need = min(need, ro.max_seq_len)
    if cfg.train.seq_len < need:
        raise TrainerError(f"train.seq_len ({cfg.train.seq_len}) is shorter than the longest "
                           f"prompt ({longest} tokens, row {where} of data.train) + "
                           f"rollout.max_new_tokens ({ro.max_new_tokens}); raise train.seq_len "
                           f"to at least {need}")


def check_servers_reachable(urls: list[str], api_key: str | None, timeout: float = 5.0) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for url in urls:
        with input_error("rollout.servers", httpx.HTTPError,
                         what=f"rollout server {url} is unreachable",
                         hint="start it first (see docs/servers.md, 'Driving SGLang')"):
            r = httpx.get(url.rstrip("/") + "/health", timeout=timeout, headers=headers)
        if r.status_code != 200:
            raise TrainerError(f"rollout server {url} answered /health with HTTP {r.status_code}")


def enable_compilation_cache(path: str | None) -> str | None:
    """``compile_cache.enable_compilation_cache``, with a TrainerError for a bad path."""
    from areal_jax.compile_cache import enable_compilation_cache as enable

    with input_error("compilation_cache_dir", OSError,
                     what=f"compilation_cache_dir {path} cannot be created",
                     hint="set compilation_cache_dir to a writable directory or null"):
        return enable(path)


CHECKPOINT_DIR_NAMES = ("checkpoints", "checkpoints-critic", "weights")  # written directly


def prepare_run_dir(cfg: TrainConfig, resume: bool | None) -> tuple[str, str, bool]:
    """Checks run_dir (and checkpoint.dir), local or gs://, up front; returns
    (run_dir, ckpt_dir, has_ckpt) as local paths or URLs."""
    with input_error("run_dir", storage.StorageError):
        run_dir = storage.check_location(cfg.run_dir, "run_dir", write=True)
    with input_error("checkpoint.dir", storage.StorageError):
        ckpt_dir = (storage.check_location(cfg.checkpoint.dir, "checkpoint.dir", write=True)
                    if cfg.checkpoint.dir else storage.join(run_dir, "checkpoints"))
    if not storage.is_url(run_dir):
        check_writable(Path(run_dir), "run_dir")
    if not storage.is_url(ckpt_dir):
        check_writable(Path(ckpt_dir), "checkpoint.dir" if cfg.checkpoint.dir else "run_dir")
    from areal_jax.checkpoint import TrainCheckpointer

    has_ckpt = False
    if storage.is_url(ckpt_dir) or os.path.exists(ckpt_dir):
        with contextlib.suppress(Exception):
            probe = TrainCheckpointer(ckpt_dir, read_only=True)
            has_ckpt = probe.latest_step() is not None
            probe.close()
    if resume is True and not has_ckpt:
        raise TrainerError(f"--resume given but {ckpt_dir} holds no checkpoint")
    if resume is False and has_ckpt:
        raise TrainerError(f"run_dir {run_dir} already holds checkpoints in {ckpt_dir}; "
                           "use --resume (or drop --no-resume) to continue it, "
                           "or pick a new run_dir")
    return run_dir, ckpt_dir, has_ckpt


