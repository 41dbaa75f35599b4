"""The critic of the actor-critic (``algo.name: ppo``) variant: a value model, GAE, its update.

    critic = Critic.from_hf("hf_dir", optim, mesh=learner.mesh, ppo_n_minibatches=n)
    batches = pack_trajectories(trajs, None, ...)            # advantages filled in below
    targets = critic.gae_targets(batches, trajs, gamma=1.0, lam=1.0)  # sets mb["advantages"]
    learner.train_step(batches)                              # the policy, as for GRPO
    critic.train_step(batches, returns=targets.returns, old_values=targets.old_values)

The value model is a ``CausalLM`` backbone (initialised from the policy's checkpoint, its
LM head dropped) and a zero-initialised scalar head, so every initial value is 0. The value
of token t is read from the hidden state at t-1 of the same segment: the state before token
t was generated, the same alignment as the learner's logprobs (0 on the first token of a
segment and on padding).

GAE uses a sparse terminal reward on the last loss token of each trajectory and skips
every other token (prompt, environment turns); the value after the last token is 0.

``Critic`` and the policy's ``Learner`` are siblings: both are a
:class:`~areal_jax.learner.trainable.TrainableModel` (the sharded fp32 master weights, the
AdamW state, micro-batch placement, minibatch grouping, one optimizer step per minibatch,
``state_dict``/``load_state``), each with its own model, loss and gradient program. A
critic has no token logprobs: it has ``compute_values`` instead of ``compute_logp``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from areal_jax.learner.config import OptimConfig
from areal_jax.learner.learner import LOGP_KEYS
from areal_jax.learner.packing import PackedBatch, unpack_per_token
from areal_jax.learner.steps import CompilerOptions, cast_params
from areal_jax.learner.token_logp import predicted_mask, shift_right
from areal_jax.learner.trainable import MicroBatch, TrainableModel, _get
from areal_jax.losses import gae, normalize_advantages, ppo_value_loss
from areal_jax.parallel.mesh import make_mesh, replicated
from areal_jax.trajectory import Trajectory
from model_defs import (
    CausalLM,
    ModelConfig,
    PyTree,
    fp32_matmuls,
    load_hf,
    remat_policy_name,
    use_mesh,
)

VALUE_TRAIN_KEYS = (*LOGP_KEYS, "loss_mask", "returns", "old_values")
VALUE_SUM_KEYS = ("value_loss", "token_count", "n_tokens", "value_clipped", "value_sum",
                  "value_abs_error", "returns_sum", "returns_sq_sum", "error_sum", "error_sq_sum")


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
        hidden_btd = self.backbone.hidden_states(input_ids_bt, positions=positions_bt,
                                                 segment_ids=segment_ids_bt)
        value_of_next_bt = jnp.einsum(
            "btd,d->bt", hidden_btd.astype(jnp.float32),
            self.value_head_d[...].astype(jnp.float32)) + self.value_bias[...].astype(jnp.float32)
        return jnp.where(predicted_mask(segment_ids_bt), shift_right(value_of_next_bt), 0.0)


def make_values_fn(graphdef: nnx.GraphDef, compute_dtype: DTypeLike | None
                   ) -> Callable[..., jax.Array]:
    """(params, rest, batch) -> values_bt (fp32 [R, L])."""

    def values_fn(params, rest, batch):
        model = nnx.merge(graphdef, cast_params(params, compute_dtype), rest)
        with fp32_matmuls(compute_dtype):  # fp32 stays fp32 on GPU/TPU (model_defs.precision)
            return model(batch["input_ids"], batch["positions"], batch["segment_ids"])

    return values_fn


def make_value_grad_fn(graphdef: nnx.GraphDef, compute_dtype: DTypeLike | None,
                       value_eps_clip: float | None, value_coef: float
                       ) -> Callable[..., tuple[PyTree, dict[str, jax.Array]]]:
    """(params, rest, grads, sums, batch, denom, n_loss_tokens, version) -> (grads, sums).

    The signature of the learner's PPO grad function, so the learner's gradient
    accumulation drives it: adds this micro-batch's gradient of ``value_coef *
    clipped value loss`` normalised by ``denom`` (the minibatch's global loss-token count).
    """
    values_fn = make_values_fn(graphdef, compute_dtype)

    def loss_fn(params, rest, batch, denom):
        values_bt = values_fn(params, rest, batch)
        loss, stats = ppo_value_loss(values_bt, batch["old_values"], batch["returns"],
                                     batch["loss_mask"], value_eps_clip=value_eps_clip,
                                     normalizer=denom)
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

        new = {
            "value_loss": loss,
            "token_count": count,
            "n_tokens": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32),
            "value_clipped": stats["value_clip_frac"] * count,
            "value_sum": stats["value_mean"] * count,
            "value_abs_error": stats["value_abs_error"] * count,
            "returns_sum": masked_sum(returns_bt),
            "returns_sq_sum": masked_sum(jnp.square(returns_bt)),
            "error_sum": masked_sum(error_bt),
            "error_sq_sum": masked_sum(jnp.square(error_bt)),
        }
        return grads, {k: sums[k] + new[k] for k in VALUE_SUM_KEYS}

    return grad_fn


class _ValueMicroBatch(dict):
    """The arrays of one micro-batch plus its returns / old values, and its minibatch id."""

    minibatch_id: int = 0


def _loss_token_count(batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.sum(batch["loss_mask"] != 0).astype(jnp.float32)


class ValueTargets(NamedTuple):
    """Per micro-batch [R, L] arrays for :meth:`Critic.train_step`."""

    returns: list[np.ndarray]
    old_values: list[np.ndarray]


# ----------------------------------------------------------------------------- the critic
class Critic(TrainableModel):
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
      ppo_n_minibatches: optimizer steps per ``train_step``; the micro-batches must be packed
        with ``n_minibatches`` equal to it, as for the policy.
      compute_dtype, remat, compiler_options, attention: as for
        :class:`~areal_jax.learner.Learner`.
    """

    def __init__(self, model: CausalLM, model_cfg: ModelConfig, optim: OptimConfig, *,
                 mesh: Mesh | None = None, value_eps_clip: float | None = 0.2,
                 value_coef: float = 1.0, ppo_n_minibatches: int = 1,
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
        self.value_eps_clip = None if value_eps_clip is None else float(value_eps_clip)
        self.value_coef = float(value_coef)
        if remat is not None:
            model.remat = remat_policy_name(remat)
        if attention is not None:
            model.attention_impl = attention
        super().__init__(ValueModel(model), model_cfg, optim, n_minibatches=ppo_n_minibatches,
                         mesh=mesh, compute_dtype=compute_dtype,
                         compiler_options=compiler_options)

    @classmethod
    def from_hf(cls, path: str, optim: OptimConfig, *, mesh: Mesh | None = None,
                value_eps_clip: float | None = 0.2, value_coef: float = 1.0,
                ppo_n_minibatches: int = 1, compute_dtype: DTypeLike = "float32",
                remat: bool | str = False,
                compiler_options: CompilerOptions | None = None,
                attention: str | None = None) -> Critic:
        """A critic whose backbone is the HF checkpoint at ``path`` (fp32 master weights)."""
        mesh = make_mesh("data=-1") if mesh is None else mesh
        model, cfg = load_hf(path, dtype="float32", mesh=mesh)
        return cls(model, cfg, optim, mesh=mesh, value_eps_clip=value_eps_clip,
                   value_coef=value_coef, ppo_n_minibatches=ppo_n_minibatches,
                   compute_dtype=compute_dtype, remat=remat, compiler_options=compiler_options,
                   attention=attention)

    def _compile(self) -> None:
        super()._compile()  # the optimizer update and zero gradients
        opts = self._jit_options
        self._count = jax.jit(_loss_token_count, out_shardings=replicated(self.mesh), **opts)
        self._grad = jax.jit(
            make_value_grad_fn(self._graphdef, self.compute_dtype, self.value_eps_clip,
                               self.value_coef),
            donate_argnums=(2, 3), out_shardings=(self.param_shardings, replicated(self.mesh)),
            **opts)
        self._values = jax.jit(make_values_fn(self._graphdef, self.compute_dtype), **opts)

    # ------------------------------------------------------------------ values
    def compute_values(self, micro_batches: Sequence[MicroBatch]) -> list[np.ndarray]:
        """Values under the current weights (no gradient), one fp32 [R, L] per micro-batch."""
        self._check_micro_batches(micro_batches, LOGP_KEYS)
        with use_mesh(self.mesh):
            outs = [self._values(self.params, self._rest, self._put(mb, LOGP_KEYS))
                    for mb in micro_batches]
        return [self._to_host(o) for o in outs]

    def gae_targets(self, micro_batches: Sequence[PackedBatch], trajs: Sequence[Trajectory], *,
                    gamma: float, lam: float, rewards: Sequence[float] | None = None,
                    normalize: bool = True) -> ValueTargets:
        """Values -> GAE: sets ``mb["advantages"]`` on every micro-batch and returns the
        critic's ``returns`` and ``old_values``.

        ``micro_batches`` are ``trajs`` packed by ``pack_trajectories`` (any advantages);
        ``rewards`` (default ``t.reward``) are e.g. shaped rewards; ``normalize``
        standardises the advantages over the batch's loss tokens (returns unchanged).
        """
        old_values = self.compute_values(micro_batches)
        values_per_traj = unpack_per_token(micro_batches, old_values, len(trajs))
        advantages, returns = gae_advantages(trajs, values_per_traj, gamma, lam, rewards=rewards,
                                             normalize=normalize)
        for mb, adv in zip(micro_batches, scatter_per_token(micro_batches, advantages, len(trajs)),
                           strict=True):
            mb["advantages"] = adv
        return ValueTargets(scatter_per_token(micro_batches, returns, len(trajs)), old_values)

    # ------------------------------------------------------------------ training
    def _value_micro_batches(self, micro_batches: Sequence[MicroBatch],
                             returns: Sequence[np.ndarray] | None,
                             old_values: Sequence[np.ndarray] | None) -> list[_ValueMicroBatch]:
        micro_batches = list(micro_batches)
        if not micro_batches:
            raise ValueError("got no micro-batches")
        if returns is None:
            raise ValueError("Critic.train_step needs returns=[one [R, L] array per micro-batch] "
                             "(from Critic.gae_targets or scatter_per_token)")
        for name, arrays in (("returns", returns), ("old_values", old_values)):
            if arrays is not None and len(arrays) != len(micro_batches):
                raise ValueError(f"got {len(arrays)} {name} arrays for {len(micro_batches)} "
                                 "micro-batches; pass one [R, L] array per micro-batch")
        if old_values is None:
            old_values = self.compute_values(micro_batches)
        views = []
        for i, mb in enumerate(micro_batches):
            view = _ValueMicroBatch({k: _get(mb, k, i) for k in (*LOGP_KEYS, "loss_mask")})
            view["returns"], view["old_values"] = np.asarray(returns[i]), np.asarray(old_values[i])
            for key in ("returns", "old_values"):
                arr = view[key]
                if not np.issubdtype(arr.dtype, np.number) or not np.isfinite(arr).all():
                    raise ValueError(f"micro-batch {i}: {key} has non-finite or non-numeric "
                                     f"entries (dtype {arr.dtype})")
            view.minibatch_id = int(getattr(mb, "minibatch_id", 0))
            views.append(view)
        self._check_micro_batches(views, VALUE_TRAIN_KEYS)
        return views

    def train_step(self, micro_batches: Sequence[MicroBatch], *,
                   returns: Sequence[np.ndarray] | None = None,
                   old_values: Sequence[np.ndarray] | None = None) -> dict[str, float]:
        """``ppo_n_minibatches`` AdamW steps of the clipped value loss; returns metrics.

        Each micro-batch needs input_ids, positions, segment_ids and loss_mask; ``returns``
        and ``old_values`` are one [R, L] array per micro-batch (``old_values`` default:
        the current values). The loss of a minibatch is normalised by its global loss-token
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
                          returns: Sequence[np.ndarray] | None = None,
                          old_values: Sequence[np.ndarray] | None = None
                          ) -> tuple[float, PyTree]:
        """(value loss, grads) of all ``micro_batches`` taken as ONE minibatch, no update."""
        views = self._value_micro_batches(micro_batches, returns, old_values)
        with use_mesh(self.mesh):
            grads, sums = self._accumulate(views, VALUE_TRAIN_KEYS, jnp.zeros((), jnp.float32))
        return float(sums["value_loss"]), grads

    def _zero_sums(self) -> dict[str, jax.Array]:
        return {k: jnp.zeros((), jnp.float32) for k in VALUE_SUM_KEYS}

    def _accumulate(self, group: Sequence[MicroBatch], keys: Sequence[str], version: jax.Array,
                    **_: bool) -> tuple[PyTree, dict[str, jax.Array]]:
        """Gradient of one minibatch: the value loss normalised by its global loss-token
        count."""
        batches = [self._put(mb, keys) for mb in group]
        n_loss = jnp.zeros((), jnp.float32)
        for b in batches:
            n_loss = n_loss + self._count(b)
        grads, sums = self._zeros(self.params), self._zero_sums()
        for b in batches:
            grads, sums = self._grad(self.params, self._rest, grads, sums, b, n_loss, n_loss,
                                     version)
        return grads, sums

    @staticmethod
    def _metrics(per_step: list, lrs: list[float]) -> dict[str, float]:
        total = {k: sum(float(s[k]) for s, _, _ in per_step) for k in VALUE_SUM_KEYS}
        count = max(total["token_count"], 1.0)
        grad_norms = [float(g) for _, g, _ in per_step]
        returns_var = total["returns_sq_sum"] / count - (total["returns_sum"] / count) ** 2
        error_var = total["error_sq_sum"] / count - (total["error_sum"] / count) ** 2
        return {
            "value_loss": total["value_loss"] / len(per_step),  # mean of the minibatch losses
            "value_clip_frac": total["value_clipped"] / count,
            "value_mean": total["value_sum"] / count,
            "value_abs_error": total["value_abs_error"] / count,
            "returns_mean": total["returns_sum"] / count,
            # 1 - Var(R - V) / Var(R) over loss tokens, V as predicted before each update.
            "explained_variance": (1.0 - error_var / returns_var if returns_var > 1e-8
                                   else float("nan")),
            "grad_norm": float(np.mean(grad_norms)),
            "grad_norm_max": float(np.max(grad_norms)),
            "n_tokens": total["n_tokens"],
            "n_loss_tokens": total["token_count"],
            "n_minibatches": float(len(per_step)),
            "skipped_steps": float(sum(1 for _, _, ok in per_step if not bool(ok))),
            "lr": lrs[-1],
        }


# ----------------------------------------------------------------------------- GAE, packing
@functools.partial(jax.jit, static_argnames=("gamma", "lam", "normalize", "eps"))
def _padded_gae(rewards_nt: jax.Array, values_nt: jax.Array, mask_nt: jax.Array, *, gamma: float,
                lam: float, normalize: bool, eps: float) -> tuple[jax.Array, jax.Array]:
    advantages_nt, returns_nt = gae(rewards_nt, values_nt, mask_nt, gamma, lam)
    if normalize:
        advantages_nt = normalize_advantages(advantages_nt, mask_nt, eps=eps)
    return advantages_nt, returns_nt


def _padded_length(n: int) -> int:
    """Next power of two >= n (at least 16): few distinct shapes, few compilations."""
    return max(16, 1 << (int(n) - 1).bit_length())


def gae_advantages(trajs: Sequence[Trajectory], values_per_traj: Sequence[np.ndarray],
                   gamma: float, lam: float, *, rewards: Sequence[float] | None = None,
                   normalize: bool = False, eps: float = 1e-5
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-token GAE advantages and returns, one fp32 [T_i] array each per trajectory.

    Each trajectory's reward (``rewards[i]``, default ``trajs[i].reward``) sits on its last
    loss token; GAE runs over the loss tokens only (prompt and environment tokens are
    skipped, their advantages and returns are 0) and the value after the last one is 0.
    ``values_per_traj[i]`` is [T_i], aligned like the critic's values (value of token t =
    V(state before t)). ``normalize`` standardises the advantages over all loss tokens of
    the batch; returns stay ``A + V`` of the raw advantages.
    """
    n = len(trajs)
    if n == 0:
        raise ValueError("gae_advantages: got no trajectories")
    if len(values_per_traj) != n:
        raise ValueError(f"gae_advantages: got {len(values_per_traj)} value arrays for {n} "
                         "trajectories")
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
            raise ValueError(f"gae_advantages: {name}={value!r}; expected a number in [0, 1]")
    reward_n = np.asarray([t.reward for t in trajs] if rewards is None else rewards, np.float64)
    if reward_n.shape != (n,):
        raise ValueError(f"gae_advantages: rewards has shape {reward_n.shape}; expected ({n},), "
                         "one per trajectory")
    if not np.isfinite(reward_n).all():
        bad = int(np.flatnonzero(~np.isfinite(reward_n))[0])
        raise ValueError(f"gae_advantages: reward of trajectory {bad} is {reward_n[bad]}")

    lengths = [t.num_tokens for t in trajs]
    width = _padded_length(max(lengths))
    rewards_nt = np.zeros((n, width), np.float32)
    values_nt = np.zeros((n, width), np.float32)
    mask_nt = np.zeros((n, width), bool)
    for i, (t, v) in enumerate(zip(trajs, values_per_traj, strict=True)):
        v = np.asarray(v, np.float32)
        if v.shape != (lengths[i],):
            raise ValueError(f"gae_advantages: values of trajectory {i} have shape {v.shape}; "
                             f"expected ({lengths[i]},) like its input_ids")
        if not np.isfinite(v).all():
            raise ValueError(f"gae_advantages: values of trajectory {i} are not all finite")
        mask = t.loss_mask != 0
        mask_nt[i, :lengths[i]] = mask
        values_nt[i, :lengths[i]] = v
        if mask.any():
            rewards_nt[i, int(np.flatnonzero(mask)[-1])] = reward_n[i]
    advantages_nt, returns_nt = jax.device_get(_padded_gae(
        rewards_nt, values_nt, mask_nt, gamma=float(gamma), lam=float(lam),
        normalize=bool(normalize), eps=float(eps)))
    return ([np.asarray(advantages_nt[i, :k]) for i, k in enumerate(lengths)],
            [np.asarray(returns_nt[i, :k]) for i, k in enumerate(lengths)])


def scatter_per_token(batches: Sequence[PackedBatch], per_traj: Sequence[np.ndarray],
                      n_trajectories: int) -> list[np.ndarray]:
    """Per-trajectory [T_i] arrays -> one fp32 [R, L] array per micro-batch (0 elsewhere).

    The inverse of :func:`~areal_jax.learner.packing.unpack_per_token`, by ``placements``.
    """
    if len(per_traj) != n_trajectories:
        raise ValueError(f"got {len(per_traj)} per-trajectory arrays for "
                         f"n_trajectories={n_trajectories}")
    placed = np.zeros(n_trajectories, bool)
    out = []
    for b_index, b in enumerate(batches):
        placements = getattr(b, "placements", None)
        if placements is None:
            raise TypeError(f"micro-batch {b_index} has no placements; pack it with "
                            "pack_trajectories")
        arr_rl = np.zeros(b.shape, np.float32)
        for p in placements:
            if not 0 <= p.traj_index < n_trajectories:
                raise ValueError(f"micro-batch {b_index} holds trajectory {p.traj_index} but "
                                 f"n_trajectories={n_trajectories}")
            values = np.asarray(per_traj[p.traj_index], np.float32)
            if values.shape != (p.length,):
                raise ValueError(f"array of trajectory {p.traj_index} has shape {values.shape}, "
                                 f"but the trajectory is packed with {p.length} tokens")
            arr_rl[p.row, p.start:p.start + p.length] = values
            placed[p.traj_index] = True
        out.append(arr_rl)
    missing = np.flatnonzero(~placed)
    if missing.size:
        raise ValueError(f"trajectories {missing[:10].tolist()} are in none of the micro-batches")
    return out
