"""AdamW schedule, weight-decay mask and grad clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _learner_data import TINY
from flax import nnx

from areal_jax.learner import (
    OptimizerConfig,
    learning_rate_at,
    learning_rate_schedule,
    make_optimizer,
    weight_decay_mask,
)
from model_defs import CausalLM


def test_warmup_then_constant_or_cosine():
    const = learning_rate_schedule(OptimizerConfig(lr=1.0, warmup_steps=4))
    np.testing.assert_allclose([float(const(i)) for i in range(6)], [0.25, 0.5, 0.75, 1, 1, 1])
    cos = learning_rate_schedule(OptimizerConfig(lr=2.0, warmup_steps=2, schedule="cosine",
                                                 total_steps=6, min_lr_ratio=0.1))
    got = [float(cos(i)) for i in range(8)]
    cfg = OptimizerConfig(lr=2.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    np.testing.assert_allclose([learning_rate_at(cfg, i) for i in range(8)], got, rtol=1e-6)
    want = [1.0, 2.0] + [2.0 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * k / 4))) for k in range(5)] + [0.2]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_weight_decay_skips_norms_and_biases():
    params = nnx.state(nnx.eval_shape(lambda: CausalLM(TINY, rngs=nnx.Rngs(0))), nnx.Param)
    mask = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(weight_decay_mask(params))[0]}
    assert mask["['embed_vd'].value"] and mask["['lm_head_dv'].value"]
    assert mask["['layers'][0]['mlp']['gate_kernel_df'].value"]
    assert not mask["['final_norm']['scale'].value"]
    assert not mask["['layers'][1]['attn']['q_bias'].value"]  # 2-D, but a bias
    assert not mask["['layers'][1]['post_attn_norm']['scale'].value"]

    # With zero gradients, only decayed params move (AdamW decoupled decay).
    small = {"embed_vd": jnp.ones((4, 2)), "q_bias": jnp.ones((2, 2)),
             "input_norm": {"scale": jnp.ones((2,))}, "up_kernel_df": jnp.ones((2, 3))}
    tx = make_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5))
    zeros = jax.tree.map(jnp.zeros_like, small)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(small), small)
    moved = {k: bool(jnp.any(u != 0)) for k, u in jax.tree_util.tree_leaves_with_path(updates)}
    assert moved == {k: bool(v) for k, v in jax.tree_util.tree_leaves_with_path(weight_decay_mask(small))}
    assert moved[(jax.tree_util.DictKey("embed_vd"),)] and not moved[(jax.tree_util.DictKey("q_bias"),)]


def test_grad_norm_clipping():
    params = {"w": jnp.ones((3,))}
    tx = make_optimizer(OptimizerConfig(lr=1.0, max_grad_norm=1.0, b1=0.0, b2=0.0, eps=1e-12))
    grads = {"w": jnp.array([30.0, 40.0, 0.0])}  # norm 50 -> clipped to norm 1
    state = tx.init(params)
    clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    np.testing.assert_allclose(optax.global_norm(clipped), 1.0, rtol=1e-6)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_allclose(updates["w"][:2], [-1.0, -1.0], rtol=1e-5)  # Adam with b=0: sign
