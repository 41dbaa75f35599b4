"""The learner's memory, compiled and by formula, and the engine's KV cache.

Compile only (nothing is run, so it works for shapes that would not fit): the learner's
real gradient program (``learner.steps.make_grad_fn``: packed rows, chunked logprobs,
decoupled PPO loss) and optimizer update are lowered with abstract inputs, on a mesh or
one device, and XLA's ``memory_analysis`` is read (``grad_memory``, ``learner_bytes``:
bytes per parameter held between steps and at the compiled peak, full fine-tuning or
LoRA). Beside them, the formula of docs/models.md, "Memory" (``predicted_learner_bytes``,
``kv_cache_bytes``). ``python -m areal_jax.bench memory`` prints them side by side
(``areal_jax.bench.memory``); ``bench memory-run`` sets them next to real runs' RSS.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np


def _abstract_model(cfg: Any, dtype: str, remat: Any, lora_rank: int = 0
                    ) -> tuple[Any, Any, Any, int]:
    """(graphdef, trainable params, the rest, trainable count), as the learner splits them:
    with LoRA the trainable part is the adapters and the rest holds the frozen base in the
    compute dtype."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model_defs import CausalLM, LoraConfig, add_lora

    def build() -> Any:
        model = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype),
                         param_dtype=jnp.float32, remat=remat)
        if lora_rank:
            add_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank),
                     rngs=nnx.Rngs(1))
        return model

    trainable = nnx.LoRAParam if lora_rank else nnx.Param
    graphdef, params, rest = nnx.split(nnx.eval_shape(build), trainable, ...)  # type: ignore[misc]
    if lora_rank:
        rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), rest)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return graphdef, params, rest, n_params


def _abstract_batch(t: int, rows: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    # Shapes only: the segment layout does not change the program.
    i32 = jax.ShapeDtypeStruct((rows, t), jnp.int32)
    f32 = jax.ShapeDtypeStruct((rows, t), jnp.float32)
    return {"input_ids": i32, "positions": i32, "segment_ids": i32, "versions": i32,
            "loss_mask": f32, "prox_logp": f32, "behav_logp": f32, "advantages": f32}


def _on_mesh(tree: Any, shardings: Any) -> Any:
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(shardings, dict):
        shardings = [shardings[k] for k in tree]  # batch dicts: same keys, same order
    return jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)])


def _compiler_options(mesh: Any) -> dict[str, Any]:
    """The learner's XLA options on this mesh's (or the default) platform."""
    import jax

    from areal_jax.learner.steps import learner_compiler_options

    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return learner_compiler_options(platform)


def grad_memory(cfg: Any, dtype: str, remat: Any, t: int, rows: int = 1,
                 mesh: Any = None, lora_rank: int = 0) -> tuple[Any, int]:
    import contextlib

    import jax
    import jax.numpy as jnp

    from areal_jax.learner.config import AlgoConfig
    from areal_jax.learner.steps import make_grad_fn, zero_sums
    from areal_jax.parallel.mesh import batch_sharding
    from model_defs import param_shardings, use_mesh

    graphdef, params, rest, n_params = _abstract_model(cfg, dtype, remat, lora_rank)
    batch = _abstract_batch(t, rows)
    if mesh is not None:  # the learner's placement: params by their logical axes, rows split
        params = _on_mesh(params, param_shardings(params, mesh))
        rest = _on_mesh(rest, param_shardings(rest, mesh))
        batch = _on_mesh(batch, {k: batch_sharding(mesh) for k in batch})
    grad_fn = make_grad_fn(graphdef, jnp.dtype(dtype), AlgoConfig())
    sums = jax.eval_shape(zero_sums)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    version = jax.ShapeDtypeStruct((), jnp.int32)
    with use_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        compiled = jax.jit(grad_fn, donate_argnums=(2, 3),
                           compiler_options=_compiler_options(mesh)).lower(
            params, rest, params, sums, batch, scalar, scalar, version).compile()
    return compiled.memory_analysis(), n_params


def _apply_memory(cfg: Any, mesh: Any = None, lora_rank: int = 0) -> Any:
    import jax

    from areal_jax.learner.config import OptimConfig
    from areal_jax.learner.optimizer import make_optimizer
    from areal_jax.learner.steps import make_apply_fn
    from model_defs import param_shardings

    _, params, _, _ = _abstract_model(cfg, "float32", False, lora_rank)
    tx = make_optimizer(OptimConfig())
    opt_state = jax.eval_shape(tx.init, params)
    if mesh is not None:
        params = _on_mesh(params, param_shardings(params, mesh))
        opt_state = jax.eval_shape(tx.init, params)  # moments take the params' shardings
    compiled = jax.jit(make_apply_fn(tx), donate_argnums=(0, 1),
                       compiler_options=_compiler_options(mesh)).lower(
        params, opt_state, params).compile()
    return compiled.memory_analysis(), opt_state


def predicted_learner_bytes(cfg: Any, n_params: int, tokens: int, dtype: str,
                            shards: int = 1, chunk: int = 4096) -> dict[str, float]:
    """The formula of docs/models.md, "Memory" (per device; ``tokens`` = this device's
    tokens per micro-batch, ``shards`` = fsdp x tensor), for full fine-tuning with
    ``model.remat: full``:

    * held = 16 B/param / shards: fp32 params 4 + gradient accumulator 4 + AdamW moments 8;
    * gradient program = 3 fp32 logit chunks (tokens x chunk) + each layer's saved input
      (L x tokens x D x act) + one layer's recompute and backward (tokens x (6 F + 12 D)
      x 4: MLP and attention working set); the gradients themselves go straight into the
      accumulator (each layer's inside its backward step, the output matrix's chunk by
      chunk in the logprob kernel), so no second gradient is counted. Sharded (shards >
      1) there are two phases and the larger counts: the output layer's, with the output
      matrix gathered whole and its whole gradient before the reduce-scatter (2 x 4 B x
      V x D) next to the logit chunks, and the layers', with one layer's gathered weights
      and gradient (2 x 4 B x the layer's params) next to its working set; the saved
      layer inputs are alive in both;
    * optimizer program = the largest parameter's AdamW update (fp32, its shard).
    """
    d, f, v, n_layers = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
                         cfg.num_hidden_layers)
    act = 2 if dtype == "bfloat16" else 4
    head = 3 * tokens * min(chunk, v) * 4
    saved = n_layers * tokens * d * act
    layer = tokens * (6 * f + 12 * d) * 4
    held = 16 * n_params / shards
    grad_temp = head + saved + layer
    if shards > 1:
        out_matrices = 1 if cfg.tie_word_embeddings else 2
        layer_params = (n_params - out_matrices * v * d - d) / n_layers
        grad_temp = saved + max(head + 2 * 4 * v * d, layer + 2 * 4 * layer_params)
    apply_temp = 4 * v * d / shards
    return {"held": held, "grad_temp": grad_temp, "apply_temp": apply_temp,
            "peak": held + max(grad_temp, apply_temp)}


def kv_cache_bytes(cfg: Any, slots: int, max_len: int, dtype: str) -> tuple[int, int]:
    """(the formula of docs/models.md, "Memory", the bytes the engine's
    ``init_slot_cache`` allocates) for the engine's KV cache of ``slots`` rows of
    ``max_len`` tokens."""
    import jax
    import jax.numpy as jnp

    from areal_jax.engine.forward import init_slot_cache

    itemsize = jnp.dtype(dtype).itemsize
    formula = (2 * cfg.num_hidden_layers * slots * max_len * cfg.num_key_value_heads
               * cfg.head_dim * itemsize)
    cache = jax.eval_shape(lambda: init_slot_cache(cfg, slots, max_len, jnp.dtype(dtype)))
    return formula, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def learner_bytes(cfg: Any, args: argparse.Namespace, remat: Any, mesh: Any, shards: int,
                   lora_rank: int) -> dict[str, Any]:
    """Bytes per parameter of the whole model (base + adapters) the learner holds between
    steps and at its compiled peak, per device. Held: the trainable params (fp32), their
    AdamW state and gradient accumulator (fp32), and under LoRA the frozen base in the
    compute dtype."""
    import jax

    grad_mem, n_trainable = grad_memory(cfg, args.dtype, remat, args.learner_seq,
                                         args.learner_rows, mesh, lora_rank)
    apply_mem, opt_state = _apply_memory(cfg, mesh, lora_rank)
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))
    _, _, rest, _ = _abstract_model(cfg, args.dtype, False, lora_rank)
    frozen = [x for x in jax.tree.leaves(rest)] if lora_rank else []
    frozen_bytes = sum(x.size * x.dtype.itemsize for x in frozen)
    n_params = n_trainable + sum(x.size for x in frozen)
    held = (4 * n_trainable + opt_bytes + 4 * n_trainable + frozen_bytes) / shards
    peak = held + max(grad_mem.temp_size_in_bytes, apply_mem.temp_size_in_bytes)
    return {"n_params": n_params, "n_trainable": n_trainable,
            "held": round(held / n_params, 2), "peak": round(peak / n_params, 2),
            "grad_temp_mib": mib(grad_mem.temp_size_in_bytes),
            "apply_temp_mib": mib(apply_mem.temp_size_in_bytes)}


def mib(n: float) -> float:
    return round(n / 2**20, 1)
