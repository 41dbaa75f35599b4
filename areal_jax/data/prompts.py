"""Prompt datasets as grain pipelines: local or ``gs://`` JSONL/JSON/Parquet files, or a
Hugging Face hub dataset ``hf://ORG/NAME?config=C&split=S`` (read through ``datasets``).

    ds = load_prompt_dataset("train.jsonl", prompt_key="question", seed=1, num_epochs=2)
    it = iter(ds)           # a grain DatasetIterator
    item = next(it)         # {"prompt_id": "17", "prompt": ..., "answer": ..., "epoch": 0, ...}
    state = it.get_state()  # JSON-serialisable; it.set_state(state) resumes exactly there

Every item is the original row (as JSON types: Parquet timestamps and dates become ISO
8601 text, bytes UTF-8 text or ``base64:...``, decimals text, so an item can go into a
checkpoint; a column of any other type is refused at load, naming it) plus five normalised
keys:

- ``prompt_id``: stable id of the row: the ``id_key`` column; by default the
  ``prompt_id`` column when every row has one, else the row's index counted over all
  files in order;
- ``prompt``: the ``prompt_key`` column (a string, or a list of chat messages);
- ``answer``: the ``answer_key`` column (absent when ``answer_key`` is None);
- ``epoch``: which pass over this shard the item comes from;
- ``stream_index``: the item's position in this shard's stream (0, 1, 2, ...).

Order: rows are sharded first (``shard_index::shard_count``), then shuffled with
``seed`` and a new permutation every epoch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grain

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")


def _suffix(path: str) -> str:
    lower = path.lower()
    for suffix in SUPPORTED_SUFFIXES:
        if lower.endswith(suffix):
            return suffix
    raise ValueError(
        f"prompt dataset {path!r} has an unsupported extension; "
        f"supported: {', '.join(SUPPORTED_SUFFIXES)}"
    )


def read_records(path: str) -> list[dict[str, Any]]:
    """Reads every row of one JSONL, JSON (a list of objects) or Parquet file, or of a hub
    dataset ``hf://ORG/NAME?config=C&split=S`` (see ``areal_jax/hub.py``)."""
    from areal_jax import hub

    if hub.is_dataset_uri(path):
        try:
            return hub.dataset_rows(path, key="prompt dataset")
        except hub.HubError as e:
            raise ValueError(str(e)) from None
    suffix = _suffix(path)
    from areal_jax import storage  # local paths and gs:// alike

    try:
        exists = storage.isfile(path)
    except storage.StorageError as e:  # unsupported scheme, gs:// without gcsfs
        raise ValueError(f"prompt dataset {path!r}: {e}") from None
    if not exists:
        raise FileNotFoundError(f"prompt dataset {path!r} does not exist")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        with storage.open_file(path, "rb") as f:
            rows = pq.read_table(f).to_pylist()
    elif suffix == ".json":
        try:
            rows = json.loads(storage.read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"prompt dataset {path!r} is not valid JSON: {e}") from None
        if not isinstance(rows, list):
            raise ValueError(f"prompt dataset {path!r} must hold a JSON list of objects, "
                             f"got {type(rows).__name__}")
    else:
        rows = []
        for line_no, line in enumerate(storage.read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON line: {e}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} is a {type(row).__name__}, expected an object")
    return rows


_ROLES = ("system", "developer", "user", "assistant", "tool")


def prompt_problem(prompt: Any) -> str | None:
    """Why ``prompt`` (a row's prompt column) cannot be a prompt, else None: it must be a
    non-empty string or a non-empty list of chat messages, each {role, content} with a
    known role and string content."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is an empty string"
    if not isinstance(prompt, list):
        shown = repr(prompt)
        return (f"is {'null' if prompt is None else type(prompt).__name__} "
                f"({shown[:60]}{'...' if len(shown) > 60 else ''}); expected a string or a "
                "list of chat messages")
    if not prompt:
        return "is an empty list of chat messages"
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"message {j} is a {type(m).__name__}, expected {{role, content}}"
        if m.get("role") not in _ROLES:
            return (f"message {j} has role {m.get('role')!r}; expected one of "
                    f"{', '.join(_ROLES)}")
        if not isinstance(m.get("content"), str):
            return (f"message {j} ({m['role']}) has content of type "
                    f"{type(m.get('content')).__name__}; expected a string")
    return None


_JSON_SCALARS = (str, int, float, bool, type(None))


def _json_value(value: Any, where: str) -> Any:
    """``value`` as JSON types, so every item can go into a checkpoint (the executor's state
    holds the prompts in flight): dates and times (Parquet timestamps) as ISO 8601 text,
    bytes as UTF-8 text (``base64:...`` when they are not UTF-8), decimals as text, NumPy
    scalars and arrays as numbers and lists. Anything else is refused naming its column."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v, where) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v, where) for v in value]
    import datetime
    import decimal

    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            import base64

            return "base64:" + base64.b64encode(raw).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # NumPy scalars and arrays
        return _json_value(value.tolist(), where)
    raise ValueError(f"{where} holds a {type(value).__module__}.{type(value).__qualname__}, "
                     "which a checkpoint cannot hold; drop the column or convert it to text, "
                     "numbers or lists")


def _normalise_rows(rows_by_file: list[tuple[str, list[dict]]], prompt_key: str,
                    answer_key: str | None, id_key: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    seen_ids: set[str] = set()
    if id_key is None and all("prompt_id" in row for _, rows in rows_by_file for row in rows):
        id_key = "prompt_id"
    for path, rows in rows_by_file:
        for i, row in enumerate(rows):
            for key, role in ((prompt_key, "prompt_key"), (answer_key, "answer_key"),
                              (id_key, "id_key")):
                if key is not None and key not in row:
                    raise KeyError(
                        f"{path}: row {i} has no key {key!r} (the {role}); "
                        f"available keys: {sorted(row)}"
                    )
            problem = prompt_problem(row[prompt_key])
            if problem is not None:
                raise ValueError(f"{path}: row {i}: {prompt_key!r} (the prompt_key) {problem}")
            prompt_id = str(row[id_key]) if id_key is not None else str(len(out))
            if prompt_id in seen_ids:
                raise ValueError(f"{path}: row {i} repeats prompt id {prompt_id!r} "
                                 f"(id_key={id_key!r}); ids must be unique")
            seen_ids.add(prompt_id)
            item = {key: _json_value(value, f"{path}: row {i}: column {key!r}")
                    for key, value in row.items()}
            item["prompt_id"] = prompt_id
            item["prompt"] = row[prompt_key]
            if answer_key is not None:
                item["answer"] = row[answer_key]
            out.append(item)
    return out


def _default_shard() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def prompt_map_dataset(
    paths: str | Sequence[str],
    *,
    prompt_key: str = "question",
    answer_key: str | None = "answer",
    id_key: str | None = None,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.MapDataset:
    """The random-access form of :func:`load_prompt_dataset` (same arguments)."""
    path_list = [paths] if isinstance(paths, str) else list(paths)
    if not path_list:
        raise ValueError("load_prompt_dataset needs at least one path")
    if num_epochs is not None and num_epochs <= 0:
        raise ValueError(f"num_epochs must be a positive int or None (forever), got {num_epochs}")
    if (shard_index is None) != (shard_count is None):
        raise ValueError("give both shard_index and shard_count, or neither "
                         f"(got shard_index={shard_index}, shard_count={shard_count})")
    if shard_index is None:
        shard_index, shard_count = _default_shard()
    assert shard_count is not None
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} is outside [0, shard_count={shard_count})")

    rows = _normalise_rows([(p, read_records(p)) for p in path_list], prompt_key, answer_key,
                           id_key)
    if len(rows) < shard_count:
        raise ValueError(f"prompt dataset {path_list} has {len(rows)} rows, fewer than "
                         f"shard_count={shard_count}; every shard needs at least one")
    ds = grain.MapDataset.source(rows)[shard_index::shard_count]
    if shuffle:
        ds = ds.shuffle(seed=seed)  # grain reseeds every epoch: seed + epoch
    shard_len = len(ds)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)

    def tag(index: int, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "epoch": index // shard_len, "stream_index": index}

    return ds.map_with_index(tag)


def load_prompt_dataset(
    paths: str | Sequence[str],
    *,
    prompt_key: str = "question",
    answer_key: str | None = "answer",
    id_key: str | None = None,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.IterDataset:
    """A grain IterDataset of prompt items; ``iter()`` gives a checkpointable iterator.

    Args:
        paths: one or more ``.jsonl``/``.json``/``.parquet`` files, local or ``gs://``.
        prompt_key, answer_key: column names of the prompt and the reference answer.
        id_key: column holding a unique id; None uses ``prompt_id`` if present, else row index.
        seed, shuffle: the shuffle seed; each epoch gets its own permutation.
        num_epochs: passes over the data; None repeats forever.
        shard_index, shard_count: this process's shard; default
            ``jax.process_index()`` / ``jax.process_count()``.
    """
    ds = prompt_map_dataset(paths, prompt_key=prompt_key, answer_key=answer_key, id_key=id_key,
                            seed=seed, shuffle=shuffle, num_epochs=num_epochs,
                            shard_index=shard_index, shard_count=shard_count)
    # No read-ahead threads: the executor pulls prompts one at a time, and a synchronous
    # iterator keeps get_state() exact.
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def prompt_items_from_list(items: Sequence[dict[str, Any]], *, seed: int = 0,
                           shuffle: bool = False, num_epochs: int | None = 1) -> grain.IterDataset:
    """Wraps in-memory prompt dicts (each needs ``prompt_id``) in the same pipeline."""
    for i, item in enumerate(items):
        if "prompt_id" not in item:
            raise KeyError(f"prompt item {i} has no 'prompt_id' key; keys: {sorted(item)}")
    ds = grain.MapDataset.source(list(items))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    n = len(ds)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    ds = ds.map_with_index(lambda i, row: {**row, "epoch": i // n, "stream_index": i})
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
