"""Engine start-up: the persistent compilation cache on by default (serve.py, eval.py), a
second start compiling nothing; the programs a server compiles, counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from areal_jax.engine.launch import launch_server

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
