"""The torch process group of SGLang's in-memory weight update (``/init_weights_update_group``
+ ``/update_weights_from_distributed``), shared by its sender (``checkpoint/distributed.py``,
rank 0) and the embedded engine's receiver (``engine/distributed_update.py``, ranks
``rank_offset``..).

The group is built exactly as SGLang builds its side (``init_custom_process_group``): a
TCP store rendezvous at ``tcp://master_address:master_port`` (rank 0 hosts the store), the
store prefixed by the group's name, then torch's own group constructor for a group that is
not the process's default one. Both ends therefore agree on the store's keys whichever of
them is real SGLang, and neither needs a default process group. Every collective on the group
is bounded by its ``timeout_s`` (gloo raises when it expires; a peer that died mid-broadcast
is noticed that way), so nothing waits forever.

torch is not a core dependency of areal-jax: it is imported here only when a group is made,
and its absence is one clear :class:`WeightGroupError`.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import numpy as np

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default
BACKENDS = ("gloo", "nccl")
# The wire dtypes the update accepts: what a sender may broadcast (SGLang's names, with or
# without torch's "torch." prefix).
DTYPES = ("bfloat16", "float16", "float32")


class WeightGroupError(RuntimeError):
    """A group that cannot be made or used (torch missing, a rendezvous that timed out)."""


def torch_modules() -> tuple[Any, Any]:
    """(torch, torch.distributed), or WeightGroupError saying how to get them."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise WeightGroupError(
            f"weight updates through a torch process group need torch, which is not a core "
            f"dependency of areal-jax ({e}); install it (pip install torch, the CPU wheel "
            f"is enough for the gloo backend)") from None
    if not dist.is_available():
        raise WeightGroupError("this torch build has no torch.distributed; weight updates "
                               "through a process group need one")
    return torch, dist


def dtype_name(dtype: str) -> str:
    """SGLang's dtype string ("bfloat16" or "torch.bfloat16") as one of DTYPES; ValueError
    for anything else."""
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else ""
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}")
    return name


def init_group(backend: str, master_address: str, master_port: int, rank: int,
               world_size: int, group_name: str, timeout_s: float) -> Any:
    """Joins (rank 0: hosts) the group; blocks until every rank has joined or ``timeout_s``
    passed. Returns the torch ProcessGroup."""
    _, dist = torch_modules()
    from torch.distributed import distributed_c10d as c10d

    if backend not in BACKENDS:
        raise WeightGroupError(f"backend {backend!r} is not one of {list(BACKENDS)}")
    if backend == "gloo" and not dist.is_gloo_available():
        raise WeightGroupError("this torch build has no gloo backend")
    if backend == "nccl" and not dist.is_nccl_available():
        raise WeightGroupError("this torch build has no NCCL (a CUDA build of torch and a "
                               "GPU are needed); use the gloo backend on CPU")
    # torch's builder of a non-default group; SGLang, vLLM and verl build theirs with it too,
    # so the store's keys match theirs (a private name, hence looked up and checked).
    helper = getattr(c10d, "_new_process_group_helper", None)
    world = getattr(c10d, "_world", None)
    if helper is None or world is None:
        raise WeightGroupError(f"torch {_torch_version()} lacks the process-group builder "
                               "SGLang uses; use the torch version SGLang pins")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, rank, world_size = next(dist.rendezvous(
            f"tcp://{master_address}:{master_port}", rank=rank, world_size=world_size,
            timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore(group_name, store)
        pg, _ = helper(world_size, rank, [], dist.Backend(backend), store,
                       group_name=group_name, timeout=timeout)
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError is a RuntimeError
        raise WeightGroupError(f"cannot join weight update group {group_name!r} at "
                               f"{master_address}:{master_port} as rank {rank} of "
                               f"{world_size}: {_first_line(e)}") from None
    world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    """Leaves ``pg`` (best effort: a group whose peer died may already be broken)."""
    if pg is None:
        return
    _, dist = torch_modules()
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001, S110 - already gone
        pass


def to_torch(array: Any, torch: Any) -> Any:
    """A torch tensor of ``array`` (a jax or numpy array): through DLPack, no copy, where
    both sides allow it; else through numpy (bfloat16 as its 16-bit pattern)."""
    if not isinstance(array, np.ndarray):
        try:
            return torch.from_dlpack(array)
        except (TypeError, RuntimeError, BufferError, AttributeError):
            array = np.asarray(array)
    array = np.ascontiguousarray(array)
    with warnings.catch_warnings():  # a read-only view (a jax array's host buffer): only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def to_numpy(tensor: Any, torch: Any) -> np.ndarray:
    """A host numpy array of ``tensor`` (bfloat16 as ml_dtypes' bfloat16; no copy on CPU)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _torch_version() -> str:
    torch, _ = torch_modules()
    return str(torch.__version__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
