"""WeightPublisher: atomic v{N} HF dirs, keep-K, pinning, tokenizer copy; params_to_hf_dir."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import hf_logits, make_tiny_hf_checkpoint
from safetensors.numpy import load_file

from areal_jax.checkpoint.publish import (
    COMMIT_MARKER,
    PublishError,
    WeightPublisher,
    params_to_hf_dir,
)
from areal_jax.data.builtin_task import save_tokenizer
from model_defs import load_hf


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    hf_dir = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"), arch="qwen2", tie=False, seed=3)
    model, cfg = load_hf(hf_dir, dtype="float32")
    return hf_dir, model, cfg


def _scaled_params(model, factor: float):
    """The model's params times ``factor``, as the pure dict a checkpoint restore gives."""
    return jax.tree.map(lambda x: x * factor, nnx.state(model, nnx.Param).to_pure_dict())


def _tensors(path) -> dict[str, np.ndarray]:
    return load_file(os.path.join(path, "model.safetensors"))


def test_publish_keep_k_and_transformers_loads(tmp_path, tiny_model):
    hf_dir, model, cfg = tiny_model
    pub = WeightPublisher(tmp_path / "weights", keep=2)
    assert pub.latest() is None
    paths = [pub.publish(model, cfg, v) for v in range(4)]
    assert pub.versions() == [2, 3] and pub.latest() == 3
    assert sorted(os.listdir(tmp_path / "weights")) == ["v2", "v3"]
    assert paths[3] == pub.path_for(3) == os.path.join(str(tmp_path / "weights"), "v3")
    assert os.path.isfile(os.path.join(paths[3], COMMIT_MARKER))
    with pytest.raises(PublishError, match=r"version 0 is not published .*available: \[2, 3\]"):
        pub.path_for(0)
    # The published dir is an HF dir that transformers loads, with the original's logits.
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 9))
    # fp32 weights published bit for bit: transformers computes the same logits exactly.
    np.testing.assert_array_equal(hf_logits(paths[3], ids), hf_logits(hf_dir, ids))


def test_pinned_and_republished_versions(tmp_path, tiny_model):
    _, model, cfg = tiny_model
    pub = WeightPublisher(tmp_path / "weights", keep=1)
    pub.publish(model, cfg, 0)
    pub.pin(0)
    for v in (1, 2, 3):
        pub.publish(model, cfg, v)
    assert pub.versions() == [0, 3]
    pub.unpin(0)
    pub.publish(_scaled_params(model, 2.0), cfg, 3)  # a resumed run re-publishes v3
    assert pub.versions() == [3]
    got = _tensors(pub.path_for(3))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(got, 2.0 * np.asarray(model.embed_vd[...]))
    assert not [n for n in os.listdir(tmp_path / "weights") if n.startswith(".")]


def test_tokenizer_files_copied(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    _, model, cfg = tiny_model
    tok_dir = save_tokenizer(tmp_path / "tok")
    (tok_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    pub = WeightPublisher(tmp_path / "weights")
    path = pub.publish(model, cfg, 1, tokenizer_dir=tok_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tok_dir / name).read_bytes() == open(os.path.join(path, name), "rb").read()
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode(tok("12+3=")["input_ids"]).replace(" ", "").endswith("12+3=")


def test_failed_or_killed_publish_is_never_visible(tmp_path, tiny_model):
    _, model, cfg = tiny_model
    weights = tmp_path / "weights"
    pub = WeightPublisher(weights, keep=3)
    pub.publish(model, cfg, 1)
    # Fails after the safetensors were written (bad tokenizer dir): no v2, no tmp left.
    with pytest.raises(PublishError, match="tokenizer_dir .*nope does not exist"):
        pub.publish(model, cfg, 2, tokenizer_dir=tmp_path / "nope")
    assert pub.versions() == [1] and sorted(os.listdir(weights)) == ["v1"]
    # Params of another shape: named error, nothing written.
    bad = _scaled_params(model, 1.0)
    bad["embed_vd"] = bad["embed_vd"][:, :-1]
    with pytest.raises(PublishError, match=r"param embed_vd has shape \(128, 31\).*\(128, 32\)"):
        pub.publish(bad, cfg, 2)
    del bad["final_norm"]
    with pytest.raises(PublishError, match=r"missing \['final_norm.scale'\]"):
        pub.publish(bad, cfg, 2)
    assert sorted(os.listdir(weights)) == ["v1"]
    # What a killed publisher leaves: a tmp dir of a dead pid, and a v-dir with no COMMIT
    # (an object-store write cut short). Neither is a version; the tmp dir is cleaned.
    dead = weights / ".v2.tmp-999999999"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    (weights / "v5").mkdir()
    pub = WeightPublisher(weights, keep=3)
    assert not dead.exists()
    assert pub.versions() == [1] and pub.latest() == 1
    with pytest.raises(PublishError, match="version 5 is not published"):
        pub.path_for(5)


def test_commit_marker_mode_on_local_disk(tmp_path, tiny_model):
    """The object-store (gs://) code path: files first, COMMIT last, no rename."""
    _, model, cfg = tiny_model
    pub = WeightPublisher(tmp_path / "weights", keep=2)
    pub.use_rename = False
    for v in (1, 2, 3):
        pub.publish(_scaled_params(model, float(v)), cfg, v)
    pub.publish(_scaled_params(model, 5.0), cfg, 3)
    assert pub.versions() == [2, 3]
    got = _tensors(pub.path_for(3))["model.norm.weight"]
    np.testing.assert_array_equal(got, 5.0 * np.asarray(model.final_norm.scale[...]))


def test_commit_marker_mode_writes_the_marker_only_after_every_file(tmp_path, tiny_model,
                                                                  monkeypatch):
    """The object-store path's ordering promise, by a fault injected between the steps: a
    write that fails part-way (a full disk, a dropped connection) leaves the version
    invisible, never a COMMIT over missing files; the versions before it stay served. And
    in a whole publish COMMIT is the last thing written."""
    from etils.epath import gpath

    _, model, cfg = tiny_model
    pub = WeightPublisher(tmp_path / "weights", keep=3)
    pub.use_rename = False
    pub.publish(_scaled_params(model, 1.0), cfg, 1)
    written, real_write_bytes = [], gpath._GPath.write_bytes

    def faulty_write_bytes(self, data):
        written.append(self.name)
        if self.name == "model.safetensors":
            raise OSError(28, "No space left on device")
        return real_write_bytes(self, data)

    monkeypatch.setattr(gpath._GPath, "write_bytes", faulty_write_bytes)
    for version in (2, 1):  # a new version, and one replacing a committed version
        with pytest.raises(OSError, match="No space left"):
            pub.publish(_scaled_params(model, 2.0), cfg, version)
        assert not (tmp_path / "weights" / f"v{version}" / COMMIT_MARKER).exists()
        assert pub.versions() == ([1] if version == 2 else [])  # v1 was taken down first
        with pytest.raises(PublishError, match=f"version {version} is not published"):
            pub.path_for(version)
    assert "model.safetensors" in written and COMMIT_MARKER not in written

    monkeypatch.setattr(gpath._GPath, "write_bytes", real_write_bytes)
    order = []
    real_write_text = gpath._GPath.write_text

    def spy_bytes(self, data):
        order.append(self.name)
        return real_write_bytes(self, data)

    def spy_text(self, data, *args, **kwargs):
        order.append(self.name)
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(gpath._GPath, "write_bytes", spy_bytes)
    monkeypatch.setattr(gpath._GPath, "write_text", spy_text)
    pub.publish(_scaled_params(model, 3.0), cfg, 3)
    assert order[-1] == COMMIT_MARKER and order.count(COMMIT_MARKER) == 1
    assert {"model.safetensors", "config.json"} <= set(order[:-1])
    assert pub.versions() == [3]


def test_params_to_hf_dir_from_state_and_restored_dict(tmp_path, tiny_model):
    _, model, cfg = tiny_model
    state = nnx.state(model, nnx.Param)
    a = params_to_hf_dir(state, cfg, tmp_path / "a")
    # A checkpoint restored without a target has string keys for the layer list.
    pure = state.to_pure_dict()
    pure["layers"] = {str(k): v for k, v in pure["layers"].items()}
    b = params_to_hf_dir(pure, cfg.to_hf_dict(), tmp_path / "b", dtype="bfloat16")
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and "lm_head.weight" in ta
    for k in ta:
        np.testing.assert_array_equal(tb[k].astype(np.float32),
                                      ta[k].astype("bfloat16").astype(np.float32))
    with pytest.raises(TypeError, match="model_cfg must be a ModelConfig or an HF config dict"):
        params_to_hf_dir(state, "qwen2", tmp_path / "c")
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        WeightPublisher(tmp_path / "w", keep=0)


def test_host_copy_in_the_serving_dtype_is_what_the_publisher_writes(tmp_path):
    """host_params(dtype="bfloat16") casts on device before the host copy (2 B/param for a
    bf16 run's fp32 master weights), and publishing it writes the same bf16 tensors as
    publishing the fp32 params with the publisher's own cast."""
    import ml_dtypes

    from areal_jax.checkpoint.publish import host_params

    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True)
    model, cfg = load_hf(path)
    copy = host_params(model, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(copy)} == {np.dtype(ml_dtypes.bfloat16)}
    a = WeightPublisher(tmp_path / "a", dtype="bfloat16").publish(copy, cfg, 1)
    b = WeightPublisher(tmp_path / "b", dtype="bfloat16").publish(host_params(model), cfg, 1)
    ta, tb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert ta[key].dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(ta[key].view(np.uint16), tb[key].view(np.uint16))
