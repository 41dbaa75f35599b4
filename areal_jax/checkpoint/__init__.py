"""Training checkpoints (Orbax) and serving-weight publishing (HF dirs per version)."""

from areal_jax.checkpoint.meta import CheckpointMeta
from areal_jax.checkpoint.orbax_ckpt import (
    CheckpointError,
    CheckpointWriteError,
    TrainCheckpointer,
    rng_from_json,
    rng_to_json,
)
from areal_jax.checkpoint.publish import (
    COMMIT_MARKER,
    PublishError,
    WeightPublisher,
    copy_tokenizer_files,
    params_to_hf_dir,
    params_to_model,
)

__all__ = [
    "COMMIT_MARKER",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointWriteError",
    "PublishError",
    "TrainCheckpointer",
    "WeightPublisher",
    "copy_tokenizer_files",
    "params_to_hf_dir",
    "params_to_model",
    "rng_from_json",
    "rng_to_json",
]
