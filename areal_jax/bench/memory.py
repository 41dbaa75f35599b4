"""Learner memory: compiled forward+backward temporaries vs row length, and bytes/parameter.

    python -m areal_jax.bench memory [--seq 2048,4096,8192 --layers 2 --hidden 256]
                                      [--learner-preset qwen2.5-0.5b --learner-seq 1024]
                                      [--lora-rank 16]

Compile only (nothing is run, so it works for shapes that would not fit), through the
planner's ``areal_jax.plan.memory``: the learner's real gradient program
(``learner.steps.make_grad_fn``: packed rows, chunked logprobs, decoupled PPO loss) is
lowered with abstract inputs and XLA's ``memory_analysis`` is read. Side by side, per row
length T (one packed row; the program, and so its memory, does not depend on how the row
is split into segments):

* ``blockwise``: the attention as shipped (query blocks of ``model_defs.attention.BLOCK``);
* ``one block``: the same function with the block set to T, i.e. plain attention with the
  full T x T scores, the peer a linear-memory attention is measured against.

The summary then gives the learner's memory per parameter for --learner-preset with
micro-batches of --learner-rows x --learner-seq tokens: fp32 master params (4 B) + AdamW
moments (8 B) + the gradient accumulator (4 B) = 16 B/param held between steps, plus the
larger of the gradient and optimizer programs' compiled temporaries. With ``--lora-rank R``
the same figures follow for LoRA (rank R on every projection): the frozen base in the
compute dtype, and fp32 adapters + their AdamW moments + gradient accumulator, per
parameter of the whole model (base + adapters), side by side with full fine-tuning.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from areal_jax.plan import memory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", default="2048,4096,8192", help="comma list of row lengths T")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--remat", default="none",
                        help="model.remat policy for the T sweep (docs/models.md: none, full, ...)")
    parser.add_argument("--learner-preset", default="qwen2.5-0.5b",
                        help="ModelConfig preset for bytes/param ('' to skip)")
    parser.add_argument("--learner-seq", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--learner-rows", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="also report LoRA of this rank on every projection (0: skip)")
    parser.add_argument("--engine-slots", type=int, default=16, help="KV-cache rows")
    parser.add_argument("--engine-seq", type=int, default=2048, help="KV-cache row length")
    parser.add_argument("--mesh", default="",
                        help="learner mesh, e.g. fsdp=2 (CPU: that many XLA host devices); "
                             "figures are then per device")



def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.mesh:  # on a CPU host, one XLA device per mesh slot (before JAX starts)
        from areal_jax.engine.config import request_cpu_devices
        from areal_jax.parallel.mesh import parse_mesh_spec

        request_cpu_devices(int(np.prod(list(parse_mesh_spec(args.mesh).values()))))
    import jax

    import model_defs.attention as attention_module
    from model_defs import ModelConfig

    seqs = [int(x) for x in args.seq.split(",") if x]  # --seq '' skips the sweep
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(seqs, default=2048))
    remat = False if args.remat == "none" else (True if args.remat == "full" else args.remat)
    rows: list[list] = []
    shipped_block = attention_module.BLOCK
    temps: dict[str, list[int]] = {"blockwise": [], "one block": []}
    for t in seqs:
        for name, block in (("blockwise", shipped_block), ("one block", t)):
            attention_module.BLOCK = block
            try:
                mem, _ = memory.grad_memory(cfg, args.dtype, remat, t)
            finally:
                attention_module.BLOCK = shipped_block
            temps[name].append(mem.temp_size_in_bytes)
            prev = temps[name][-2] if len(temps[name]) > 1 else None
            growth = round(mem.temp_size_in_bytes / prev, 2) if prev else ""
            rows.append([t, name, memory.mib(mem.temp_size_in_bytes), growth])
    summary: dict[str, Any] = {
        "model": f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {args.dtype}",
        "backend": jax.default_backend(),
    }
    for name, values in temps.items():
        if len(values) > 1:
            summary[f"{name}: growth per doubling (last)"] = round(values[-1] / values[-2], 2)
    if seqs:
        summary[f"one block / blockwise temp at T={seqs[-1]}"] = round(
            temps["one block"][-1] / temps["blockwise"][-1], 2)

    if args.learner_preset:
        mesh = None
        shards = 1
        if args.mesh:
            from areal_jax.parallel.mesh import make_mesh

            mesh = make_mesh(args.mesh)
            shards = mesh.shape.get("fsdp", 1) * mesh.shape.get("tensor", 1)
        lcfg = ModelConfig.preset(args.learner_preset)
        full = memory.learner_bytes(lcfg, args, remat, mesh, shards, lora_rank=0)
        n_params = full["n_params"]
        summary.update({
            "learner model": f"{args.learner_preset} ({n_params / 1e6:.0f}M params), "
                             f"{args.learner_rows} x {args.learner_seq} tokens, {args.dtype}, "
                             f"remat {args.remat}",
            "learner mesh": args.mesh or "one device",
            "learner held bytes/param per device (params+AdamW+grads)": full["held"],
            "learner grad-program temp MiB": full["grad_temp_mib"],
            "learner apply-program temp MiB": full["apply_temp_mib"],
            "learner compiled peak bytes/param per device": full["peak"],
        })
        batch_shards = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1) if mesh else 1
        predicted = memory.predicted_learner_bytes(
            lcfg, n_params, args.learner_rows * args.learner_seq // batch_shards, args.dtype,
            shards)
        kv_formula, kv_alloc = memory.kv_cache_bytes(lcfg, args.engine_slots, args.engine_seq,
                                              args.dtype)
        summary.update({
            "predicted (docs formula) grad-program temp MiB": memory.mib(predicted["grad_temp"]),
            "predicted apply-program temp MiB": memory.mib(predicted["apply_temp"]),
            "predicted peak bytes/param per device": round(predicted["peak"] / n_params, 2),
            "measured / predicted peak": round(full["peak"] * n_params / predicted["peak"], 3),
            f"engine KV cache MiB ({args.engine_slots} x {args.engine_seq}, {args.dtype}): "
            "formula / allocated": f"{memory.mib(kv_formula)} / {memory.mib(kv_alloc)}",
        })
        if args.lora_rank:
            lora = memory.learner_bytes(lcfg, args, remat, mesh, shards, lora_rank=args.lora_rank)
            r = args.lora_rank
            summary.update({
                f"LoRA r={r}: trainable params": f"{lora['n_trainable'] / 1e6:.2f}M "
                f"({100 * lora['n_trainable'] / lora['n_params']:.2f}% of all)",
                f"LoRA r={r}: held bytes/param per device (base+adapters+AdamW+grads)":
                    lora["held"],
                f"LoRA r={r}: grad-program temp MiB": lora["grad_temp_mib"],
                f"LoRA r={r}: compiled peak bytes/param per device": lora["peak"],
                f"full / LoRA r={r} held bytes": round(full["held"] / lora["held"], 2),
                f"full / LoRA r={r} compiled peak": round(full["peak"] / lora["peak"], 2),
            })
    return {"title": "learner forward+backward compiled temp memory (memory_analysis)",
            "columns": ["T", "attention", "temp MiB", "x prev T"], "rows": rows,
            "summary": summary}
