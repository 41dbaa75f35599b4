"""Compiles packed causal attention forward+backward for a compile-only accelerator target
and prints what the compiled program holds as one JSON line (run in a subprocess by
tests/test_fused_attention.py: libtpu's settings must be made before jax starts).

    JAX_PLATFORMS=cpu python tests/_attention_compile.py TARGET IMPL T [DTYPE [SEGMENTS]]

DTYPE: bfloat16 (default) or float32; SEGMENTS: 1 (packed rows, default) or 0 (rows without
segment ids, as the engine's prefill).
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from areal_jax.parallel.targets import compile_only_devices
from model_defs.attention import attention
from model_defs.sharding import logical_to_spec, use_mesh


def main(target: str, impl: str, t: int, dtype: str = "bfloat16", segments: bool = True) -> None:
    devices = compile_only_devices(target)
    # batch over fsdp, kv heads over tensor: the learner's rules, both shard_map axes used
    mesh = Mesh(np.array(devices).reshape(1, len(devices) // 2, 2), ("data", "fsdp", "tensor"))
    b, kv, g, dh = len(devices) // 2, 2, 7, 64  # Qwen2.5-0.5B's heads
    shapes = {"q": (b, kv, g, t, dh), "k": (b, kv, t, dh), "v": (b, kv, t, dh), "seg": (b, t)}
    names = {"q": ("batch", "kv_heads", "heads", None, None),
             "k": ("batch", "kv_heads", None, None), "v": ("batch", "kv_heads", None, None),
             "seg": ("batch", None)}
    shardings = {n: NamedSharding(mesh, logical_to_spec(names[n], mesh, shapes[n]))
                 for n in shapes}

    def loss(q, k, v, seg):
        out = attention(q, k, v, segment_ids_bt=seg if segments else None, impl=impl)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    args = [jax.ShapeDtypeStruct(shapes[n], jnp.int32 if n == "seg" else jnp.dtype(dtype))
            for n in ("q", "k", "v", "seg")]
    with use_mesh(mesh):
        compiled = jax.jit(
            grad, in_shardings=tuple(shardings[n] for n in ("q", "k", "v", "seg")),
            out_shardings=tuple(shardings[n] for n in ("q", "k", "v"))).lower(*args).compile()
    hlo = compiled.as_text()
    square = re.findall(rf"(?:f32|bf16)\[[0-9,]*{t},{t}\]", hlo)
    memory = compiled.memory_analysis()
    print(json.dumps({
        "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "tpu_custom_call": hlo.count("tpu_custom_call"),
        "triton_custom_call": hlo.count("__gpu$xla.gpu.triton"),
        "cudnn_custom_call": hlo.count("__cudnn$"),
        "square_buffers": sorted(set(square)),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
    }))


if __name__ == "__main__":
    args = sys.argv[1:] + ["bfloat16", "1"][len(sys.argv) - 4:]
    main(args[0], args[1], int(args[2]), args[3], args[4] == "1")
