"""The fused attention kernels (model_defs.fused_attention) against the plain full-matrix
reference: Pallas kernels run in Pallas' interpreter on CPU (splash for TPU, the Triton
flash kernel for GPU), packed causal rows with GQA, fp32 and bf16, values, gradients and
the prefill's log-sum-exp, alone and under shard_map on a CPU mesh. Then compile-only
targets: the TPU program of forward+backward at T = 8192 holds the Mosaic kernel and no
[8192, 8192] buffer, and the H100 program holds the Triton kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from test_attention import EPS16, _fp32_tol, _packed_segments, _qkv, _self_mask

import model_defs.attention as attention_module
from model_defs.attention import attention, reference_attention
from model_defs.fused_attention import (
    ATTENTION_IMPLS,
    cudnn_available,
    resolve_attention_impl,
)
from model_defs.sharding import use_mesh

KERNELS = ("splash", "pallas_gpu")
T = 45  # not a multiple of any kernel block: exercises the padding


def _reference_lse(q, k, seg):
    scores = jnp.einsum("bkgtd,bksd->bkgts", q.astype(jnp.float32), k.astype(jnp.float32))
    return jax.nn.logsumexp(jnp.where(_self_mask(seg)[:, None, None], scores, -jnp.inf), -1)


def test_resolve_attention_impl_per_platform_and_errors():
    assert resolve_attention_impl("auto", "tpu") == "splash"
    assert resolve_attention_impl("auto", "cpu") == "xla"
    assert resolve_attention_impl("splash", "tpu") == "splash"
    assert resolve_attention_impl("pallas_gpu", "gpu") == "pallas_gpu"
    assert resolve_attention_impl("xla", "tpu") == "xla"
    assert resolve_attention_impl("splash", "cpu", interpret=True) == "splash"
    with pytest.raises(ValueError, match=r"model.attention must be one of auto, xla, splash"):
        resolve_attention_impl("flash", "tpu")
    with pytest.raises(ValueError, match=r"model.attention=splash runs on tpu, not cpu"):
        resolve_attention_impl("splash", "cpu")
    with pytest.raises(ValueError, match=r"model.attention=cudnn runs on gpu, not tpu"):
        resolve_attention_impl("cudnn", "tpu", interpret=True)
    with pytest.raises(ValueError, match="model.attention must be one of"):
        attention(*_qkv(t=4), impl="Splash")
    assert set(ATTENTION_IMPLS) == {"auto", "xla", "splash", "cudnn", "pallas_gpu"}


@pytest.mark.parametrize("cudnn_loads", [True, False])
def test_gpu_kernel_follows_the_dtype_never_the_host(monkeypatch, cudnn_loads):
    """cuDNN's fused attention refuses fp32 (a GPU run served no fp32 model with the default
    attention), so auto is cudnn for bf16/fp16 and pallas_gpu for fp32 on every GPU
    platform name; and the choice never depends on whether this host can load cuDNN, so the
    planner on a CPU host picks the kernel the GPU runs."""
    import model_defs.fused_attention as fused

    monkeypatch.setattr(fused, "cudnn_available", lambda: cudnn_loads)
    for platform in ("gpu", "cuda", "rocm"):
        for dtype in (jnp.bfloat16, jnp.float16):
            assert resolve_attention_impl("auto", platform, dtype=dtype) == "cudnn"
            assert resolve_attention_impl("cudnn", platform, dtype=dtype) == "cudnn"
        assert resolve_attention_impl("auto", platform, dtype=jnp.float32) == "pallas_gpu"
        with pytest.raises(ValueError, match="model.attention=cudnn needs bf16 or fp16 queries"):
            resolve_attention_impl("cudnn", platform, dtype=jnp.float32)


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_matches_reference_fp32(impl):
    """Values, gradients of q, k, v and the lse (the prefill's return_lse) in fp32."""
    q, k, v = _qkv(b=2, kv=2, g=2, t=T)
    seg = _packed_segments(2, T)
    ref = reference_attention(q, k, v, _self_mask(seg))
    out, lse = attention(q, k, v, segment_ids_bt=seg, impl=impl, interpret=True,
                         return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:4]
    assert float(jnp.max(jnp.abs(out - ref))) <= _fp32_tol(q, k, v)
    # lse = m + log(l): the scores' rounding (as for the output, without max|v|)
    lse_tol = 4 * float(jnp.finfo(jnp.float32).eps) * (
        float(jnp.max(jnp.abs(_reference_lse(q, k, seg)))) + np.sqrt(T))
    assert float(jnp.max(jnp.abs(lse - _reference_lse(q, k, seg)))) <= lse_tol

    cot = jnp.asarray(np.random.RandomState(7).randn(*q.shape), jnp.float32)
    g_ours = jax.grad(lambda q, k, v: jnp.sum(
        attention(q, k, v, segment_ids_bt=seg, impl=impl, interpret=True) * cot),
        argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(lambda q, k, v: jnp.sum(reference_attention(q, k, v, _self_mask(seg))
                                             * cot), argnums=(0, 1, 2))(q, k, v)
    # As tests/test_attention.py: the forward tolerance times |cot| and the reduction length.
    tol = _fp32_tol(q, k, v) * float(jnp.max(jnp.abs(cot))) * np.sqrt(T)
    for name, a, b in zip("qkv", g_ours, g_ref, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= tol, name


@pytest.mark.slow
@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_bf16_within_bf16_rounding(impl):
    q, k, v = _qkv(b=1, kv=2, g=2, t=T, seed=2, dtype=jnp.bfloat16)
    seg = _packed_segments(2, T)[:1]
    out = attention(q, k, v, segment_ids_bt=seg, impl=impl, interpret=True)
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(q, k, v, _self_mask(seg))  # fp32 math on the same bf16 inputs
    # Probabilities rounded to bf16 (eps/2 each, a convex combination of |v| <= max|v|)
    # plus the output's own rounding (eps/2 * max|v|).
    tol = EPS16 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) <= tol

    cot = jnp.asarray(np.random.RandomState(3).randn(*q.shape), jnp.float32)
    g = jax.grad(lambda v: jnp.sum(attention(q, k, v, segment_ids_bt=seg, impl=impl,
                                             interpret=True).astype(jnp.float32) * cot))(v)
    g_ref = jax.grad(lambda v: jnp.sum(reference_attention(q, k, v, _self_mask(seg)) * cot))(v)
    # dv_j = sum_i p_ij cot_i: bf16 rounding of p (eps/2) and of the result (eps/2).
    g_tol = EPS16 * (float(jnp.max(jnp.abs(g_ref))) + float(jnp.max(jnp.abs(cot))))
    assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - g_ref))) <= g_tol


@pytest.mark.parametrize("block", [8, 256], ids=["blockwise", "one-block"])
def test_xla_self_attention_returns_lse(monkeypatch, block):
    """The XLA path's return_lse for self-attention (the prefill's fallback)."""
    monkeypatch.setattr(attention_module, "BLOCK", block)
    q, k, v = _qkv(t=T)
    seg = _packed_segments(2, T)
    out, lse = jax.jit(lambda q, k, v: attention(q, k, v, segment_ids_bt=seg,
                                                 return_lse=True))(q, k, v)
    assert float(jnp.max(jnp.abs(out - reference_attention(q, k, v, _self_mask(seg))))) <= (
        _fp32_tol(q, k, v))
    ref_lse = _reference_lse(q, k, seg)
    lse_tol = 4 * float(jnp.finfo(jnp.float32).eps) * (float(jnp.max(jnp.abs(ref_lse)))
                                                       + np.sqrt(T))
    assert float(jnp.max(jnp.abs(lse - ref_lse))) <= lse_tol


def test_splash_under_shard_map_on_a_cpu_mesh():
    """Batch rows over fsdp and kv heads over tensor (shard_map), forward and gradients."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    q, k, v = _qkv(b=2, kv=2, g=2, t=T, seed=4)
    seg = jnp.asarray(_packed_segments(2, T))
    cot = jnp.asarray(np.random.RandomState(5).randn(*q.shape), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, segment_ids_bt=seg, impl="splash",
                                 interpret=True) * cot)

    with use_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref_value, ref_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(reference_attention(q, k, v, _self_mask(seg)) * cot),
        argnums=(0, 1, 2))(q, k, v)
    tol = _fp32_tol(q, k, v) * float(jnp.max(jnp.abs(cot))) * np.sqrt(T)
    assert abs(float(value - ref_value)) <= tol * np.sqrt(q.size)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= tol, name


def _compile(target: str, impl: str, t: int, dtype: str = "bfloat16",
             segments: bool = True) -> dict:
    script = Path(__file__).with_name("_attention_compile.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script), target, impl, str(t), dtype,
                           str(int(segments))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _has("libtpu"), reason="needs libtpu: pip install 'jax[tpu]'")
def test_splash_compiles_for_tpu_without_a_square_buffer():
    """v5e:2x2 (batch over fsdp=2, kv heads over tensor=2), bf16 forward+backward at
    T = 8192: the Mosaic kernels are in the program and no [.., 8192, 8192] buffer is."""
    result = _compile("v5e:2x2", "auto", 8192)  # auto on TPU devices: splash
    assert result["platform"] == "tpu"
    assert result["tpu_custom_call"] >= 3, result  # forward, dq and dkv kernels
    assert result["square_buffers"] == [], result


@pytest.mark.skipif(not _has("jax_plugins.xla_cuda13"),
                    reason="needs the CUDA plugin: pip install jax-cuda13-plugin jax-cuda13-pjrt")
def test_pallas_gpu_compiles_for_h100_without_a_square_buffer():
    result = _compile("h100:4", "pallas_gpu", 8192)
    assert result["device_kind"].startswith("NVIDIA H100")
    assert result["triton_custom_call"] >= 2, result  # forward and backward kernels
    assert result["square_buffers"] == [], result


@pytest.mark.skipif(not _has("jax_plugins.xla_cuda13"),
                    reason="needs the CUDA plugin: pip install jax-cuda13-plugin jax-cuda13-pjrt")
@pytest.mark.skipif(not cudnn_available(),
                    reason="needs the cuDNN wheel to compile cuDNN attention: pip install "
                           "nvidia-cudnn-cu13 (aot extra)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_h100_program_runs_the_kernel_the_runtime_resolves(dtype):
    """Rows without segments (the engine's prefill) compiled for H100 with attention auto:
    bf16 holds cuDNN's kernel and fp32 the Triton one, exactly what the runtime resolves for
    that platform and dtype (the planner compiles through the same function)."""
    result = _compile("h100:2", "auto", 256, dtype, segments=False)
    runtime = resolve_attention_impl("auto", "cuda", dtype=jnp.dtype(dtype))
    compiled = "cudnn" if result["cudnn_custom_call"] else (
        "pallas_gpu" if result["triton_custom_call"] else "xla")
    assert compiled == runtime == ("cudnn" if dtype == "bfloat16" else "pallas_gpu"), result


def test_rows_hold_one_segment_only_when_no_mask_is_needed():
    from model_defs.fused_attention import rows_hold_one_segment

    def check(rows):
        return bool(rows_hold_one_segment(jnp.asarray(rows, jnp.int32)))

    assert check([[1, 1, 1, 0, 0], [4, 4, 4, 4, 4]])  # one trajectory each, padding last
    assert check([[0, 0, 0], [2, 2, 0]])  # an all-padding row
    assert check([[1, 1, -1, -1]])  # the kernels' own -1 padding
    assert not check([[1, 1, 2, 2, 0]])  # two segments: needs the mask
    assert not check([[0, 0, 1, 1]])  # padding first: real tokens would read it
    assert not check([[1, 0, 1, 0]])  # a hole


def test_one_segment_rows_need_no_segment_mask():
    """The fact cuDNN's use for packed rows rests on: when rows_hold_one_segment, causal
    attention without segments gives every real token its packed attention, values and
    the gradients that reach real tokens (padding queries' outputs carry no loss)."""
    from model_defs.fused_attention import rows_hold_one_segment

    q, k, v = _qkv(b=2, kv=2, g=2, t=T)
    seg = np.zeros((2, T), np.int32)
    seg[0, :31], seg[1, :] = 1, 3
    assert bool(rows_hold_one_segment(jnp.asarray(seg)))
    real = jnp.asarray(seg > 0)[:, None, None, :, None]
    cot = jnp.where(real, jax.random.normal(jax.random.key(1), q.shape), 0.0)

    def loss(q, k, v, segments):
        out = attention(q, k, v, segment_ids_bt=segments, impl="xla")
        return jnp.sum(out * cot), out

    (packed, out_p), g_p = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        q, k, v, jnp.asarray(seg))
    (plain, out_c), g_c = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        q, k, v, None)
    tol = _fp32_tol(q, k, v)
    assert float(jnp.max(jnp.abs(jnp.where(real, out_p - out_c, 0.0)))) <= tol
    assert abs(float(packed - plain)) <= tol * float(jnp.sum(jnp.abs(cot)))
    for name, a, b in zip("qkv", g_p, g_c, strict=True):
        bound = tol * float(jnp.max(jnp.abs(cot))) * np.sqrt(T)
        assert float(jnp.max(jnp.abs(a - b))) <= bound, name


@pytest.mark.skipif(not _has("jax_plugins.xla_cuda13"),
                    reason="needs the CUDA plugin: pip install jax-cuda13-plugin jax-cuda13-pjrt")
@pytest.mark.skipif(not cudnn_available(),
                    reason="needs the cuDNN wheel to compile cuDNN attention: pip install "
                           "nvidia-cudnn-cu13 (aot extra)")
def test_h100_packed_bf16_program_holds_cudnn_and_triton():
    """Packed bf16 rows with attention auto on H100: cuDNN for micro-batches of one segment
    per row, the Triton kernel otherwise, both compiled into the one program."""
    result = _compile("h100:2", "auto", 256, "bfloat16", segments=True)
    assert result["cudnn_custom_call"] > 0 and result["triton_custom_call"] > 0, result
