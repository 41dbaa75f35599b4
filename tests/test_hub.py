"""Models and datasets named the way users name them: Hugging Face hub ids (``org/name``) and
``hf://`` datasets, resolved by the real ``huggingface_hub`` / ``datasets`` code against a
cache laid out by the tests (tests/hub_cache.py) with ``HF_HUB_OFFLINE=1``; local Parquet and
GSM8K-shaped JSONL datasets; the GSM8K reward on the dataset's own ``#### N`` answers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from hub_cache import ASSET_DIR, COMMIT, REPO, add_hub_dataset, add_hub_model, offline_env

from areal_jax import hub


def _run_py(code: str, env: dict[str, str], cwd=REPO, timeout: float = 120) -> dict:
    """Runs ``code`` in a fresh interpreter (the hub libraries read HF_HOME and
    HF_HUB_OFFLINE at import); it prints one JSON object last."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


RESOLVE = """
import json
import os
import shutil
from areal_jax.run_inputs import TrainerError, resolve_model_path

out = {}
for name, spec, rev in CASES:
    try:
        out[name] = str(resolve_model_path(spec, key="model.path", revision=rev))
    except TrainerError as e:
        out[name] = "error: " + str(e)
print(json.dumps(out))
"""


def test_hub_id_resolves_from_the_offline_cache(tmp_path):
    hf_home = tmp_path / "hf"
    snap = add_hub_model(hf_home, "areal-test/arith-sft")
    add_hub_model(hf_home, "areal-test/pinned", ref=None)  # only a commit, no branch
    local = tmp_path / "work" / "areal-test" / "local-only"  # a local dir named like an id
    local.mkdir(parents=True)
    (local / "config.json").write_text((ASSET_DIR / "config.json").read_text())
    cases = [("main", "areal-test/arith-sft", None), ("commit", "areal-test/pinned", COMMIT),
             ("local", "areal-test/local-only", None),
             ("uncached", "areal-test/never-fetched", None),
             ("branch", "areal-test/pinned", None), ("tag", "areal-test/arith-sft", "v2")]
    out = _run_py(f"CASES = {cases!r}\n" + RESOLVE, offline_env(hf_home), cwd=tmp_path / "work")
    assert out["main"] == str(snap)
    assert (snap / "model.safetensors").is_symlink()  # the cache's own blob + link layout
    assert out["commit"].endswith(f"models--areal-test--pinned/snapshots/{COMMIT}")
    assert out["local"] == str(local)  # a local directory wins over the hub
    for case in ("uncached", "branch", "tag"):
        msg = out[case]
        assert msg.startswith("error: model.path areal-test/"), msg
        assert "\n" not in msg and "HF_HUB_OFFLINE=1" in msg, msg
        assert f"HF_HOME={hf_home}" in msg and "`hf download areal-test/" in msg, msg
    assert "at revision v2" in out["tag"] and "--revision v2" in out["tag"], out["tag"]
    assert "point model.path at a local directory" in out["uncached"]
    # The command the message names exists and takes --revision (huggingface_hub >= 1.0
    # ships `hf` only; the message named `huggingface-cli`, issue 39 item 3).
    hf = shutil.which("hf", path=os.path.dirname(sys.executable)) or shutil.which("hf")
    assert hf, "the `hf` command of huggingface_hub is not installed"
    res = subprocess.run([hf, "download", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--revision" in res.stdout, res.stdout + res.stderr


def test_snapshot_fetches_only_model_files(tmp_path):
    """The cached tree listing names a ``pytorch_model.bin`` the snapshot lacks: with the
    model file patterns the snapshot is complete; without them huggingface_hub calls it
    incomplete. So MODEL_PATTERNS is what snapshot_download is given."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    hf_home = tmp_path / "hf"
    snap = add_hub_model(hf_home, "areal-test/arith-sft")
    listing = {f.name: tree_cache.TreeCacheEntry(size=f.stat().st_size, blob_id="0" * 40)
               for f in snap.iterdir()}
    listing["pytorch_model.bin"] = tree_cache.TreeCacheEntry(size=3, blob_id="1" * 40)
    tree_cache.write_tree_cache(str(snap.parents[1]), COMMIT, listing)
    code = """
    import json
    from huggingface_hub import snapshot_download
    from areal_jax import hub
    ours = hub.local_model_dir("areal-test/arith-sft")
    try:
        snapshot_download("areal-test/arith-sft")
        everything = "complete"
    except Exception as e:
        everything = type(e).__name__
    print(json.dumps({"ours": ours, "everything": everything}))
    """
    out = _run_py(code, offline_env(hf_home))
    assert out == {"ours": str(snap), "everything": "IncompleteSnapshotError"}


def test_looks_like_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("Qwen/Qwen2.5-1.5B-Instruct", "openai/gsm8k", "meta-llama/Llama-3.2-1B"):
        assert hub.looks_like_hub_id(spec), spec
    (tmp_path / "runs" / "v3").mkdir(parents=True)
    for spec in ("runs/v3", "runs/x/weights/v3", "./a/b", "/abs/x", "gs://b/x", "builtin:x",
                 "a/..", "name", "~/m"):
        assert not hub.looks_like_hub_id(spec), spec


def test_hf_dataset_uri_maps_to_load_dataset_arguments():
    assert hub.parse_dataset_uri("hf://openai/gsm8k?config=main&split=train") == {
        "path": "openai/gsm8k", "name": "main", "split": "train", "revision": None}
    assert hub.parse_dataset_uri("hf://HuggingFaceH4/MATH-500?split=test&revision=abc") == {
        "path": "HuggingFaceH4/MATH-500", "name": None, "split": "test", "revision": "abc"}
    bad = {"hf://openai/gsm8k?config=main": "name the split",
           "hf://openai/gsm8k?split=train&subset=x": "unknown parameter 'subset'",
           "hf://gsm8k?split=train": "not a hub dataset",
           "hf://openai/gsm8k?split=": "parameter 'split' is empty"}
    for spec, text in bad.items():
        with pytest.raises(hub.HubError, match=text) as e:
            hub.parse_dataset_uri(spec, key="data.eval")
        assert str(e.value).startswith(f"data.eval {spec}") and "\n" not in str(e.value)


GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                 "many clips in May. How many clips did Natalia sell altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A shop sells 1,234 pens a day for 2 days. How many pens?",
     "answer": "1,234 * 2 = <<1234*2=2468>>2,468\n#### 2,468"},
    {"question": "It is 3 degrees and falls by 10. What is the temperature?",
     "answer": "3 - 10 = <<3-10=-7>>-7\n#### -7"},
]


def test_hf_dataset_from_the_offline_cache(tmp_path):
    hf_home = tmp_path / "hf"
    add_hub_dataset(hf_home, "areal-test/gsm8k", "main",
                    {"train": GSM8K_ROWS, "test": GSM8K_ROWS[:1]})
    code = f"""
    import json
    from pathlib import Path
    from areal_jax.run_inputs import TrainerError, resolve_dataset
    from areal_jax.data.prompts import load_prompt_dataset, read_records
    out = {{}}
    path = resolve_dataset("hf://areal-test/gsm8k?config=main&split=train",
                           Path({str(tmp_path / "run")!r}), "data.train")
    out["path"] = path
    out["rows"] = read_records(path)
    out["direct"] = read_records("hf://areal-test/gsm8k?config=main&split=test")
    ds = load_prompt_dataset(path, shuffle=False, shard_index=0, shard_count=1)
    out["items"] = [item["answer"] for item in ds]
    for name, spec in [("split", "hf://areal-test/gsm8k?config=main&split=validation"),
                       ("config", "hf://areal-test/gsm8k?config=socratic&split=train"),
                       ("uncached", "hf://areal-test/not-here?split=train")]:
        try:
            resolve_dataset(spec, Path({str(tmp_path / "run")!r}), "data.eval")
            out[name] = "resolved"
        except TrainerError as e:
            out[name] = str(e)
    print(json.dumps(out))
    """
    out = _run_py(code, offline_env(hf_home))
    assert out["path"] == str(tmp_path / "run" / "data" /
                              "hf_areal-test__gsm8k__main__train.parquet")
    assert out["rows"] == GSM8K_ROWS and out["direct"] == GSM8K_ROWS[:1]
    assert out["items"] == [r["answer"] for r in GSM8K_ROWS]
    assert out["split"].startswith("data.eval hf://areal-test/gsm8k?config=main&split=validation")
    assert "Unknown split" in out["split"] and "'train', 'test'" in out["split"]
    assert "'socratic'" in out["config"]
    msg = out["uncached"]
    assert msg.startswith("data.eval hf://areal-test/not-here?split=train is not in the "
                          "datasets cache"), msg
    assert "HF_HUB_OFFLINE=1" in msg and "datasets.load_dataset('areal-test/not-here')" in msg
    assert "\n" not in msg


def test_local_parquet_and_gsm8k_jsonl_with_the_math_reward(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from areal_jax.data.prompts import load_prompt_dataset
    from areal_jax.rewards.math import math_reward, reference_answer

    jsonl = tmp_path / "gsm8k_train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    parquet = tmp_path / "problems.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "1/2 + 1/4?", "solution": "\\frac{3}{4}"}]),
                   parquet)
    items = list(load_prompt_dataset(str(jsonl), prompt_key="question", answer_key="answer",
                                     shuffle=False, shard_index=0, shard_count=1))
    assert [reference_answer(it["answer"]) for it in items] == ["72", "2468", "-7"]
    natalia = items[0]
    assert natalia["prompt"] == GSM8K_ROWS[0]["question"]
    assert math_reward("She sold 48 + 24 = 72 clips.", natalia["answer"]) == 1.0
    assert math_reward("The answer is \\boxed{72}.", natalia["answer"]) == 1.0
    # The worked solution's other numbers (48, 24) are not the answer.
    assert math_reward("She sold 24 clips in May.", natalia["answer"]) == 0.0
    assert math_reward("So 2,468 pens.", items[1]["answer"]) == 1.0
    assert math_reward("It is -7 degrees.", items[2]["answer"]) == 1.0
    assert math_reward("It is 7 degrees.", items[2]["answer"]) == 0.0
    [row] = list(load_prompt_dataset(str(parquet), prompt_key="problem", answer_key="solution",
                                     shuffle=False, shard_index=0, shard_count=1))
    assert row["prompt"] == "1/2 + 1/4?"
    assert math_reward("\\boxed{0.75}", row["answer"]) == 1.0


def test_config_loading_does_not_touch_the_hub(tmp_path):
    """A hub id and an hf:// dataset are plain strings until a run starts: the shipped GSM8K
    configs load (and plan.py reads them) with no cache and no network."""
    from areal_jax.config import load_config
    from areal_jax.plan.planner import model_config

    for name, model in (("qwen2.5-1.5b_gsm8k", "Qwen/Qwen2.5-1.5B-Instruct"),
                        ("qwen3-1.7b_gsm8k", "Qwen/Qwen3-1.7B")):
        cfg = load_config(REPO / "configs" / f"{name}.yaml", ["model.revision=abc123"])
        assert cfg.model.path == model and cfg.model.revision == "abc123"
        assert cfg.data.train == "hf://openai/gsm8k?config=main&split=train"
        assert cfg.data.eval == "hf://openai/gsm8k?config=main&split=test"
        assert hub.parse_dataset_uri(cfg.data.train)["path"] == "openai/gsm8k"
        assert cfg.hardware
        assert model_config(cfg)[1].startswith("preset ")  # plan.py: shapes from the name


@pytest.mark.slow  # ~100 s on 2 busy cores: a training run and an eval, each with an engine
def test_train_on_a_hub_model_and_dataset_from_the_offline_cache(tmp_path):
    """scripts/train.py with model.path a hub id and data.* hf:// datasets, all from the
    offline cache: the run trains two versions, its embedded server loads the snapshot, and
    scripts/eval.py takes the same hub id."""
    from areal_jax.data import builtin_task

    hf_home = tmp_path / "hf"
    snap = add_hub_model(hf_home, "areal-test/arith-sft")
    add_hub_dataset(hf_home, "areal-test/arith", "default",
                    {"train": list(builtin_task.make_split("train", 64)),
                     "test": list(builtin_task.make_split("eval", 8))})
    run_dir = tmp_path / "run"
    env = offline_env(hf_home)
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), "--config",
         str(REPO / "configs" / "tiny_demo.yaml"), f"run_dir={run_dir}",
         "model.path=areal-test/arith-sft", f"model.revision={COMMIT}",
         "data.train=hf://areal-test/arith?config=default&split=train",
         "data.eval=hf://areal-test/arith?config=default&split=test",
         "train.batch_size=4", "rollout.n_samples=4", "rollout.max_new_tokens=40",
         "rollout.max_slots=16", "eval.every_versions=0", "eval.at_start=false",
         "eval.at_end=false", "progress_bar=false", "rollout.server_cpu_cores=null",
         "rollout.learner_cpu_cores=null", "train.total_versions=2",
         "checkpoint.every_versions=0"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("version", 0) for r in rows) == 2, rows[-1]
    assert (run_dir / "data" / "hf_areal-test__arith__default__train.parquet").is_file()
    logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    assert str(snap) in logs, sorted(p.name for p in run_dir.rglob("*.log"))
    out = tmp_path / "eval.json"
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "eval.py"), "--model", "areal-test/arith-sft",
         "--data", "hf://areal-test/arith?config=default&split=test", "--reward", "builtin",
         "-k", "1", "--max-prompts", "4", "--max-new-tokens", "40", "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["model"] == "areal-test/arith-sft", result
    assert result["n_prompts"] == 4 and 0.0 <= result["accuracy"] <= 1.0, result


def test_serve_and_convert_take_hub_ids(tmp_path):
    """serve.py --model-path and convert.py hf-to-orbax --hf resolve a hub id from the
    cache; an uncached one is a one-line error and exit status 2."""
    hf_home = tmp_path / "hf"
    add_hub_model(hf_home, "areal-test/arith-sft")
    env = offline_env(hf_home)
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "serve.py"), "--model-path",
                          "areal-test/never-fetched", "--port", "9"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --model-path areal-test/never-fetched is not in the Hugging "
                           "Face cache"), last
    out = tmp_path / "orbax"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "convert.py"), "hf-to-orbax",
                          "--hf", "areal-test/arith-sft", "--revision", COMMIT, "--out", str(out)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    from areal_jax.checkpoint import TrainCheckpointer

    with TrainCheckpointer(str(out), read_only=True) as ck:
        _, _, meta = ck.restore(0, params_only=True)
    assert meta.source_hf_dir.endswith(f"models--areal-test--arith-sft/snapshots/{COMMIT}")
    assert meta.source_hub_id == "areal-test/arith-sft"
