"""Cloud runs against a real GCS emulator (fake-gcs-server on 127.0.0.1): train.py with
run_dir=gs://..., the initial model and the datasets read from the bucket, SIGKILL and
resume from the bucket, then eval.py / convert.py / plot.py on what the bucket holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from areal_jax import storage
from tests.gcs_emulator import gcs  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
ASSETS = REPO / "areal_jax" / "data" / "assets" / "arith_sft"
BUCKET = "gs://test-bucket"
TRAIN = [sys.executable, str(SCRIPTS / "train.py"), "--config",
         str(REPO / "configs" / "tiny_demo.yaml")]
SMALL = [  # as tests/test_trainer.py: 4 prompts x 4 samples per version
    "train.batch_size=4", "rollout.n_samples=4", "rollout.max_new_tokens=40",
    "rollout.max_slots=16", "train.rows_per_micro_batch=8", "data.max_eval_prompts=8",
    "eval.every_versions=0", "eval.at_start=false", "eval.at_end=false", "progress_bar=false",
    "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null",
]


def _env(gcs_emulator, tmp_path: Path) -> dict[str, str]:  # noqa: F811
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    env.update(gcs_emulator.env(), JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               AREAL_JAX_CACHE_DIR=str(tmp_path / "cache"))
    return env


def _bucket_rows(url: str) -> list[dict]:
    if not storage.isfile(url):
        return []
    return [json.loads(line) for line in storage.read_text(url).splitlines() if line.strip()]


def _no_gs_folder(*roots: Path) -> None:
    for root in roots:
        bad = [p for p in root.rglob("*") if p.name in ("gs:", "gs")]
        assert not bad, f"local folders named after the URL scheme: {bad}"


def test_bad_cloud_paths_fail_up_front(gcs, tmp_path):  # noqa: F811
    """One line naming the key, the path and the cause; exit 2 before any compile; no
    local folder named after the URL."""
    env = _env(gcs, tmp_path)
    cases = [
        (["run_dir=gs://no-such-bucket/run"],
         "error: run_dir gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist"),
        (["run_dir=s3://bucket/run"],
         "error: run_dir s3://bucket/run: unsupported URL scheme 's3'"),
        ([f"run_dir={tmp_path}/run", "model.path=gs://test-bucket/no-model"],
         "error: model.path gs://test-bucket/no-model does not exist"),
        ([f"run_dir={tmp_path}/run", "data.train=gs://test-bucket/none.jsonl"],
         "error: data.train gs://test-bucket/none.jsonl does not exist"),
    ]
    for overrides, message in cases:
        res = subprocess.run(TRAIN + SMALL + overrides, capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=300)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 2 and lines and lines[-1].startswith(message), res.stderr[-3000:]
        assert "Traceback" not in res.stderr
    _no_gs_folder(tmp_path)
    assert not (tmp_path / "s3:").exists()


def test_gs_paths_without_gcsfs_name_the_extra(tmp_path):
    """issue 39 item 3: a config's optional packages are checked before anything starts;
    gcsfs missing (simulated by one that cannot be imported, first on the path) names the
    key and the extra to install."""
    shim = tmp_path / "shim" / "gcsfs"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'gcsfs'\", name='gcsfs')\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(shim.parent), str(REPO)]))
    res = subprocess.run(TRAIN + SMALL + ["run_dir=gs://test-bucket/run"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "error: run_dir gs://test-bucket/run needs the gcsfs package, which is not installed: "
        "pip install -e '.[gcs]' (or pip install 'areal-jax[gcs]')"), res.stderr[-3000:]
    _no_gs_folder(tmp_path)


def _stage_inputs(tmp_path: Path, prefix: str) -> list[str]:
    """The initial policy and the prompt datasets, uploaded to the bucket; the overrides
    that point a run at them."""
    from areal_jax.data import builtin_task

    storage.upload(ASSETS, f"{prefix}/models/arith_sft")
    for split in ("train", "eval"):
        local = builtin_task.write_split(tmp_path / f"{split}.jsonl", split)
        storage.upload(local, f"{prefix}/data/{split}.jsonl")
    return [f"model.path={prefix}/models/arith_sft", f"data.train={prefix}/data/train.jsonl",
            f"data.eval={prefix}/data/eval.jsonl"]


def _latest_step(ckpt_dir: str) -> int | None:
    from areal_jax.checkpoint import TrainCheckpointer

    with TrainCheckpointer(ckpt_dir, read_only=True) as ck:
        return ck.latest_step()


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 900):
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


@pytest.mark.slow
def test_train_on_a_bucket_then_convert(gcs, tmp_path):  # noqa: F811
    """run_dir, initial model and datasets on gs://: checkpoints, weights, metrics and the
    other run files end up as objects in the bucket, and no local ``gs:`` folder appears.
    convert.py turns the bucket checkpoint into an HF dir in the bucket."""
    env = _env(gcs, tmp_path)
    prefix = f"{BUCKET}/plain"
    run = f"{prefix}/run"
    res = _run(TRAIN + SMALL + _stage_inputs(tmp_path, prefix)
               + [f"run_dir={run}", "train.total_versions=2", "checkpoint.every_versions=1"],
               env, tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _bucket_rows(f"{run}/metrics.jsonl")
    assert [r["version"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert _latest_step(f"{run}/checkpoints") == 2
    assert storage.isfile(f"{run}/checkpoints/2/commit_success.txt")
    assert {"v1", "v2"} <= set(storage.listdir(f"{run}/weights"))
    assert storage.isfile(f"{run}/weights/v2/COMMIT")
    assert storage.isfile(f"{run}/config.yaml") and storage.listdir(f"{run}/tensorboard")
    assert "server0.log" in storage.listdir(f"{run}/logs")
    assert len(_bucket_rows(f"{run}/consumed_prompts.jsonl")) == 2
    _no_gs_folder(tmp_path, REPO)

    # The bucket checkpoint -> an HF dir in the bucket, equal to the weights the trainer
    # published for the same version (both are the learner's fp32 params, no arithmetic).
    hf_out = f"{prefix}/exports/v2"
    res = _run([sys.executable, str(SCRIPTS / "convert.py"), "orbax-to-hf", "--ckpt",
                f"{run}/checkpoints", "--out", hf_out, "--tokenizer", f"{prefix}/models/arith_sft"],
               env, tmp_path, 300)
    assert res.returncode == 0, res.stderr[-3000:]
    from safetensors.numpy import load_file

    converted = storage.local_copy(hf_out, str(tmp_path / "dl"), kind="a")
    published = storage.local_copy(f"{run}/weights/v2", str(tmp_path / "dl"), kind="b")
    a, b = load_file(converted / "model.safetensors"), load_file(published / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert (converted / "tokenizer.json").is_file()
    # A non-empty --out in the bucket is refused, with one line.
    res = _run([sys.executable, str(SCRIPTS / "convert.py"), "orbax-to-hf", "--ckpt",
                f"{run}/checkpoints", "--out", hf_out], env, tmp_path, 300)
    assert res.returncode == 2 and res.stderr.strip().endswith(f"--out {hf_out} is not empty; "
                                                               "choose a new directory")
    _no_gs_folder(tmp_path, REPO)


@pytest.mark.slow
def test_sigkill_resume_from_the_bucket_then_eval_and_plot(gcs, tmp_path):  # noqa: F811
    env = _env(gcs, tmp_path)
    prefix = f"{BUCKET}/killed"
    run = f"{prefix}/run"
    args = _stage_inputs(tmp_path, prefix) + [
        f"run_dir={run}", "train.total_versions=3", "checkpoint.every_versions=1",
        "storage.upload_every_s=0.5"]
    proc = subprocess.Popen(TRAIN + SMALL + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, cwd=tmp_path, start_new_session=True)
    # Killed once the bucket holds version 1's checkpoint and its metrics row.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if (storage.exists(f"{run}/checkpoints/1/commit_success.txt")
                and any(r["version"] >= 1 for r in _bucket_rows(f"{run}/metrics.jsonl"))):
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    saved = _latest_step(f"{run}/checkpoints")
    assert saved is not None and 1 <= saved < 3
    # Uploaded before the kill: the rows of every checkpointed version.
    assert {r["version"] for r in _bucket_rows(f"{run}/metrics.jsonl")} >= set(range(1, saved + 1))

    res = _run(TRAIN + SMALL + args, env, tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resumed from {run}/checkpoints at version {saved}" in res.stdout
    rows = _bucket_rows(f"{run}/metrics.jsonl")
    assert [r["version"] for r in rows] == [1, 2, 3]  # versions continue, no row repeated
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert _latest_step(f"{run}/checkpoints") == 3
    assert storage.isfile(f"{run}/weights/v3/COMMIT")
    _no_gs_folder(tmp_path, REPO)

    # eval.py: the bucket checkpoint on the bucket's eval set; the result goes to the bucket.
    res = _run([sys.executable, str(SCRIPTS / "eval.py"), "--ckpt", f"{run}/checkpoints",
                "--tokenizer", f"{prefix}/models/arith_sft", "--data", f"{prefix}/data/eval.jsonl",
                "--max-prompts", "4", "--max-new-tokens", "40", "--max-slots", "8",
                "--max-seq-len", "96", "--out", f"{run}/eval.json"], env, tmp_path, 300)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(storage.read_text(f"{run}/eval.json"))
    assert 0.0 <= result["accuracy"] <= 1.0 and result["model"] == f"{run}/checkpoints"

    # plot.py: from the bucket, into the bucket.
    res = _run([sys.executable, str(SCRIPTS / "plot.py"), run], env, tmp_path, 300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reward_vs_version.png" in storage.listdir(f"{run}/plots")
    _no_gs_folder(tmp_path, REPO)
