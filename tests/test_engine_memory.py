"""The engine's step programs allocate no copy of the weights: on a CPU a program that
slices the stacked layers, converts a bf16 kernel to fp32 for its product, or hoists a
transposed embedding out of its step loop allocates temporaries as large as the weights on
every call (2.3 GB per decode call at the 0.5B shape). Counted from the compiled programs'
own memory analysis, on a real server (``/get_server_info``'s ``programs``)."""

from __future__ import annotations

import sys

import httpx
import pytest

from areal_jax.engine.launch import launch_server
from tests.hf_fixtures import make_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def vocab_heavy(tmp_path_factory):
    # A tied embedding larger than the layers, as in the small Qwen models.
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("mem"), tie=True, vocab_size=4096,
                                   hidden_size=256, intermediate_size=256)


def test_bf16_step_programs_hold_no_copy_of_the_weights(vocab_heavy):
    from safetensors.numpy import load_file

    tensors = load_file(str(vocab_heavy / "model.safetensors"))
    weight_bytes = sum(a.size for a in tensors.values()) * 2  # served in bf16
    with launch_server(vocab_heavy, max_slots=4, max_seq_len=64, dtype="bfloat16",
                       warmup=True) as server:
        info = httpx.get(f"{server.url}/get_server_info", timeout=60).json()
        programs = info["programs"]
        assert info["layer_loop"] == "unrolled" and programs
        for name, stats in programs.items():
            # activations, logits and sampling buffers only: well under the weights
            assert stats["temp_mb"] * 1e6 < 0.5 * weight_bytes, (name, stats, weight_bytes)
        r = httpx.post(f"{server.url}/generate", timeout=120, json={
            "input_ids": [5, 9, 17, 3], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 6


def test_cpu_engine_xla_flags_add_each_missing_flag_and_keep_the_users(monkeypatch):
    from areal_jax.engine import server as server_mod

    monkeypatch.setattr(server_mod, "cpu_only_host", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3 --xla_foo=1")
    server_mod.apply_cpu_engine_xla_flags()
    flags = server_mod.os.environ["XLA_FLAGS"].split()
    # the user's level stays (once); the flags the user did not set are added
    assert [f for f in flags if f.startswith("--xla_backend_optimization_level")] == [
        "--xla_backend_optimization_level=3"]
    assert "--xla_foo=1" in flags
    assert "--xla_disable_hlo_passes=while-loop-invariant-code-motion" in flags
    server_mod.apply_cpu_engine_xla_flags()  # applying twice adds nothing
    assert server_mod.os.environ["XLA_FLAGS"].split() == flags
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(server_mod, "cpu_only_host", lambda: False)
    server_mod.apply_cpu_engine_xla_flags()  # an accelerator host: XLA's defaults
    assert server_mod.os.environ["XLA_FLAGS"] == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_memory_returns_the_heaps_free_pages():
    import ctypes
    import ctypes.util

    from areal_jax.engine.runner import release_freed_memory

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    # 64 KiB blocks come from the heap (below glibc's mmap threshold): freed, they stay
    # resident until trimmed; the last one, kept, pins the heap's top.
    blocks = [libc.malloc(64 << 10) for _ in range(3200)]  # 200 MiB
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for block in blocks[:-1]:
        libc.free(block)
    before = rss_mb()
    assert release_freed_memory()
    assert rss_mb() < before - 100, (before, rss_mb())
    libc.free(blocks[-1])


def _plugin_libraries_after_start(skip: bool, platforms: str | None) -> tuple[bool, list[str]]:
    """In a fresh process: whether ``skip_accelerator_plugins`` applied, and the shared
    libraries of accelerator plugins (a ``jax_plugins`` package's PJRT library, the CUDA
    libraries it loads) mapped once JAX's CPU backend started."""
    import json
    import os
    import subprocess

    code = (
        "import json, jax\n"
        "from areal_jax.engine.server import skip_accelerator_plugins\n"
        f"did = skip_accelerator_plugins() if {skip} else False\n"
        "jax.devices('cpu')\n"
        "maps = {line.split()[-1] for line in open('/proc/self/maps') if len(line.split()) > 5}\n"
        "libs = sorted(m for m in maps if ('/jax_plugins/' in m or '/nvidia/' in m)\n"
        "              and '.so' in m)\n"
        "print(json.dumps([did, libs]))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    did, libs = json.loads(out.stdout.strip().splitlines()[-1])
    return did, libs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_cpu_server_loads_no_accelerator_plugin():
    """With JAX_PLATFORMS=cpu (how launch_server starts a CPU engine) the server's process
    loads no plugin library (jax-cuda's PJRT library and CUDA libraries: 0.29 GB of
    resident set where it is installed); without JAX_PLATFORMS, or with another platform
    named too, the function leaves JAX's plugins alone."""
    did, libs = _plugin_libraries_after_start(skip=True, platforms="cpu")
    assert did and libs == []
    assert _plugin_libraries_after_start(skip=True, platforms=None)[0] is False
    assert _plugin_libraries_after_start(skip=True, platforms="cpu,cuda")[0] is False
    _, default = _plugin_libraries_after_start(skip=False, platforms="cpu")
    if not default:
        pytest.skip("no accelerator plugin installed here: nothing to keep out")
