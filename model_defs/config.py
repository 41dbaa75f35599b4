"""ModelConfig: the hyper-parameters of a decoder-only causal LM, read from / written to HF."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")

MODEL_TYPE_BY_ARCH = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}

SUPPORTED_ROPE_TYPES = ("default", "llama3")


# A JSON object: an HF config.json, a checkpoint's meta, a request body. Its values are
# whatever JSON holds (numbers, strings, lists, nested objects): truly arbitrary, hence Any.
JsonDict = dict[str, Any]


class ConfigError(ValueError):
    """A config value that cannot be used: a model's config.json or ModelConfig field, or a
    run config key (``areal_jax.config``); the message names the key."""


def read_json_config(path: Path) -> Any:
    """A JSON config file's contents; ConfigError naming the file when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


class UnsupportedArchitectureError(ConfigError):
    """config.json names an architecture outside SUPPORTED_ARCHITECTURES."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Qwen2 / Qwen3 / Llama-3 style decoder-only LM.

    Field names follow the HF config.json keys. ``attention_bias`` is the q/k/v bias
    (Qwen2 has it, Qwen3 and Llama do not); ``qk_norm`` is the per-head RMSNorm on q
    and k (Qwen3).
    """

    architecture: str = "Qwen2ForCausalLM"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # 0 (or None, as HF configs write it): hidden_size // num_attention_heads, set at init,
    # so the field is always a positive int afterwards.
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling)

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Builds a config from an HF config.json dict (transformers 4.x or 5.x layout)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source} holds a JSON {type(d).__name__}; expected a JSON object "
                              "(an HF model config, {\"architectures\": [...], ...})")
        archs = d.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(d.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            shown = archs[0] if archs else f"model_type={d.get('model_type')!r}"
            raise UnsupportedArchitectureError(
                f"{source}: architecture {shown!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act={d['hidden_act']!r} is not supported "
                              "(only 'silu')")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        # transformers 5 folds rope_theta / rope_scaling into rope_parameters.
        rope_params = dict(d.get("rope_parameters") or {})
        rope_theta = (d["rope_theta"] if "rope_theta" in d
                      else rope_params.pop("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params:
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.pop("rope_theta", None)
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type == "default":
                rope_scaling = None
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing key(s) {', '.join(missing)}")
        if arch == "Qwen2ForCausalLM":
            attention_bias, qk_norm = True, False
        elif arch == "Qwen3ForCausalLM":
            attention_bias, qk_norm = bool(d.get("attention_bias", False)), True
        else:
            attention_bias, qk_norm = bool(d.get("attention_bias", False)), False
        try:
            return cls(
                architecture=arch,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                head_dim=d.get("head_dim") or 0,
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                qk_norm=qk_norm,
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
            )
        except ConfigError as e:
            if str(e).startswith(source):
                raise
            raise type(e)(f"{source}: {e}") from None

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """An HF config.json dict that transformers (4.x and 5.x) loads."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPE_BY_ARCH[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }
        if self.architecture == "Qwen2ForCausalLM":
            d["use_sliding_window"] = False
        else:
            d["attention_bias"] = self.attention_bias
        if self.architecture == "LlamaForCausalLM":
            d["mlp_bias"] = False
        return d

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        """Reads ``path/config.json``."""
        path = Path(path)
        config_path = path / "config.json"
        if not path.is_dir():
            raise ModelDirNotFoundError(f"model directory {path} does not exist")
        if not config_path.is_file():
            raise ModelDirNotFoundError(f"model directory {path} has no config.json")
        return cls.from_hf_dict(read_json_config(config_path), source=str(config_path))

    # ----------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """Named shapes: "tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "llama3.2-1b"."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads


class ModelDirNotFoundError(FileNotFoundError):
    """A model directory (or its config.json) that does not exist."""


def _validate_rope_scaling(rope_scaling: dict[str, Any]) -> None:
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rope_scaling]
        if missing:
            raise ConfigError(f"rope_scaling type 'llama3' is missing {', '.join(missing)}")


_ARCH_BY_MODEL_TYPE = {v: k for k, v in MODEL_TYPE_BY_ARCH.items()}

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=10000.0, tie_word_embeddings=True, attention_bias=True,
        max_position_embeddings=2048,
    ),
    "qwen2.5-0.5b": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=True, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen2.5-1.5b": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=1536,
        intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=True, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-1.7b": ModelConfig(  # Qwen/Qwen3-1.7B's config.json
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
    ),
    "llama3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, attention_bias=False, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
}
