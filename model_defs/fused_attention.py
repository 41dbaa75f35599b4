"""Fused self-attention kernels on accelerators, chosen by ``model.attention``.

``auto`` resolves by platform and dtype: ``splash`` on TPU, ``cudnn`` on GPU for bf16/fp16
queries (``pallas_gpu`` for fp32, which cuDNN's fused attention refuses), ``xla`` on CPU (the
blockwise flash attention of :mod:`model_defs.attention`). The choice is a pure function of
(name, platform, dtype): it never looks at what the host happens to have installed, so
``scripts/plan.py`` compiling for a GPU target on a CPU picks exactly the kernel the GPU
will run (the planner needs the cuDNN wheel, ``nvidia-cudnn-cu13`` in the ``aot`` extra, to
compile it, and says so when it is missing).

Every kernel computes the same thing as the XLA path: packed causal self-attention (token
i reads tokens j <= i of its own segment), GQA, queries pre-scaled, optionally with the
fp32 log-sum-exp of each query's scores (the engine's prefill). Shapes as in
:mod:`model_defs.attention`: q [B, K, G, T, Dh], k/v [B, K, T, Dh].

* ``splash`` (TPU): ``jax.experimental.pallas.ops.tpu.splash_attention``, the MQA kernel
  (one kv head, G query heads) vmapped over batch rows and kv heads, causal mask plus
  segment ids; its own forward and backward kernels (``save_residuals`` gives the lse,
  forward only). T is padded to a multiple of 128 (the kernel's lane width); the padded
  tail comes after every real token, so causality alone keeps it out of real outputs.
* ``pallas_gpu`` (GPU): ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton), causal
  plus segment ids, forward and backward kernels; it has no GQA, so keys/values are
  repeated G times (their gradient sums back through the repeat). Its lse is base 2 and is
  converted.
* ``cudnn`` (GPU): ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)``.
  It takes no segment ids (a [T, T] mask would be quadratic again). Rows without segments
  (the engine's prefill) use cuDNN, in bf16/fp16 only; packed rows (``segment_ids_bt``
  given) use it when every row of the micro-batch holds one segment followed by padding
  (``rows_hold_one_segment``: long trajectories), and ``pallas_gpu`` otherwise: both
  programs are compiled and a ``lax.cond`` picks one per call. Needs the cuDNN library (the
  ``nvidia-cudnn`` wheel, which ``jax[cuda13]`` installs).

A Pallas/Mosaic custom call cannot be partitioned automatically ("Mosaic kernels cannot be
automatically partitioned"), so on a mesh every kernel runs under ``shard_map``: batch
rows over the mesh's batch axes, kv heads (or, when they do not divide, query heads) over
``tensor``, as :mod:`model_defs.sharding`'s rules name them; with no mesh it is called
directly. ``interpret=True`` runs the Pallas kernels in the interpreter on any backend
(the CPU tests compare them with the reference attention that way).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp

from model_defs.sharding import current_mesh, logical_to_spec

Array = jax.Array
ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn", "pallas_gpu")
_KERNEL_PLATFORMS = {"splash": ("tpu",), "cudnn": ("gpu",), "pallas_gpu": ("gpu",)}
_LN2 = 0.6931471805599453
# The query dtypes cuDNN's fused attention takes (it raises on fp32).
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _normalize_platform(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def cudnn_available() -> bool:
    """True when the cuDNN library loads in this process (the fused-attention API raises
    without it): from the ``nvidia-cudnn`` wheel that ``jax[cuda]`` installs, else from
    the system's library path. Public means only (jax's own probe is private API)."""
    names: list[str] = []
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(folder, "lib")
        if os.path.isdir(lib):
            names += [os.path.join(lib, n) for n in sorted(os.listdir(lib))
                      if n.startswith("libcudnn.so")]
    for name in [*names, "libcudnn.so.9", "libcudnn.so"]:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def resolve_attention_impl(name: str, platform: str, *, dtype: Any = None,
                           interpret: bool = False) -> str:
    """The kernel ``model.attention: name`` means on ``platform`` (``cpu``, ``tpu``,
    ``gpu``/``cuda``/``rocm``) for queries of ``dtype`` (None: a half-precision dtype, the
    kernels' common case). ``auto``: splash on TPU; on GPU cudnn for bf16/fp16 and
    pallas_gpu for other dtypes (cuDNN's fused attention refuses fp32); xla elsewhere. A
    kernel asked for on another platform, or for a dtype it refuses, is an error, except
    that Pallas kernels run anywhere when ``interpret`` (cuDNN has no interpreter)."""
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_IMPLS)}; "
                         f"got {name!r}")
    platform = _normalize_platform(platform)
    half = dtype is None or jnp.dtype(dtype) in CUDNN_DTYPES
    if name == "auto":
        if platform == "tpu":
            return "splash"
        if platform == "gpu":
            return "cudnn" if half else "pallas_gpu"
        return "xla"
    if name == "cudnn" and not half:
        raise ValueError(f"model.attention=cudnn needs bf16 or fp16 queries (cuDNN's fused "
                         f"attention refuses {jnp.dtype(dtype).name}); use auto or "
                         "pallas_gpu for an fp32 model")
    if name == "xla" or platform in _KERNEL_PLATFORMS[name]:
        return name
    if interpret and name != "cudnn":
        return name
    raise ValueError(f"model.attention={name} runs on {'/'.join(_KERNEL_PLATFORMS[name])}, "
                     f"not {platform}; use auto or xla (Pallas kernels run elsewhere only "
                     "in interpret mode)")


def active_platform() -> str:
    """Platform of the active mesh's devices (compile-only TPU/GPU devices included), else
    of jax's default backend."""
    mesh = current_mesh()
    if isinstance(mesh, jax.sharding.Mesh):
        return _normalize_platform(mesh.devices.flat[0].platform)
    if mesh is not None:  # an AbstractMesh (jax.set_mesh): its device kind, if it has one
        abstract_device = getattr(mesh, "abstract_device", None)
        if abstract_device is not None:
            return _normalize_platform(abstract_device.platform)
    return _normalize_platform(jax.default_backend())


def fused_self_attention(impl: str, q_bkgtd: Array, k_bktd: Array, v_bktd: Array,
                         segment_ids_bt: Array | None, *, return_lse: bool = False,
                         interpret: bool = False) -> Any:
    """Causal (packed, if ``segment_ids_bt``) self-attention with kernel ``impl`` (a
    resolved name other than ``xla``). Returns out [B, K, G, T, Dh] in the queries' dtype,
    or with ``return_lse`` (forward only) also the fp32 lse [B, K, G, T]."""
    kernels = {"splash": _splash, "pallas_gpu": _pallas_gpu, "cudnn": _cudnn}
    if impl == "cudnn" and segment_ids_bt is not None:
        kernels["cudnn"] = _cudnn_or_pallas_gpu  # cuDNN's public API has no segment ids
    if impl not in kernels:
        raise ValueError(f"fused_self_attention: impl must be one of {sorted(kernels)}; "
                         f"got {impl!r}")
    kernel = functools.partial(kernels[impl], return_lse=return_lse, interpret=interpret)
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return kernel(q_bkgtd, k_bktd, v_bktd, segment_ids_bt)
    q_spec = logical_to_spec(("batch", "kv_heads", "heads", None, None), mesh, q_bkgtd.shape)
    kv_spec = logical_to_spec(("batch", "kv_heads", None, None), mesh, k_bktd.shape)
    seg_spec = jax.sharding.PartitionSpec(q_spec[0], None)
    lse_spec = jax.sharding.PartitionSpec(*q_spec[:4])
    in_specs = (q_spec, kv_spec, kv_spec, None if segment_ids_bt is None else seg_spec)
    out_specs = (q_spec, lse_spec) if return_lse else q_spec
    return jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(q_bkgtd, k_bktd, v_bktd, segment_ids_bt)


def rows_hold_one_segment(segment_ids_bt: Array) -> Array:
    """True (a scalar) when every row holds at most one segment, starting at its first
    token, with only padding (ids <= 0) after it: then plain causal attention, with no
    segment mask, gives every real token exactly its packed attention (a real token's
    earlier keys are all of its own segment; padding queries read real keys, but nothing
    real reads them and their outputs carry no loss)."""
    seg_bt = segment_ids_bt
    real_bt = seg_bt > 0
    one_id = jnp.all((seg_bt == seg_bt[:, :1]) | ~real_bt)
    padding_last = jnp.all(real_bt[:, 1:].astype(jnp.int32) <= real_bt[:, :-1].astype(jnp.int32))
    return one_id & padding_last


def _cudnn_or_pallas_gpu(q_bkgtd, k_bktd, v_bktd, seg_bt, *, return_lse, interpret):
    """Packed rows on cuDNN when they need no segment mask (``rows_hold_one_segment``: a
    long trajectory per row), else on the Triton kernel: both are compiled, one runs (a
    ``lax.cond`` on the micro-batch, per shard under ``shard_map``)."""
    return jax.lax.cond(
        rows_hold_one_segment(seg_bt),
        lambda: _cudnn(q_bkgtd, k_bktd, v_bktd, None, return_lse=return_lse,
                       interpret=interpret),
        lambda: _pallas_gpu(q_bkgtd, k_bktd, v_bktd, seg_bt, return_lse=return_lse,
                            interpret=interpret))


def _pad_time(t: int, multiple: int, *arrays_axes: tuple[Array | None, int]) -> list:
    """Pads each array's time axis to a multiple of ``multiple`` (zeros; segment ids with
    -1). Right padding is safe under a causal mask: no real token reads a later one."""
    pad = -(-t // multiple) * multiple - t
    out = []
    for x, axis in arrays_axes:
        if x is None or not pad:
            out.append(x)
            continue
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        fill = -1 if jnp.issubdtype(x.dtype, jnp.integer) else 0
        out.append(jnp.pad(x, widths, constant_values=fill))
    return out


def _splash_block(t_padded: int) -> int:
    return next(b for b in (512, 256, 128) if t_padded % b == 0)


def _splash(q_bkgtd, k_bktd, v_bktd, seg_bt, *, return_lse, interpret):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    t = q_bkgtd.shape[3]
    q_bkgtd, k_bktd, v_bktd, seg_bt = _pad_time(
        t, 128, (q_bkgtd, 3), (k_bktd, 2), (v_bktd, 2),
        (None if seg_bt is None else seg_bt.astype(jnp.int32), 1))
    g, t_pad = q_bkgtd.shape[2], q_bkgtd.shape[3]
    block = _splash_block(t_pad)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    mask = sa.MultiHeadMask([sa.CausalMask((t_pad, t_pad))] * g)
    kernel = sa.make_splash_mqa(mask, block_sizes=sizes, save_residuals=return_lse,
                                head_shards=1, q_seq_shards=1, interpret=interpret)

    def one_head(q_gtd, k_td, v_td, seg_t):
        ids = None if seg_t is None else sa.SegmentIds(q=seg_t, kv=seg_t)
        return kernel(q_gtd, k_td, v_td, ids)

    per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None))
    result = jax.vmap(per_row, in_axes=(0, 0, 0, None if seg_bt is None else 0))(
        q_bkgtd, k_bktd, v_bktd, seg_bt)
    if not return_lse:
        return result[:, :, :, :t]
    out_bkgtd, (lse_bkgt,) = result
    return out_bkgtd[:, :, :, :t], lse_bkgt[..., :t].astype(jnp.float32)


def _heads_minor(q_bkgtd, k_bktd, v_bktd):
    """[B, T, K*G, Dh] queries and keys/values repeated to every query head."""
    b, kv, g, t, dh = q_bkgtd.shape
    q_bthd = q_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, dh)
    k_bthd = jnp.repeat(k_bktd.transpose(0, 2, 1, 3), g, axis=2)
    v_bthd = jnp.repeat(v_bktd.transpose(0, 2, 1, 3), g, axis=2)
    return q_bthd, k_bthd, v_bthd


def _heads_major(x_bthd, kv: int, g: int):
    b, t, _, dh = x_bthd.shape
    return x_bthd.reshape(b, t, kv, g, dh).transpose(0, 2, 3, 1, 4)


def _pallas_gpu(q_bkgtd, k_bktd, v_bktd, seg_bt, *, return_lse, interpret, blocks=(128, 32)):
    """``blocks``: the (forward, backward) tiles, jax's defaults unless a benchmark sweeps
    them (``scripts/bench.py attention --pallas-blocks``)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    b, kv, g, t, dh = q_bkgtd.shape
    multiple = 128 if t > 128 else max(16, 1 << (t - 1).bit_length())
    q_bkgtd, k_bktd, v_bktd, seg_bt = _pad_time(
        t, multiple, (q_bkgtd, 3), (k_bktd, 2), (v_bktd, 2),
        (None if seg_bt is None else seg_bt.astype(jnp.int32), 1))
    fwd, bwd = (min(block, multiple) for block in blocks)
    sizes = gpu_attention.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd,
                                     block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
    result = gpu_attention.mha(*_heads_minor(q_bkgtd, k_bktd, v_bktd), seg_bt, sm_scale=1.0,
                               causal=True, block_sizes=sizes, interpret=interpret,
                               return_residuals=return_lse)
    if not return_lse:
        return _heads_major(result, kv, g)[:, :, :, :t]
    out_bthd, lse2_bht = result  # base-2 log-sum-exp
    lse_bkgt = (lse2_bht.astype(jnp.float32) * _LN2).reshape(b, kv, g, -1)[..., :t]
    return _heads_major(out_bthd, kv, g)[:, :, :, :t], lse_bkgt


def _cudnn(q_bkgtd, k_bktd, v_bktd, seg_bt, *, return_lse, interpret):
    if interpret:
        raise ValueError("model.attention=cudnn has no interpret mode")
    assert seg_bt is None  # fused_self_attention sends packed rows to pallas_gpu
    b, kv, g, t, dh = q_bkgtd.shape
    q_bthd = q_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, dh)
    result = jax.nn.dot_product_attention(
        q_bthd, k_bktd.transpose(0, 2, 1, 3), v_bktd.transpose(0, 2, 1, 3), scale=1.0,
        is_causal=True, implementation="cudnn", return_residual=return_lse)
    if not return_lse:
        return _heads_major(result, kv, g)
    out_bthd, lse_bth = result
    lse_bkgt = lse_bth.astype(jnp.float32).transpose(0, 2, 1).reshape(b, kv, g, t)
    return _heads_major(out_bthd, kv, g), lse_bkgt
