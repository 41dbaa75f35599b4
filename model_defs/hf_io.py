"""HF checkpoint I/O: ``load_hf`` and ``save_hf`` driven by one mapping table.

``HF_PARAM_TABLE`` rows are (HF key, NNX path, transform). ``{i}`` in an HF key stands for
the layer; the decoder layers' variables are stacked [L, ...] under ``layers`` (see
``model_defs.model.stack_layers``), so HF tensor ``model.layers.{i}.X`` is row ``i`` of ours.
Transforms (data, applied in both directions):
- ``None``: same shape;
- ``"reshape"``: HF flattens the trailing dims of ours (bias [H*Dh] <-> [H, Dh]);
- ``("transpose", n)``: HF stores [out, in] while ours is [in..., out...] with the first
  ``n`` dims of ours forming "in": ours = HF.T reshaped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.typing import DTypeLike
from safetensors import safe_open

from model_defs.config import ModelConfig
from model_defs.model import CausalLM
from model_defs.sharding import sharding_for_array

Transform = Literal["reshape"] | tuple[str, int] | None

HF_PARAM_TABLE: tuple[tuple[str, str, Transform], ...] = (
    ("model.embed_tokens.weight", "embed_vd", None),
    ("model.norm.weight", "final_norm.scale", None),
    ("lm_head.weight", "lm_head_dv", ("transpose", 1)),
    ("model.layers.{i}.input_layernorm.weight", "layers.input_norm.scale", None),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.post_attn_norm.scale", None),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.attn.q_kernel_dhk", ("transpose", 1)),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.attn.k_kernel_dkh", ("transpose", 1)),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.attn.v_kernel_dkh", ("transpose", 1)),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.attn.o_kernel_hkd", ("transpose", 2)),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.attn.q_bias", "reshape"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.attn.k_bias", "reshape"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.attn.v_bias", "reshape"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.attn.q_norm.scale", None),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.attn.k_norm.scale", None),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.mlp.gate_kernel_df", ("transpose", 1)),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.mlp.up_kernel_df", ("transpose", 1)),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.mlp.down_kernel_fd", ("transpose", 1)),
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read or matched to what it should hold: HF
    safetensors that do not match the config, or an Orbax training checkpoint
    (``areal_jax.checkpoint``) that does not match its restore target."""


# --------------------------------------------------------------------------- transforms
def hf_shape(our_shape: tuple[int, ...], transform: Transform) -> tuple[int, ...]:
    """The HF tensor shape that maps onto a parameter of ``our_shape``."""
    if transform is None:
        return tuple(our_shape)
    if transform == "reshape":
        return (math.prod(our_shape),)
    _, n_in = transform
    return (math.prod(our_shape[n_in:]), math.prod(our_shape[:n_in]))


def hf_to_ours(array: np.ndarray, our_shape: tuple[int, ...], transform: Transform) -> np.ndarray:
    if transform is None:
        return array
    if transform == "reshape":
        return array.reshape(our_shape)
    return array.T.reshape(our_shape)


def ours_to_hf(array: Any, transform: Transform) -> Any:
    """The HF tensor of ``array``: a numpy array stays on the host (C-contiguous), a jax
    array stays on its device (the transpose runs there)."""
    if transform is None:
        return array
    if transform == "reshape":
        return array.reshape(-1)
    _, n_in = transform
    in_size = math.prod(array.shape[:n_in])
    hf = array.reshape(in_size, -1).T
    return hf if isinstance(hf, jax.Array) else np.ascontiguousarray(hf)


def param_table(cfg: ModelConfig
                ) -> Iterator[tuple[str, tuple[str | int, ...], Transform, int | None]]:
    """Rows of HF_PARAM_TABLE expanded over layers: (HF key, NNX path, transform, layer),
    where ``layer`` is the row of the stacked variable (None outside the layers)."""
    for hf_key, nnx_path, transform in HF_PARAM_TABLE:
        path = tuple(nnx_path.split("."))
        if "{i}" not in hf_key:
            yield hf_key, path, transform, None
            continue
        for i in range(cfg.num_hidden_layers):
            yield hf_key.format(i=i), path, transform, i


# --------------------------------------------------------------------------- load
def _safetensors_files(path: Path) -> dict[str, Path]:
    """HF key -> file holding it."""
    index_path = path / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {e}") from None
        files = {}
        for key, fname in weight_map.items():
            fpath = path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{index_path} maps {key} to {fname}, which does not exist")
            files[key] = fpath
        return files
    single = path / SINGLE_SAFETENSORS
    if not single.is_file():
        raise FileNotFoundError(
            f"model directory {path} has neither {SINGLE_SAFETENSORS} nor {SAFETENSORS_INDEX}"
        )
    try:
        with safe_open(str(single), framework="numpy") as f:
            return {key: single for key in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise CheckpointError(f"{single} is not a readable safetensors file: {e}") from None


def _bits(array: np.ndarray) -> np.ndarray:
    """``array`` viewed as unsigned integers of its item size: numpy copies (transposes)
    those with its fast loops, where a bfloat16 array's copy goes element by element."""
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _place(array: np.ndarray, dtype: DTypeLike, sharding: jax.sharding.Sharding | None
           ) -> jax.Array:
    """Puts a host array straight onto its target sharding (each device gets its slice)."""
    if sharding is None:
        return jnp.asarray(array, dtype=dtype)
    return jax.make_array_from_callback(
        array.shape, sharding, lambda idx: np.asarray(array[idx], dtype=dtype)
    )


def load_hf(
    path: str | os.PathLike, dtype: DTypeLike = "float32", mesh: Mesh | None = None
) -> tuple[CausalLM, ModelConfig]:
    """Loads an HF Qwen2/Qwen2.5, Qwen3 or Llama-3 checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors (or shards + index).
      dtype: "float32" or "bfloat16" (params and compute; logits are always fp32).
      mesh: optional mesh with axes data/fsdp/tensor; each tensor is placed directly on
        its NamedSharding from the logical-axis rules.
    """
    path = Path(path)
    cfg = ModelConfig.from_pretrained_dir(path)
    jdtype = parse_dtype(dtype)
    files = _safetensors_files(path)

    abstract = nnx.eval_shape(
        lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jdtype, param_dtype=jdtype)
    )
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))

    rows_by_path: dict[tuple[str | int, ...], list[tuple[str, Transform, int | None]]] = {}
    for hf_key, nnx_path, transform, layer in param_table(cfg):
        if nnx_path in flat:  # else a tensor this config does not have (bias, qk-norm, head)
            rows_by_path.setdefault(nnx_path, []).append((hf_key, transform, layer))
    handles: dict[Path, Any] = {}
    try:
        new_flat = []
        for nnx_path, rows in rows_by_path.items():
            variable = flat.pop(nnx_path)
            abstract_value = variable.get_value()
            stacked_shape = tuple(abstract_value.shape)
            our_shape = stacked_shape if rows[0][2] is None else stacked_shape[1:]
            # Each tensor is cast where it lies in the file's order (one contiguous pass),
            # then copied as raw bits (fast for any dtype, ml_dtypes' bfloat16 included)
            # into its row of the stacked array: no per-layer arrays to stack afterwards.
            host = np.empty(stacked_shape, jdtype)
            host_bits = _bits(host)
            for hf_key, transform, layer in rows:
                fpath = files.get(hf_key)
                if fpath is None:
                    where = path / (SAFETENSORS_INDEX if (path / SAFETENSORS_INDEX).is_file()
                                    else SINGLE_SAFETENSORS)
                    raise CheckpointError(
                        f"{where}: missing tensor {hf_key} (expected shape "
                        f"{list(hf_shape(our_shape, transform))}) for {cfg.architecture}"
                    )
                if fpath not in handles:
                    handles[fpath] = safe_open(str(fpath), framework="numpy").__enter__()
                handle = handles[fpath]
                actual_shape = tuple(handle.get_slice(hf_key).get_shape())
                expected_shape = hf_shape(our_shape, transform)
                if actual_shape != expected_shape:
                    raise CheckpointError(
                        f"{fpath}: tensor {hf_key} has shape {list(actual_shape)}, expected "
                        f"{list(expected_shape)} for {cfg.architecture} per config.json"
                    )
                cast = _bits(np.asarray(handle.get_tensor(hf_key), dtype=jdtype))
                host_bits[() if layer is None else layer] = hf_to_ours(cast, our_shape,
                                                                       transform)
                del cast
            sharding = None
            if mesh is not None:
                axes = variable.get_metadata().get("logical_axes")
                sharding = sharding_for_array(stacked_shape, axes, mesh)
            new_flat.append((nnx_path, variable.replace(_place(host, jdtype, sharding))))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    if flat:
        raise CheckpointError(f"internal: no HF mapping for parameters {sorted(flat)}")
    state = nnx.from_flat_state(new_flat)
    return nnx.merge(graphdef, state), cfg


DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16}


def parse_dtype(dtype: DTypeLike, what: str = "dtype") -> np.dtype:
    """A float32 or bfloat16 dtype from its name (``DTYPES``) or a dtype; ValueError naming
    ``what`` for anything else."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"{what}={dtype!r} is not supported; use 'float32' or 'bfloat16'")
        return jnp.dtype(DTYPES[dtype])
    jd = jnp.dtype(dtype)
    if jd not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"{what}={dtype!r} is not supported; use 'float32' or 'bfloat16'")
    return jd


# --------------------------------------------------------------------------- save
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
                       "uint8": "U8", "bool": "BOOL"}


def _write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], np.dtype, Any]],
                       metadata: dict[str, str]) -> None:
    """Writes one safetensors file, one tensor at a time: the header first (from shapes and
    dtypes), then each ``produce()``'s bytes. Peak host memory is one tensor, not the file
    (``safetensors.numpy.save_file`` holds every tensor and then their bytes: two copies)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, shape, dtype, _ in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype.name], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for key, shape, dtype, produce in entries:
            array = np.ascontiguousarray(produce())
            if array.shape != tuple(shape) or array.dtype != dtype:  # a bug, never user input
                raise AssertionError(f"{key}: produced {array.shape} {array.dtype}, "
                                     f"header says {shape} {dtype}")
            f.write(array.reshape(-1).view(np.uint8).data)  # no copy, any dtype
            del array


def _hf_entries(model: CausalLM, cfg: ModelConfig, dtype: str | None
                ) -> list[tuple[str, tuple[int, ...], np.dtype, Any]]:
    """Every tensor :func:`save_hf` writes, in order, as (HF key, HF shape, dtype, a
    function that returns the HF tensor on the host); the function all-gathers a tensor
    spread over several processes (a collective: every process calls it in turn)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out_dtype = parse_dtype(dtype) if dtype is not None else None
    entries: list[tuple[str, tuple[int, ...], np.dtype, Any]] = []
    for hf_key, nnx_path, transform, layer in param_table(cfg):
        if nnx_path not in flat:
            continue
        value = flat[nnx_path].get_value()
        want = np.dtype(out_dtype if out_dtype is not None else value.dtype)
        shape = tuple(value.shape) if layer is None else tuple(value.shape[1:])

        def produce(value=value, layer=layer, transform=transform, want=want,
                    gather_only=False) -> Any:
            if isinstance(value, jax.Array):
                if gather_only and value.is_fully_addressable:
                    return None  # no collective: the writer reads its own copy
                if layer is not None:
                    value = value[layer]  # on device, one layer's tensor
                if value.dtype != want:
                    value = value.astype(want)  # on device, one tensor
                if not value.is_fully_addressable:
                    value = multihost_utils.process_allgather(value, tiled=True)
            elif layer is not None:
                value = value[layer]
            if gather_only:
                return None
            host = np.asarray(jax.device_get(value)).astype(want, copy=False)
            return ours_to_hf(host, transform)

        entries.append((hf_key, hf_shape(shape, transform), want, produce))
    return entries


def save_hf(
    model: CausalLM,
    cfg: ModelConfig,
    path: str | os.PathLike,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: str | None = None,
) -> Path:
    """Writes config.json + model.safetensors (or shards + index) that transformers loads.

    ``dtype`` (e.g. "bfloat16") casts the saved tensors; default: the params' dtype.
    Tensors are fetched, cast and written one at a time, so the host holds at most one
    of them beyond what the model already holds. With several JAX processes every
    process must call this (each tensor is all-gathered in turn).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    entries = _hf_entries(model, cfg, dtype)
    torch_dtype = entries[0][2].name

    shards: list[list[tuple[str, tuple[int, ...], np.dtype, Any]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + [path / SAFETENSORS_INDEX]:
        if stale.exists():
            stale.unlink()
    metadata = {"format": "pt"}
    if len(shards) == 1:
        _write_safetensors(path / SINGLE_SAFETENSORS, shards[0], metadata)
    else:
        weight_map = {}
        for n, shard_entries in enumerate(shards, start=1):
            fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(path / fname, shard_entries, metadata)
            weight_map.update({e[0]: fname for e in shard_entries})
        total = sum(math.prod(e[1]) * e[2].itemsize for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(torch_dtype), indent=2))
    return path


def join_save_gathers(model: CausalLM, cfg: ModelConfig, dtype: str | None = None) -> None:
    """What :func:`save_hf` on process 0 needs from the other JAX processes: their part of
    each tensor's all-gather, in the same order, writing nothing. Call it on every
    process but the writer, with the same model and dtype, while that one saves."""
    for _, _, _, produce in _hf_entries(model, cfg, dtype):
        produce(gather_only=True)
