"""Each self-attention kernel of this platform against the fp32 reference, and its speed.

    python -m areal_jax.bench attention                           # CPU: xla at T = 256
    python -m areal_jax.bench attention --t 4096,16384            # GPU: cudnn, pallas_gpu, xla

Per kernel (``model.attention`` names, resolved as the model resolves them) and length T:
forward + backward of causal GQA self-attention over ``--rows`` rows, timed (median of
``--repeats`` calls after one compiling call), in TFLOP/s of the work the mask leaves (Σ over
segments of causal pairs: forward 4·Dh per pair and head, backward 2.5x that, as
FlashAttention counts it), and the largest difference of its output and of dq from the fp32
reference attention at T = min(T, ``--check-t``), against a bound from the dtype's eps.

Packed rows (``--segments`` > 1, what the learner runs) go to every kernel that takes segment
ids; ``cudnn`` takes none (rows without segments are the engine's prefill), so its row times
one segment per row and says so. fp32 rows run under ``model_defs.fp32_matmuls`` as the
learner and engine do (the highest matmul precision on GPU/TPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from areal_jax.bench.common import time_calls

PLATFORM_KERNELS = {"gpu": ("cudnn", "pallas_gpu", "xla"), "tpu": ("splash", "xla"),
                    "cpu": ("xla",)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--t", default=None,
                        help="comma-separated sequence lengths (default: 4096,16384 on an "
                             "accelerator, 256 on a CPU)")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--heads", type=int, default=14, help="query heads (Qwen2.5-0.5B: 14)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--segments", type=int, default=3,
                        help="equal segments per packed row (1: rows without segments)")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="comma-separated: bfloat16, float32")
    parser.add_argument("--kernels", default=None,
                        help="comma-separated model.attention names (default: every kernel of "
                             "this platform)")
    parser.add_argument("--check-t", type=int, default=2048,
                        help="the longest T compared with the (quadratic-memory) reference")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pallas-blocks", default=None,
                        help="GPU only: extra rows timing jax's Triton kernel with other "
                             "block sizes, as FWD/BWD pairs (e.g. 128/64,64/64; the model "
                             "runs 128/32, jax's default); default on a GPU: 128/64,64/64,"
                             "128/128; elsewhere none (Pallas' interpreter times nothing "
                             "useful, but runs them)")


def _segment_ids(rows: int, t: int, segments: int) -> np.ndarray:
    bounds = np.linspace(0, t, segments + 1).astype(int)
    seg = np.zeros((rows, t), np.int32)
    for i in range(segments):
        seg[:, bounds[i]:bounds[i + 1]] = i + 1
    return seg


def causal_pairs(seg_bt: np.ndarray) -> int:
    """Query-key pairs the packed causal mask keeps: Σ over segments of len·(len+1)/2."""
    total = 0
    for row in seg_bt:
        _, counts = np.unique(row, return_counts=True)
        total += int(np.sum(counts * (counts + 1) // 2))
    return total


def attention_flops(seg_bt: np.ndarray, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of the kept pairs: 4·Dh per pair and head forward (two
    products), 2.5x that backward."""
    return 3.5 * 4.0 * head_dim * heads * causal_pairs(seg_bt)


def _inputs(args: argparse.Namespace, t: int, dtype: Any, segments: int) -> tuple:
    import jax
    import jax.numpy as jnp

    g = args.heads // args.kv_heads
    keys = jax.random.split(jax.random.key(0), 4)
    shape_q = (args.rows, args.kv_heads, g, t, args.head_dim)
    shape_kv = (args.rows, args.kv_heads, t, args.head_dim)
    q = (jax.random.normal(keys[0], shape_q) * args.head_dim ** -0.5).astype(dtype)
    k = jax.random.normal(keys[1], shape_kv).astype(dtype)
    v = jax.random.normal(keys[2], shape_kv).astype(dtype)
    cot = jax.random.normal(keys[3], shape_q).astype(jnp.float32)
    seg = jnp.asarray(_segment_ids(args.rows, t, segments))
    return q, k, v, cot, seg


def _grad_fn(impl: str, packed: bool, dtype: Any) -> Any:
    import jax
    import jax.numpy as jnp

    from model_defs import fp32_matmuls
    from model_defs.attention import attention

    def loss(q, k, v, cot, seg):
        with fp32_matmuls(dtype):
            out = attention(q, k, v, segment_ids_bt=seg if packed else None, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    return jax.jit(jax.value_and_grad(loss, argnums=0, has_aux=True))


def _check(impl: str, args: argparse.Namespace, t: int, dtype: Any, segments: int
           ) -> dict[str, float]:
    """Largest |kernel - fp32 reference| of the output and of dq, with the bound the dtype's
    rounding allows (eps x the largest reference magnitude x a small constant for the
    softmax's and the sums' roundings)."""
    import jax
    import jax.numpy as jnp

    from model_defs.attention import reference_attention

    q, k, v, cot, seg = _inputs(args, t, dtype, segments)
    packed = segments > 1
    (_, out), dq = _grad_fn(impl, packed, dtype)(q, k, v, cot, seg)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    seg_ref = seg if packed else jnp.ones_like(seg)
    idx = jnp.arange(t)
    mask = (seg_ref[:, :, None] == seg_ref[:, None, :]) & (idx[:, None] >= idx[None, :])

    def ref_loss(q_):
        with jax.default_matmul_precision("highest"):
            out_ = reference_attention(q_, k32, v32, mask)
        return jnp.sum(out_ * cot), out_

    (_, ref_out), ref_dq = jax.value_and_grad(ref_loss, has_aux=True)(q32)
    eps = float(jnp.finfo(dtype).eps)
    out_err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out)))
    dq_err = float(jnp.max(jnp.abs(dq.astype(jnp.float32) - ref_dq)))
    # |out| <= max|v|; a bf16 output is rounded once (eps/2) after fp32 accumulation, plus the
    # rounding of the inputs it was computed from: a few eps of the largest magnitude.
    out_bound = 8 * eps * float(jnp.max(jnp.abs(v32)))
    dq_bound = 8 * eps * float(jnp.max(jnp.abs(ref_dq))) * float(np.sqrt(args.head_dim))
    return {"out_err": out_err, "out_bound": out_bound, "dq_err": dq_err, "dq_bound": dq_bound}


def _time(fn: Any, inputs: tuple, repeats: int) -> tuple[float, float]:
    """(median seconds of ``repeats`` calls, seconds of the first, compiling, call)."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    first_s = time.perf_counter() - t0
    times = time_calls(lambda: jax.block_until_ready(fn(*inputs)), repeats)
    return statistics.median(times), first_s


def _pallas_blocks_grad_fn(fwd: int, bwd: int, interpret: bool) -> Any:
    """Forward + backward of the model's Triton kernel (``fused_attention._pallas_gpu``) on
    packed rows with (``fwd``, ``bwd``) tiles instead of its defaults: the block-size sweep
    a GPU check runs before the model's defaults change."""
    import jax
    import jax.numpy as jnp

    from model_defs.fused_attention import _pallas_gpu

    def loss(q, k, v, cot, seg):
        out = _pallas_gpu(q, k, v, seg, return_lse=False, interpret=interpret,
                          blocks=(fwd, bwd))
        return jnp.sum(out.astype(jnp.float32) * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from model_defs.fused_attention import active_platform, resolve_attention_impl

    platform = active_platform()
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    lengths = [int(x) for x in (args.t or ("256" if platform == "cpu" else "4096,16384"))
               .split(",")]
    kernels = (args.kernels.split(",") if args.kernels
               else list(PLATFORM_KERNELS.get(platform, ("xla",))))
    rows, results = [], []
    for dtype_name in args.dtypes.split(","):
        dtype = jnp.dtype(dtype_name)
        for impl in kernels:
            try:
                resolved = resolve_attention_impl(impl, platform, dtype=dtype)
            except ValueError as e:  # e.g. cudnn refuses fp32: a row that says so
                rows.append([impl, dtype_name, "-", "-", "-", "-", "-", f"skipped: {e}"[:80]])
                continue
            segments = 1 if resolved == "cudnn" else args.segments
            check = _check(impl, args, min(args.check_t, max(lengths)), dtype, segments)
            ok = bool(check["out_err"] <= check["out_bound"]
                      and check["dq_err"] <= check["dq_bound"])
            for t in lengths:
                median_s, compile_s = _time(_grad_fn(impl, segments > 1, dtype),
                                            _inputs(args, t, dtype, segments), args.repeats)
                flops = attention_flops(_segment_ids(args.rows, t, segments), args.heads,
                                        args.head_dim)
                result = {"kernel": impl, "resolved": resolved, "dtype": dtype_name, "t": t,
                          "segments": segments, "median_s": median_s, "compile_s": compile_s,
                          "tflops": flops / median_s / 1e12, **check, "within_bound": ok}
                results.append(result)
                rows.append([impl, dtype_name, t, segments, round(median_s * 1000, 3),
                             round(result["tflops"], 2), round(compile_s, 1),
                             f"out {check['out_err']:.1e} (<= {check['out_bound']:.1e}), "
                             f"dq {check['dq_err']:.1e} (<= {check['dq_bound']:.1e})"
                             + ("" if ok else " EXCEEDS")])
    blocks = args.pallas_blocks or ("128/64,64/64,128/128" if platform == "gpu" else "")
    for pair in filter(None, blocks.split(",")):
        fwd, bwd = (int(x) for x in pair.split("/"))
        fn = _pallas_blocks_grad_fn(fwd, bwd, interpret=platform != "gpu")
        for t in lengths:
            median_s, _ = _time(fn, _inputs(args, t, jnp.bfloat16, args.segments),
                                args.repeats)
            tflops = attention_flops(_segment_ids(args.rows, t, args.segments), args.heads,
                                     args.head_dim) / median_s / 1e12
            results.append({"kernel": f"pallas_gpu[{pair}]", "dtype": "bfloat16", "t": t,
                            "segments": args.segments, "median_s": median_s,
                            "tflops": tflops, "within_bound": True})
            rows.append([f"pallas_gpu blocks {pair}", "bfloat16", t, args.segments,
                         round(median_s * 1000, 3), round(tflops, 2), "-", "(timing only)"])
    return {
        "title": f"attention forward+backward on {platform} ({jax.devices()[0].device_kind}): "
                 f"{args.rows} rows, {args.heads}/{args.kv_heads} heads, head dim "
                 f"{args.head_dim}",
        "columns": ["kernel", "dtype", "T", "segments", "median ms", "TFLOP/s", "compile s",
                    "vs fp32 reference"],
        "rows": rows,
        "results": results,
        "summary": {"platform": platform, "device": jax.devices()[0].device_kind,
                    "all_within_bound": all(r["within_bound"] for r in results)},
    }
