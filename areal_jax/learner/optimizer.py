"""AdamW with warmup + constant/cosine schedule, grad-norm clipping and a decay mask."""

from __future__ import annotations

import jax
import optax

from areal_jax.learner.config import OptimConfig
from model_defs import PyTree


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """lr at optimizer step ``count`` (0-based): linear warmup, then constant or cosine.

    Warmup reaches ``lr * (count + 1) / warmup_steps``, so the very first step already
    moves the weights; the cosine phase decays from ``lr`` to ``lr * min_lr_ratio`` between
    ``warmup_steps`` and ``total_steps`` and stays there.
    """
    if cfg.schedule == "cosine":
        if cfg.total_steps is None:
            raise ValueError("optim.schedule='cosine' needs optim.total_steps (the optimizer "
                             "steps the learning rate decays over)")
        main = optax.cosine_decay_schedule(cfg.lr, cfg.total_steps - cfg.warmup_steps,
                                           alpha=cfg.min_lr_ratio)
    else:
        main = optax.constant_schedule(cfg.lr)
    if cfg.warmup_steps == 0:
        return main
    warmup = (optax.constant_schedule(cfg.lr) if cfg.warmup_steps == 1 else  # lr * 1 / 1
              optax.linear_schedule(cfg.lr / cfg.warmup_steps, cfg.lr, cfg.warmup_steps - 1))
    return optax.join_schedules([warmup, main], [cfg.warmup_steps])


def weight_decay_mask(params: PyTree) -> PyTree:
    """True for matrices (ndim >= 2, embeddings and lm head included); False for norm scales
    and biases (ndim <= 1, and the [heads, head_dim] attention biases)."""

    def decays(path: tuple, leaf: jax.Array) -> bool:
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1]))) if path else ""
        if "bias" in name or "norm" in name or "scale" in name:
            return False
        return leaf.ndim >= 2

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: decays(tuple(p for p in path if not _is_value_key(p)), leaf), params)


def _is_value_key(entry: object) -> bool:
    # nnx.Variable flattens to a "value" child; skip it so the last key is the param name.
    return str(getattr(entry, "key", getattr(entry, "name", ""))) in ("value", "raw_value")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip_by_global_norm (if max_grad_norm) -> AdamW(schedule, masked weight decay)."""
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask,
    )
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
