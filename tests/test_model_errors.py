"""Bad input gets a short, specific error naming the file, architecture or tensor."""

from __future__ import annotations

import json
import traceback

import numpy as np
import pytest
from hf_fixtures import make_tiny_hf_checkpoint
from safetensors.numpy import load_file, save_file

from model_defs import (
    CheckpointError,
    ConfigError,
    ModelConfig,
    ModelDirNotFoundError,
    UnsupportedArchitectureError,
    load_hf,
)


def _raised_in_model_defs(excinfo: pytest.ExceptionInfo) -> None:
    """The error comes from our code, not from deep inside JAX/safetensors, with no chain."""
    last_frame = traceback.extract_tb(excinfo.tb)[-1]
    assert "model_defs" in last_frame.filename, last_frame
    assert excinfo.value.__cause__ is None
    assert excinfo.value.__suppress_context__ or excinfo.value.__context__ is None
    assert "\n" not in str(excinfo.value)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen2", tie=True)


def _copy_with(tmp_path, src, config=None, tensors=None):
    out = tmp_path / "bad"
    out.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    weights = load_file(str(src / "model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(out / "model.safetensors"))
    return out


def test_directory_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as excinfo:
        load_hf(tmp_path / "empty")
    assert isinstance(excinfo.value, ModelDirNotFoundError)
    assert str(tmp_path / "empty") in str(excinfo.value)
    assert "config.json" in str(excinfo.value)
    _raised_in_model_defs(excinfo)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tmp_path / "nope")


def test_unsupported_architecture(tmp_path, checkpoint):
    def mistral(cfg):
        return dict(cfg, architectures=["MistralForCausalLM"], model_type="mistral")

    bad = _copy_with(tmp_path, checkpoint, config=mistral)
    with pytest.raises(ValueError) as excinfo:
        load_hf(bad)
    assert isinstance(excinfo.value, UnsupportedArchitectureError)
    message = str(excinfo.value)
    assert "MistralForCausalLM" in message and "config.json" in message
    assert "Qwen2ForCausalLM" in message  # says what is supported
    _raised_in_model_defs(excinfo)


def test_missing_tensor(tmp_path, checkpoint):
    key = "model.layers.1.mlp.up_proj.weight"
    bad = _copy_with(tmp_path, checkpoint,
                     tensors=lambda w: {k: v for k, v in w.items() if k != key})
    with pytest.raises(ValueError) as excinfo:
        load_hf(bad)
    assert isinstance(excinfo.value, CheckpointError)
    message = str(excinfo.value)
    assert key in message and "model.safetensors" in message and "missing" in message
    assert "[64, 32]" in message  # the expected HF shape
    _raised_in_model_defs(excinfo)


def test_wrongly_shaped_tensor(tmp_path, checkpoint):
    key = "model.layers.0.self_attn.k_proj.weight"

    def corrupt(weights):
        weights = dict(weights)
        weights[key] = np.zeros((24, 32), np.float32)  # expected [16, 32]
        return weights

    bad = _copy_with(tmp_path, checkpoint, tensors=corrupt)
    with pytest.raises(CheckpointError) as excinfo:
        load_hf(bad)
    message = str(excinfo.value)
    assert key in message and "[24, 32]" in message and "[16, 32]" in message
    assert "model.safetensors" in message
    _raised_in_model_defs(excinfo)


def test_missing_weights_file(tmp_path, checkpoint):
    out = tmp_path / "noweights"
    out.mkdir()
    (out / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(out)


def test_corrupt_safetensors_file(tmp_path, checkpoint):
    out = tmp_path / "corrupt"
    out.mkdir()
    (out / "config.json").write_text((checkpoint / "config.json").read_text())
    (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as excinfo:
        load_hf(out)
    _raised_in_model_defs(excinfo)


def test_bad_dtype(checkpoint):
    with pytest.raises(ValueError, match="'float16' is not supported"):
        load_hf(checkpoint, dtype="float16")


@pytest.mark.parametrize("changes,match", [
    ({"num_key_value_heads": 3},
     "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    ({"hidden_size": 0}, "hidden_size must be a positive int, got 0"),
    ({"architecture": "GPT2LMHeadModel"}, "architecture 'GPT2LMHeadModel' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing low_freq_factor"),
])
def test_model_config_validation_names_the_key(changes, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.preset("tiny", **changes)


def test_config_json_missing_keys_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "hidden_size": 32}))
    with pytest.raises(ConfigError) as excinfo:
        ModelConfig.from_pretrained_dir(tmp_path)
    assert "config.json" in str(excinfo.value) and "vocab_size" in str(excinfo.value)


@pytest.mark.parametrize("text, kind", [("[1, 2]", "list"), ('"qwen"', "str"), ("3", "int")])
def test_config_json_that_is_not_an_object_names_the_file(tmp_path, text, kind):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        ModelConfig.from_pretrained_dir(tmp_path)
    assert str(excinfo.value).startswith(f"{tmp_path / 'config.json'} holds a JSON {kind}; "
                                         "expected a JSON object")
    _raised_in_model_defs(excinfo)


def test_hf_config_round_trip_and_presets():
    for name in ("tiny", "qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b"):
        cfg = ModelConfig.preset(name)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'"):
        ModelConfig.preset("gpt5")
