"""Flax NNX decoder-only causal LMs (Qwen2/Qwen2.5, Qwen3, Llama 3) and HF checkpoint I/O."""

from model_defs.config import (
    PRESETS,
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    JsonDict,
    ModelConfig,
    ModelDirNotFoundError,
    UnsupportedArchitectureError,
)
from model_defs.hf_io import HF_PARAM_TABLE, CheckpointError, load_hf, parse_dtype, save_hf
from model_defs.lora import LORA_TARGETS, LoraConfig, add_lora, lora_config, merge_lora
from model_defs.model import REMAT_POLICIES, CausalLM, remat_policy_name
from model_defs.peft_io import PeftAdapter, load_peft_adapter, peft_adapter, save_peft_adapter
from model_defs.precision import fp32_matmul_precision, fp32_matmuls
from model_defs.sharding import (
    LOGICAL_AXIS_RULES,
    PyTree,
    current_mesh,
    logical_to_spec,
    param_logical_axes,
    param_shardings,
    shard,
    use_mesh,
)

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "HF_PARAM_TABLE",
    "JsonDict",
    "LOGICAL_AXIS_RULES",
    "LORA_TARGETS",
    "LoraConfig",
    "ModelConfig",
    "ModelDirNotFoundError",
    "PRESETS",
    "PeftAdapter",
    "PyTree",
    "REMAT_POLICIES",
    "add_lora",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "current_mesh",
    "fp32_matmul_precision",
    "fp32_matmuls",
    "load_hf",
    "load_peft_adapter",
    "logical_to_spec",
    "lora_config",
    "merge_lora",
    "param_logical_axes",
    "param_shardings",
    "parse_dtype",
    "peft_adapter",
    "remat_policy_name",
    "save_hf",
    "save_peft_adapter",
    "shard",
    "use_mesh",
]
