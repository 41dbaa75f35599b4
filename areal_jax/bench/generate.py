"""Engine decode throughput vs transformers generate (torch), same model, side by side.

    python -m areal_jax.bench generate [--batch 32 --new-tokens 128 --hidden 384 --layers 4]
    python -m areal_jax.bench generate --preset qwen2.5-0.5b --dtype bfloat16 \
        --compile-cache /tmp/cc --data-parallel 1   # GPU: the peer on CUDA; run twice for
                                                    # a cold and a warm engine start-up

Both generate greedily with EOS ignored, so every request makes exactly --new-tokens
tokens. The engine runs in-process, warmed up (all shapes compiled first); the figure
is generated tokens per second of wall time for the whole batch, plus the time to the
first token and the engine's compile count (which must not grow during the timed runs).

The roofline: the engine's decode GFLOP/s (tokens/s x the matmul FLOPs of one token, at the
mean context) is printed next to fp32 matmul GFLOP/s measured in the same process, at the
decode step's own shape (batch x hidden @ hidden x intermediate) and at 1024^3.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.bench.common import save_random_hf, time_calls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--torch-threads", default="auto",
                        help="comma-separated torch thread counts to try, or 'auto' "
                             "(1 and torch's default); the best one is the baseline")
    parser.add_argument("--data-parallel", default="auto",
                        help="comma-separated engine data_parallel values to run (each a "
                             "row), or 'auto': 1 and the number of usable CPU cores")
    parser.add_argument("--decode-steps", type=int, default=None,
                        help="engine tokens per device call (default: engine default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system (median)")
    parser.add_argument("--model-path", default=None,
                        help="an existing HF checkpoint instead of the random Qwen2 model")
    parser.add_argument("--preset", default=None,
                        help="random weights of this model_defs preset (e.g. qwen2.5-0.5b) "
                             "instead of the small Qwen2 shape")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engine's and the peer's weights and compute")
    parser.add_argument("--torch-device", default="auto",
                        help="the peer's device: cpu, cuda, or auto (cuda when torch sees one)")
    parser.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unrolled"],
                        help="the engine's loop over the layers (EngineConfig.layer_loop)")
    parser.add_argument("--compile-cache", default=None,
                        help="JAX's persistent compilation cache directory for the engine: run "
                             "twice with the same directory for a cold and a warm start-up")


def _model_config(args: argparse.Namespace) -> Any:
    from model_defs import ModelConfig

    if args.preset:
        return ModelConfig.preset(args.preset)
    return ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)


def _bench_transformers(path: Path, prompts: np.ndarray, new_tokens: int, repeats: int,
                        threads: int, device: str = "cpu", dtype: str = "float32"
                        ) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device).eval()
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones_like(input_ids))
    with torch.inference_mode():
        model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        ttfts, totals, cpus = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            ttfts.append(time.perf_counter() - t0)
            t0, c0 = time.perf_counter(), time.process_time()
            out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 **kwargs)
            totals.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            assert out.shape[1] == prompts.shape[1] + new_tokens
    total = statistics.median(totals)
    n_tokens = prompts.shape[0] * new_tokens
    return {"tokens_per_s": n_tokens / total, "total_s": total,
            "cpu_ms_per_token": statistics.median(cpus) / n_tokens * 1000,
            "ttft_s": statistics.median(ttfts), "threads": threads}


def _bench_engine(path: Path, prompts: np.ndarray, new_tokens: int, repeats: int,
                  decode_steps: int | None, data_parallel: int = 1,
                  dtype: str = "float32", layer_loop: str = "auto") -> dict[str, Any]:
    from areal_jax.engine.config import EngineConfig
    from areal_jax.engine.engine import GenerationEngine
    from areal_jax.engine.request import SamplingParams

    batch, prompt_len = prompts.shape
    max_seq_len = 16
    while max_seq_len < prompt_len + new_tokens:
        max_seq_len *= 2
    extra = {} if decode_steps is None else {"decode_steps": decode_steps}
    extra["data_parallel"] = data_parallel
    t0 = time.perf_counter()
    engine = GenerationEngine(EngineConfig(
        str(path), max_slots=batch, max_seq_len=max_seq_len, warmup=True, dtype=dtype,
        layer_loop=layer_loop, **extra))
    startup_s = time.perf_counter() - t0  # ready to serve; the rest compiles in the background
    engine.warmup()  # every program compiled before the timed runs
    compiles_after_warmup = engine.num_compilations
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    try:
        engine.generate(prompts[0].tolist(), SamplingParams(max_new_tokens=4, temperature=0.0))
        totals, ttfts, cpus = [], [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            reqs = [engine.submit(p.tolist(), params) for p in prompts]
            for r in reqs:
                r.done.wait()
            totals.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            ttfts.append(statistics.mean(r.first_token_time - r.arrival_time for r in reqs))
            assert all(len(r.output_ids) == new_tokens for r in reqs)
        total = statistics.median(totals)
        return {"tokens_per_s": batch * new_tokens / total, "total_s": total,
                "cpu_ms_per_token": statistics.median(cpus) / (batch * new_tokens) * 1000,
                "ttft_s": statistics.median(ttfts), "startup_s": startup_s,
                "compiles_after_warmup": compiles_after_warmup,
                "compiles_at_end": engine.num_compilations,
                "decode_steps": engine.config.decode_steps, "data_parallel": data_parallel}
    finally:
        engine.shutdown()


def decode_flops_per_token(cfg: Any, context: float) -> float:
    """Matmul FLOPs of one decoded token: 2 x (projection + MLP + LM-head weights) plus the
    attention scores and weighted sum over ``context`` cached positions."""
    h = cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    attention = 2 * q * context  # q.k over the context, then the weighted sum of v
    return 2.0 * (cfg.num_hidden_layers * (per_layer + attention) + h * cfg.vocab_size)


def matmul_gflops(m: int, k: int, n: int, repeats: int = 20) -> float:
    """Measured fp32 [m, k] @ [k, n] GFLOP/s of jitted JAX on this process's CPU."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.float32)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    times = time_calls(lambda: f(a, b).block_until_ready(), repeats)
    return 2.0 * m * k * n / min(times) / 1e9


def _data_parallel_values(spec: str, batch: int) -> list[int]:
    if spec == "auto":
        from areal_jax.cpu_affinity import usable_cpu_count

        values = sorted({1, max(1, min(usable_cpu_count(), batch))})
    else:
        values = [int(v) for v in spec.split(",")]
    bad = [v for v in values if v < 1 or batch % v]
    if bad:
        raise SystemExit(f"--data-parallel {bad}: each value must divide --batch {batch}")
    return values


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    if args.preset and args.model_path:
        raise SystemExit("bench generate: give --preset or --model-path, not both")
    dps = _data_parallel_values(args.data_parallel, args.batch)
    from areal_jax.engine.config import request_cpu_devices

    request_cpu_devices(max(dps))  # one XLA CPU device per slot shard, before JAX starts
    from areal_jax.engine.server import apply_cpu_engine_xla_flags

    apply_cpu_engine_xla_flags()  # the engine as serve.py runs it (a no-op off a CPU host)
    if args.compile_cache:
        from areal_jax.compile_cache import enable_compilation_cache

        enable_compilation_cache(args.compile_cache)
    with tempfile.TemporaryDirectory() as tmp:
        path = (Path(args.model_path) if args.model_path else
                save_random_hf(_model_config(args), Path(tmp), "bench-qwen2"))
        from model_defs import ModelConfig

        model_cfg = ModelConfig.from_pretrained_dir(path)
        vocab = model_cfg.vocab_size
        prompts = rng.integers(3, vocab, size=(args.batch, args.prompt_len)).astype(np.int32)
        engines = [_bench_engine(path, prompts, args.new_tokens, args.repeats,
                                 args.decode_steps, dp, args.dtype, args.layer_loop)
                   for dp in dps]
        import torch

        device = args.torch_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.torch_threads == "auto":
            thread_counts = sorted({1, torch.get_num_threads()}) if device == "cpu" else [
                torch.get_num_threads()]
        else:
            thread_counts = [int(t) for t in args.torch_threads.split(",")]
        peers = [_bench_transformers(path, prompts, args.new_tokens, args.repeats, t, device,
                                     args.dtype)
                 for t in thread_counts]
        # The roofline: decode FLOP/s against matmuls measured here, at the decode step's
        # own shape (batch rows x hidden @ hidden x intermediate) and at a large square one.
        peak_decode_shape = matmul_gflops(args.batch, model_cfg.hidden_size,
                                          model_cfg.intermediate_size, repeats=200)
        peak_large = matmul_gflops(1024, 1024, 1024)
    theirs = max(peers, key=lambda r: r["tokens_per_s"])
    ours = max(engines, key=lambda r: r["tokens_per_s"])
    speedup = ours["tokens_per_s"] / theirs["tokens_per_s"]
    flops_per_token = decode_flops_per_token(model_cfg, args.prompt_len + args.new_tokens / 2)
    decode_gflops = ours["tokens_per_s"] * flops_per_token / 1e9
    cpu_speedup = min(r["cpu_ms_per_token"] for r in peers) / ours["cpu_ms_per_token"]
    rows = [[f"areal-jax engine, data_parallel={r['data_parallel']}", round(r["tokens_per_s"], 1),
             round(r["total_s"], 3), round(r["cpu_ms_per_token"], 3), round(r["ttft_s"] * 1000, 1),
             r["compiles_at_end"], round(r["tokens_per_s"] / theirs["tokens_per_s"], 2)]
            for r in engines]
    rows += [[f"transformers generate ({device}), torch {r['threads']} thread(s)",
              round(r["tokens_per_s"], 1), round(r["total_s"], 3),
              round(r["cpu_ms_per_token"], 3), round(r["ttft_s"] * 1000, 1), "-",
              round(r["tokens_per_s"] / theirs["tokens_per_s"], 2)]
             for r in peers]
    return {
        "title": f"generate: batch {args.batch}, {args.new_tokens} new tokens, prompt "
                 f"{args.prompt_len}, greedy ({model_cfg.architecture} h{model_cfg.hidden_size} "
                 f"L{model_cfg.num_hidden_layers} V{model_cfg.vocab_size})",
        "columns": ["system", "tokens/s", "batch wall s", "CPU ms/token", "TTFT ms",
                    "compilations", "vs best transformers"],
        "rows": rows,
        "summary": {
            "speedup_vs_transformers": speedup,
            "cpu_time_speedup_vs_transformers": cpu_speedup,
            "target_speedup": 5.0,
            "engine_tokens_per_s": ours["tokens_per_s"],
            "engine_decode_gflops": decode_gflops,
            "matmul_gflops_at_decode_shape": peak_decode_shape,
            "matmul_gflops_large": peak_large,
            "engine_fraction_of_decode_shape_peak": decode_gflops / peak_decode_shape,
            "decode_mflops_per_token": flops_per_token / 1e6,
            "transformers_tokens_per_s": theirs["tokens_per_s"],
            "transformers_best_threads": theirs["threads"],
            "engine_ttft_ms": ours["ttft_s"] * 1000,
            "transformers_ttft_ms": theirs["ttft_s"] * 1000,
            "engine_compilations_after_warmup": ours["compiles_after_warmup"],
            "engine_compilations_at_end": ours["compiles_at_end"],
            "engine_startup_s": ours["startup_s"],
            "compile_cache": args.compile_cache,
            "layer_loop": args.layer_loop,
            "dtype": args.dtype,
            "torch_device": device,
            "engine_decode_steps": ours["decode_steps"],
            "engine_data_parallel": ours["data_parallel"],
            "speedup_data_parallel_1": next(
                r["tokens_per_s"] for r in engines if r["data_parallel"] == 1)
            / theirs["tokens_per_s"]
            if 1 in dps else float("nan"),
        },
    }
