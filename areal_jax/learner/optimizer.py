"""AdamW with warmup + constant/cosine schedule, grad-norm clipping and a decay mask."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from areal_jax.learner.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """lr at optimizer step ``count`` (0-based): linear warmup, then constant or cosine.

    Warmup reaches ``lr * (count + 1) / warmup_steps``, so the very first step already
    moves the weights; the cosine phase decays from ``lr`` to ``lr * min_lr_ratio`` between
    ``warmup_steps`` and ``total_steps`` and stays there.
    """
    lr, warmup = cfg.lr, cfg.warmup_steps

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (step + 1.0) / warmup) if warmup > 0 else 1.0
        if cfg.schedule == "constant":
            return lr * warm
        span = float(cfg.total_steps - warmup)
        progress = jnp.clip((step - warmup) / span, 0.0, 1.0)
        cosine = cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return lr * jnp.where(step < warmup, warm, cosine)

    return schedule


def learning_rate_at(cfg: OptimizerConfig, step: int) -> float:
    """The same schedule in plain Python, for logging without a device round trip."""
    warm = min(1.0, (step + 1.0) / cfg.warmup_steps) if cfg.warmup_steps > 0 else 1.0
    if cfg.schedule == "constant" or step < cfg.warmup_steps:
        return cfg.lr * warm
    progress = min(max((step - cfg.warmup_steps) / float(cfg.total_steps - cfg.warmup_steps), 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio
                     + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def weight_decay_mask(params: Any) -> Any:
    """True for matrices (ndim >= 2, embeddings and lm head included); False for norm scales
    and biases (ndim <= 1, and the [heads, head_dim] attention biases)."""

    def decays(path: tuple, leaf: jax.Array) -> bool:
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1]))) if path else ""
        if "bias" in name or "norm" in name or "scale" in name:
            return False
        return leaf.ndim >= 2

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: decays(tuple(p for p in path if not _is_value_key(p)), leaf), params)


def _is_value_key(entry: Any) -> bool:
    # nnx.Variable flattens to a "value" child; skip it so the last key is the param name.
    return str(getattr(entry, "key", getattr(entry, "name", ""))) in ("value", "raw_value")


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
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
