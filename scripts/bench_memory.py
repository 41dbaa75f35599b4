"""Learner memory: compiled forward+backward temporaries vs row length, and bytes/parameter.

    python scripts/bench.py memory [--seq 2048,4096,8192 --layers 2 --hidden 256]
                                   [--learner-preset qwen2.5-0.5b --learner-seq 1024]

Compile only (nothing is run, so it works for shapes that would not fit): the learner's
real gradient program (``learner.steps.make_grad_fn``: packed rows, chunked logprobs,
decoupled PPO loss) is lowered with abstract inputs and XLA's ``memory_analysis`` is
read. Side by side, per row length T (one packed row of --segments segments):

* ``blockwise``: the attention as shipped (query blocks of ``model_defs.attention.BLOCK``);
* ``one block``: the same function with the block set to T, i.e. plain attention with the
  full T x T scores, the peer a linear-memory attention is measured against.

The second table gives the learner's memory per parameter for --learner-preset at
--learner-seq tokens per micro-batch: fp32 master params (4 B) + AdamW moments (8 B) +
the gradient accumulator (4 B) = 16 B/param held between steps, plus the larger of the
gradient and optimizer programs' compiled temporaries.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", default="2048,4096,8192", help="comma list of row lengths T")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--segments", type=int, default=4, help="packed segments per row")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--remat", default="none",
                        help="model.remat policy for the T sweep (see README: none, full, ...)")
    parser.add_argument("--learner-preset", default="qwen2.5-0.5b",
                        help="ModelConfig preset for bytes/param ('' to skip)")
    parser.add_argument("--learner-seq", type=int, default=1024)


def _abstract_model(cfg: Any, dtype: str, remat: Any) -> tuple[Any, Any, Any, int]:
    import jax.numpy as jnp
    from flax import nnx

    from model_defs import CausalLM

    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype),
                                            param_dtype=jnp.float32, remat=remat))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    n_params = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(params))
    return graphdef, params, rest, n_params


def _abstract_batch(t: int, segments: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    del segments  # shapes only; the segment layout does not change the program
    i32 = jax.ShapeDtypeStruct((1, t), jnp.int32)
    f32 = jax.ShapeDtypeStruct((1, t), jnp.float32)
    return {"input_ids": i32, "positions": i32, "segment_ids": i32, "versions": i32,
            "loss_mask": f32, "prox_logp": f32, "behav_logp": f32, "advantages": f32}


def _grad_memory(cfg: Any, dtype: str, remat: Any, t: int, segments: int) -> tuple[Any, int]:
    import jax
    import jax.numpy as jnp

    from areal_jax.learner.config import PPOConfig
    from areal_jax.learner.steps import make_grad_fn, zero_sums

    graphdef, params, rest, n_params = _abstract_model(cfg, dtype, remat)
    grad_fn = make_grad_fn(graphdef, jnp.dtype(dtype), PPOConfig())
    sums = jax.eval_shape(zero_sums)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    version = jax.ShapeDtypeStruct((), jnp.int32)
    compiled = jax.jit(grad_fn, donate_argnums=(2, 3)).lower(
        params, rest, params, sums, _abstract_batch(t, segments), scalar, scalar, version
    ).compile()
    return compiled.memory_analysis(), n_params


def _apply_memory(cfg: Any) -> Any:
    import jax

    from areal_jax.learner.config import OptimizerConfig
    from areal_jax.learner.optimizer import make_optimizer
    from areal_jax.learner.steps import make_apply_fn

    _, params, _, _ = _abstract_model(cfg, "float32", False)
    tx = make_optimizer(OptimizerConfig())
    opt_state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(make_apply_fn(tx), donate_argnums=(0, 1)).lower(
        params, opt_state, params).compile()
    return compiled.memory_analysis(), opt_state


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    import model_defs.attention as attention_module
    from model_defs import ModelConfig

    seqs = [int(x) for x in args.seq.split(",")]
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(seqs))
    remat = False if args.remat == "none" else (True if args.remat == "full" else args.remat)
    rows: list[list] = []
    shipped_block = attention_module.BLOCK
    temps: dict[str, list[int]] = {"blockwise": [], "one block": []}
    for t in seqs:
        for name, block in (("blockwise", shipped_block), ("one block", t)):
            attention_module.BLOCK = block
            try:
                mem, _ = _grad_memory(cfg, args.dtype, remat, t, args.segments)
            finally:
                attention_module.BLOCK = shipped_block
            temps[name].append(mem.temp_size_in_bytes)
            prev = temps[name][-2] if len(temps[name]) > 1 else None
            growth = round(mem.temp_size_in_bytes / prev, 2) if prev else ""
            rows.append([t, name, _mib(mem.temp_size_in_bytes), growth])
    summary: dict[str, Any] = {
        "model": f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {args.dtype}",
        "backend": jax.default_backend(),
    }
    for name, values in temps.items():
        if len(values) > 1:
            summary[f"{name}: growth per doubling (last)"] = round(values[-1] / values[-2], 2)
    if len(seqs) and temps["one block"][-1]:
        summary[f"one block / blockwise temp at T={seqs[-1]}"] = round(
            temps["one block"][-1] / temps["blockwise"][-1], 2)

    if args.learner_preset:
        lcfg = ModelConfig.preset(args.learner_preset)
        grad_mem, n_params = _grad_memory(lcfg, args.dtype, remat, args.learner_seq, 1)
        apply_mem, opt_state = _apply_memory(lcfg)
        opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))
        held = 4 * n_params + opt_bytes + 4 * n_params  # params, AdamW state, grad accumulator
        peak = held + max(grad_mem.temp_size_in_bytes, apply_mem.temp_size_in_bytes)
        summary.update({
            "learner model": f"{args.learner_preset} ({n_params / 1e6:.0f}M params), "
                             f"T={args.learner_seq}",
            "learner held bytes/param (params+AdamW+grads)": round(held / n_params, 2),
            "learner grad-program temp MiB": _mib(grad_mem.temp_size_in_bytes),
            "learner apply-program temp MiB": _mib(apply_mem.temp_size_in_bytes),
            "learner compiled peak bytes/param": round(peak / n_params, 2),
        })
    return {"title": "learner forward+backward compiled temp memory (memory_analysis)",
            "columns": ["T", "attention", "temp MiB", "x prev T"], "rows": rows,
            "summary": summary}
