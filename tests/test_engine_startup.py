"""Engine start-up: the persistent compilation cache on by default (serve.py, eval.py), a
second start compiling nothing; the programs an engine compiles, counted (they do not grow
with max_seq_len); a request served while the larger programs compile in the background."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from areal_jax.engine import EngineConfig, GenerationEngine
from areal_jax.engine.launch import launch_server
from areal_jax.engine.runner import BACKGROUND_COMPILE_NICE, chunk_plan
from areal_jax.sampling_params import SamplingParams
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.test_engine import hf_greedy

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "areal_jax" / "data" / "assets" / "arith_sft"


def _server_info(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()


def test_serve_uses_the_default_cache_and_a_second_start_compiles_nothing(tmp_path):
    # No --compilation-cache-dir: the default directory, here moved by the environment.
    cache = tmp_path / "cache"
    env = {"AREAL_JAX_COMPILATION_CACHE_DIR": str(cache)}
    infos = []
    for _ in range(2):
        with launch_server(DEMO, max_slots=2, max_seq_len=32, warmup=True, env=env) as server:
            infos.append(_server_info(server.url))
    first, second = (info["compilation_cache"] for info in infos)
    assert first["dir"] == str(cache.resolve()) and second["dir"] == first["dir"]
    assert first["hits"] == 0 and first["writes"] > 0, first
    # The second start loads every program the first one compiled and compiles none.
    assert second["hits"] >= first["writes"] and second["writes"] == 0, (first, second)
    assert infos[1]["num_compilations"] == infos[0]["num_compilations"]

    # "off" turns it off: nothing looked up, nothing written.
    with launch_server(DEMO, max_slots=2, max_seq_len=32, warmup=True,
                       compilation_cache_dir=None, env=env) as server:
        off = _server_info(server.url)["compilation_cache"]
    assert off == {"dir": None, "requests": 0, "hits": 0, "writes": 0}


@pytest.mark.slow  # two eval.py runs, each starting a server: about a minute under load
def test_eval_hits_the_cache_on_a_second_start(tmp_path):
    cache = tmp_path / "cache"
    stats = []
    for i in range(2):
        out = tmp_path / f"eval{i}.json"
        done = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "eval.py"), "--model", "builtin:arith_sft",
             "--data", "builtin:eval", "--max-prompts", "2", "--max-new-tokens", "4",
             "--max-slots", "2", "--max-seq-len", "32", "--reward-workers", "1",
             "--compilation-cache-dir", str(cache), "--out", str(out)],
            capture_output=True, text=True, cwd=REPO, timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert done.returncode == 0, done.stderr[-3000:]
        stats.append(json.loads(out.read_text())["engine_compilation_cache"])
    first, second = stats
    assert first["hits"] == 0 and first["writes"] > 0, first
    assert second["hits"] >= first["writes"] and second["writes"] == 0, (first, second)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("startup"), seed=0,
                                   max_position_embeddings=2048)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 120, n).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_programs_do_not_grow_with_max_seq_len(ckpt):
    """Prompts of every chunk plan (one short chunk, a 64 and a 256 chunk, a 256 + 64 pair)
    and generations across several key blocks of the cache: the same programs at a context
    of 320 and of 2048 (a prefill and a decode per power-of-two length before: 10 and 16
    programs)."""
    compiled = {}
    for max_seq_len in (320, 2048):
        engine = GenerationEngine(EngineConfig(str(ckpt), max_slots=2, max_seq_len=max_seq_len,
                                               decode_steps=4))
        try:
            reqs = [engine.submit(_prompt(n, n), _greedy(m))
                    for n, m in ((3, 150), (20, 4), (70, 4), (300, 10))]
            assert all(r.done.wait(300) for r in reqs)
            assert len(reqs[0].output_ids) == 150
            compiled[max_seq_len] = (engine.num_compilations, sorted(engine.runner.compiled))
            keys = engine.runner.program_keys()
        finally:
            engine.shutdown()
        # The prompt prefilled in two chunks gives transformers' greedy tokens.
        assert reqs[3].output_ids == hf_greedy(ckpt, _prompt(300, 300), 10)
    # decode windows 64, 128, 256 and 512 capped at max_seq_len (longer sequences loop
    # beyond), prefill chunks 16, 64, 256: as many programs whatever max_seq_len
    assert compiled[320][0] == compiled[2048][0] == len(keys) == 7, compiled
    assert [n for n in compiled[320][1] if "window=320" not in n] == [
        n for n in compiled[2048][1] if "window=512" not in n], compiled


def test_a_request_during_the_background_compile_is_answered_correctly(ckpt):
    """With warm-up the engine is ready once the decode and the shortest prefill chunk are
    compiled; a long prompt that arrives while the longer chunks still compile is served
    in short chunks, with transformers' greedy tokens; later ones use the longer chunks."""
    engine = GenerationEngine(EngineConfig(str(ckpt), max_slots=2, max_seq_len=320,
                                           warmup=True))
    try:
        pending = engine.info()["programs_pending"]
        prompt = _prompt(100, 1)
        req = engine.generate(prompt, _greedy(8), timeout=300)
        assert pending, "every program was compiled before the engine was ready"
        assert set(pending) <= {"decode_128", "decode_256", "decode_320", "prefill_64",
                                "prefill_256"}
        expected = hf_greedy(ckpt, prompt, 8)
        assert req.output_ids == expected
        engine.warmup()  # waits for the background compile
        info = engine.info()
        assert info["programs_pending"] == [] and set(info["programs"]) == {
            "decode_64", "decode_128", "decode_256", "decode_320", "prefill_16", "prefill_64",
            "prefill_256"}
        assert all(p["compile_s"] > 0 and p["hlo_chars"] > 0 for p in info["programs"].values())
        calls = engine.stats["prefill_calls"]
        assert engine.generate(prompt, _greedy(8), timeout=300).output_ids == expected
        # Now in the longer chunks (on a CPU 64 + 64 rather than one 256: chunk_plan), not
        # the seven 16-token chunks the first request took.
        plan = chunk_plan(len(prompt), engine.runner.chunks, engine.runner.prefill_call_tokens)
        assert engine.stats["prefill_calls"] == calls + len(plan) and len(plan) <= 2
        assert engine.num_compilations == 7
        if sys.platform == "linux":  # the background compile ran below the step loop
            expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_COMPILE_NICE)
            assert engine.runner.background_nice == expected
    finally:
        engine.shutdown()


@pytest.mark.slow  # a one-version training run with an eval at start
def test_the_runs_first_row_holds_the_start_up_breakdown(tmp_path):
    """metrics.jsonl's first row (the eval at start) has the start-up milestones so far and
    the server's own breakdown; the first version's row adds the first batch and step, and
    the console shows them as one line."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user has
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), "--config",
         str(REPO / "configs" / "tiny_demo.yaml"), "train.batch_size=4", "rollout.n_samples=4",
         "rollout.max_new_tokens=24", "rollout.max_slots=16", "eval.every_versions=0",
         "eval.at_start=true", "eval.at_end=false", "data.max_eval_prompts=4",
         "progress_bar=false", "rollout.server_cpu_cores=null",
         "rollout.learner_cpu_cores=null", "train.total_versions=1",
         f"compilation_cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"],
        capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    first, second = (json.loads(line) for line in
                     (run_dir / "metrics.jsonl").read_text().splitlines()[:2])
    assert first["version"] == 0 and "eval_accuracy" in first
    marks = [first[f"startup/{k}"] for k in ("imports_s", "servers_launched_s",
                                             "learner_loaded_s", "setup_s")]
    assert marks == sorted(marks) and marks[0] > 0, first
    for key in ("load_s", "compile_s", "ready_s", "compile_decode_64_s",
                "compile_prefill_16_s"):
        assert first[f"startup/engine_{key}"] > 0, (key, first)
    assert "startup/first_step_s" not in first
    assert second["startup/first_step_s"] >= second["startup/first_batch_s"] > marks[-1]
    lines = [x for x in res.stdout.splitlines() if x.startswith("start-up")]
    assert len(lines) == 1 and "first step" in lines[0] and "engine: load" in lines[0], lines


def test_a_runner_compiles_only_its_step_programs(ckpt):
    """The zero cache and slot state are made on the host and placed: the programs a
    runner builds are its prefill and decode, no broadcast per shape and dtype (8 of them
    before, each a compile or a cache lookup on the start path)."""
    code = f"""
import json, jax
from areal_jax.engine.runner import ModelRunner
from model_defs import load_hf
model, _ = load_hf({str(ckpt)!r})
seen = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: seen.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)
runner = ModelRunner(model, max_slots=4, max_seq_len=64)
before = len(seen)
runner.compile_programs(runner.essential_keys(), workers=1)
print(json.dumps([before, len(seen) - before]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    # none for the runner's state, one each for the decode and the shortest prefill
    assert json.loads(done.stdout.splitlines()[-1]) == [0, 2]

