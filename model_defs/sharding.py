"""Logical-axis sharding: parameters and activations name their dims; a rule table maps
the names to the mesh axes ``data``, ``fsdp`` and ``tensor``.

Without a mesh everything here is a no-op, so the same model runs in CPU tests and on a pod.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

# A pytree of parameters, or of what has their structure (gradients, optimizer state,
# shardings, ShapeDtypeStructs): nested dicts/lists/tuples, nnx.State, optax states, with
# array leaves. Python's types cannot spell a tree of any depth and container, so this is
# Any under a name; the one alias every room uses (model_defs is the room all may import).
PyTree = Any

# Logical dim name -> mesh axis (or axes). Names missing here are replicated.
LOGICAL_AXIS_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "seq": None,
    "act_embed": None,  # hidden-size dim of activations: replicated
    "layers": None,
}

MESH_AXES = ("data", "fsdp", "tensor")

_state = threading.local()


def current_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set by :func:`use_mesh`, else the one set by ``jax.set_mesh``, else None."""
    mesh = getattr(_state, "mesh", None)
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Makes :func:`shard` constrain activations on ``mesh`` inside the block."""
    previous = getattr(_state, "mesh", None)
    _state.mesh = None if mesh is None else auto_axes_mesh(mesh)
    try:
        yield
    finally:
        _state.mesh = previous


def auto_axes_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis in Auto mode.

    The model relies on XLA's sharding propagation (GSPMD); ``jax.make_mesh`` defaults to
    Explicit axes, whose typed shardings would demand ``out_sharding=`` on every gather.
    """
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def _mesh_axis_size(mesh: Mesh | AbstractMesh, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    size = 1
    for a in axes:
        size *= mesh.shape.get(a, 1)
    return size


def _present_axes(mesh: Mesh | AbstractMesh, axes: MeshAxes) -> MeshAxes:
    """Drops mesh axes the mesh does not have (e.g. a mesh with only ``fsdp``)."""
    if axes is None:
        return None
    if isinstance(axes, str):
        return axes if axes in mesh.shape else None
    kept = tuple(a for a in axes if a in mesh.shape)
    return kept or None


def logical_to_spec(
    logical_axes: Sequence[str | None],
    mesh: Mesh | AbstractMesh,
    shape: Sequence[int] | None = None,
    rules: dict[str, MeshAxes] | None = None,
) -> PartitionSpec:
    """PartitionSpec for a value whose dims are named ``logical_axes``.

    A dim whose size does not divide the mesh axes it maps to is replicated instead;
    a mesh axis already used by an earlier dim is not used twice.
    """
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for i, name in enumerate(logical_axes):
        axes = _present_axes(mesh, rules.get(name)) if name is not None else None
        names = (axes,) if isinstance(axes, str) else (axes or ())
        if any(a in used for a in names):
            axes = None
        elif shape is not None and axes is not None and shape[i] % _mesh_axis_size(mesh, axes):
            axes = None
        if axes is not None:
            used.update((axes,) if isinstance(axes, str) else axes)
        spec.append(axes)
    return PartitionSpec(*spec)


def named_sharding(
    logical_axes: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None
) -> NamedSharding:
    mesh = auto_axes_mesh(mesh)
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, shape))


def shard(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's sharding; a no-op when no mesh is active."""
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return x
    spec = logical_to_spec(logical_axes, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def param_logical_axes(model_or_state: Any) -> Any:
    """Pytree (same structure as ``nnx.state(model, nnx.Param)``) of logical-axis tuples."""
    state = _as_param_state(model_or_state)
    return jax.tree.map(
        lambda v: tuple(v.get_metadata().get("logical_axes") or (None,) * v.value.ndim),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def param_shardings(model_or_state: Any, mesh: Mesh) -> Any:
    """Pytree of NamedSharding for every parameter of a model (or an nnx.State of params).

    Works on abstract states too (``nnx.eval_shape``), so the learner can build shardings
    for params and optimizer state before materialising anything.
    """
    state = _as_param_state(model_or_state)
    mesh = auto_axes_mesh(mesh)

    def one(variable: nnx.Variable) -> NamedSharding:
        value = variable.value
        axes = variable.get_metadata().get("logical_axes") or (None,) * len(value.shape)
        return NamedSharding(mesh, logical_to_spec(axes, mesh, value.shape))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sharding_for_array(shape: Sequence[int], logical_axes: Sequence[str | None] | None,
                       mesh: Mesh) -> NamedSharding:
    """NamedSharding for one array of ``shape`` with optional logical dim names."""
    axes = tuple(logical_axes) if logical_axes is not None else (None,) * len(shape)
    mesh = auto_axes_mesh(mesh)
    return NamedSharding(mesh, logical_to_spec(axes, mesh, shape))


def _as_param_state(model_or_state: Any) -> Any:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    return model_or_state
