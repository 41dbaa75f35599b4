"""Serving weights: one complete HF model directory per weight version.

``WeightPublisher.publish`` writes ``weights_dir/v{N}`` so that a rollout server can
load it with ``/update_weights_from_disk``. A version directory is never half-visible:

* local disk: files go to ``weights_dir/.v{N}.tmp-<pid>``, are fsynced, a ``COMMIT``
  marker is written, and the directory is renamed to ``v{N}`` (atomic on POSIX);
* object stores (``gs://``), which have no directory rename: files are written into
  ``v{N}`` and the ``COMMIT`` marker last. Readers treat a ``v{N}`` without ``COMMIT`` as
  absent (``latest()`` and ``path_for`` do).

Only the newest ``keep`` versions stay on disk, plus any a caller pinned.

``params_to_hf_dir`` is the one conversion from learner params to an HF directory; the
publisher and ``scripts/convert.py orbax-to-hf`` both use it.

A LoRA model is published merged (W + scale * A @ B, a plain HF model any server loads);
``publish(..., adapter=)`` also writes the adapter alone, in PEFT layout, to ``v{N}/adapter``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from areal_jax import storage
from areal_jax.checkpoint.orbax_ckpt import require_gcs_support
from model_defs import (
    CausalLM,
    JsonDict,
    ModelConfig,
    PeftAdapter,
    PyTree,
    merge_lora,
    parse_dtype,
    peft_adapter,
    save_hf,
)
from model_defs.hf_io import join_save_gathers

if TYPE_CHECKING:  # the run config's sections (checkpoint/ never imports config)
    from areal_jax.config import CheckpointConfig, ModelSection

COMMIT_MARKER = "COMMIT"
ADAPTER_SUBDIR = "adapter"  # v{N}/adapter: the LoRA adapter alone (PEFT layout), if published
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
# What a publish takes: a CausalLM, the nnx.State of its params, or that state's pure dict.
Weights = CausalLM | nnx.State | PyTree
_VERSION_DIR = re.compile(r"^v(\d+)$")
_TMP_DIR = re.compile(r"^\.v(\d+)\.(tmp|old)-(\d+)$")


class PublishError(RuntimeError):
    """Params that do not fit the model config, or a weights dir that cannot be written."""


def _is_url(path: str) -> bool:
    return "://" in path


def _as_model_config(model_cfg: ModelConfig | JsonDict) -> ModelConfig:
    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    if isinstance(model_cfg, Mapping):
        return ModelConfig.from_hf_dict(dict(model_cfg), source="model_config")
    raise TypeError(f"model_cfg must be a ModelConfig or an HF config dict, got "
                    f"{type(model_cfg).__name__}")


def _gather_to_host(pure: PyTree) -> PyTree:
    """Arrays spread over several hosts are all-gathered (a collective: every process calls)."""
    leaves = jax.tree.leaves(pure)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return pure
    return multihost_utils.process_allgather(pure, tiled=True)


def host_params(model: Weights, dtype: str | None = None) -> PyTree:
    """A host (numpy) copy of a model's state, as its pure dict: what :meth:`WeightPublisher.
    publish` needs, safe to write from another thread while the learner trains on.

    ``model``: a ``CausalLM`` (with LoRA adapters: merged into its kernels), an
    ``nnx.State`` or a pure dict. ``dtype`` (the serving dtype, e.g. "bfloat16") casts
    floating-point arrays on their device first, one at a time, so a bf16 model's host
    copy is 2 bytes/param rather than its fp32 master weights' 4. With several JAX
    processes this is a collective (arrays are all-gathered): every process must call it.
    """
    if isinstance(model, CausalLM):
        model = merge_lora(model)
    if isinstance(model, nnx.Module):
        model = nnx.state(model)
    pure = model.to_pure_dict() if isinstance(model, nnx.State) else model
    if dtype is not None:
        want = parse_dtype(dtype)
        pure = jax.tree.map(lambda x: x.astype(want) if jnp.issubdtype(x.dtype, jnp.floating)
                            and x.dtype != want else x, pure)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), _gather_to_host(pure))


@dataclass(frozen=True)
class ServingWeights:
    """A host copy of what one version publishes: ``params`` (see :func:`host_params`) and,
    for a LoRA model, optionally its ``adapter`` alone (written to ``v{N}/adapter``)."""

    params: PyTree
    adapter: PeftAdapter | None = None


def serving_weights(model: CausalLM, *, with_adapter: bool = False,
                    base_model_name_or_path: str | None = None,
                    dtype: str | None = None) -> ServingWeights:
    """:func:`host_params` of ``model`` (adapters merged) and, with ``with_adapter``, its
    adapter in PEFT layout; ``dtype`` (the serving dtype) casts both. A collective with
    several processes."""
    adapter = (peft_adapter(model, base_model_name_or_path, dtype=dtype) if with_adapter
               else None)
    return ServingWeights(host_params(model, dtype), adapter)


def serving_model(model: CausalLM, *, with_adapter: bool = False,
                  base_model_name_or_path: str | None = None,
                  dtype: str | None = None) -> ServingWeights:
    """What an inline publish writes (``checkpoint.publish_mode: inline``): the model
    itself, LoRA adapters merged on its devices, read one tensor at a time while
    :meth:`WeightPublisher.publish` writes it (no host copy of the model), and with
    ``with_adapter`` the adapter's host copy (small). With several processes the adapter
    is a collective, and while process 0 publishes the others call
    :func:`join_inline_publish`."""
    adapter = (peft_adapter(model, base_model_name_or_path, dtype=dtype) if with_adapter
               else None)
    return ServingWeights(merge_lora(model), adapter)


def serving_copy(model: CausalLM, section: ModelSection, dtype: str | None = None,
                 inline: bool = False) -> ServingWeights:
    """What a version of a run publishes, from the run config's ``model`` section: the
    params, LoRA adapters merged, and with ``model.lora.publish_adapter`` the adapter
    alone, in the serving ``dtype`` (default ``model.dtype``). A host copy
    (:func:`serving_weights`), or with ``inline`` the merged model on its devices
    (:func:`serving_model`). A collective with several processes."""
    make = serving_model if inline else serving_weights
    lora = section.lora
    return make(model, with_adapter=lora is not None and lora.publish_adapter,
                base_model_name_or_path=section.path, dtype=dtype or section.dtype)


def join_inline_publish(weights: ServingWeights, model_cfg: ModelConfig | JsonDict,
                        dtype: str | None = None) -> None:
    """On every process but 0, while process 0 publishes ``weights`` (from
    :func:`serving_model`): their part of each tensor's all-gather, writing nothing."""
    join_save_gathers(weights.params, _as_model_config(model_cfg), dtype)


def params_to_model(params: Weights, model_cfg: ModelConfig | JsonDict) -> CausalLM:
    """A ``CausalLM`` holding ``params`` (a model, an ``nnx.State`` or its pure dict).

    Keys and shapes are checked against ``model_cfg``; the arrays are used as they are
    (no copy), their dtype becomes the model's param dtype.
    """
    if isinstance(params, CausalLM):
        return merge_lora(params)
    cfg = _as_model_config(model_cfg)
    pure = params.to_pure_dict() if isinstance(params, nnx.State) else params
    if not isinstance(pure, Mapping):
        raise TypeError(f"params must be a CausalLM, nnx.State or dict, got {type(pure).__name__}")
    leaves = jax.tree.leaves(pure)
    if not leaves:
        raise PublishError("params are empty")
    dtype = np.dtype(leaves[0].dtype)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                               param_dtype=dtype))
    graphdef, state = nnx.split(abstract)
    want = {tuple(str(k) for k in path): tuple(v.get_value().shape)
            for path, v in nnx.to_flat_state(state)}
    have = {tuple(str(getattr(k, "key", k)) for k in path): tuple(np.shape(x))
            for path, x in jax.tree_util.tree_flatten_with_path(pure)[0]}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise PublishError(
            f"params do not match {cfg.architecture} (hidden_size={cfg.hidden_size}, "
            f"layers={cfg.num_hidden_layers}, tie_word_embeddings={cfg.tie_word_embeddings}): "
            f"missing {['.'.join(p) for p in missing[:5]]}, unexpected "
            f"{['.'.join(p) for p in extra[:5]]}"
        )
    for key, shape in want.items():
        if have[key] != shape:
            raise PublishError(f"param {'.'.join(key)} has shape {have[key]}, but the model "
                               f"config expects {shape}")
    nnx.replace_by_pure_dict(state, dict(pure))
    return nnx.merge(graphdef, state)


def params_to_hf_dir(params: Weights, model_cfg: ModelConfig | JsonDict,
                     out_dir: str | os.PathLike, *, dtype: str | None = None,
                     tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Writes ``params`` as an HF model dir (config.json + safetensors [+ tokenizer]).

    ``params``: a ``CausalLM``, an ``nnx.State`` of its ``nnx.Param`` or the pure dict of
    one (e.g. restored from an Orbax checkpoint). ``dtype`` casts the saved tensors.
    """
    cfg = _as_model_config(model_cfg)
    if not isinstance(params, CausalLM):
        pure = params.to_pure_dict() if isinstance(params, nnx.State) else params
        params = _gather_to_host(pure)
    model = params_to_model(params, cfg)
    out = save_hf(model, cfg, out_dir, dtype=dtype)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def copy_tokenizer_files(tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copies the tokenizer / chat-template files present in ``tokenizer_dir``."""
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise PublishError(f"tokenizer_dir {src} does not exist")
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not any(n in copied for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise PublishError(f"tokenizer_dir {src} has no tokenizer.json, tokenizer.model or "
                           f"vocab.json")
    for name in copied:
        shutil.copyfile(src / name, Path(out_dir) / name)
    return copied


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WeightPublisher:
    """Writes serving weights to ``weights_dir/v{version}`` and keeps the newest ``keep``."""

    @classmethod
    def from_config(cls, checkpoint: CheckpointConfig, run_dir: str, dtype: str
                    ) -> WeightPublisher:
        """The run's publisher: ``checkpoint.publish_dir`` (checked writable) or
        ``RUN_DIR/weights``, keeping ``checkpoint.keep_weights`` versions in ``dtype``."""
        publish_dir = (storage.check_location(checkpoint.publish_dir, "checkpoint.publish_dir",
                                              write=True)
                       if checkpoint.publish_dir else storage.join(run_dir, "weights"))
        return cls(publish_dir, keep=checkpoint.keep_weights, dtype=dtype)

    def __init__(self, weights_dir: str | os.PathLike, keep: int = 3, *, dtype: str | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"WeightPublisher keep must be an int >= 1, got {keep!r}")
        self.weights_dir = os.fspath(weights_dir)
        require_gcs_support(self.weights_dir)
        self.keep = keep
        self.dtype = dtype
        self.use_rename = not _is_url(self.weights_dir)
        self._pinned: set[int] = set()
        if self.use_rename:
            self.weights_dir = os.path.abspath(self.weights_dir)
            if os.path.exists(self.weights_dir) and not os.path.isdir(self.weights_dir):
                raise PublishError(f"weights dir {self.weights_dir} is a file")
            os.makedirs(self.weights_dir, exist_ok=True)
            self._remove_dead_tmp_dirs()
        self._root = epath.Path(self.weights_dir)

    # ---------------------------------------------------------------- queries
    def versions(self) -> list[int]:
        """Committed versions, oldest first."""
        if not self._root.exists():
            return []
        found = []
        for child in self._root.iterdir():
            m = _VERSION_DIR.match(child.name)
            if m and (child / COMMIT_MARKER).exists():
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def path_for(self, version: int) -> str:
        """The directory of committed ``version`` (raises if absent or incomplete)."""
        path = self._root / f"v{int(version)}"
        if not (path / COMMIT_MARKER).exists():
            raise PublishError(f"weight version {version} is not published in "
                               f"{self.weights_dir}; available: {self.versions()}")
        return os.fspath(path)

    def pin(self, version: int) -> None:
        """Keeps ``version`` on disk regardless of ``keep`` until ``unpin``."""
        self._pinned.add(int(version))

    def unpin(self, version: int) -> None:
        self._pinned.discard(int(version))

    # ---------------------------------------------------------------- publish
    def publish(self, model: Weights | ServingWeights, model_cfg: ModelConfig | JsonDict,
                version: int, tokenizer_dir: str | os.PathLike | None = None,
                adapter: PeftAdapter | None = None) -> str:
        """Writes version ``version`` (replacing an existing one) and returns its path.

        ``model``: a ``CausalLM`` (LoRA adapters merged), an ``nnx.State`` of its params,
        that state's pure dict, or :class:`ServingWeights` (its adapter is written too).
        ``adapter`` (``model_defs.peft_adapter``): also written to ``v{N}/adapter`` in PEFT
        layout. With several JAX processes every process must call this (params are
        gathered); process 0 writes.
        """
        if isinstance(model, ServingWeights):
            model, adapter = model.params, adapter or model.adapter
        if not isinstance(version, int | np.integer) or version < 0:
            raise ValueError(f"weight version must be an int >= 0, got {version!r}")
        version = int(version)
        cfg = _as_model_config(model_cfg)
        if not isinstance(model, CausalLM):
            model = _gather_to_host(model.to_pure_dict() if isinstance(model, nnx.State)
                                    else model)
        if jax.process_index() == 0:
            if self.use_rename:
                self._publish_by_rename(model, cfg, version, tokenizer_dir, adapter)
            else:
                self._publish_with_marker(model, cfg, version, tokenizer_dir, adapter)
            self._garbage_collect(just_written=version)
        return os.fspath(self._root / f"v{version}")

    def _write(self, model: Weights, cfg: ModelConfig, out: Path,
               tokenizer_dir: str | os.PathLike | None, adapter: PeftAdapter | None) -> None:
        params_to_hf_dir(model, cfg, out, dtype=self.dtype, tokenizer_dir=tokenizer_dir)
        if adapter is not None:
            adapter.save(out / ADAPTER_SUBDIR)

    def _publish_by_rename(self, model: Weights, cfg: ModelConfig, version: int,
                           tokenizer_dir: str | os.PathLike | None,
                           adapter: PeftAdapter | None = None) -> None:
        root = Path(self.weights_dir)
        tmp = root / f".v{version}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            self._write(model, cfg, tmp, tokenizer_dir, adapter)
            (tmp / COMMIT_MARKER).write_text(f"{version}\n")
            _fsync_tree(tmp)
            final = root / f"v{version}"
            if final.exists():
                old = root / f".v{version}.old-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _publish_with_marker(self, model: Weights, cfg: ModelConfig, version: int,
                             tokenizer_dir: str | os.PathLike | None,
                             adapter: PeftAdapter | None = None) -> None:
        final = self._root / f"v{version}"
        if final.exists():
            if (final / COMMIT_MARKER).exists():
                (final / COMMIT_MARKER).unlink()  # invisible first, then replaced
            final.rmtree()
        with tempfile.TemporaryDirectory(prefix=f"areal-weights-v{version}-") as local:
            self._write(model, cfg, Path(local), tokenizer_dir, adapter)
            final.mkdir(parents=True, exist_ok=True)
            for src in sorted(Path(local).rglob("*")):
                if src.is_file():
                    dst = final / src.relative_to(local)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(src.read_bytes())
        (final / COMMIT_MARKER).write_text(f"{version}\n")

    # ------------------------------------------------------------ housekeeping
    def _garbage_collect(self, just_written: int) -> None:
        versions = self.versions()
        keep = set(versions[-self.keep:]) | self._pinned | {just_written}
        for v in versions:
            if v not in keep:
                path = self._root / f"v{v}"
                (path / COMMIT_MARKER).unlink()  # readers stop seeing it before files go
                path.rmtree()

    def _remove_dead_tmp_dirs(self) -> None:
        """Leftovers of a killed publish (their pid no longer runs)."""
        for name in os.listdir(self.weights_dir):
            m = _TMP_DIR.match(name)
            if m and not storage.pid_alive(int(m.group(3))):
                shutil.rmtree(os.path.join(self.weights_dir, name), ignore_errors=True)
