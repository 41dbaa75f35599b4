"""areal_jax.losses stays a standalone pure-JAX library, and its README example runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("flax", "optax", "orbax", "grain", "tensorstore", "httpx", "fastapi", "uvicorn",
         "transformers", "torch", "tokenizers", "safetensors", "math_verify", "model_defs")


def _run(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def test_import_pulls_in_only_jax_numpy_and_stdlib():
    code = (
        "import sys, json, areal_jax.losses as L\n"
        "L.decoupled_ppo_loss, L.group_advantages, L.gae\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(heavy))))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('areal_jax'))))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    heavy_lines = result.stdout.strip().splitlines()
    assert json.loads(heavy_lines[0]) == []
    ours = json.loads(heavy_lines[1])
    assert all(m == "areal_jax" or m.startswith("areal_jax.losses") for m in ours), ours


def test_readme_example_runs():
    text = (REPO / "docs" / "readme" / "losses.md").read_text()
    assert "## Using the losses in your own JAX code" in text
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 1
    result = _run(blocks[0])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss " in result.stdout and "accumulated clip_frac" in result.stdout
