"""Start-up: the learner compiles its train step ahead of time, and the persistent
compilation cache lets a second process skip compiling altogether."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Runs in a fresh process: a tiny learner, precompiled, then one train step. Prints how
# many XLA compilations ran and how many executables came from / went to the disk cache.
_CHILD = r"""
import json, sys
from jax._src import monitoring
counts = {"backend_compiles": 0, "cache_hits": 0, "cache_misses": 0}
def on_event(name, **kw):
    for key in ("cache_hits", "cache_misses"):
        if name == f"/jax/compilation_cache/{key}":
            counts[key] += 1
def on_duration(name, secs, **kw):
    if name == "/jax/core/compile/backend_compile_duration":
        counts["backend_compiles"] += 1
monitoring.register_event_listener(on_event)
monitoring.register_event_duration_secs_listener(on_duration)
from areal_jax.compile_cache import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
from tests._learner_data import make_learner, random_trajectories, random_advantages
from areal_jax.learner import AlgoConfig, pack_trajectories
from areal_jax.parallel import make_mesh
import jax
learner = make_learner(make_mesh("data=1", jax.devices()[:1]), algo=AlgoConfig(ppo_n_minibatches=2))
trajs = random_trajectories(0, 12, 30)
batches = pack_trajectories(trajs, random_advantages(0, trajs), seq_len=32,
                            rows_per_micro_batch=4, n_minibatches=2)
learner.precompile(4, 32)
learner.train_step(batches)
print("COUNTS", json.dumps(counts))
"""


def _child_counts(cache_dir: Path) -> dict[str, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", _CHILD, str(cache_dir)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("COUNTS "))
    return json.loads(line.split(" ", 1)[1])


def test_second_process_compiles_nothing(tmp_path):
    cache = tmp_path / "xla_cache"
    first = _child_counts(cache)
    assert first["backend_compiles"] > 0 and first["cache_misses"] > 0, first
    assert any(cache.iterdir())
    second = _child_counts(cache)
    # Every program came from the disk cache (JAX times a cache load as a compile too).
    assert second["cache_misses"] == 0, second
    assert second["cache_hits"] == second["backend_compiles"] >= first["cache_misses"], \
        (first, second)


@pytest.fixture
def compile_counter():
    from jax._src import monitoring

    events: list[float] = []

    def on_duration(name: str, secs: float, **kw) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(secs)

    monitoring.register_event_duration_secs_listener(on_duration)
    yield events
    monitoring.unregister_event_duration_listener(on_duration)


@pytest.mark.devices(2)
def test_precompile_leaves_nothing_for_the_train_step(compile_counter):
    import jax

    from areal_jax.learner import AlgoConfig, pack_trajectories
    from areal_jax.parallel import make_mesh
    from tests._learner_data import make_learner, random_advantages, random_trajectories

    learner = make_learner(make_mesh("data=2", jax.devices()[:2]),
                           algo=AlgoConfig(ppo_n_minibatches=2, c_clip=3.0))
    trajs = random_trajectories(1, 16, 40)
    advs = random_advantages(1, trajs)
    assert learner.precompile(4, 48) > 0
    compile_counter.clear()
    learner.train_step(pack_trajectories(trajs, advs, seq_len=48, rows_per_micro_batch=4,
                                         n_shards=2, n_minibatches=2))
    assert compile_counter == []
    # Another shape was not precompiled: its first step compiles (the counter sees it).
    learner.train_step(pack_trajectories(trajs, advs, seq_len=64, rows_per_micro_batch=4,
                                         n_shards=2, n_minibatches=2))
    assert len(compile_counter) > 0


def _cache_entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.name.endswith("-cache")}


@pytest.mark.slow
def test_second_training_run_compiles_nothing_new(tmp_path):
    """The trainer enables the cache for itself and its embedded server: a second run of
    the same config finds every program on disk (a miss would have added an entry)."""
    cache = tmp_path / "xla_cache"
    args = [sys.executable, str(REPO / "scripts" / "train.py"), "--config",
            str(REPO / "configs" / "tiny_demo.yaml"), "train.batch_size=4", "rollout.n_samples=4",
            "rollout.max_new_tokens=40", "rollout.max_slots=16", "eval.every_versions=0",
            "eval.at_start=false", "eval.at_end=false", "progress_bar=false",
            "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null",
            "train.total_versions=1", f"compilation_cache_dir={cache}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    entries = []
    for i in range(2):
        run_dir = tmp_path / f"run{i}"
        res = subprocess.run(args + [f"run_dir={run_dir}"], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
        entries.append(_cache_entries(cache))
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        marks = [row[f"startup/{k}"] for k in ("learner_loaded_s", "learner_compiled_s",
                                               "setup_s", "first_batch_s", "first_step_s")]
        assert marks == sorted(marks) and marks[0] > 0, row
        assert row["startup/servers_ready_s"] <= row["startup/setup_s"], row
        # A fresh run starts its servers on the model's checkpoint before loading the learner.
        assert row["startup/servers_launched_s"] <= row["startup/learner_loaded_s"], row
    # Both processes wrote there: the engine's step functions (wrapped as "traced" in
    # engine/runner.py) and the learner's gradient program (learner.py: _grad_program).
    names = {e.rsplit("-", 2)[0] for e in entries[0]}
    assert {"jit_traced", "jit__grad_program"} <= names, names
    assert entries[1] == entries[0], sorted(entries[1] ^ entries[0])
