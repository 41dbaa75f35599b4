"""areal-jax: fully asynchronous RL for language-model reasoning, in JAX."""

import os as _os

__version__ = "0.1.0"


def _quiet_absent_cuda() -> None:
    """No CUDA plugin traceback on a machine without an NVIDIA GPU. With the plugin
    installed (the aot or cuda extra), jax's first backend start runs its CUDA library
    version check, which fails on a GPU-less host and logs ~25 lines of traceback, then
    skips CUDA anyway: jax starts no CUDA backend without a visible GPU device node (the
    very check below, in jax's private hardware_utils.has_visible_nvidia_gpu). So the version check
    is skipped exactly where its backend would be; a GPU machine keeps it."""
    if not any(_os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")):
        _os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


_quiet_absent_cuda()
# gcsfs reads this once, when it is imported (a gRPC bucket-type probe per open that stalls
# for a minute against an emulator): set before anything of ours imports it. A value the
# user set is kept; areal_jax.storage.configure_environment() also repairs an early import.
_os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
