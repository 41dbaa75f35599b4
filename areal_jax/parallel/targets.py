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
from typing import Any

# name -> (topology_name, chip_config_name, chips_per_host_bounds, TPU_ACCELERATOR_TYPE)
_TPU_TARGETS = {
    "v5e:2x2": ("v5e:2x2", "default", (2, 2, 1), "v5litepod-4"),
    "v5e:2x4": ("v5e:2x4", "default", (2, 4, 1), "v5litepod-8"),
    "v6e:2x2": ("v6e:2x2", "default", (2, 2, 1), "v6e-4"),
    "v4:2x2x1": ("v4:2x2x1", "megacore", (2, 2, 1), "v4-8"),
    "v5p:2x2x1": ("v5p:2x2x1", "megacore", (2, 2, 1), "v5p-8"),
}
_GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
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
        os.environ.update(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE=accelerator,
                          TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0")
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
