"""Device mesh (``--mesh data=D,fsdp=F,tensor=T``), batch sharding, multi-host start-up,
and which devices each process of a run gets (placement)."""

from areal_jax.parallel.distributed import (
    JobGuard,
    board_client,
    detected_cluster,
    initialize_distributed,
    is_main_process,
    job_guard,
    start_job_guard,
)
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
    process_batch_rows,
    put_batch,
    replicated,
)
from areal_jax.parallel.placement import (
    Placement,
    PlacementError,
    check_learner_backend,
    plan_placement,
    start_placement,
)
from areal_jax.parallel.transfer import scatter_from_main

__all__ = [
    "BATCH_AXES",
    "JobGuard",
    "MESH_AXES",
    "MeshSpecError",
    "Placement",
    "PlacementError",
    "batch_sharding",
    "check_learner_backend",
    "board_client",
    "detected_cluster",
    "format_mesh_spec",
    "initialize_distributed",
    "is_main_process",
    "job_guard",
    "local_batch_rows",
    "make_mesh",
    "mesh_sizes",
    "n_batch_shards",
    "parse_mesh_spec",
    "plan_placement",
    "process_batch_rows",
    "put_batch",
    "replicated",
    "scatter_from_main",
    "start_job_guard",
    "start_placement",
]
