"""The critic of the actor-critic (``algo.name: ppo``) variant: a value model, GAE, its update.

    critic = Critic.from_hf("hf_dir", optim, mesh=learner.mesh, ppo_n_minibatches=n)
    batches = pack_trajectories(trajs, None, ...)            # advantages: zeros until GAE
    targets = critic.gae_targets(batches, trajs, gamma=1.0, lam=1.0)  # new micro-batches
    learner.train_step(targets.micro_batches)                # the policy, as for GRPO
    critic.train_step(targets.micro_batches, returns=targets.returns,
                      old_values=targets.old_values)

The value model is a ``CausalLM`` backbone (initialised from the policy's checkpoint, its
LM head dropped) and a zero-initialised scalar head, so every initial value is 0. The value
of token t is read from the hidden state at t-1 of the same segment: the state before token
t was generated, the same alignment as the learner's logprobs (0 on the first token of a
segment and on padding).

GAE uses a sparse terminal reward on the last loss token of each trajectory and skips
every other token (prompt, environment turns); the value after the last token is 0. It
runs on the packed rows, on device, in the programs after the critic's values
(:func:`packed_gae_targets`): the advantages, returns and values never leave the devices,
and the micro-batches passed in are not modified (new ones carry the advantages).

``Critic`` and the policy's ``Learner`` are siblings: both are a
:class:`~areal_jax.learner.trainable.TrainableModel` (the sharded fp32 master weights, the
AdamW state, micro-batch placement, minibatch grouping, one optimizer step per minibatch,
``state_dict``/``load_state``), each with its own model, loss and gradient program. A
critic has no token logprobs: it has ``compute_values`` instead of ``compute_logp``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import ArrayLike, DTypeLike

from areal_jax.learner.config import OptimConfig
from areal_jax.learner.learner import LOGP_KEYS
from areal_jax.learner.packing import PackedBatch
from areal_jax.learner.steps import CompilerOptions, cast_params
from areal_jax.learner.token_logp import predicted_mask, shift_right
from areal_jax.learner.trainable import (
    MicroBatch,
    Program,
    TrainableModel,
    _get,
    configure_model,
)
from areal_jax.losses import packed_gae, ppo_value_loss
from areal_jax.losses.critic import VALUE_LOSSES
from areal_jax.losses.step_metrics import ValueSums, finalise_value_step
from areal_jax.parallel.mesh import make_mesh, put_batch, replicated
from areal_jax.trajectory import Trajectory
from model_defs import (
    CausalLM,
    ModelConfig,
    PyTree,
    fp32_matmuls,
    load_hf,
    use_mesh,
)

VALUE_TRAIN_KEYS = (*LOGP_KEYS, "loss_mask", "returns", "old_values")


# ----------------------------------------------------------------------------- the model
class ValueModel(nnx.Module):
    """``CausalLM`` backbone + scalar value head: (ids, positions, segment_ids) -> values [B, T].

    The backbone's LM head is dropped (a critic never needs logits), which saves its
    params and AdamW moments for models with untied embeddings.
    """

    def __init__(self, backbone: CausalLM):
        backbone.lm_head_dv = None
        self.backbone = backbone
        self.dtype = backbone.dtype
        d = backbone.cfg.hidden_size
        self.value_head_d = nnx.Param(jnp.zeros((d,), backbone.param_dtype),
                                      logical_axes=("embed",))
        self.value_bias = nnx.Param(jnp.zeros((), backbone.param_dtype), logical_axes=())

    def __call__(self, input_ids_bt: jax.Array, positions_bt: jax.Array,
                 segment_ids_bt: jax.Array) -> jax.Array:
        """fp32 values [B, T]: ``values[r, t] = head(h[r, t-1])`` within a segment, else 0."""
        return self.values_and_next(input_ids_bt, positions_bt, segment_ids_bt)[0]

    def values_and_next(self, input_ids_bt: jax.Array, positions_bt: jax.Array,
                        segment_ids_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(values, next values), fp32 [B, T] each: ``values`` as ``__call__``;
        ``next[r, t] = head(h[r, t])``, the value of the state after token t (0 on
        padding), which GAE reads at a truncated sequence's last token."""
        hidden_btd = self.backbone.hidden_states(input_ids_bt, positions=positions_bt,
                                                 segment_ids=segment_ids_bt)
        value_of_next_bt = jnp.einsum(
            "btd,d->bt", hidden_btd.astype(jnp.float32),
            self.value_head_d[...].astype(jnp.float32)) + self.value_bias[...].astype(jnp.float32)
        values_bt = jnp.where(predicted_mask(segment_ids_bt), shift_right(value_of_next_bt), 0.0)
        return values_bt, jnp.where(segment_ids_bt > 0, value_of_next_bt, 0.0)


def make_values_fn(graphdef: nnx.GraphDef, compute_dtype: DTypeLike | None, *,
                   with_next: bool = False) -> Callable[..., jax.Array]:
    """(params, rest, batch) -> values_bt (fp32 [R, L]); ``with_next``: (values_bt,
    next_values_bt) (``ValueModel.values_and_next``)."""

    def values_fn(params, rest, batch):
        model = nnx.merge(graphdef, cast_params(params, compute_dtype), rest)
        with fp32_matmuls(compute_dtype):  # fp32 stays fp32 on GPU/TPU (model_defs.precision)
            args = (batch["input_ids"], batch["positions"], batch["segment_ids"])
            return model.values_and_next(*args) if with_next else model(*args)

    return values_fn


def make_value_grad_fn(graphdef: nnx.GraphDef, compute_dtype: DTypeLike | None,
                       value_eps_clip: float | None, value_coef: float,
                       value_loss: str = "mse", huber_delta: float = 1.0
                       ) -> Callable[..., tuple[PyTree, ValueSums]]:
    """(params, rest, grads, sums, batch, denom, n_loss_tokens, version) -> (grads, sums).

    The signature of the learner's PPO grad function, so the learner's gradient
    accumulation drives it: adds this micro-batch's gradient of ``value_coef *
    clipped value loss`` (``value_loss``: "mse" or "huber" with ``huber_delta``) normalised
    by ``denom`` (the minibatch's global loss-token count).
    """
    values_fn = make_values_fn(graphdef, compute_dtype)

    def loss_fn(params, rest, batch, denom):
        values_bt = values_fn(params, rest, batch)
        loss, stats = ppo_value_loss(values_bt, batch["old_values"], batch["returns"],
                                     batch["loss_mask"], value_eps_clip=value_eps_clip,
                                     normalizer=denom, loss=value_loss,
                                     huber_delta=huber_delta)
        return value_coef * loss, (loss, values_bt, stats)

    def grad_fn(params, rest, grads, sums, batch, denom, n_loss_tokens, version):
        del n_loss_tokens, version
        with fp32_matmuls(compute_dtype):  # the backward rules are traced here
            (_, (loss, values_bt, stats)), g = jax.value_and_grad(loss_fn, has_aux=True)(
                params, rest, batch, denom)
        grads = jax.tree.map(jnp.add, grads, g)
        mask_bt = batch["loss_mask"] != 0
        count = jnp.sum(mask_bt).astype(jnp.float32)
        returns_bt = batch["returns"]
        error_bt = returns_bt - jax.lax.stop_gradient(values_bt)

        def masked_sum(x_bt):
            return jnp.sum(jnp.where(mask_bt, x_bt, 0.0))

        new = ValueSums(
            value_loss=loss,
            token_count=count,
            n_tokens=jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32),
            value_clipped=stats["value_clip_frac"] * count,
            value_sum=stats["value_mean"] * count,
            value_abs_error=stats["value_abs_error"] * count,
            returns_sum=masked_sum(returns_bt),
            returns_sq_sum=masked_sum(jnp.square(returns_bt)),
            error_sum=masked_sum(error_bt),
            error_sq_sum=masked_sum(jnp.square(error_bt)),
        )
        return grads, sums.add(new)

    return grad_fn


def _values_program(params, rest, batch, *, graphdef, compute_dtype, with_next=False):
    return make_values_fn(graphdef, compute_dtype, with_next=with_next)(params, rest, batch)


def _value_grad_program(params, rest, grads, sums, batch, denom, n_loss_tokens, version, *,
                        graphdef, compute_dtype, value_eps_clip, value_coef, value_loss,
                        huber_delta):
    fn = make_value_grad_fn(graphdef, compute_dtype, value_eps_clip, value_coef, value_loss,
                            huber_delta)
    return fn(params, rest, grads, sums, batch, denom, n_loss_tokens, version)


class _ValueMicroBatch(dict):
    """The arrays of one micro-batch plus its returns / old values, and its minibatch id."""

    minibatch_id: int = 0


def _loss_token_count(batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.sum(batch["loss_mask"] != 0).astype(jnp.float32)


class ValueTargets(NamedTuple):
    """GAE's results for a packed batch, one [R, L] device array per micro-batch each.

    ``micro_batches`` are new micro-batches (the ones passed in, unmodified, with these
    advantages) for the policy's ``train_step``; ``returns`` and ``old_values`` are the
    critic's ``train_step`` targets.
    """

    micro_batches: list[PackedBatch]
    returns: list[jax.Array]
    old_values: list[jax.Array]


# ----------------------------------------------------------------------------- the critic
class Critic(TrainableModel[ValueModel]):
    """A value model's training state on a mesh (fp32 master weights + AdamW) and its update.

    Args:
      model: the backbone ``CausalLM`` (e.g. the policy's initial weights); its LM head is
        dropped and a zero-initialised value head added.
      model_cfg: its ``ModelConfig``.
      optim: the critic's own optimizer.
      mesh: the device mesh (use the policy learner's).
      value_eps_clip: clip range of the value loss around ``old_values`` (None: no clip).
      value_coef: weight of the value loss (with AdamW this mostly matters through
        ``max_grad_norm`` clipping).
      value_loss: "mse" (0.5 (V - R)^2) or "huber" (quadratic within ``huber_delta`` of the
        return, linear beyond), both clipped around ``old_values`` by ``value_eps_clip``.
      ppo_n_minibatches: optimizer steps per ``train_step``; the micro-batches must be packed
        with ``n_minibatches`` equal to it, as for the policy.
      compute_dtype, remat, compiler_options, attention: as for
        :class:`~areal_jax.learner.Learner`.
    """

    def __init__(self, model: CausalLM, model_cfg: ModelConfig, optim: OptimConfig, *,
                 mesh: Mesh | None = None, value_eps_clip: float | None = 0.2,
                 value_coef: float = 1.0, ppo_n_minibatches: int = 1,
                 value_loss: str = "mse", huber_delta: float = 1.0,
                 compute_dtype: DTypeLike | None = None, remat: bool | str | None = None,
                 compiler_options: CompilerOptions | None = None,
                 attention: str | None = None):
        if not isinstance(model, CausalLM):
            raise TypeError("Critic model must be a model_defs.CausalLM, "
                            f"got {type(model).__name__}")
        if value_eps_clip is not None and not (np.isfinite(value_eps_clip) and value_eps_clip > 0):
            raise ValueError(f"critic value_eps_clip must be > 0 (or None), got {value_eps_clip!r}")
        if not (np.isfinite(value_coef) and value_coef > 0):
            raise ValueError(f"critic value_coef must be > 0, got {value_coef!r}")
        if value_loss not in VALUE_LOSSES:
            raise ValueError(f"critic value_loss={value_loss!r}; expected one of "
                             f"{list(VALUE_LOSSES)}")
        if not (np.isfinite(huber_delta) and huber_delta > 0):
            raise ValueError(f"critic huber_delta must be > 0, got {huber_delta!r}")
        self.value_eps_clip = None if value_eps_clip is None else float(value_eps_clip)
        self.value_coef = float(value_coef)
        self.value_loss, self.huber_delta = value_loss, float(huber_delta)
        configure_model(model, remat=remat, attention=attention)  # the backbone's
        super().__init__(ValueModel(model), model_cfg, optim, n_minibatches=ppo_n_minibatches,
                         mesh=mesh, compute_dtype=compute_dtype,
                         compiler_options=compiler_options)

    @classmethod
    def from_hf(cls, path: str, optim: OptimConfig, *, mesh: Mesh | None = None,
                value_eps_clip: float | None = 0.2, value_coef: float = 1.0,
                ppo_n_minibatches: int = 1, value_loss: str = "mse", huber_delta: float = 1.0,
                compute_dtype: DTypeLike = "float32",
                remat: bool | str = False,
                compiler_options: CompilerOptions | None = None,
                attention: str | None = None) -> Critic:
        """A critic whose backbone is the HF checkpoint at ``path`` (fp32 master weights)."""
        mesh = make_mesh("data=-1") if mesh is None else mesh
        model, cfg = load_hf(path, dtype="float32", mesh=mesh)
        return cls(model, cfg, optim, mesh=mesh, value_eps_clip=value_eps_clip,
                   value_coef=value_coef, ppo_n_minibatches=ppo_n_minibatches,
                   value_loss=value_loss, huber_delta=huber_delta,
                   compute_dtype=compute_dtype, remat=remat, compiler_options=compiler_options,
                   attention=attention)

    def _compile(self) -> None:
        super()._compile()  # the optimizer update and zero gradients
        opts, rep = self._jit_options, replicated(self.mesh)
        model = {"graphdef": self._graphdef, "compute_dtype": self.compute_dtype}
        self._count = Program(_loss_token_count, {}, out_shardings=rep, **opts)
        self._grad = Program(_value_grad_program, {
            **model, "value_eps_clip": self.value_eps_clip, "value_coef": self.value_coef,
            "value_loss": self.value_loss, "huber_delta": self.huber_delta},
            donate_argnums=(2, 3), out_shardings=(self.param_shardings, rep), **opts)
        self._values = Program(_values_program, model, **opts)
        self._values_next = Program(_values_program, {**model, "with_next": True}, **opts)

    # ------------------------------------------------------------------ values
    def compute_values(self, micro_batches: Sequence[MicroBatch]) -> list[np.ndarray]:
        """Values under the current weights (no gradient), one fp32 [R, L] per micro-batch."""
        return [self._to_host(v) for v in self._device_values(micro_batches)]

    def _device_values(self, micro_batches: Sequence[MicroBatch]) -> list[jax.Array]:
        """:meth:`compute_values`, left on the devices (batch-sharded)."""
        self._check_micro_batches(micro_batches, LOGP_KEYS)
        with use_mesh(self.mesh):
            return [self._values(self.params, self._rest, self._put(mb, LOGP_KEYS))
                    for mb in micro_batches]

    def _device_values_and_next(self, micro_batches: Sequence[MicroBatch]
                                ) -> tuple[list[jax.Array], list[jax.Array]]:
        """(values, next values) per micro-batch, on the devices
        (``ValueModel.values_and_next``)."""
        self._check_micro_batches(micro_batches, LOGP_KEYS)
        with use_mesh(self.mesh):
            pairs = [self._values_next(self.params, self._rest, self._put(mb, LOGP_KEYS))
                     for mb in micro_batches]
        return [v for v, _ in pairs], [n for _, n in pairs]

    def gae_targets(self, micro_batches: Sequence[PackedBatch], trajs: Sequence[Trajectory], *,
                    gamma: float, lam: float, rewards: Sequence[float] | np.ndarray | None = None,
                    normalize: bool = True) -> ValueTargets:
        """Values -> GAE on the packed rows, on device (:func:`packed_gae_targets`).

        ``micro_batches`` are ``trajs`` packed by ``pack_trajectories`` (any advantages),
        and stay as they are; ``rewards`` (default ``t.reward``) are e.g. shaped rewards;
        ``normalize`` standardises the advantages over the batch's loss tokens (returns
        unchanged). A truncated trajectory (``Trajectory.truncated``, packed as the
        micro-batches' ``truncated``) is bootstrapped from the critic's value of the state
        after its last token. Returns new micro-batches with the advantages, and the
        critic's ``returns`` and ``old_values``.
        """
        reward_n = np.asarray([t.reward for t in trajs] if rewards is None else rewards,
                              np.float64)
        if reward_n.shape != (len(trajs),):
            raise ValueError(f"gae_targets: rewards has shape {reward_n.shape}; expected "
                             f"({len(trajs)},), one per trajectory")
        values, next_values = self._device_values_and_next(micro_batches)
        with use_mesh(self.mesh):
            return packed_gae_targets(micro_batches, values, reward_n, gamma=gamma, lam=lam,
                                      normalize=normalize, mesh=self.mesh,
                                      bootstrap_values=next_values)

    # ------------------------------------------------------------------ training
    def _value_micro_batches(self, micro_batches: Sequence[MicroBatch],
                             returns: Sequence[ArrayLike] | None,
                             old_values: Sequence[ArrayLike] | None) -> list[_ValueMicroBatch]:
        micro_batches = list(micro_batches)
        if not micro_batches:
            raise ValueError("got no micro-batches")
        if returns is None:
            raise ValueError("Critic.train_step needs returns=[one [R, L] array per micro-batch] "
                             "(from Critic.gae_targets)")
        for name, arrays in (("returns", returns), ("old_values", old_values)):
            if arrays is not None and len(arrays) != len(micro_batches):
                raise ValueError(f"got {len(arrays)} {name} arrays for {len(micro_batches)} "
                                 "micro-batches; pass one [R, L] array per micro-batch")
        if old_values is None:
            old_values = self._device_values(micro_batches)
        views = []
        on_device = []  # (micro-batch, key, all finite) of device arrays, fetched at once
        for i, mb in enumerate(micro_batches):
            view = _ValueMicroBatch({k: _get(mb, k, i) for k in (*LOGP_KEYS, "loss_mask")})
            for key, arrays in (("returns", returns), ("old_values", old_values)):
                arr = arrays[i]
                if not isinstance(arr, jax.Array):  # device arrays (gae_targets') stay there
                    arr = np.asarray(arr)
                if not np.issubdtype(arr.dtype, np.number) or (
                        isinstance(arr, np.ndarray) and not np.isfinite(arr).all()):
                    raise ValueError(f"micro-batch {i}: {key} has non-finite or non-numeric "
                                     f"entries (dtype {arr.dtype})")
                if isinstance(arr, jax.Array):
                    on_device.append((i, key, jnp.isfinite(arr).all()))
                view[key] = arr
            view.minibatch_id = int(getattr(mb, "minibatch_id", 0))
            views.append(view)
        if on_device:
            finite = np.asarray(jnp.stack([ok for _, _, ok in on_device]))
            if not finite.all():
                i, key, _ = on_device[int(np.flatnonzero(~finite)[0])]
                raise ValueError(f"micro-batch {i}: {key} has non-finite entries")
        self._check_micro_batches(views, VALUE_TRAIN_KEYS)
        return views

    def train_step(self, micro_batches: Sequence[MicroBatch], *,
                   returns: Sequence[ArrayLike] | None = None,
                   old_values: Sequence[ArrayLike] | None = None) -> dict[str, float]:
        """``ppo_n_minibatches`` AdamW steps of the clipped value loss; returns metrics.

        Each micro-batch needs input_ids, positions, segment_ids and loss_mask; ``returns``
        and ``old_values`` are one [R, L] array per micro-batch, host or device (``old_values``
        default: the current values). The loss of a minibatch is normalised by its global loss-token
        count, as the policy's token-mean loss.
        """
        t0 = time.perf_counter()
        views = self._value_micro_batches(micro_batches, returns, old_values)
        groups = self.minibatches(views)
        version = jnp.asarray(self.version, jnp.float32)
        metrics = self._optimizer_steps(groups, VALUE_TRAIN_KEYS, version)
        metrics["step_time_s"] = time.perf_counter() - t0
        return metrics

    def compute_gradients(self, micro_batches: Sequence[MicroBatch], *,
                          returns: Sequence[ArrayLike] | None = None,
                          old_values: Sequence[ArrayLike] | None = None
                          ) -> tuple[float, PyTree]:
        """(value loss, grads) of all ``micro_batches`` taken as ONE minibatch, no update."""
        views = self._value_micro_batches(micro_batches, returns, old_values)
        with use_mesh(self.mesh):
            grads, sums = self._accumulate(views, VALUE_TRAIN_KEYS, jnp.zeros((), jnp.float32))
        return float(sums.value_loss), grads

    def _accumulate(self, group: Sequence[MicroBatch], keys: Sequence[str], version: jax.Array,
                    **_: bool) -> tuple[PyTree, ValueSums]:
        """Gradient of one minibatch: the value loss normalised by its global loss-token
        count."""
        batches = [self._put(mb, keys) for mb in group]
        n_loss = jnp.zeros((), jnp.float32)
        for b in batches:
            n_loss = n_loss + self._count(b)
        grads, sums = self._zeros(self.params), ValueSums.zeros()
        for b in batches:
            grads, sums = self._grad(self.params, self._rest, grads, sums, b, n_loss, n_loss,
                                     version)
        return grads, sums

    @staticmethod
    def _metrics(per_step: list, lrs: list[float]) -> dict[str, float]:
        """The step's metrics (``losses.step_metrics.ValueStepMetrics``) from each
        minibatch's (sums, grad norm, applied)."""
        sums, grad_norms, applied = zip(*per_step, strict=True)
        return finalise_value_step(sums, [float(g) for g in grad_norms],
                                   [bool(ok) for ok in applied], lrs[-1]).as_dict()


# ----------------------------------------------------------------------------- GAE, packed
class _MicroBatchGAE(NamedTuple):
    """One micro-batch's GAE, on device: the raw advantages and returns [R, L], and what
    the batch-wide normalisation needs."""

    advantages: jax.Array
    returns: jax.Array
    n_loss_tokens: jax.Array
    first_advantage: jax.Array  # of its first loss token (0 without one): a centring pivot
    values_finite: jax.Array  # every value of a real token (segment id > 0) is finite


@functools.partial(jax.jit, static_argnames=("gamma", "lam"))
def _gae_program(batch: dict[str, jax.Array], *, gamma: float, lam: float) -> _MicroBatchGAE:
    """GAE on one micro-batch's packed rows (``rewards``, ``values``, ``loss_mask``,
    ``segment_ids``, and ``truncated`` with ``bootstrap_values`` when present)."""
    values_rl, mask_rl = batch["values"], batch["loss_mask"] != 0
    advantages_rl, returns_rl = packed_gae(
        batch["rewards"], values_rl, mask_rl, batch["segment_ids"], gamma, lam,
        truncated=batch.get("truncated"), bootstrap_values=batch.get("bootstrap_values"))
    flat_mask = mask_rl.reshape(-1)
    first = jnp.argmax(flat_mask)
    real = batch["segment_ids"] > 0
    finite = jnp.all(jnp.isfinite(values_rl) | ~real)
    if "truncated" in batch:  # the bootstrap values that are read must be finite too
        finite &= jnp.all(jnp.isfinite(batch["bootstrap_values"]) | ~real
                          | (batch["truncated"] == 0))
    return _MicroBatchGAE(
        advantages_rl, returns_rl, jnp.sum(mask_rl).astype(jnp.float32),
        jnp.where(flat_mask[first], advantages_rl.reshape(-1)[first], 0.0), finite)


@jax.jit
def _deviation_sum_program(advantages_rl: jax.Array, loss_mask_rl: jax.Array,
                           pivot: jax.Array) -> jax.Array:
    """Σ (A - pivot) over the loss tokens."""
    return jnp.sum(jnp.where(loss_mask_rl != 0, advantages_rl - pivot, 0.0))


@jax.jit
def _squared_deviation_program(advantages_rl: jax.Array, loss_mask_rl: jax.Array,
                               pivot: jax.Array, mean_dev: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(loss_mask_rl != 0,
                             jnp.square((advantages_rl - pivot) - mean_dev), 0.0))


@functools.partial(jax.jit, static_argnames=("eps",))
def _standardize_program(advantages_rl: jax.Array, loss_mask_rl: jax.Array, pivot: jax.Array,
                         mean_dev: jax.Array, std: jax.Array, *, eps: float) -> jax.Array:
    return jnp.where(loss_mask_rl != 0, ((advantages_rl - pivot) - mean_dev) / (std + eps), 0.0)


def terminal_rewards(batch: PackedBatch, reward_n: np.ndarray) -> np.ndarray:
    """fp32 [R, L]: each packed trajectory's reward (``reward_n[traj_index]``) on its last
    loss token, 0 elsewhere (GAE's sparse terminal reward)."""
    out_rl = np.zeros(batch.shape, np.float32)
    for p in batch.placements:
        if not 0 <= p.traj_index < len(reward_n):
            raise ValueError(f"a micro-batch holds trajectory {p.traj_index} but there are "
                             f"{len(reward_n)} rewards")
        loss_tokens = np.flatnonzero(batch.loss_mask[p.row, p.start:p.start + p.length])
        if loss_tokens.size:
            out_rl[p.row, p.start + int(loss_tokens[-1])] = reward_n[p.traj_index]
    return out_rl


def packed_gae_targets(micro_batches: Sequence[PackedBatch], values: Sequence[ArrayLike],
                       rewards: ArrayLike, *, gamma: float, lam: float, normalize: bool = True,
                       eps: float = 1e-5, mesh: Mesh | None = None,
                       bootstrap_values: Sequence[ArrayLike] | None = None) -> ValueTargets:
    """GAE over packed micro-batches, on device: the policy's advantages and the critic's
    returns, with no trajectory unpacked and no array brought back to the host.

    Each trajectory's reward (``rewards[i]`` for trajectory i of the placements) sits on
    its last loss token; GAE (:func:`~areal_jax.losses.packed_gae`) runs over the loss
    tokens of each packed sequence (prompt and environment tokens are skipped, their
    advantages and returns are 0) and the value after the last one is 0, or, for a
    trajectory cut short (the micro-batch's ``truncated``, from ``Trajectory.truncated``),
    ``bootstrap_values`` at its last token: V(state after it), the critic's
    ``values_and_next``. ``values`` (and ``bootstrap_values``) are one [R, L] array per
    micro-batch, aligned like the critic's (value of token t = V(state before t)); device
    arrays stay where they are, host ones are placed on ``mesh``.

    ``normalize`` standardises the advantages over the loss tokens of all micro-batches
    together, as ``losses.normalize_advantages`` over the whole batch: centred on the
    batch's first loss-token advantage (so equal advantages come out exactly 0), each
    micro-batch's program sums its deviations (then their squares), and the batch totals
    give the mean and std. Returns stay ``A + V`` of the raw advantages.

    The micro-batches passed in are not modified: the result holds new ones
    (``dataclasses.replace``) whose ``advantages`` are the device arrays.
    """
    fn = "packed_gae_targets"
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ValueError(f"{fn}: got no micro-batches")
    if len(values) != len(micro_batches):
        raise ValueError(f"{fn}: got {len(values)} value arrays for {len(micro_batches)} "
                         "micro-batches; pass one [R, L] array per micro-batch")
    if bootstrap_values is not None and len(bootstrap_values) != len(micro_batches):
        raise ValueError(f"{fn}: got {len(bootstrap_values)} bootstrap_values arrays for "
                         f"{len(micro_batches)} micro-batches; pass one [R, L] array per "
                         "micro-batch")
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
            raise ValueError(f"{fn}: {name}={value!r}; expected a number in [0, 1]")
    reward_n = np.asarray(rewards, np.float64)
    if reward_n.ndim != 1:
        raise ValueError(f"{fn}: rewards has shape {reward_n.shape}; expected [N], one per "
                         "trajectory")
    if not np.isfinite(reward_n).all():
        bad = int(np.flatnonzero(~np.isfinite(reward_n))[0])
        raise ValueError(f"{fn}: reward of trajectory {bad} is {reward_n[bad]}")
    placed = {p.traj_index for mb in micro_batches for p in mb.placements}
    missing = sorted(set(range(len(reward_n))) - placed)
    if missing:
        raise ValueError(f"{fn}: trajectories {missing[:10]} are in none of the micro-batches")

    def on_device(x: ArrayLike, dtype: type) -> jax.Array:
        if isinstance(x, jax.Array):
            return x
        x = np.asarray(x, dtype)
        return jnp.asarray(x) if mesh is None else put_batch(x, mesh)

    batches, gaes = [], []
    for i, (mb, values_rl) in enumerate(zip(micro_batches, values, strict=True)):
        if tuple(np.shape(values_rl)) != mb.shape:
            raise ValueError(f"{fn}: micro-batch {i}: values has shape {np.shape(values_rl)}, "
                             f"expected {mb.shape} like input_ids")
        batch = {"rewards": on_device(terminal_rewards(mb, reward_n), np.float32),
                 "values": on_device(values_rl, np.float32),
                 "loss_mask": on_device(mb.loss_mask, np.int32),
                 "segment_ids": on_device(mb.segment_ids, np.int32)}
        truncated = getattr(mb, "truncated", None)
        if truncated is not None and np.any(truncated):
            if bootstrap_values is None:
                raise ValueError(f"{fn}: micro-batch {i} holds truncated trajectories "
                                 "(finish reason length) but no bootstrap_values were given "
                                 "(the critic's next values: Critic.gae_targets passes them)")
            boot_rl = bootstrap_values[i]
            if tuple(np.shape(boot_rl)) != mb.shape:
                raise ValueError(f"{fn}: micro-batch {i}: bootstrap_values has shape "
                                 f"{np.shape(boot_rl)}, expected {mb.shape} like input_ids")
            batch["truncated"] = on_device(truncated, np.int32)
            batch["bootstrap_values"] = on_device(boot_rl, np.float32)
        batches.append(batch)
        gaes.append(_gae_program(batch, gamma=float(gamma), lam=float(lam)))
    advantages = [g.advantages for g in gaes]
    if normalize:  # the batch totals, summed on device
        count = functools.reduce(jnp.add, [g.n_loss_tokens for g in gaes])
        # The pivot: the first loss-token advantage of the first micro-batch that has one.
        pivot = jnp.zeros((), jnp.float32)
        for g in reversed(gaes):
            pivot = jnp.where(g.n_loss_tokens > 0, g.first_advantage, pivot)
        mean_dev = functools.reduce(jnp.add, [
            _deviation_sum_program(adv, b["loss_mask"], pivot)
            for adv, b in zip(advantages, batches, strict=True)]) / jnp.maximum(count, 1.0)
        sq_dev = functools.reduce(jnp.add, [
            _squared_deviation_program(adv, b["loss_mask"], pivot, mean_dev)
            for adv, b in zip(advantages, batches, strict=True)])
        std = jnp.sqrt(sq_dev / jnp.maximum(count, 1.0))
        advantages = [_standardize_program(adv, b["loss_mask"], pivot, mean_dev, std,
                                           eps=float(eps))
                      for adv, b in zip(advantages, batches, strict=True)]
    # The only fetch: one flag per micro-batch.
    finite = np.asarray(jnp.stack([g.values_finite for g in gaes]))
    if not finite.all():
        raise ValueError(f"{fn}: the values of micro-batch {int(np.flatnonzero(~finite)[0])} "
                         "are not all finite")
    return ValueTargets(
        [dataclasses.replace(mb, advantages=adv)
         for mb, adv in zip(micro_batches, advantages, strict=True)],
        [g.returns for g in gaes], [b["values"] for b in batches])
