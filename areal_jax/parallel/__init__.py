"""Device mesh (``--mesh data=D,fsdp=F,tensor=T``), batch sharding, multi-host start-up."""

from areal_jax.parallel.distributed import initialize_distributed, is_main_process
from areal_jax.parallel.mesh import (
    BATCH_AXES,
    MESH_AXES,
    MeshSpecError,
    batch_sharding,
    format_mesh_spec,
    local_batch_rows,
    make_mesh,
    mesh_sizes,
    n_batch_shards,
    parse_mesh_spec,
    put_batch,
    replicated,
)

__all__ = [
    "BATCH_AXES",
    "MESH_AXES",
    "MeshSpecError",
    "batch_sharding",
    "format_mesh_spec",
    "initialize_distributed",
    "is_main_process",
    "local_batch_rows",
    "make_mesh",
    "mesh_sizes",
    "n_batch_shards",
    "parse_mesh_spec",
    "put_batch",
    "replicated",
]
