"""AdamW schedule, weight-decay mask and grad clipping."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _learner_data import TINY
from flax import nnx
from tolerance import unit_roundoff

from areal_jax.learner import (
    OptimConfig,
    learning_rate_schedule,
    make_optimizer,
    weight_decay_mask,
)
from model_defs import CausalLM


def _old_formula(lr, warmup, schedule, total, min_ratio, step):
    """The hand-written schedule optax's replaced, in plain Python: linear warmup to
    lr * (step + 1) / warmup, then constant, or cosine from lr to lr * min_ratio."""
    warm = min(1.0, (step + 1.0) / warmup) if warmup > 0 else 1.0
    if schedule == "constant" or step < warmup:
        return lr * warm
    progress = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("schedule, warmup, total, min_ratio", [
    ("constant", 0, None, 0.0), ("constant", 1, None, 0.0), ("constant", 4, None, 0.0),
    ("cosine", 0, 9, 0.0), ("cosine", 1, 9, 0.0), ("cosine", 2, 6, 0.1), ("cosine", 5, 37, 0.3),
])
def test_schedule_equals_the_warmup_then_constant_or_cosine_formula(schedule, warmup, total,
                                                                    min_ratio):
    lr = 3e-4
    cfg = OptimConfig(lr=lr, warmup_steps=warmup, schedule=schedule, total_steps=total,
                      min_lr_ratio=min_ratio)
    sched = learning_rate_schedule(cfg)
    steps = range((total or 8) + 4)  # past the end of the decay too
    got = np.array([float(sched(i)) for i in steps])
    want = np.array([_old_formula(lr, warmup, schedule, total, min_ratio, i) for i in steps])
    # optax evaluates in float32: each of its handful of operations (division, cos, scale,
    # add) on values of magnitude <= lr rounds by at most unit_roundoff * lr.
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * unit_roundoff("float32") * lr)
    assert got[0] > 0  # the first step already moves the weights


def test_weight_decay_skips_norms_and_biases():
    params = nnx.state(nnx.eval_shape(lambda: CausalLM(TINY, rngs=nnx.Rngs(0))), nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(weight_decay_mask(params))[0]
    mask = {jax.tree_util.keystr(p): v for p, v in leaves}
    assert mask["['embed_vd'].value"] and mask["['lm_head_dv'].value"]
    # Layers are stacked [L, ...]: a norm scale is 2-D and a bias 3-D, skipped by name.
    assert mask["['layers']['mlp']['gate_kernel_df'].value"]
    assert not mask["['final_norm']['scale'].value"]
    assert not mask["['layers']['attn']['q_bias'].value"]
    assert not mask["['layers']['post_attn_norm']['scale'].value"]

    # With zero gradients, only decayed params move (AdamW decoupled decay).
    small = {"embed_vd": jnp.ones((4, 2)), "q_bias": jnp.ones((2, 2)),
             "input_norm": {"scale": jnp.ones((2,))}, "up_kernel_df": jnp.ones((2, 3))}
    tx = make_optimizer(OptimConfig(lr=0.1, weight_decay=0.5))
    zeros = jax.tree.map(jnp.zeros_like, small)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(small), small)
    moved = {k: bool(jnp.any(u != 0)) for k, u in jax.tree_util.tree_leaves_with_path(updates)}
    decayed = jax.tree_util.tree_leaves_with_path(weight_decay_mask(small))
    assert moved == {k: bool(v) for k, v in decayed}
    key = jax.tree_util.DictKey
    assert moved[(key("embed_vd"),)] and not moved[(key("q_bias"),)]


def test_grad_norm_clipping():
    params = {"w": jnp.ones((3,))}
    tx = make_optimizer(OptimConfig(lr=1.0, max_grad_norm=1.0, b1=0.0, b2=0.0, eps=1e-12))
    grads = {"w": jnp.array([30.0, 40.0, 0.0])}  # norm 50 -> clipped to norm 1
    state = tx.init(params)
    clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    # Each is a handful of float32 roundings away from the exact value: the clip's scale (a
    # norm: squares, a 3-term sum, a sqrt; a division), its product; then the norm again, or
    # Adam with b = 0 (g / (sqrt(g^2) + 1e-12): a square, a sqrt, an add, a division; eps
    # moves it by 2e-12 relative): 8 roundings bound both.
    rounding = 8 * unit_roundoff("float32")
    np.testing.assert_allclose(optax.global_norm(clipped), 1.0, rtol=rounding)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_allclose(updates["w"][:2], [-1.0, -1.0], rtol=rounding)  # Adam, b=0: sign


@pytest.mark.parametrize("max_grad_norm", [None, 1.0, 0.5])
def test_max_grad_norm_scales_a_known_gradient_by_its_effect_on_the_update(max_grad_norm):
    """optim.max_grad_norm reaches the update: with b1 = b2 = 0 and eps = 1, Adam's update is
    g / (|g| + 1), which depends on the gradient's scale (unlike sign(g) at eps ~ 0). The
    gradient (30, 40, 0) has norm 50: clipped to c it is (0.6c, 0.8c, 0); unclipped it stays."""
    params = {"w": jnp.ones((3,))}
    tx = make_optimizer(OptimConfig(lr=1.0, max_grad_norm=max_grad_norm, b1=0.0, b2=0.0,
                                    eps=1.0, weight_decay=0.0))
    grads = {"w": jnp.array([30.0, 40.0, 0.0])}
    scale = 1.0 if max_grad_norm is None else max_grad_norm / 50.0
    g = np.array([30.0, 40.0, 0.0]) * scale
    want = -g / (np.abs(g) + 1.0)  # (-0.375, -0.444.., 0) at c = 1; (-0.968, -0.976, 0) unclipped
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    # A handful of float32 roundings (the norm, the clip's scale and product, a square, a
    # sqrt, an add and a division) on values of magnitude <= 1.
    np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=0,
                               atol=16 * unit_roundoff("float32"))


def test_a_non_finite_gradient_leaves_params_and_optimizer_state_unchanged():
    """``make_apply_fn`` skips the update (a ``lax.cond``) when the gradient norm is not
    finite: params and every optimizer-state leaf (moments and step count) keep their
    values, and a finite gradient afterwards updates them as usual."""
    from areal_jax.learner.steps import make_apply_fn

    tx = make_optimizer(OptimConfig(lr=0.1, max_grad_norm=1.0))
    params = {"w": jnp.arange(1.0, 4.0), "b": jnp.ones((2, 2))}
    apply = jax.jit(make_apply_fn(tx))
    params, state, _, applied = apply(params, tx.init(params),
                                      {"w": jnp.ones((3,)), "b": jnp.ones((2, 2))})
    assert bool(applied)
    before = [np.asarray(x) for x in jax.tree.leaves((params, state))]
    w_before = np.asarray(params["w"])
    for bad in (jnp.nan, jnp.inf):
        grads = {"w": jnp.array([1.0, bad, 0.0]), "b": jnp.ones((2, 2))}
        params, state, grad_norm, applied = apply(params, state, grads)
        assert not bool(applied) and not np.isfinite(float(grad_norm))
        for old, new in zip(before, jax.tree.leaves((params, state)), strict=True):
            np.testing.assert_array_equal(np.asarray(new), old)
    params, state, _, applied = apply(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((2, 2))})
    assert bool(applied) and not np.array_equal(np.asarray(params["w"]), w_before)
