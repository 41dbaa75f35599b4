"""What the policy learner and the critic share: a model's training state on a mesh.

``TrainableModel`` holds fp32 master weights (or, under LoRA, the adapters) and their AdamW
state on a device mesh, places micro-batches on it, groups them into minibatches, runs
one optimizer step per minibatch and saves/restores its state. It knows no loss: a
subclass compiles its own gradient program and supplies ``_accumulate`` (one minibatch's
gradient and statistic sums) and ``_metrics``. ``Learner`` (the PPO policy, a
``TrainableModel[CausalLM]``) and ``Critic`` (the value model, a
``TrainableModel[ValueModel]``) are its two subclasses, siblings rather than one a
variant of the other; it is generic over the model, so each types its own.
"""

from __future__ import annotations

import logging
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypedDict, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.typing import DTypeLike

from areal_jax.learner.config import OptimConfig
from areal_jax.learner.optimizer import learning_rate_schedule, make_optimizer
from areal_jax.learner.packing import PackedBatch
from areal_jax.learner.steps import CompilerOptions, learner_compiler_options, make_apply_fn
from areal_jax.parallel.mesh import (
    batch_sharding,
    make_mesh,
    n_batch_shards,
    put_batch,
    replicated,
    replicated_params,
)
from model_defs import (
    CausalLM,
    ModelConfig,
    PyTree,
    lora_config,
    param_shardings,
    parse_dtype,
    remat_policy_name,
    use_mesh,
)
from model_defs.fused_attention import ATTENTION_IMPLS

logger = logging.getLogger(__name__)

MicroBatch = PackedBatch | Mapping[str, np.ndarray]  # Mapping: of [R, L] arrays by field
# The NNX model a TrainableModel trains: the policy's CausalLM, the critic's ValueModel.
ModelT = TypeVar("ModelT", bound=nnx.Module)


class TrainState(TypedDict):
    """``TrainableModel.state_dict()``: the sharded arrays (also valid Orbax restore
    targets) and the counters."""

    params: nnx.State
    opt_state: PyTree | None  # an optax state; None for a frozen (reference) model
    step: int
    version: int


def _set_compute_dtype(model: nnx.Module, dtype: DTypeLike | None) -> None:
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "dtype"):
            module.dtype = dtype


def configure_model(model: CausalLM, *, remat: bool | str | None = None,
                    attention: str | None = None) -> None:
    """Sets a ``CausalLM``'s gradient checkpointing (a bool or a policy name of
    ``model_defs.model.REMAT_POLICIES``) and its attention kernel; None keeps the model's.
    The learner does it to its policy, the critic to its value model's backbone."""
    if remat is not None:
        model.remat = remat_policy_name(remat)
    if attention is not None:
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_IMPLS)}; "
                             f"got {attention!r}")
        model.attention_impl = attention


def _model_dtype(model: nnx.Module) -> DTypeLike:
    """The model's own ``dtype`` (its compute dtype; CausalLM and ValueModel carry one)."""
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        raise TypeError(f"{type(model).__name__} has no dtype attribute: a TrainableModel's "
                        "model carries its compute dtype (as CausalLM and ValueModel do)")
    return dtype


def _get(mb: MicroBatch, key: str, index: int) -> np.ndarray | jax.Array:
    """``mb[key]`` as numpy, or as it is when it is already a device array (e.g. the
    critic's GAE advantages): checking its shape must not copy it to the host."""
    try:
        value = mb[key]
    except KeyError:
        raise KeyError(f"micro-batch {index} has no {key!r} array") from None
    if value is None:
        raise KeyError(f"micro-batch {index} has no {key!r} array")
    return value if isinstance(value, jax.Array) else np.asarray(value)


def with_arrays(mb: MicroBatch, **arrays: np.ndarray) -> MicroBatch:
    """A new micro-batch holding ``mb``'s arrays and these ones (``PackedBatch.with_arrays``,
    or a new dict for a mapping): ``mb`` itself is not modified, so a batch is never
    changed after packing by the rooms it passes through."""
    if isinstance(mb, PackedBatch):
        return mb.with_arrays(**arrays)
    return {**mb, **arrays}


class Program:
    """A module-level function, jitted once, with its static arguments bound."""

    # The static arguments are hashable config objects of any kind, and jax.jit's keyword
    # arguments (donate_argnums, out_shardings...) each their own kind: Any.
    def __init__(self, fn: Callable[..., PyTree], static: dict[str, Any], **jit_kwargs: Any):
        self._jitted = jax.jit(fn, static_argnames=tuple(static), **jit_kwargs)
        self._static = static

    def __call__(self, *args: PyTree) -> PyTree:
        return self._jitted(*args, **self._static)

    def lower(self, *args: PyTree) -> jax.stages.Lowered:
        return self._jitted.lower(*args, **self._static)


def _apply_program(params, opt_state, grads, *, optim):
    return make_apply_fn(make_optimizer(optim))(params, opt_state, grads)


def _init_opt_program(params, *, optim):
    return make_optimizer(optim).init(params)


def _zeros_program(params):
    return jax.tree.map(jnp.zeros_like, params)


class TrainableModel(ABC, Generic[ModelT]):
    """A model's training state on a mesh (see the module doc), generic over the NNX model
    it trains (``ModelT``: ``Learner`` is a ``TrainableModel[CausalLM]``, ``Critic`` a
    ``TrainableModel[ValueModel]``). Arguments as for :class:`~areal_jax.learner.Learner`
    (a subclass sets remat and attention on its model first, :func:`configure_model`);
    ``n_minibatches``: optimizer steps per train step."""

    def __init__(self, model: ModelT, model_cfg: ModelConfig, optim: OptimConfig, *,
                 n_minibatches: int = 1, mesh: Mesh | None = None,
                 compute_dtype: DTypeLike | None = None,
                 compiler_options: CompilerOptions | None = None,
                 trainable: bool = True, process_local_batches: bool = False):
        if not isinstance(optim, OptimConfig):
            raise TypeError(f"optim must be an OptimConfig, got {type(optim).__name__}")
        self.mesh = make_mesh("data=-1") if mesh is None else mesh
        self.model_cfg, self.optim = model_cfg, optim
        self.n_minibatches = int(n_minibatches)
        if compute_dtype is not None:
            _set_compute_dtype(model, parse_dtype(compute_dtype, "compute_dtype"))
        self.compute_dtype = jnp.dtype(_model_dtype(model))
        self.n_batch_shards = n_batch_shards(self.mesh)
        self.process_local_batches = process_local_batches
        # Batch shards whose rows this process feeds (all of them unless process-local).
        self.n_fed_shards = (len({i[0].start for i in batch_sharding(self.mesh, 1)
                                  .addressable_devices_indices_map((self.n_batch_shards,))
                                  .values() if i is not None})
                             if process_local_batches else self.n_batch_shards)
        platform = self.mesh.devices.flat[0].platform
        options = learner_compiler_options(platform, compiler_options)
        self._jit_options = {"compiler_options": options} if options else {}

        # LoRA adapters sit on a CausalLM (model_defs.add_lora); a ValueModel has none.
        self.lora = lora_config(model) if isinstance(model, CausalLM) else None
        # What the optimizer differentiates and updates: the adapters only under LoRA.
        self.trainable_filter = nnx.LoRAParam if self.lora is not None else nnx.Param
        graphdef, params, rest = nnx.split(model, self.trainable_filter, ...)  # type: ignore[misc]
        self._graphdef: nnx.GraphDef = graphdef
        self.param_shardings = self._shardings(params)
        self._warn_replicated(params)
        self.params = self._place(params, self.param_shardings)
        if self.lora is not None:  # the frozen base: no master copy, keep the compute dtype
            rest = jax.tree.map(lambda x: x.astype(self.compute_dtype)
                                if jnp.issubdtype(x.dtype, jnp.floating) else x, rest)
        self._rest = self._place(rest, self._shardings(rest))
        self.trainable = trainable
        self.tx = make_optimizer(optim)
        self._lr_schedule = learning_rate_schedule(optim)
        self.opt_shardings = self.opt_state = None
        if trainable:
            abstract_opt = jax.eval_shape(self.tx.init, self.params)
            self.opt_shardings = optax.tree_map_params(
                self.tx, lambda _, sharding: sharding, abstract_opt, self.param_shardings,
                transform_non_params=lambda _: replicated(self.mesh),
                is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
            self.opt_state = Program(_init_opt_program, {"optim": optim},
                                     out_shardings=self.opt_shardings,
                                     **self._jit_options)(self.params)
        self.step = 0  # optimizer steps taken
        self.version = 0  # train_step calls (learner weight version)
        self._compile()


    def _warn_replicated(self, params: PyTree) -> None:
        names = replicated_params(params, self.param_shardings, self.mesh)
        if names:
            fsdp = dict(self.mesh.shape)["fsdp"]
            logger.warning(
                "%d parameter(s) of 1M+ elements are replicated on every device of the "
                "fsdp=%d mesh, because none of their dimensions divides it: %s%s. Each device "
                "holds them whole; choose an fsdp size that divides the model's hidden size "
                "(or its vocabulary / MLP size for tensor)", len(names), fsdp,
                ", ".join(names[:5]), " ..." if len(names) > 5 else "")

    def _shardings(self, state: PyTree) -> PyTree:
        """NamedShardings from the variables' logical axes (replicated where they have none),
        with ``state``'s own tree structure."""
        return jax.tree.unflatten(jax.tree.structure(state),
                                  jax.tree.leaves(param_shardings(state, self.mesh)))

    @staticmethod
    def _place(tree: PyTree, shardings: PyTree | jax.sharding.Sharding) -> PyTree:
        """``tree`` with the given shardings. Leaves elsewhere go through host memory:
        ``device_put`` of a device array onto a new sharding compiles a slicing program
        per shape, while host arrays are sliced by numpy."""
        leaves, treedef = jax.tree.flatten(tree)
        if isinstance(shardings, jax.sharding.Sharding):
            flat_sh = [shardings] * len(leaves)
        else:
            flat_sh = jax.tree.leaves(shardings)

        def one(x: jax.Array | np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
            if isinstance(x, jax.Array):
                if x.sharding == sharding:
                    return x
                if x.is_fully_addressable:
                    x = np.asarray(x)
            return jax.device_put(x, sharding)

        placed = [one(x, s) for x, s in zip(leaves, flat_sh, strict=True)]
        return jax.tree.unflatten(treedef, placed)

    # ------------------------------------------------------------------ compile
    def _compile(self) -> None:
        """Jits the optimizer update and zero gradients (subclasses add their programs).
        jax caches traces and executables per (function, jit options, static arguments),
        so models with the same graph, mesh, dtype, config and XLA options share them."""
        opts = self._jit_options
        self._apply = Program(_apply_program, {"optim": self.optim}, donate_argnums=(0, 1),
                              out_shardings=(self.param_shardings, self.opt_shardings,
                                             replicated(self.mesh), replicated(self.mesh)),
                              **opts) if self.trainable else None
        self._zeros = Program(_zeros_program, {}, out_shardings=self.param_shardings, **opts)

    @abstractmethod
    def _accumulate(self, group: Sequence[MicroBatch], keys: Sequence[str], version: jax.Array,
                    **kwargs: bool) -> tuple[PyTree, PyTree]:
        """One minibatch's gradient (params' structure) and statistic sums (a pytree of
        scalars: ``losses.StepSums`` for the policy), on device."""

    @staticmethod
    @abstractmethod
    def _metrics(per_step: list, lrs: list[float]) -> dict[str, float]:
        """Metrics from each optimizer step's (sums, grad_norm, applied) and the lrs."""

    # ------------------------------------------------------------------ data in/out
    def _check_micro_batches(self, micro_batches: Sequence[MicroBatch], keys: Sequence[str]
                             ) -> None:
        if len(micro_batches) == 0:
            raise ValueError("got no micro-batches")
        vocab = self.model_cfg.vocab_size
        for i, mb in enumerate(micro_batches):
            ids = _get(mb, "input_ids", i)
            if ids.ndim != 2:
                raise ValueError(f"micro-batch {i}: input_ids has shape {ids.shape}; "
                                 "expected [R, L]")
            if ids.shape[0] % self.n_fed_shards:
                what = ("this process's share of the mesh's data x fsdp" if
                        self.process_local_batches else "the mesh's data x fsdp")
                raise ValueError(
                    f"micro-batch {i} has {ids.shape[0]} rows, not a multiple of {what} = "
                    f"{self.n_fed_shards}; pack with rows_per_micro_batch a multiple of "
                    f"{self.n_fed_shards}")
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise ValueError(f"micro-batch {i}: token ids span [{ids.min()}, {ids.max()}], "
                                 f"outside the model's vocabulary [0, {vocab})")
            for key in keys:
                arr = _get(mb, key, i)
                if arr.shape != ids.shape:
                    raise ValueError(f"micro-batch {i}: {key} has shape {arr.shape}, expected "
                                     f"{ids.shape} like input_ids")

    def _put(self, mb: MicroBatch, keys: Sequence[str]) -> dict[str, jax.Array]:
        """The micro-batch's ``keys`` on the mesh, rows over ("data", "fsdp"), as int32 or
        fp32. A device array (the critic's GAE advantages, returns and values) stays on the
        devices: it is only resharded there if it is laid out otherwise."""
        out = {}
        for key in keys:
            value = mb[key]
            arr = value if isinstance(value, jax.Array) else np.asarray(value)
            integral = np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool
            dtype = np.int32 if integral else np.float32
            if isinstance(arr, jax.Array):
                out[key] = jax.device_put(arr.astype(dtype),
                                          batch_sharding(self.mesh, arr.ndim))
            else:
                out[key] = put_batch(arr.astype(dtype, copy=False), self.mesh,
                                     process_local=self.process_local_batches)
        return out

    def _to_host(self, x: jax.Array) -> np.ndarray:
        """A batch-sharded result as numpy: all rows, or this process's rows when the
        micro-batches are process-local."""
        if self.process_local_batches:
            shards = {s.index[0].start or 0: s.data for s in x.addressable_shards}
            return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)], axis=0)
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def minibatches(self, micro_batches: Sequence[MicroBatch]) -> list[list[MicroBatch]]:
        """Group micro-batches into ``n_minibatches`` (``algo.ppo_n_minibatches``) minibatches,
        one optimizer step each: by their ``minibatch_id`` when packed with
        ``n_minibatches``, else in order."""
        n = self.n_minibatches
        ids = [int(getattr(mb, "minibatch_id", 0)) for mb in micro_batches]
        distinct = sorted(set(ids))
        if len(distinct) == n:
            return [[mb for mb, i in zip(micro_batches, ids, strict=True) if i == k]
                    for k in distinct]
        if len(distinct) == 1:
            if len(micro_batches) < n:
                raise ValueError(f"ppo_n_minibatches={n} but only {len(micro_batches)} "
                                 "micro-batches; pack with n_minibatches=ppo_n_minibatches")
            return [list(g) for g in np.array_split(np.array(micro_batches, dtype=object), n)]
        raise ValueError(f"micro-batches carry {len(distinct)} minibatch ids but "
                         f"ppo_n_minibatches={n}; pack with n_minibatches={n}")

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"{type(self).__name__}.{what}: this model was built with "
                               "trainable=False (a frozen reference model); it only computes "
                               "logprobs")

    def _optimizer_steps(self, groups: Sequence[Sequence[MicroBatch]], keys: Sequence[str],
                         version: jax.Array, *,
                         finalise: Callable[[list, list[float]], dict[str, float]] | None = None,
                         **accumulate_kw: bool) -> dict[str, float]:
        """One AdamW step per minibatch group (its gradient from the subclass's
        ``_accumulate``), then bump the version; returns the subclass's ``_metrics`` (or
        ``finalise``'s, for another loss of the same model: the learner's SFT step)."""
        # Host values, for logging only (this process's own CPU device: with several
        # processes jax.devices() lists every process's devices).
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            lrs = [float(self._lr_schedule(self.step + i)) for i in range(len(groups))]
        per_step = []
        assert self._apply is not None  # a frozen learner has no optimizer (_require_trainable)
        with use_mesh(self.mesh):
            for group in groups:
                grads, sums = self._accumulate(group, keys, version, **accumulate_kw)
                self.params, self.opt_state, grad_norm, applied = self._apply(
                    self.params, self.opt_state, grads)
                self.step += 1
                per_step.append((sums, grad_norm, applied))
            per_step = jax.device_get(per_step)
        self.version += 1
        return (finalise or self._metrics)(per_step, lrs)

    # ------------------------------------------------------------------ state
    @property
    def model(self) -> ModelT:
        """An NNX model view of the current weights (for ``save_hf``). Its arrays are
        donated by the next ``train_step``: use it before training on."""
        return nnx.merge(self._graphdef, self.params, self._rest)

    def params_state(self) -> nnx.State:
        return self.params

    def state_dict(self) -> TrainState:
        """params, opt_state (sharded arrays; also valid Orbax restore targets), step, version."""
        return {"params": self.params, "opt_state": self.opt_state, "step": self.step,
                "version": self.version}

    def load_state(self, params: PyTree, opt_state: PyTree | None = None, *,
                   step: int | None = None, version: int | None = None) -> None:
        """Replace the training state (e.g. after an Orbax restore), resharding onto the mesh."""
        want = jax.tree.structure(self.params)
        # operator.ne: jaxlib's PyTreeDef has no stub, so mypy rejects a plain != (here too).
        if operator.ne(jax.tree.structure(params), want):
            raise ValueError("load_state: params do not have this model's structure; "
                             f"expected {want}")
        for (path, new), old in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                    jax.tree.leaves(self.params), strict=True):
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(f"load_state: param {jax.tree_util.keystr(path)} has shape "
                                 f"{tuple(new.shape)}, expected {tuple(old.shape)}")
        for new, old in zip(jax.tree.leaves(params), jax.tree.leaves(self.params), strict=True):
            if new.dtype != old.dtype:
                raise ValueError(f"load_state: params have dtype {new.dtype}, expected {old.dtype}")
        self.params = self._place(params, self.param_shardings)
        if opt_state is not None:
            self._require_trainable("load_state(opt_state=...)")
            if operator.ne(jax.tree.structure(opt_state), jax.tree.structure(self.opt_state)):
                raise ValueError("load_state: opt_state does not match this optimizer's state")
            self.opt_state = self._place(opt_state, self.opt_shardings)
        if step is not None:
            self.step = int(step)
        if version is not None:
            self.version = int(version)
