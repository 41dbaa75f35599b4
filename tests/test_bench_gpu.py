"""The one-call GPU check (``scripts/bench.py gpu``) and the pieces it reports.

The check itself needs a GPU to mean anything; here its steps run at tiny shapes on the
CPU (``--small``, slow), so a lent GPU's 15 minutes are never spent finding a typo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_jax.bench.attention import attention_flops, causal_pairs
from areal_jax.bench.gpu import STEP_LIMITS, hardware_target, steps

REPO = Path(__file__).resolve().parent.parent


def test_attention_work_counts_only_the_pairs_the_mask_keeps():
    # One row of segments 3, 1, 4 and one of a single 8-token segment.
    seg = np.array([[1, 1, 1, 2, 3, 3, 3, 3], [1] * 8])
    assert causal_pairs(seg) == (6 + 1 + 10) + 36
    # 4·Dh per pair and head forward, 2.5x that backward.
    assert attention_flops(seg, heads=2, head_dim=8) == 3.5 * 4 * 8 * 2 * (17 + 36)


def test_gpu_check_orders_its_steps_by_importance_and_fits_one_device_call(tmp_path):
    assert list(STEP_LIMITS)[:3] == ["demo", "train-0.5b", "train-1.5b"]
    assert sum(STEP_LIMITS.values()) <= 600  # one device call
    assert hardware_target("NVIDIA H200") == "h200:1"
    assert hardware_target("NVIDIA H100 80GB HBM3") == "h100:1"
    assert hardware_target(None) == "cpu"
    plan = steps(tmp_path, small=False, hardware="h100:1")
    demo = plan["demo"][0]
    # The engine shares the learner's GPU: no CPU platform or core pinning left over.
    assert "rollout.engine_platform=null" in demo and "hardware=h100:1" in demo
    # ... with the memory split a shared card needs: its placement on one H100 holds.
    from areal_jax.config import load_config
    from areal_jax.parallel.placement import plan_placement, target_host

    cfg = load_config(demo[demo.index("--config") + 1],
                      [a for a in demo[demo.index("--config") + 2:] if "=" in a])
    placement = plan_placement(cfg, target_host("h100:1", 80 * 2**30))
    assert placement.learner.devices == placement.engines[0].devices == (0,)
    train = plan["train-1.5b"][0]
    assert "--torch-compile" in train and "qwen2.5-1.5b" in train
    cold, warm = plan["generate-cold"][0], plan["generate-warm"][0]
    assert cold[cold.index("--compile-cache") + 1] == warm[warm.index("--compile-cache") + 1]


@pytest.mark.slow
def test_gpu_check_runs_every_step_small_on_cpu(tmp_path):
    out = tmp_path / "gpu"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "areal_jax.bench", "gpu", "--small",
                           "--out-dir", str(out), "--out", str(tmp_path / "gpu_result.json")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps_run = json.loads((out / "gpu.json").read_text())
    assert list(steps_run) == list(STEP_LIMITS)
    for name, step in steps_run.items():
        assert step["status"] == "ok", (name, step["log_tail"])
        assert step["result"], name
    assert steps_run["demo"]["result"]["eval_accuracy"]
    assert steps_run["train-0.5b"]["result"]["ours_tokens_per_s"] > 0
    # The second engine start-up found the first one's programs in the shared cache.
    assert steps_run["generate-warm"]["result"]["compile_cache"]
    assert steps_run["attention"]["result"]["all_within_bound"] is True
    assert "GPU check on this CPU" in proc.stdout
