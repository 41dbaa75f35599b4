"""Compile-only accelerator devices: programs compile for a TPU or GPU target on a CPU host.

``compile_only_devices("v5e:2x2")`` returns devices of that topology which can be put in a
``Mesh`` and compiled for (``jax.jit(f, in_shardings=..., out_shardings=...).lower(...)
.compile()``), but never run: ``jax.devices()`` stays the CPU. TPU targets need ``libtpu``
(``pip install 'jax[tpu]==<jax version>'``), GPU targets the CUDA plugin
(``jax-cuda13-plugin`` and ``jax-cuda13-pjrt`` of jax's version); neither needs the chip.

TPU: libtpu reads ``TPU_*`` variables when it is first loaded, and jax must not try to open
a TPU client, so this sets them (and checks ``JAX_PLATFORMS=cpu``) before the first call
loads libtpu; a process that already loaded libtpu for another accelerator type cannot
switch. GPU: the card's fields come from XLA's target specs, stored in ``gpu_specs/``
(their source and commit are in each file's header).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, NamedTuple

# name -> (topology_name, chip_config_name, chips_per_host_bounds, TPU_ACCELERATOR_TYPE)
_TPU_TARGETS = {
    "v5e:2x2": ("v5e:2x2", "default", (2, 2, 1), "v5litepod-4"),
    "v5e:2x4": ("v5e:2x4", "default", (2, 4, 1), "v5litepod-8"),
    "v6e:2x2": ("v6e:2x2", "default", (2, 2, 1), "v6e-4"),
    "v4:2x2x1": ("v4:2x2x1", "megacore", (2, 2, 1), "v4-8"),
    "v5p:2x2x1": ("v5p:2x2x1", "megacore", (2, 2, 1), "v5p-8"),
}
_GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
TARGET_HELP = "v5e:2x2, v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x2, h100:N or h200:N"


class Chip(NamedTuple):
    """One chip's published figures: dense bf16 peak, HBM capacity and bandwidth."""

    name: str
    peak_bf16_flops: float  # FLOP/s, dense (no sparsity)
    hbm_bytes: int
    hbm_bytes_per_s: float


# Sources: the vendors' product pages (Google Cloud TPU docs "TPU v4/v5e/v5p/v6e" system
# architecture tables; NVIDIA's H100 and H200 datasheets, SXM form factor).
CHIPS: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2, 1,200 GB/s
    "v4": Chip("TPU v4", 275e12, 32 * 2**30, 1200e9),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM2, 819 GB/s
    "v5e": Chip("TPU v5e", 197e12, 16 * 2**30, 819e9),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e, 2,765 GB/s
    "v5p": Chip("TPU v5p", 459e12, 95 * 2**30, 2765e9),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GiB HBM, 1,640 GB/s
    "v6e": Chip("TPU v6e", 918e12, 32 * 2**30, 1640e9),
    # nvidia.com/en-us/data-center/h100: H100 SXM 989 TFLOP/s bf16 dense (1,979 with
    # sparsity), 80 GB HBM3, 3.35 TB/s; the memory is the device_memory_size XLA's spec holds
    "h100": Chip("NVIDIA H100 SXM", 989e12, 84942979072, 3.35e12),
    # nvidia.com/en-us/data-center/h200: 989 TFLOP/s bf16 dense, 141 GB HBM3e, 4.8 TB/s
    "h200": Chip("NVIDIA H200 SXM", 989e12, 151397597184, 4.8e12),
}


def check_target(target: str) -> str:
    """``target`` if it names a known target, else ValueError listing them. Needs no jax
    plugin (configs validate their ``hardware`` with it)."""
    if target in _TPU_TARGETS:
        return target
    match = re.fullmatch(r"(h100|h200):(\d+)", str(target))
    if match is None or int(match.group(2)) < 1:
        raise ValueError(f"unknown target {target!r}; use one of {TARGET_HELP}")
    return target


def target_chip(target: str) -> Chip:
    """The chip of a target name (its part before the colon)."""
    return CHIPS[check_target(target).split(":")[0]]


def target_platform(target: str) -> str:
    """"tpu" or "gpu"."""
    return "tpu" if check_target(target) in _TPU_TARGETS else "gpu"

# GpuDeviceInfoProto fields newer XLA specs carry that jaxlib 0.10's proto does not know
# (the parse fails on an unknown field); they do not affect code generation.
_FIELDS_UNKNOWN_TO_JAXLIB = ("collective_memory_granularity",)


def compile_only_devices(target: str) -> list[Any]:
    """Compile-only devices of ``target``: a TPU slice (``v5e:2x2``, ``v5e:2x4``,
    ``v6e:2x2``, ``v4:2x2x1``, ``v5p:2x2x1``) or ``h100:N`` / ``h200:N`` (N GPUs of one
    host). Raises ValueError for an unknown target and RuntimeError, with the install
    command, when libtpu or the CUDA plugin is missing."""
    import jax
    import jax.experimental.topologies as topologies

    allowed = f"{sorted(_TPU_TARGETS)} or h100:N / h200:N"
    if target in _TPU_TARGETS:
        topology, chip_config, bounds, accelerator = _TPU_TARGETS[target]
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if platforms != "cpu":
            raise RuntimeError(f"compile_only_devices({target!r}) needs JAX_PLATFORMS=cpu "
                               f"set before jax starts (it is {platforms!r})")
        # ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu otherwise takes a host-wide lock file that
        # makes a second compiling process fail; compile-only devices touch no chip.
        os.environ.update(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE=accelerator,
                          TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0",
                          ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        try:
            import libtpu  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"target {target} needs libtpu: pip install "
                               f"'jax[tpu]=={jax.__version__}'") from e
        return list(topologies.get_topology_desc(
            platform="tpu", topology_name=topology, chip_config_name=chip_config,
            chips_per_host_bounds=bounds, num_slices=1, wrap=(False, False, False)).devices)
    match = re.fullmatch(r"(h100|h200):(\d+)", target)
    if match is None or int(match.group(2)) < 1:
        raise ValueError(f"target {target!r} is not one of {allowed}")
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"target {target} needs the CUDA plugin: pip install "
                           f"jax-cuda13-plugin=={jax.__version__} "
                           f"jax-cuda13-pjrt=={jax.__version__}") from e
    spec = Path(__file__).with_name("gpu_specs") / _GPU_SPECS[match.group(1)]
    text = "\n".join(line for line in spec.read_text().splitlines()
                     if line.split(":")[0].strip() not in _FIELDS_UNKNOWN_TO_JAXLIB)
    return list(topologies.get_topology_desc(
        platform="cuda", topology_name="", topology=f"1x1x{match.group(2)}",
        target_config=text).devices)
