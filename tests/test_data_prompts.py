"""Prompt datasets: JSONL/JSON/Parquet, seeded shuffles over epochs, sharding, iterator state."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_jax.data.prompts import load_prompt_dataset, prompt_items_from_list, read_records

ROWS = [{"question": f"q{i}", "answer": str(i * i), "level": i % 3} for i in range(23)]


@pytest.fixture
def jsonl_path(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return str(path)


@pytest.fixture
def parquet_path(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return str(path)


def take(ds, n=None):
    it = iter(ds)
    out = []
    for item in it:
        out.append(item)
        if n is not None and len(out) == n:
            break
    return out


def test_jsonl_and_parquet_give_the_same_stream(jsonl_path, parquet_path):
    a = take(load_prompt_dataset(jsonl_path, seed=3, shard_index=0, shard_count=1))
    b = take(load_prompt_dataset(parquet_path, seed=3, shard_index=0, shard_count=1))
    assert [x["prompt_id"] for x in a] == [x["prompt_id"] for x in b]
    assert a == b
    item = a[0]
    row = ROWS[int(item["prompt_id"])]
    assert item["prompt"] == row["question"] and item["answer"] == row["answer"]
    assert item["level"] == row["level"]  # other columns come along


def test_one_epoch_is_a_seeded_permutation(jsonl_path):
    ids = [x["prompt_id"] for x in take(load_prompt_dataset(jsonl_path, seed=1, shard_index=0,
                                                            shard_count=1))]
    assert sorted(ids, key=int) == [str(i) for i in range(len(ROWS))]
    assert ids != [str(i) for i in range(len(ROWS))]  # shuffled
    again = [x["prompt_id"] for x in take(load_prompt_dataset(jsonl_path, seed=1, shard_index=0,
                                                              shard_count=1))]
    other = [x["prompt_id"] for x in take(load_prompt_dataset(jsonl_path, seed=2, shard_index=0,
                                                              shard_count=1))]
    assert again == ids and other != ids
    plain = take(load_prompt_dataset(jsonl_path, shuffle=False, shard_index=0, shard_count=1))
    assert [x["prompt_id"] for x in plain] == [str(i) for i in range(len(ROWS))]


def test_epochs_each_cover_everything_in_a_new_order(jsonl_path):
    items = take(load_prompt_dataset(jsonl_path, seed=5, num_epochs=3, shard_index=0,
                                     shard_count=1))
    n = len(ROWS)
    assert len(items) == 3 * n
    epochs = [[x["prompt_id"] for x in items[e * n:(e + 1) * n]] for e in range(3)]
    for e, ids in enumerate(epochs):
        assert sorted(ids, key=int) == [str(i) for i in range(n)]
        assert {x["epoch"] for x in items[e * n:(e + 1) * n]} == {e}
    assert epochs[0] != epochs[1] != epochs[2]
    assert [x["stream_index"] for x in items] == list(range(3 * n))
    forever = take(load_prompt_dataset(jsonl_path, seed=5, num_epochs=None, shard_index=0,
                                       shard_count=1), 5 * n)
    assert [x["prompt_id"] for x in forever[:3 * n]] == [x["prompt_id"] for x in items]


def test_shards_partition_the_rows(jsonl_path):
    shards = [take(load_prompt_dataset(jsonl_path, seed=0, shard_index=s, shard_count=4))
              for s in range(4)]
    ids = [set(x["prompt_id"] for x in shard) for shard in shards]
    assert all(ids)
    assert set().union(*ids) == {str(i) for i in range(len(ROWS))}
    assert sum(len(s) for s in ids) == len(ROWS)  # disjoint


def test_iterator_state_round_trip_resumes_exactly(jsonl_path):
    ds = load_prompt_dataset(jsonl_path, seed=7, num_epochs=2, shard_index=0, shard_count=1)
    full = [x["prompt_id"] for x in take(ds)]
    it = iter(ds)
    head = [next(it)["prompt_id"] for _ in range(30)]  # crosses the epoch boundary
    state = json.loads(json.dumps(it.get_state()))
    fresh = iter(load_prompt_dataset(jsonl_path, seed=7, num_epochs=2, shard_index=0,
                                     shard_count=1))
    fresh.set_state(state)
    tail = [x["prompt_id"] for x in fresh]
    assert head + tail == full


def test_id_key_and_prompt_id_column(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"uid": f"u{i}", "prompt_id": f"p{i}", "text": "x", "answer": 1}
                                for i in range(4)]))
    items = take(load_prompt_dataset(str(path), prompt_key="text", shuffle=False,
                                     shard_index=0, shard_count=1))
    assert [x["prompt_id"] for x in items] == ["p0", "p1", "p2", "p3"]
    items = take(load_prompt_dataset(str(path), prompt_key="text", id_key="uid", shuffle=False,
                                     shard_index=0, shard_count=1))
    assert [x["prompt_id"] for x in items] == ["u0", "u1", "u2", "u3"]


def test_builtin_task_split_loads(tmp_path):
    from areal_jax.data import builtin_task

    path = builtin_task.write_split(tmp_path / "eval.jsonl", "eval", n=16)
    items = take(load_prompt_dataset(str(path), shuffle=False, shard_index=0, shard_count=1))
    assert [x["prompt_id"] for x in items] == [f"eval-{i}" for i in range(16)]
    assert items[0]["prompt"].startswith("Q:")


def test_in_memory_items():
    items = [{"prompt_id": str(i), "prompt": "p"} for i in range(5)]
    out = take(prompt_items_from_list(items, num_epochs=2))
    assert [x["prompt_id"] for x in out] == [str(i) for i in range(5)] * 2
    with pytest.raises(KeyError, match="prompt item 0 has no 'prompt_id'"):
        prompt_items_from_list([{"prompt": "p"}])


def test_errors_name_the_problem(tmp_path, jsonl_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"))
    bad_ext = tmp_path / "data.csv"
    bad_ext.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data\.csv.*unsupported extension.*\.parquet"):
        load_prompt_dataset(str(bad_ext))
    with pytest.raises(KeyError, match=r"row 0 has no key 'prompt'.*available keys: \['answer', "
                                       r"'level', 'question'\]"):
        load_prompt_dataset(jsonl_path, prompt_key="prompt", shard_index=0, shard_count=1)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: invalid JSON"):
        read_records(str(broken))
    with pytest.raises(ValueError, match="shard_index=4 is outside"):
        load_prompt_dataset(jsonl_path, shard_index=4, shard_count=4)
    with pytest.raises(ValueError, match="give both shard_index and shard_count"):
        load_prompt_dataset(jsonl_path, shard_index=0)
    with pytest.raises(ValueError, match="num_epochs"):
        load_prompt_dataset(jsonl_path, num_epochs=0, shard_index=0, shard_count=1)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"question": "a", "answer": 1, "prompt_id": "x"}\n'
                   '{"question": "b", "answer": 2, "prompt_id": "x"}\n')
    with pytest.raises(ValueError, match="repeats prompt id 'x'"):
        load_prompt_dataset(str(dup), shard_index=0, shard_count=1)


_WITHOUT_GCSFS = """
import sys
sys.modules["gcsfs"] = None  # as if not installed: every import of it raises ImportError
from areal_jax.data.prompts import load_prompt_dataset
try:
    load_prompt_dataset("gs://bucket/train.jsonl", shard_index=0, shard_count=1)
except ValueError as e:
    print(e)
else:
    print("no error")
"""


def test_gs_paths_without_gcsfs_say_what_is_missing():
    """The test extra installs gcsfs, so its absence is simulated: in a fresh interpreter
    (fsspec caches a filesystem class once imported) where importing gcsfs fails."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _WITHOUT_GCSFS], capture_output=True,
                         text=True, timeout=300, env=env, cwd=repo)
    assert out.returncode == 0, out.stderr[-3000:]
    message = out.stdout.strip().splitlines()[-1]
    assert re.search(r"prompt dataset 'gs://bucket/train.jsonl'.*gcsfs", message), message


@pytest.mark.parametrize("prompt, words", [
    (None, "is null (None)"), (12345, "is int (12345)"), ("  ", "is an empty string"),
    ([], "is an empty list of chat messages"), (["hi"], "message 0 is a str"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 has role None"),
    ([{"role": "user", "content": None}], "message 0 (user) has content of type NoneType"),
])
def test_every_row_s_prompt_is_text_or_chat_messages(tmp_path, prompt, words):
    """Checked for every row when the dataset is built (the run checks the first 512 before
    anything starts): one line naming the file, the row and the key."""
    path = tmp_path / "d.jsonl"
    rows = [{"question": "1+1", "answer": "2"}] * 600 + [{"question": prompt, "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as e:
        load_prompt_dataset(str(path), prompt_key="question", shard_index=0, shard_count=1)
    assert str(e.value).startswith(f"{path}: row 600: 'question' (the prompt_key) {words}")


def test_parquet_timestamp_and_bytes_columns_reach_a_checkpoint(tmp_path):
    """Issue 50 item 4: a Parquet dataset with a timestamp (or bytes) column trained
    version 1, then the first checkpoint crashed (the executor's state, which holds the
    prompts in flight, was not JSON-serialisable), so no checkpoint was ever written. Items
    are JSON now: timestamps as ISO 8601 text, bytes as UTF-8 text or base64."""
    import asyncio
    import datetime
    import decimal

    from areal_jax.rollout.executor import RolloutExecutor
    from areal_jax.trajectory import Trajectory

    when = datetime.datetime(2024, 5, 17, 8, 30, 15, tzinfo=datetime.UTC)
    rows = [{"question": f"q{i}", "answer": str(i), "created": when, "day": when.date(),
             "blob": b"caf\xc3\xa9", "raw": b"\xff\x00", "price": decimal.Decimal("1.50")}
            for i in range(4)]
    path = tmp_path / "stamped.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    item = next(iter(load_prompt_dataset(str(path), shard_index=0, shard_count=1)))
    assert item["created"] == "2024-05-17T08:30:15+00:00" and item["day"] == "2024-05-17"
    assert item["blob"] == "café" and item["raw"] == "base64:/wA="
    assert item["price"] == "1.50"
    assert json.loads(json.dumps(item)) == item

    gate = asyncio.Event()

    async def waits(client, item, ctx):  # keeps prompts in flight at the checkpoint
        if item["prompt_id"] != "0":
            await gate.wait()
        return [Trajectory(input_ids=[1, 2], loss_mask=[0, 1], behav_logp=[0.0, -1.0],
                           versions=[-1, 0], reward=1.0)]

    ds = load_prompt_dataset(str(path), shard_index=0, shard_count=1, seed=0, num_epochs=1)
    with RolloutExecutor(None, waits, iter(ds), batch_size=1, max_concurrent=4,
                         max_staleness=None) as ex:
        ex.prepare_batch(1, timeout=30)
        state = ex.state_dict()  # raised "executor state is not JSON-serialisable"
    assert len(state["in_flight"]) == 3
    assert json.loads(json.dumps(state))["in_flight"][0]["item"]["created"] == item["created"]


def test_a_column_a_checkpoint_cannot_hold_is_refused_naming_it(tmp_path):
    path = tmp_path / "odd.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "1"}]), path)
    from areal_jax.data import prompts

    with pytest.raises(ValueError, match=r"row 0: column 'odd' holds a builtins.object"):
        prompts._normalise_rows([(str(path), [{"question": "q", "odd": object()}])],
                                "question", None, None)
