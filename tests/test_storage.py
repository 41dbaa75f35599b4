"""The storage layer against a real GCS emulator (fake-gcs-server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_jax import storage
from areal_jax.storage import StorageError
from tests.gcs_emulator import gcs  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path, message", [
    ("s3://bucket/run", "unsupported URL scheme 's3'"),
    ("hdfs://nn/run", "unsupported URL scheme 'hdfs'"),
    ("gs:/bucket/run", "mangled URL"),
])
def test_unsupported_schemes_are_errors_not_local_folders(tmp_path, path, message):
    with pytest.raises(StorageError, match=message):
        storage.check_location(path, "run_dir", write=True)
    with pytest.raises(StorageError, match=message):
        storage.join(path, "metrics.jsonl")
    assert not any(tmp_path.iterdir()) and not Path("gs:").exists() and not Path("s3:").exists()


def test_local_and_url_paths_join_alike():
    assert storage.join("gs://b/run/", "checkpoints") == "gs://b/run/checkpoints"
    assert storage.join("/tmp/run", "checkpoints") == "/tmp/run/checkpoints"
    assert storage.normalize("gs://b/run/") == "gs://b/run"
    assert storage.normalize("file:///tmp/x") == "/tmp/x"
    assert storage.name_of("gs://b/run/weights/v3/") == "v3"
    assert storage.parent_of("gs://b/run/weights/v3/") == "gs://b/run/weights"
    assert storage.parent_of("/tmp/run/weights/v3") == "/tmp/run/weights"


def test_files_round_trip_in_the_bucket(gcs, tmp_path):  # noqa: F811
    base = "gs://test-bucket/storage-roundtrip"
    storage.write_text(storage.join(base, "a", "b.json"), json.dumps({"x": 1}))
    assert json.loads(storage.read_text(storage.join(base, "a", "b.json"))) == {"x": 1}
    assert storage.isdir(storage.join(base, "a")) and storage.isfile(storage.join(base, "a/b.json"))
    assert storage.listdir(base) == ["a"]
    assert storage.listdir(storage.join(base, "missing")) == []
    # A local tree up and down again, byte for byte.
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "top.bin").write_bytes(os.urandom(1000))
    (src / "sub" / "deep.txt").write_text("deep")
    storage.upload(src, storage.join(base, "tree"))
    copied = storage.download(storage.join(base, "tree"), tmp_path / "back")
    assert sorted(copied) == ["sub/deep.txt", "top.bin"]
    assert (tmp_path / "back" / "top.bin").read_bytes() == (src / "top.bin").read_bytes()
    # local_copy: cached under the cache root, marked complete, never a "gs:" folder.
    cached = storage.local_copy(storage.join(base, "tree"), cache_dir=str(tmp_path / "cache"))
    assert cached.is_relative_to(tmp_path / "cache")
    assert (cached / "sub" / "deep.txt").read_text() == "deep"
    assert not any("gs:" in p.parts for p in tmp_path.rglob("*"))
    storage.remove(storage.join(base, "tree"), recursive=True)
    assert not storage.exists(storage.join(base, "tree", "top.bin"))


def test_fail_fast_on_a_missing_bucket_or_object(gcs):  # noqa: F811
    with pytest.raises(StorageError, match=r"^run_dir gs://no-such-bucket/run: bucket "
                                           r"gs://no-such-bucket does not exist$"):
        storage.check_location("gs://no-such-bucket/run", "run_dir", write=True)
    with pytest.raises(StorageError,
                       match=r"data.train gs://test-bucket/nope.jsonl does not exist"):
        storage.check_location("gs://test-bucket/nope.jsonl", "data.train", must_exist=True)
    assert storage.check_location("gs://test-bucket/run/", "run_dir", write=True) \
        == "gs://test-bucket/run"
    with pytest.raises(StorageError, match="no bucket name"):
        storage.check_location("gs:///run", "run_dir")


def test_no_credentials_is_one_line_up_front(tmp_path):
    """Without an emulator and without Application Default Credentials, a gs:// run dir
    is refused with one line naming the path and the cause (the metadata server is
    pointed at a closed local port, as off-cloud)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GOOGLE_", "STORAGE_EMULATOR", "TENSORSTORE_GCS", "CLOUDSDK"))}
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9",
               NO_GCE_CHECK="true", PYTHONPATH=str(REPO))
    code = ("from areal_jax import storage\n"
            "storage.check_location('gs://some-bucket/run', 'run_dir', write=True)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("areal_jax.storage.StorageError: run_dir gs://some-bucket/run: "
                           "no Google Cloud credentials found"), res.stderr[-2000:]
    assert not (tmp_path / "gs:").exists()


def test_run_files_are_uploaded_and_continued(gcs, tmp_path):  # noqa: F811
    """The local working copy is uploaded on sync; a new RunFiles (a resumed run) starts
    from what the bucket holds, and folders written directly to the bucket are skipped."""
    run_dir = "gs://test-bucket/runfiles"
    storage.write_text(storage.join(run_dir, "checkpoints", "1", "x"), "ckpt")  # not a run file
    files = storage.RunFiles(run_dir, cache_dir=str(tmp_path / "c"), upload_every_s=0,
                                        exclude=("checkpoints", "weights"))
    with files.path("metrics.jsonl").open("a") as f:
        f.write('{"version": 1}\n')
    assert files.sync() == 1 and files.sync() == 0  # unchanged files are not re-uploaded
    with files.path("metrics.jsonl").open("a") as f:
        f.write('{"version": 2}\n')
    files.path("logs").mkdir()
    files.path("logs", "server0.log").write_text("log")
    files.close()
    assert storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines() == [
        '{"version": 1}', '{"version": 2}']
    again = storage.RunFiles(run_dir, cache_dir=str(tmp_path / "c2"), upload_every_s=0,
                             exclude=("checkpoints", "weights"))
    assert again.path("metrics.jsonl").read_text().count("version") == 2
    assert again.path("logs", "server0.log").read_text() == "log"
    assert not again.path("checkpoints").exists()
    again.close()


def test_orbax_checkpoint_in_the_bucket_is_atomic(gcs):  # noqa: F811
    """Orbax writes to gs:// through tensorstore (pointed at the emulator by the storage
    layer); a step without its commit marker is not taken for the latest."""
    import jax.numpy as jnp

    from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer

    directory = "gs://test-bucket/ckpt-atomic"
    with TrainCheckpointer(directory, keep=3) as ck:
        ck.save(1, {"w": jnp.arange(6.0).reshape(2, 3)}, None, CheckpointMeta(version=1))
        ck.save(2, {"w": jnp.arange(6.0).reshape(2, 3) * 2}, None, CheckpointMeta(version=2))
    assert storage.exists(storage.join(directory, "2", "commit_success.txt"))
    # A killed save: step 2's marker gone, as if the process died before committing it.
    storage.remove(storage.join(directory, "2", "commit_success.txt"))
    with TrainCheckpointer(directory, read_only=True) as ck:
        assert ck.latest_step() == 1
        params, _, meta = ck.restore()
    np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(6.0).reshape(2, 3))
    assert meta.version == 1


def test_engine_reads_gs_weights_through_one_cache_slot(gcs, tmp_path, monkeypatch):  # noqa: F811
    """The engine's model dir check downloads a gs:// version into this process's cache
    slot, which holds one version at a time (a long run does not fill the disk)."""
    from areal_jax.engine.model_dir import ModelPathError, check_model_dir

    monkeypatch.setenv("AREAL_JAX_CACHE_DIR", str(tmp_path / "cache"))
    assets = REPO / "areal_jax" / "data" / "assets" / "arith_sft"
    for v in (1, 2):
        storage.upload(assets, f"gs://test-bucket/slot/v{v}")
    first = check_model_dir("gs://test-bucket/slot/v1")
    assert (first / "config.json").read_bytes() == (assets / "config.json").read_bytes()
    second = check_model_dir("gs://test-bucket/slot/v2")
    assert second.parent == tmp_path / "cache" / "weights" / f"pid{os.getpid()}"
    assert second.is_dir() and not first.exists()
    with pytest.raises(ModelPathError, match=r"^model_path gs://test-bucket/slot/v9 does not "
                                             r"exist or is not a directory$"):
        check_model_dir("gs://test-bucket/slot/v9")


def test_config_file_read_from_the_bucket(gcs):  # noqa: F811
    from areal_jax.config import ConfigError, load_config

    text = (REPO / "configs" / "tiny_demo.yaml").read_text()
    storage.write_text("gs://test-bucket/configs/demo.yaml", text)
    cfg = load_config("gs://test-bucket/configs/demo.yaml", ["run_dir=gs://test-bucket/r"])
    assert cfg.run_dir == "gs://test-bucket/r" and cfg.model.path == "builtin:arith_sft"
    with pytest.raises(ConfigError, match="config file gs://test-bucket/configs/none.yaml does "
                                          "not exist"):
        load_config("gs://test-bucket/configs/none.yaml")


def test_run_files_are_uploaded_on_a_schedule(gcs, tmp_path):  # noqa: F811
    """Without any explicit sync, the background upload brings a new row to the bucket."""
    import time

    run_dir = "gs://test-bucket/scheduled"
    files = storage.RunFiles(run_dir, cache_dir=str(tmp_path), upload_every_s=0.2)
    files.start()
    try:
        with files.path("metrics.jsonl").open("a") as f:
            f.write('{"version": 1}\n')
        deadline = time.monotonic() + 60  # generous: only the eventual upload is checked
        url = storage.join(run_dir, "metrics.jsonl")
        while not storage.isfile(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert storage.read_text(url) == '{"version": 1}\n'
    finally:
        files.close()
