"""Sharded loading and forward on the fake 8-device CPU mesh equal the unsharded model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import jit_logits, make_tiny_hf_checkpoint
from jax.sharding import NamedSharding, PartitionSpec

from model_defs import (
    CausalLM,
    ModelConfig,
    load_hf,
    logical_to_spec,
    param_shardings,
    shard,
    use_mesh,
)

MESH_AXES = ("data", "fsdp", "tensor")


def _mesh(data: int, fsdp: int, tensor: int) -> jax.sharding.Mesh:
    if len(jax.devices()) < data * fsdp * tensor:
        pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
    auto = (jax.sharding.AxisType.Auto,) * 3
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=auto)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # hidden 64, 8 heads / 2 kv heads, vocab 128: divisible by fsdp=8 and tensor=2.
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen2", tie=False,
                                   hidden_size=64, num_attention_heads=8,
                                   num_key_value_heads=2, intermediate_size=96)


@pytest.fixture(scope="module")
def reference_logits(checkpoint):
    model, cfg = load_hf(checkpoint)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    return ids, np.asarray(jit_logits(model, ids))


@pytest.mark.parametrize("shape", [(1, 8, 1), (1, 4, 2)], ids=["fsdp8", "fsdp4xtensor2"])
def test_sharded_logits_equal_unsharded(checkpoint, reference_logits, shape):
    mesh = _mesh(*shape)
    model, cfg = load_hf(checkpoint, mesh=mesh)
    # Each tensor sits on its target sharding, split across devices.
    embed = model.embed_vd[...]
    expected = NamedSharding(mesh, logical_to_spec(("vocab", "embed"), mesh, embed.shape))
    assert embed.sharding.is_equivalent_to(expected, embed.ndim)
    assert "fsdp" in str(embed.sharding.spec)
    n_fsdp, n_tensor = shape[1], shape[2]
    assert embed.addressable_shards[0].data.shape == (cfg.vocab_size // n_tensor,
                                                      cfg.hidden_size // n_fsdp)
    q = model.layers.attn.q_kernel_dhk[...]  # stacked [L, D, H, Dh]; the layer axis whole
    assert q.addressable_shards[0].data.shape[0] == cfg.num_hidden_layers
    if n_tensor > 1:
        assert q.addressable_shards[0].data.shape[2] == cfg.num_attention_heads // n_tensor

    ids, want = reference_logits
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    ids_sharded = jax.device_put(jnp.asarray(ids), batch_sharding)

    @nnx.jit
    def forward(m, x):
        with use_mesh(mesh):
            return m(x)

    got = forward(model, ids_sharded)
    assert len(got.sharding.device_set) == 8
    assert float(np.max(np.abs(np.asarray(got) - want))) <= 1e-4


def test_load_with_default_explicit_mesh(checkpoint, reference_logits):
    """jax.make_mesh defaults to Explicit axes; load_hf still gives a working model."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = jax.make_mesh((2, 2, 2), MESH_AXES)
    model, _ = load_hf(checkpoint, mesh=mesh)
    ids, want = reference_logits
    got = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids))
    assert float(np.max(np.abs(np.asarray(got) - want))) <= 1e-4


def test_param_shardings_replicates_dims_that_do_not_divide():
    mesh = _mesh(1, 4, 2)
    # hidden 30 does not divide fsdp=4; 3 heads do not divide tensor=2.
    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=100, hidden_size=30,
                      intermediate_size=48, num_hidden_layers=1, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=10, attention_bias=False, qk_norm=True)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    shardings = param_shardings(abstract, mesh)
    flat = dict(nnx.to_flat_state(shardings))
    # vocab 100 over tensor=2 ok; embed 30 over fsdp=4 does not divide -> replicated.
    assert flat[("embed_vd",)].spec == PartitionSpec("tensor", None)
    # 3 heads over tensor=2 -> replicated; mlp 48 over tensor=2 -> sharded.
    # (stacked layers: the leading layer axis is never sharded)
    assert flat[("layers", "attn", "q_kernel_dhk")].spec == PartitionSpec(None, None, None, None)
    assert flat[("layers", "mlp", "gate_kernel_df")].spec == PartitionSpec(None, None, "tensor")
    # The shardings place a real model's params (what the learner does).
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), nnx.state(abstract, nnx.Param))
    placed = jax.device_put(params, shardings)
    for value, sharding in zip(jax.tree.leaves(placed), jax.tree.leaves(shardings), strict=True):
        assert value.sharding.is_equivalent_to(sharding, value.ndim)


def test_shard_is_a_no_op_without_mesh_and_constrains_with_one():
    x = jnp.ones((8, 4, 16))
    assert shard(x, ("batch", "seq", "act_embed")) is x
    mesh = _mesh(2, 4, 1)

    @jax.jit
    def constrained(v):
        with use_mesh(mesh):
            return shard(v * 2, ("batch", "seq", "act_embed"))

    batch_sharded = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, None))
    out = constrained(x)
    assert out.sharding.is_equivalent_to(batch_sharded, 3)
    with jax.set_mesh(mesh):
        out2 = jax.jit(lambda v: shard(v * 2, ("batch", "seq", "act_embed")))(x)
    assert out2.sharding.is_equivalent_to(batch_sharded, 3)


def test_learner_warns_about_large_params_left_replicated_on_fsdp(monkeypatch, caplog):
    """A dimension that does not divide its mesh axis is replicated silently; the learner
    names every parameter of REPLICATED_PARAM_WARN_ELEMENTS or more left whole on each
    device of an fsdp mesh (lowered here so that a tiny model crosses it)."""
    import logging

    import areal_jax.parallel.mesh as mesh_module
    from areal_jax.learner import AlgoConfig, Learner, OptimConfig

    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=100, hidden_size=30,
                      intermediate_size=48, num_hidden_layers=1, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=10, attention_bias=False, qk_norm=True)
    monkeypatch.setattr(mesh_module, "REPLICATED_PARAM_WARN_ELEMENTS", 500)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    # hidden 30 over fsdp=4 does not divide: the q kernel (30 x 3 x 10 = 900) stays whole,
    # the gate kernel (30 x 48, mlp over tensor) is sharded, the norms are under 500.
    names = mesh_module.replicated_params(params, param_shardings(params, _mesh(1, 4, 2)),
                                          _mesh(1, 4, 2))
    assert any("q_kernel" in n for n in names) and not any("gate" in n for n in names), names
    assert mesh_module.replicated_params(
        params, param_shardings(params, _mesh(4, 1, 2)), _mesh(4, 1, 2)) == []  # no fsdp
    with caplog.at_level(logging.WARNING, logger="areal_jax.learner.trainable"):
        Learner(CausalLM(cfg, rngs=nnx.Rngs(0)), cfg, OptimConfig(), AlgoConfig(),
                mesh=_mesh(1, 4, 2))
    warned = [r.getMessage() for r in caplog.records if "replicated on every device" in r.message]
    assert len(warned) == 1 and "q_kernel" in warned[0] and "fsdp=4" in warned[0], warned
