"""The built-in long-tail task, its warm-start checkpoint and the longtail benchmark's
bookkeeping (no training runs: the benchmark itself takes minutes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from areal_jax.bench.longtail import (
    TRL,
    areal_time_shares,
    format_histogram,
    length_histogram,
    summarise_runs,
)
from areal_jax.data import builtin_task as bt
from areal_jax.rewards.builtin import builtin_reward
from areal_jax.run_inputs import TrainerError, resolve_dataset, resolve_model_path


def test_lengths_spread_over_10x_with_most_short():
    train = bt.make_split("longtail_train", 4000)
    lengths = np.array([len(r["solution"]) + 1 for r in train])  # + eos
    assert lengths.max() >= 10 * lengths.min()
    assert lengths.min() <= 16 and 250 <= lengths.max() <= 352  # fits max_new_tokens 352
    assert np.median(lengths) < 40  # most short ...
    assert (lengths > 128).mean() > 0.05  # ... a tail of long ones
    prompts = [len(r["question"]) for r in train]
    assert max(prompts) + 352 <= 448  # the longest prompt + completion fits max_seq_len
    assert {r["num_steps"] for r in train} == set(range(1, 41))


def test_reward_verifies_longtail_solutions():
    for r in bt.make_split("longtail_eval", 50):
        assert builtin_reward(r["solution"], r["answer"]) == 1.0
        wrong = str(int(r["answer"]) + 1)
        assert builtin_reward(r["solution"].rsplit("A:", 1)[0] + f"A:{wrong}", r["answer"]) == 0
        assert builtin_reward(r["solution"].rsplit("A:", 1)[0], r["answer"]) == 0.0
        steps = r["solution"].split(";")[:-1]  # every written step is right
        assert all(eval(s.split("=")[0]) == int(s.split("=")[1]) for s in steps)  # noqa: S307


def test_splits_disjoint_and_arith_splits_unchanged():
    train = {r["question"] for r in bt.make_split("longtail_train")}
    evals = {r["question"] for r in bt.make_split("longtail_eval")}
    assert len(evals) == 256 and not train & evals
    first = bt.make_split("train", 1)[0]  # the demo's data is what it was
    assert first["question"] == "Q:7+5+4+2=" and first["prompt_id"] == "train-0"
    assert bt.make_split("longtail_eval", 1)[0]["prompt_id"] == "longtail_eval-0"
    with pytest.raises(ValueError, match="longtail_train"):
        bt.make_split("longtail_test")


def test_builtin_specs_resolve(tmp_path):
    path = resolve_dataset("builtin:longtail_train", tmp_path, "data.train")
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 20000 and rows[0]["prompt_id"] == "longtail_train-0"
    with pytest.raises(TrainerError, match="longtail_eval"):
        resolve_dataset("builtin:nope", tmp_path, "data.eval")
    asset = resolve_model_path("builtin:longtail_sft")
    config = json.loads((asset / "config.json").read_text())
    assert config["max_position_embeddings"] >= 448
    assert json.loads((asset / "tokenizer_config.json").read_text())["model_max_length"] >= 448


def test_longtail_checkpoint_loads_and_scores():
    import jax.numpy as jnp

    from model_defs import load_hf

    model, cfg = load_hf(resolve_model_path("builtin:longtail_sft"))
    item = bt.make_split("longtail_eval", 1)[0]
    ids = bt.encode(item["question"] + item["solution"])
    logits = model(jnp.asarray([ids], jnp.int32))
    assert logits.shape == (1, len(ids), cfg.vocab_size) and bool(jnp.isfinite(logits).all())


def test_histogram_and_bench_summary():
    hist = length_histogram()
    assert abs(sum(h["fraction"] for h in hist) - 1.0) < 1e-9
    assert "257-512 tokens" in format_histogram(hist)
    rows = [{"version": v, "step_time_s": 1.0, "rollout_wait_s": 0.5, "publish_s": 0.1,
             "train/step_time_s": 0.3, "tokens_consumed": 100 * v, "time": float(v)}
            for v in range(1, 5)]
    shares = areal_time_shares(rows, train_s=5.0)
    assert shares == pytest.approx({"waiting": 2.0, "training": 1.2, "publishing": 0.4,
                                    "other": 0.4, "start-up": 1.0})

    def run(tps, t_hit):
        return {"tokens_per_s": tps, "steady_tokens_per_s": tps, "train_end_s": 10.0,
                "eval_s": 0.0, "time_shares": shares,
                "evals": [{"step": 0, "accuracy": 0.1, "time_s": 1.0},
                          {"step": 5, "accuracy": 0.9, "time_s": t_hit}]}

    runs = {"async": [run(200, 10.0), run(220, 12.0)], "sync": [run(100, 20.0)],
            "async-nointerrupt": [run(150, 15.0)], TRL: [run(50, 40.0)]}
    columns, table, summary = summarise_runs(runs, 0.8)
    assert len(table) == 4 and len(columns) == len(table[0])
    assert summary["tokens/s async / sync"] == pytest.approx(2.0)
    assert summary[f"tokens/s async / {TRL}"] == pytest.approx(4.0)
    assert summary[f"time to 0.8 async / {TRL}"] == pytest.approx(11.0 / 40.0)
    assert summary["tokens/s interruptible / not"] == pytest.approx(200 / 150)
