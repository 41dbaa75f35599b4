"""scripts/convert.py: HF -> Orbax -> HF round trip and named errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_fixtures import hf_logits, make_tiny_hf_checkpoint

from areal_jax.checkpoint import CheckpointMeta
from areal_jax.checkpoint.orbax_ckpt import TrainCheckpointer
from areal_jax.data.builtin_task import save_tokenizer

REPO = Path(__file__).resolve().parent.parent
CONVERT = REPO / "scripts" / "convert.py"


def _load_convert():
    spec = importlib.util.spec_from_file_location("convert_script", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def convert():
    return _load_convert()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"), arch="qwen3", tie=False, seed=5)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, str(CONVERT), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)


def test_cli_round_trip_hf_orbax_hf(tmp_path, hf_dir):
    ckpt_dir, out_dir = tmp_path / "ckpt", tmp_path / "hf_out"
    tok_dir = save_tokenizer(tmp_path / "tok")
    proc = _run_cli("hf-to-orbax", "--hf", str(hf_dir), "--out", str(ckpt_dir))
    assert proc.returncode == 0, proc.stderr
    with TrainCheckpointer(ckpt_dir, read_only=True) as ckpt:
        assert ckpt.all_steps() == [0]
        meta = ckpt.restore_meta()
        assert meta.model_config["architectures"] == ["Qwen3ForCausalLM"]
        assert meta.has_opt_state is False and meta.version == 0
    proc = _run_cli("orbax-to-hf", "--ckpt", str(ckpt_dir), "--out", str(out_dir),
                    "--tokenizer", str(tok_dir))
    assert proc.returncode == 0, proc.stderr
    assert (out_dir / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    ids = np.random.default_rng(1).integers(0, 128, size=(2, 11))
    # fp32 in, fp32 out: the same weights bit for bit, so transformers computes the same logits.
    diff = np.abs(hf_logits(out_dir, ids) - hf_logits(hf_dir, ids)).max()
    assert diff == 0.0, f"max abs logit diff {diff}"


def test_orbax_to_hf_step_and_config_from(tmp_path, hf_dir, convert):
    ckpt_dir = tmp_path / "ckpt"
    assert convert.main(["hf-to-orbax", "--hf", str(hf_dir), "--out", str(ckpt_dir)]) == 0
    # A training checkpoint that lacks model_config (step 3) needs --config-from.
    with TrainCheckpointer(ckpt_dir, async_save=False) as ckpt:
        params, _, _ = ckpt.restore(0)
        ckpt.save(3, params, None, CheckpointMeta(version=3))
    assert convert.main(["orbax-to-hf", "--ckpt", str(ckpt_dir), "--step", "0",
                         "--out", str(tmp_path / "s0"), "--dtype", "bfloat16"]) == 0
    assert '"torch_dtype": "bfloat16"' in (tmp_path / "s0" / "config.json").read_text()
    assert convert.main(["orbax-to-hf", "--ckpt", str(ckpt_dir), "--out", str(tmp_path / "s3"),
                         "--config-from", str(hf_dir)]) == 0
    ids = np.arange(12).reshape(1, 12)
    np.testing.assert_array_equal(hf_logits(tmp_path / "s3", ids), hf_logits(hf_dir, ids))


def test_named_errors(tmp_path, hf_dir, convert, capsys):
    def err(argv: list[str]) -> str:
        assert convert.main(argv) == 2
        return capsys.readouterr().err

    missing = tmp_path / "missing"
    assert f"checkpoint directory {missing} does not exist" in err(
        ["orbax-to-hf", "--ckpt", str(missing), "--out", str(tmp_path / "o1")])
    (tmp_path / "empty").mkdir()
    assert "no checkpoint found in" in err(
        ["orbax-to-hf", "--ckpt", str(tmp_path / "empty"), "--out", str(tmp_path / "o2")])
    not_hf = tmp_path / "not_hf"
    not_hf.mkdir()
    (not_hf / "weights.bin").write_bytes(b"x")
    assert f"model directory {not_hf} has no config.json" in err(
        ["hf-to-orbax", "--hf", str(not_hf), "--out", str(tmp_path / "o3")])
    ckpt_dir = tmp_path / "ckpt"
    assert convert.main(["hf-to-orbax", "--hf", str(hf_dir), "--out", str(ckpt_dir)]) == 0
    assert "step 7 not found" in err(
        ["orbax-to-hf", "--ckpt", str(ckpt_dir), "--step", "7", "--out", str(tmp_path / "o4")])
    assert "is not empty" in err(["hf-to-orbax", "--hf", str(hf_dir), "--out", str(ckpt_dir)])
    with TrainCheckpointer(ckpt_dir, async_save=False) as ckpt:
        params, _, _ = ckpt.restore(0)
        ckpt.save(1, params, None, CheckpointMeta())
    assert "meta has no model_config; pass --config-from" in err(
        ["orbax-to-hf", "--ckpt", str(ckpt_dir), "--out", str(tmp_path / "o5")])
    assert not (tmp_path / "o4").exists() and not (tmp_path / "o5").exists()
