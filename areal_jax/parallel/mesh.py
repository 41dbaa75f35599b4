"""The device mesh: ``--mesh data=D,fsdp=F,tensor=T`` and the batch sharding over it.

Axes, outermost first:
  data    pure data parallelism: parameters replicated, batch split;
  fsdp    parameters and optimizer state sharded, batch split too (ZeRO-3 style);
  tensor  Megatron-style: heads / MLP / vocab split, batch replicated.

The batch dimension of every input is sharded over ("data", "fsdp").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")
_SPEC_HELP = "expected comma-separated axis=size pairs like 'data=2,fsdp=4,tensor=1'"


class MeshSpecError(ValueError):
    """A mesh spec that is malformed or does not fit the devices."""


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes)


def parse_mesh_spec(spec: str | Mapping[str, int], n_devices: int | None = None) -> dict[str, int]:
    """Parse ``"data=2,fsdp=-1"`` into ``{"data": 2, "fsdp": F, "tensor": 1}``.

    Axes left out have size 1. One size may be ``-1``, meaning "the rest of the devices";
    resolving it needs ``n_devices`` (default: all devices). When ``n_devices`` is given
    (or a ``-1`` is present) the product must equal it.
    """
    items: list[tuple[str, int | str]]  # a size as given: checked below
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
        text = ",".join(f"{k}={v}" for k, v in items)
    else:
        text = str(spec).strip()
        items = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                raise MeshSpecError(f"mesh spec {text!r} has an empty entry; {_SPEC_HELP}")
            if part.count("=") != 1:
                raise MeshSpecError(
                    f"mesh spec {text!r}: entry {part!r} is not axis=size; {_SPEC_HELP}")
            axis, size_text = (s.strip() for s in part.split("="))
            items.append((axis, size_text))

    sizes: dict[str, int] = {}
    for name, value in items:
        if name not in MESH_AXES:
            raise MeshSpecError(f"mesh spec {text!r}: unknown axis {name!r}; axes are "
                                f"{', '.join(MESH_AXES)}")
        if name in sizes:
            raise MeshSpecError(f"mesh spec {text!r}: axis {name!r} is given twice")
        try:
            size = int(value)
        except (TypeError, ValueError):
            raise MeshSpecError(f"mesh spec {text!r}: size of {name!r} is {value!r}, not an "
                                "integer") from None
        if size == 0 or size < -1:
            raise MeshSpecError(f"mesh spec {text!r}: size of {name!r} must be >= 1 or -1 "
                                f"(the rest), got {size}")
        sizes[name] = size
    wildcards = [a for a, s in sizes.items() if s == -1]
    if len(wildcards) > 1:
        raise MeshSpecError(f"mesh spec {text!r}: only one axis may be -1, got {wildcards}")
    full = {a: sizes.get(a, 1) for a in MESH_AXES}

    if wildcards:
        n = jax.device_count() if n_devices is None else n_devices
        known = int(np.prod([s for a, s in full.items() if s != -1]))
        if n % known:
            raise MeshSpecError(f"mesh {text} cannot use {n} devices: {n} is not divisible by "
                                f"the fixed axes' product {known}")
        full[wildcards[0]] = n // known
    elif n_devices is not None:
        need = int(np.prod(list(full.values())))
        if need != n_devices:
            raise MeshSpecError(f"mesh {text} needs {need} devices, found {n_devices}")
    return full


def make_mesh(spec: str | Mapping[str, int] = "data=-1",
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with axes ("data", "fsdp", "tensor") over ``devices`` (default: all).

    Devices are laid out data-major, so on several hosts each process's devices form one
    contiguous block of batch rows.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec, n_devices=len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    if all(d.platform == "cpu" for d in devices):
        device_array = np.array(devices, dtype=object).reshape(shape)
    else:
        from jax.experimental import mesh_utils

        device_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(device_array, MESH_AXES)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    return {a: int(mesh.shape[a]) for a in mesh.axis_names}


def n_batch_shards(mesh: Mesh) -> int:
    """How many ways the batch dimension is split: data x fsdp."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names]))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (row) dimension over ("data", "fsdp"); the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def local_batch_rows(mesh: Mesh, global_rows: int) -> slice:
    """The contiguous rows of a [global_rows, ...] batch that this process's devices hold."""
    sharding = batch_sharding(mesh, 1)
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    indices = [idx for idx in index_map.values() if idx is not None]  # a 1-d batch: all set
    starts = [idx[0].start or 0 for idx in indices]
    stops = [global_rows if idx[0].stop is None else idx[0].stop for idx in indices]
    lo, hi = min(starts), max(stops)
    covered = {r for s, e in zip(starts, stops, strict=True) for r in range(s, e)}
    if len(covered) != hi - lo:
        raise ValueError("this process's batch rows are not contiguous in the mesh; build the mesh "
                         "with make_mesh so each process owns one block of (data, fsdp) shards")
    return slice(lo, hi)


def process_batch_rows(mesh: Mesh, global_rows: int) -> dict[int, slice]:
    """The contiguous rows of a [global_rows, ...] batch that each process's devices hold:
    what :func:`local_batch_rows` returns on that process, known to every process."""
    index_map = batch_sharding(mesh, 1).devices_indices_map((global_rows,))
    spans: dict[int, set[int]] = {}
    for device, idx in index_map.items():
        assert idx is not None  # a 1-d batch sharding gives every device an index
        start = idx[0].start or 0
        stop = global_rows if idx[0].stop is None else idx[0].stop
        pid = device.process_index  # type: ignore[attr-defined]  # jaxlib's Device: no stub
        spans.setdefault(pid, set()).update(range(start, stop))
    out = {}
    for pid, rows in sorted(spans.items()):
        lo, hi = min(rows), max(rows) + 1
        if len(rows) != hi - lo:
            raise ValueError(
                f"process {pid}'s batch rows are not contiguous in the mesh; build the mesh "
                "with make_mesh so each process owns one block of (data, fsdp) shards")
        out[pid] = slice(lo, hi)
    return out


def put_batch(array: np.ndarray, mesh: Mesh, *, process_local: bool = False) -> jax.Array:
    """Place a host batch [R, ...] on the mesh, rows over ("data", "fsdp").

    Every process feeds only the rows its own devices hold, through
    ``jax.make_array_from_process_local_data``; on one host these are all the rows.

    Args:
      array: the global batch (same on every process), or with ``process_local=True``
        only this process's rows (see :func:`local_batch_rows`).
    """
    array = np.asarray(array)
    sharding = batch_sharding(mesh, array.ndim)
    n_shards = n_batch_shards(mesh)
    if process_local:
        local_shards = len({idx[0].start for idx in
                            sharding.addressable_devices_indices_map((n_shards,)).values()
                            if idx is not None})
        global_rows = array.shape[0] * n_shards // local_shards
        local = array
    else:
        global_rows = array.shape[0]
        local = array[local_batch_rows(mesh, global_rows)] if jax.process_count() > 1 else array
    if global_rows % n_shards:
        raise ValueError(f"batch of {global_rows} rows cannot be split over data x fsdp = "
                         f"{n_shards} shards; make rows a multiple of {n_shards}")
    return jax.make_array_from_process_local_data(sharding, local, (global_rows, *array.shape[1:]))


# Parameters at least this large left whole on every device of an fsdp mesh are reported:
# a dimension that does not divide its mesh axis is replicated silently (model_defs.sharding),
# and at this size that costs real memory on every device.
REPLICATED_PARAM_WARN_ELEMENTS = 1 << 20


def replicated_params(params: object, shardings: object, mesh: Mesh,
                      min_elements: int | None = None) -> list[str]:
    """The paths of the parameters of at least ``min_elements`` (default
    ``REPLICATED_PARAM_WARN_ELEMENTS``) that ``shardings`` leaves fully replicated although
    the mesh's ``fsdp`` axis has more than one device; [] on any other mesh. MaxText checks
    the same: that the parameters are sharded as intended, not only as asked."""
    if dict(mesh.shape).get("fsdp", 1) <= 1:
        return []
    floor = REPLICATED_PARAM_WARN_ELEMENTS if min_elements is None else min_elements
    leaves = jax.tree_util.tree_leaves_with_path(params)
    found = []
    for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        if int(np.prod(leaf.shape)) >= floor and sharding.is_fully_replicated:
            found.append(jax.tree_util.keystr(path))
    return found
