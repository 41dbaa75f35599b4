"""Tiny random HF checkpoints made offline with transformers (the reference implementation).

    from hf_fixtures import make_tiny_hf_checkpoint   # tests/ is on sys.path under pytest
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True, seed=0)

Overrides are HF config keys (``hidden_size=48``, ``num_key_value_heads=1``, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCH_ALIASES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}

BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_hf_config(arch: str = "qwen2", tie: bool = False, **overrides: Any) -> Any:
    """A transformers config object for a tiny model of ``arch`` ("qwen2"|"qwen3"|"llama")."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
    if arch not in config_cls:
        raise ValueError(f"arch must be one of {sorted(config_cls)}, got {arch!r}")
    kwargs = dict(BASE_CONFIG, tie_word_embeddings=tie)
    if arch in ("qwen3", "llama"):
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    kwargs.update(overrides)
    return config_cls[arch](**kwargs)


def make_hf_model(arch: str = "qwen2", tie: bool = False, seed: int = 0, **overrides: Any) -> Any:
    """A random fp32 transformers model (eval mode). Norm weights and biases are randomised
    too, so a mix-up of any tensor shows in the logits."""
    import torch
    from transformers import AutoModelForCausalLM

    config = make_hf_config(arch, tie=tie, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def make_tiny_hf_checkpoint(
    tmp_path: str | Path,
    arch: str = "qwen2",
    tie: bool = True,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Saves a tiny random fp32 HF checkpoint and returns its directory.

    ``max_shard_size`` (e.g. "20KB") makes transformers write sharded safetensors + index.
    """
    model = make_hf_model(arch, tie=tie, seed=seed, **overrides)
    name = f"{arch}-{'tied' if tie else 'untied'}-s{seed}"
    if overrides:
        name += "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())
                               if not isinstance(v, dict))
    out = Path(tmp_path) / name
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out


def hf_logits(model: Any, input_ids: Any, position_ids: Any = None) -> Any:
    """Logits [B, T, V] (numpy fp32) of a transformers model or checkpoint directory."""
    import numpy as np
    import torch

    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    kwargs = {}
    if position_ids is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(position_ids), dtype=torch.long)
    with torch.no_grad():
        return model(ids, **kwargs).logits.float().numpy()


_JITTED_FORWARD: Any = None


def jit_logits(model: Any, input_ids: Any, positions: Any = None, segment_ids: Any = None) -> Any:
    """``model(input_ids, positions=, segment_ids=)`` under ``nnx.jit`` (tests compile once
    per shape instead of running op by op, which is ~3x slower for tiny models)."""
    global _JITTED_FORWARD
    import jax.numpy as jnp
    from flax import nnx

    if _JITTED_FORWARD is None:
        _JITTED_FORWARD = nnx.jit(
            lambda m, ids, pos, seg: m(ids, positions=pos, segment_ids=seg))

    def as_int32(a: Any) -> Any:
        return None if a is None else jnp.asarray(a, jnp.int32)

    return _JITTED_FORWARD(model, as_int32(input_ids), as_int32(positions), as_int32(segment_ids))


def logit_tolerance(model: Any, input_ids: Any, position_ids: Any = None) -> float:
    """The fp32 rounding bound (tests/tolerance.py) on two evaluations of this model's logits
    for ``input_ids``: the largest Σ_d |h_d|·|W_vd| over tokens and vocabulary, at the network's
    reduction path length for this sequence length. A transformers model or checkpoint dir."""
    import numpy as np
    import torch
    from tolerance import hf_path_length, logits_term_scale, network_tolerance

    if isinstance(model, (str, Path)):
        model = _load_reference(str(model))
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    kwargs = {}
    if position_ids is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(position_ids), dtype=torch.long)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True, **kwargs).hidden_states[-1]  # after the norm
    head = model.get_output_embeddings().weight.detach().numpy()
    scale = logits_term_scale(hidden.numpy(), head).max()
    return float(network_tolerance(scale, hf_path_length(model.config, ids.shape[-1])))


_REFERENCES: dict[str, Any] = {}


def _load_reference(path: str) -> Any:
    """A transformers model of ``path``, loaded once per test process (checkpoints in tests
    are written once and never modified in place)."""
    if path not in _REFERENCES:
        import torch
        from transformers import AutoModelForCausalLM

        _REFERENCES[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _REFERENCES[path]


def token_logprob_tolerance(path: Any, sequence: Any, temperature: float = 1.0) -> float:
    """The fp32 bound on two evaluations of a sequence's per-token logprobs at ``temperature``
    (0 means greedy, reported at temperature 1): the logit bound of ``logit_tolerance``,
    divided by the temperature, through log-softmax."""
    from tolerance import logprob_tolerance

    model = _load_reference(str(path))
    t = temperature if temperature > 0 else 1.0
    return logprob_tolerance(model.config.vocab_size,
                             logit_tolerance(model, [list(sequence)]) / t)


# A chat template for the demo's arithmetic model, which ships without one: only characters
# of the built-in task's vocabulary (user turns verbatim, assistant turns followed by <eos>),
# so a conversation renders to the task's own format.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                 "<eos>{% endif %}{% endfor %}")


def arith_chat_model_dir(tmp_path_factory: Any, name: str) -> Path:
    """A copy of the demo's arithmetic checkpoint with ``CHAT_TEMPLATE`` beside it."""
    import shutil

    from areal_jax.run_inputs import ASSETS_DIR

    out = tmp_path_factory.mktemp(name) / "arith"
    shutil.copytree(ASSETS_DIR / "arith_sft", out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out
