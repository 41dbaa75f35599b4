"""Model forward tokens/s vs transformers (torch, CPU), same config, side by side.

    python -m areal_jax.bench forward [--layers 2 --shapes 1x2048,4x512 --repeats 5]

A Qwen2.5-0.5B-shaped config (hidden 896, 14/2 heads, mlp 4864, vocab 151936, tied) cut
to --layers layers, random weights shared by both models (ours is loaded from the
transformers checkpoint, so the logits are checked to agree). fp32. Both produce full
[B, T, V] fp32 logits. Ours is jitted and warmed up; timed runs alternate between the
two systems so noise from other processes hits both alike. Figure: tokens/s (median).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.bench.common import interleaved_times, save_random_hf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="ModelConfig preset to shape from")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shapes", default="1x2048,4x512", help="comma list of BxT")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per system (median)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            b, t = item.lower().split("x")
            shapes.append((int(b), int(t)))
        except ValueError:
            raise SystemExit(f"--shapes: {item!r} is not BxT (e.g. 4x512)") from None
    return shapes


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from model_defs import ModelConfig, load_hf

    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = _parse_shapes(args.shapes)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ModelConfig.preset(args.preset, num_hidden_layers=args.layers)
        path = save_random_hf(cfg, Path(tmp), f"bench-{args.preset}-{args.layers}l")
        torch_dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        ours, cfg = load_hf(path, dtype=args.dtype)
    graphdef, state = nnx.split(ours)
    forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))

    def run_ours(ids: np.ndarray) -> Any:
        return forward(state, jnp.asarray(ids)).block_until_ready()

    def run_theirs(ids: np.ndarray) -> Any:
        with torch.inference_mode():
            return theirs(torch.as_tensor(ids, dtype=torch.long)).logits

    rows = []
    ratios = []
    for batch, seq in shapes:
        ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
        t0 = time.perf_counter()
        ours_logits = np.asarray(run_ours(ids))
        compile_s = time.perf_counter() - t0
        theirs_logits = run_theirs(ids).float().numpy()
        max_diff = float(np.max(np.abs(ours_logits - theirs_logits)))
        del ours_logits, theirs_logits
        times = interleaved_times({"ours": lambda ids=ids: run_ours(ids),
                                   "transformers": lambda ids=ids: run_theirs(ids)},
                                  args.repeats)
        tokens = batch * seq
        ours_tps = tokens / statistics.median(times["ours"])
        theirs_tps = tokens / statistics.median(times["transformers"])
        ratio = ours_tps / theirs_tps
        ratios.append(ratio)
        rows.append([f"{batch}x{seq}", round(ours_tps, 1), round(theirs_tps, 1), round(ratio, 3),
                     round(compile_s, 2), f"{max_diff:.2e}"])
    return {
        "title": f"forward tokens/s: ours (JAX, jit) vs transformers (torch CPU), "
                 f"{args.preset} shape, {args.layers} layers, {args.dtype}",
        "columns": ["BxT", "ours tok/s", "transformers tok/s", "ratio", "first call s",
                    "max |dlogit|"],
        "rows": rows,
        "summary": {
            "ratio_min": min(ratios),
            "ratio_geomean": float(np.exp(np.mean(np.log(ratios)))),
            "torch_threads": torch.get_num_threads(),
            "jax_backend": jax.default_backend(),
        },
    }
