"""Shared by the learner tests and the multi-process worker: a tiny model config, random
trajectories, and a learner factory (everything seeded, so every process builds the same)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer
from areal_jax.learner import AlgoConfig, Learner, OptimConfig, pack_trajectories
from areal_jax.parallel import local_batch_rows
from areal_jax.trajectory import Trajectory
from model_defs import CausalLM, ModelConfig

# Every dim divides 8 (fsdp=8) and the head counts divide tensor=2.
TINY = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=128, hidden_size=32,
                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True)
# Tests compare numbers, not speed: compile with fewer LLVM passes.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def random_trajectories(seed: int, n: int, max_len: int, vocab: int = 128,
                        max_version: int = 3) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        n_prompt = int(rng.integers(1, max(2, max_len // 3)))
        n_gen = int(rng.integers(1, max_len - n_prompt + 1))
        length = n_prompt + n_gen
        mask = np.r_[np.zeros(n_prompt), np.ones(n_gen)].astype(np.int32)
        out.append(Trajectory(
            input_ids=rng.integers(0, vocab, length),
            loss_mask=mask,
            behav_logp=(np.log(rng.uniform(0.01, 0.3, length)) * mask).astype(np.float32),
            versions=np.where(mask == 1, rng.integers(0, max_version + 1, length), -1),
            reward=float(rng.random()),
        ))
    return out


def random_advantages(seed: int, trajs: list[Trajectory]) -> list[Any]:
    """Scalar advantages for even trajectories, per-token ones for odd."""
    rng = np.random.default_rng(seed + 1000)
    return [float(rng.normal()) if i % 2 == 0 else rng.normal(size=t.num_tokens).astype(np.float32)
            for i, t in enumerate(trajs)]


def init_model(cfg: ModelConfig = TINY, seed: int = 0) -> CausalLM:
    """A random CausalLM with numpy-drawn weights (N(0, 0.02) matrices, norm scales near 1,
    small biases): no XLA program to compile, unlike jax.random init on CPU."""
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def draw(path: tuple, leaf: Any) -> jax.Array:
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            value = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif "bias" in name:
            value = 0.1 * rng.standard_normal(leaf.shape)
        else:
            value = 0.02 * rng.standard_normal(leaf.shape)
        return jnp.asarray(np.asarray(value, leaf.dtype))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


def make_learner(mesh: Any, cfg: ModelConfig = TINY, seed: int = 0,
                 optim: OptimConfig | None = None, algo: AlgoConfig | None = None,
                 **kwargs: Any) -> Learner:
    model = init_model(cfg, seed)
    # eps=1e-6 rather than 1e-8: Adam's m / (sqrt(v) + eps) amplifies last-bit gradient
    # differences (the reduction order differs between meshes) where the moment estimates
    # are tiny; the mesh tests also compare the gradients themselves, at rtol 1e-5.
    optim = optim or OptimConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, eps=1e-6)
    algo = algo or AlgoConfig(ppo_n_minibatches=2, c_clip=3.0, behav_imp_weight_cap=5.0)
    kwargs.setdefault("compiler_options", FAST_COMPILE)
    return Learner(model, cfg, optim, algo, mesh=mesh, **kwargs)


# The standard run that the mesh, multi-process and packing tests compare against.
STANDARD_SEED, STANDARD_N, STANDARD_MAX_LEN = 7, 24, 30
STANDARD_PACKING = dict(seq_len=32, rows_per_micro_batch=8, n_shards=8, n_minibatches=2)
_reference_cache: dict[str, Any] = {}


def standard_batches() -> list:
    trajs = random_trajectories(STANDARD_SEED, STANDARD_N, STANDARD_MAX_LEN)
    return pack_trajectories(trajs, random_advantages(STANDARD_SEED, trajs), **STANDARD_PACKING)


def process_local(batches: list, rows: slice) -> list:
    """This process's rows of every micro-batch (for ``process_local_batches=True``)."""
    return [dataclasses.replace(b, placements=[], **{k: v[rows] for k, v in b.arrays().items()})
            for b in batches]


def standard_run(mesh: Any, n_steps: int = 2, process_local_batches: bool = False,
                 remat: Any = None) -> dict[str, Any]:
    """The gradient of the first minibatch, then ``n_steps`` train steps on the standard
    batches: metrics per step, logprobs and params afterwards."""
    learner = make_learner(mesh, process_local_batches=process_local_batches, remat=remat)
    batches = standard_batches()
    if process_local_batches:
        batches = process_local(batches, local_batch_rows(mesh, batches[0].shape[0]))
    _, grads = learner.compute_gradients([b for b in batches if b.minibatch_id == 0])
    grads0 = [to_host(g) for g in jax.tree.leaves(grads)]
    metrics = [train_version(learner, batches) for _ in range(n_steps)]
    return {"metrics": metrics, "grads0": grads0, "logp0": learner.compute_logp(batches[:1])[0],
            "params": [to_host(x) for x in jax.tree.leaves(learner.params)]}


def train_version(learner: Any, batches: list) -> dict[str, float]:
    """One version's train step, prox_logp recomputed under the current weights as the
    trainer does each version."""
    for b in batches:
        b.prox_logp = None
    return learner.train_step(batches)


def save_learner(learner: Any, path: Any) -> None:
    """The learner's state (params, optimizer state, step, version) as an Orbax checkpoint."""
    st = learner.state_dict()
    with TrainCheckpointer(path, async_save=False) as ckpt:
        ckpt.save(st["version"], st["params"], st["opt_state"],
                  CheckpointMeta(step=int(st["step"]), version=int(st["version"])))


def restore_learner(learner: Any, path: Any) -> None:
    """Loads the checkpoint of :func:`save_learner` into ``learner``."""
    st = learner.state_dict()
    with TrainCheckpointer(path, read_only=True) as ckpt:
        params, opt_state, meta = ckpt.restore(params_target=st["params"],
                                               opt_state_target=st["opt_state"])
    learner.load_state(params, opt_state, step=meta.step, version=meta.version)


def to_host(x: Any) -> np.ndarray:
    """A global array as numpy on every process (gathered across processes if needed)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def single_device_reference() -> dict[str, Any]:
    """``standard_run`` on one device, computed once per test process."""
    if "one_device" not in _reference_cache:
        from areal_jax.parallel import make_mesh

        _reference_cache["one_device"] = standard_run(make_mesh("data=1", jax.devices()[:1]))
    return _reference_cache["one_device"]
