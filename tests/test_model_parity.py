"""Logits of load_hf(dir) vs transformers on tiny random checkpoints, and HF round trips."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import (
    hf_logits,
    jit_logits,
    logit_tolerance,
    make_hf_model,
    make_tiny_hf_checkpoint,
)
from tolerance import network_tolerance, sum_tolerance

from model_defs import CausalLM, ModelConfig, load_hf, save_hf

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# (arch, HF config overrides): several shapes per architecture.
SHAPES = [
    ("qwen2", {}),
    ("qwen2", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 1,
               "rope_theta": 1e6}),
    ("qwen2", {"num_key_value_heads": 4, "num_hidden_layers": 3, "vocab_size": 97}),
    ("qwen3", {}),
    ("qwen3", {"head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 1}),
    ("qwen3", {"hidden_size": 64, "head_dim": 8, "num_attention_heads": 8,
               "num_key_value_heads": 4, "rms_norm_eps": 1e-5}),
    ("llama", {}),
    ("llama", {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0}),
    ("llama", {"hidden_size": 48, "head_dim": 16, "num_attention_heads": 6,
               "num_key_value_heads": 2, "rms_norm_eps": 1e-5}),
]


def _ids(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, (batch, length)).astype(np.int32)


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _parity_cases() -> list:
    """Every shape tied and untied; the first shape of each arch runs both by default, the
    others alternate, and the remaining combinations are marked slow."""
    cases, seen = [], set()
    for i, (arch, overrides) in enumerate(SHAPES):
        first = arch not in seen
        seen.add(arch)
        for tie in (True, False):
            default = first or tie == bool(i % 2)
            marks = () if default else (pytest.mark.slow,)
            name = f"{arch}-{i}-{'tied' if tie else 'untied'}"
            cases.append(pytest.param(arch, overrides, tie, id=name, marks=marks))
    return cases


@pytest.mark.parametrize("arch,overrides,tie", _parity_cases())
def test_logits_match_transformers(tmp_path, arch, overrides, tie):
    path = make_tiny_hf_checkpoint(tmp_path, arch=arch, tie=tie, seed=3, **overrides)
    model, cfg = load_hf(path)
    assert cfg.tie_word_embeddings == tie
    assert (model.lm_head_dv is None) == tie
    ids = _ids(2, 40, cfg.vocab_size)
    logits = jit_logits(model, ids)
    assert logits.dtype == jnp.float32
    assert logits.shape == (2, 40, cfg.vocab_size)
    reference = hf_logits(path, ids)
    assert _max_diff(logits, reference) <= logit_tolerance(path, ids)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_explicit_positions_match_transformers(tmp_path, arch):
    """Offset positions (past the llama3 original context) reach RoPE like position_ids do."""
    path = make_tiny_hf_checkpoint(tmp_path, arch=arch, tie=False, seed=5,
                                   rope_scaling=LLAMA3_SCALING if arch == "llama" else None)
    model, cfg = load_hf(path)
    ids = _ids(2, 24, cfg.vocab_size, seed=1)
    positions = np.stack([np.arange(24) + 100, np.arange(24) + 7]).astype(np.int32)
    logits = jit_logits(model, ids, positions)
    tol = logit_tolerance(path, ids, positions)
    assert _max_diff(logits, hf_logits(path, ids, positions)) <= tol


ROUND_TRIP_CASES = [
    pytest.param(arch, tie, {}, id=f"{arch}-{'tied' if tie else 'untied'}")
    for arch in ("qwen2", "qwen3", "llama") for tie in (True, False)
] + [pytest.param("llama", False, {"rope_scaling": LLAMA3_SCALING}, id="llama-rope-llama3")]


@pytest.mark.parametrize("arch,tie,overrides", ROUND_TRIP_CASES)
def test_hf_to_ours_to_hf_round_trip(tmp_path, arch, tie, overrides):
    """HF checkpoint -> load_hf -> save_hf -> transformers gives the original logits."""
    src = make_tiny_hf_checkpoint(tmp_path, arch=arch, tie=tie, seed=7, **overrides)
    model, cfg = load_hf(src)
    out = save_hf(model, cfg, tmp_path / "saved")
    saved_config = json.loads((out / "config.json").read_text())
    assert saved_config["architectures"] == [cfg.architecture]
    ids = _ids(2, 16, cfg.vocab_size, seed=2)
    assert _max_diff(hf_logits(out, ids), hf_logits(src, ids)) == 0.0
    reloaded, cfg2 = load_hf(out)
    assert cfg2 == cfg
    assert _max_diff(jit_logits(reloaded, ids), jit_logits(model, ids)) == 0.0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_ours_to_hf_round_trip_sharded_files(tmp_path, arch):
    """A randomly initialised CausalLM saved as several safetensors shards + index loads
    in transformers and gives our logits."""
    hf_cfg = make_hf_model(arch, tie=False).config.to_dict()
    hf_cfg["architectures"] = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                "llama": "LlamaForCausalLM"}[arch]]
    cfg = ModelConfig.from_hf_dict(hf_cfg)
    model = CausalLM(cfg, rngs=nnx.Rngs(11))
    # Random (non-identity) norms and biases so a mix-up shows.
    rng = np.random.RandomState(0)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("scale", "q_bias", "k_bias", "v_bias"):
            shape = var.get_value().shape
            var.set_value(var.get_value() + 0.1 * rng.randn(*shape).astype(np.float32))
    out = save_hf(model, cfg, tmp_path / "ours", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = _ids(2, 16, cfg.vocab_size, seed=4)
    ours = jit_logits(model, ids)
    assert _max_diff(ours, hf_logits(out, ids)) <= logit_tolerance(out, ids)
    reloaded, _ = load_hf(out)
    assert _max_diff(jit_logits(reloaded, ids), ours) == 0.0


def test_load_sharded_hf_checkpoint(tmp_path):
    """transformers' own sharded layout (several files + index) loads."""
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=False, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert not (path / "model.safetensors").exists()
    model, cfg = load_hf(path)
    ids = _ids(1, 12, cfg.vocab_size)
    assert _max_diff(jit_logits(model, ids), hf_logits(path, ids)) <= logit_tolerance(path, ids)


def test_bfloat16_params_compute_and_fp32_logits(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen3", tie=True)
    model, cfg = load_hf(path, dtype="bfloat16")
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(p.dtype == jnp.bfloat16 for p in params)
    ids = _ids(2, 16, cfg.vocab_size)
    hidden, logits = nnx.jit(lambda m, x: (m.hidden_states(x), m(x)))(model, jnp.asarray(ids))
    assert hidden.dtype == jnp.bfloat16
    assert logits.dtype == jnp.float32
    reference = hf_logits(path, ids)
    # bf16 rounding: close to the fp32 reference relative to the logit scale, not exact.
    assert _max_diff(logits, reference) < 0.05 * np.abs(reference).max()
    # The saved bf16 checkpoint loads in transformers.
    out = save_hf(model, cfg, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert np.isfinite(hf_logits(out, ids)).all()


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_save_hf_streams_tensors_in_safetensors_own_format(tmp_path, dtype):
    """save_hf writes tensor by tensor: the files read back (with safetensors' own reader)
    as what safetensors' save_file would have written, and the host never holds more than
    a fraction of the file (save_file held every tensor, then all their bytes again)."""
    import tracemalloc

    import ml_dtypes
    from safetensors.numpy import load_file

    from model_defs.hf_io import ours_to_hf, param_table

    cfg = ModelConfig.preset("tiny", hidden_size=256, intermediate_size=1024, vocab_size=4096,
                             num_hidden_layers=4)
    model = CausalLM(cfg, rngs=nnx.Rngs(3))
    want_dtype = np.dtype(ml_dtypes.bfloat16 if dtype else np.float32)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    def ours(path, layer):
        value = np.asarray(flat[path].get_value())
        return value if layer is None else value[layer]

    want = {key: ours_to_hf(ours(path, layer).astype(want_dtype), transform)
            for key, path, transform, layer in param_table(cfg) if path in flat}
    total = sum(a.nbytes for a in want.values())
    largest = max(a.nbytes for a in want.values())
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))

    tracemalloc.start()
    try:
        out = save_hf(model, cfg, tmp_path / "ours", dtype=dtype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for key, array in want.items():
        assert got[key].dtype == array.dtype and got[key].shape == array.shape
        np.testing.assert_array_equal(got[key].view(np.uint8), array.view(np.uint8))
    # One tensor at a time, never the whole file (save_file: ~0.77 x the file here).
    assert peak < largest + total // 8, (peak, largest, total)


def test_hidden_states_and_unembed_give_logits(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path, arch="llama", tie=False)
    model, cfg = load_hf(path)
    ids = jnp.asarray(_ids(2, 10, cfg.vocab_size))
    hidden_btd, w_dv, logits = nnx.jit(
        lambda m, x: (m.hidden_states(x), m.unembed_dv(), m(x)))(model, ids)
    assert hidden_btd.shape == (2, 10, cfg.hidden_size)
    assert w_dv.shape == (cfg.hidden_size, cfg.vocab_size)
    # The same head product in two evaluation orders: one sum of hidden_size terms each.
    scale = np.abs(np.asarray(hidden_btd)) @ np.abs(np.asarray(w_dv))
    assert np.all(np.abs(np.asarray(hidden_btd @ w_dv) - np.asarray(logits))
                  <= sum_tolerance(scale, cfg.hidden_size))


@pytest.mark.parametrize("remat", [True, pytest.param("dots", marks=pytest.mark.slow)])
def test_remat_gives_same_logits_and_grads(tmp_path, remat):
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True)
    model, cfg = load_hf(path)
    remat_model = CausalLM(cfg, rngs=nnx.Rngs(0), remat=remat)
    nnx.update(remat_model, nnx.state(model, nnx.Param))
    ids = jnp.asarray(_ids(2, 12, cfg.vocab_size))

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(ids))[..., 0])

    grad_fn = nnx.jit(nnx.grad(loss))
    g_plain = grad_fn(model)
    g_remat = grad_fn(remat_model)
    # Remat recomputes the same ops, perhaps fused another way: rounding along the forward and
    # backward path, plus the sum over the B*T tokens, at each leaf's own scale.
    layer = 4 * cfg.hidden_size + cfg.intermediate_size + 12  # projections, ffn, T=12
    path_length = 2 * cfg.num_hidden_layers * layer + 24  # forward and backward, B*T tokens
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= network_tolerance(np.abs(a).max(), path_length)


def test_query_chunked_attention_matches_transformers(tmp_path, monkeypatch):
    """Sequences longer than one attention block (here 7 rows, not a divisor of T) still
    match, with and without packed segments."""
    import model_defs.attention as attention_module

    monkeypatch.setattr(attention_module, "BLOCK", 7)
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen3", tie=False, seed=9)
    model, cfg = load_hf(path)
    ids = _ids(2, 40, cfg.vocab_size, seed=6)
    forward = nnx.jit(lambda m, x, p, s: m(x, positions=p, segment_ids=s))  # fresh trace
    logits = forward(model, jnp.asarray(ids), None, None)
    assert _max_diff(logits, hf_logits(path, ids)) <= logit_tolerance(path, ids)
    # Two packed segments (17 + 23 tokens) equal each one run alone by transformers.
    segment_ids = np.array([[1] * 17 + [2] * 23] * 2, np.int32)
    positions = np.array([list(range(17)) + list(range(23))] * 2, np.int32)
    packed = forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segment_ids))
    assert _max_diff(packed[:, :17], hf_logits(path, ids[:, :17])) <= logit_tolerance(path, ids)
    assert _max_diff(packed[:, 17:], hf_logits(path, ids[:, 17:])) <= logit_tolerance(path, ids)


def _packed_loss_setup(lora: bool, remat):
    """A small model (LoRA on every projection or not), a packed batch of 3 segments in
    one row, and a loss of its hidden states; params split as the learner splits them."""
    from model_defs import LoraConfig, add_lora

    cfg = ModelConfig.preset("tiny", vocab_size=64, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16)
    model = CausalLM(cfg, rngs=nnx.Rngs(0), remat=remat)
    if lora:
        add_lora(model, LoraConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
        # lora_b starts at zero: give the adapters values so every gradient is non-zero
        state = nnx.state(model, nnx.LoRAParam)
        nnx.update(model, jax.tree.map(lambda x: x + 0.05, state))
    graphdef, params, rest = nnx.split(model, nnx.LoRAParam if lora else nnx.Param, ...)
    ids = jnp.asarray(_ids(1, 24, cfg.vocab_size))
    seg = jnp.asarray([[1] * 8 + [2] * 10 + [3] * 6], jnp.int32)
    pos = jnp.asarray([list(range(8)) + list(range(10)) + list(range(6))], jnp.int32)
    w = jax.random.normal(jax.random.key(2), (1, 24, cfg.hidden_size))

    def loss(p, layer_grad_acc=None, poison=1.0):
        m = nnx.merge(graphdef, p, rest)
        h = m.hidden_states(ids, positions=pos, segment_ids=seg, layer_grad_acc=layer_grad_acc)
        return jnp.sum(h * w * poison)

    return cfg, params, loss


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.slow), "full",
                                   pytest.param("dots", marks=pytest.mark.slow)])
def test_layer_grad_acc_adds_each_layers_gradient_to_its_buffer(remat, lora):
    """``hidden_states(layer_grad_acc=...)``: the gradient of every decoder-layer variable
    that has a buffer comes out as buffer + gradient (inside each layer's backward step
    with remat: full), the others as their gradient; packed segments, LoRA adapters only
    (the frozen base gets no gradient at all) and full fine-tuning alike."""
    cfg, params, loss = _packed_loss_setup(lora, remat)
    acc = jax.tree.map(lambda x: jax.random.normal(jax.random.key(3), x.shape, x.dtype), params)
    layer_acc = acc["layers"]
    g_plain = jax.jit(jax.grad(loss))(params)
    g_acc = jax.jit(jax.grad(lambda p, a: loss(p, a)))(params, layer_acc)
    n_layer_leaves = 0
    for (path, plain), with_acc, buf in zip(jax.tree_util.tree_flatten_with_path(g_plain)[0],
                                            jax.tree.leaves(g_acc), jax.tree.leaves(acc),
                                            strict=True):
        plain, with_acc, buf = map(np.asarray, (plain, with_acc, buf))
        assert np.any(plain != 0), jax.tree_util.keystr(path)
        in_layer = path[0].key == "layers"
        n_layer_leaves += in_layer
        want = plain + buf if in_layer else plain
        # one extra rounding of the sum, plus the recomputation's rounding in the gradient
        tol = 4 * np.finfo(np.float32).eps * (np.abs(plain) + np.abs(buf)).max() + \
            network_tolerance(np.abs(plain).max(), 2 * cfg.num_hidden_layers * 400)
        np.testing.assert_allclose(with_acc, want, rtol=0, atol=tol,
                                   err_msg=jax.tree_util.keystr(path))
    assert n_layer_leaves == (14 if lora else 12)  # stacked [L, ...]: one leaf a variable


def test_remat_full_backward_keeps_a_nan_gradient():
    """A NaN cotangent through the rematerialised layers' backward scan gives NaN
    gradients (so the learner's non-finite check skips the step), never zeros."""
    cfg, params, loss = _packed_loss_setup(False, "full")
    g = jax.jit(jax.grad(lambda p: loss(p, poison=jnp.nan)))(params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
        if path[0].key == "layers":
            assert np.isnan(np.asarray(leaf)).any(), jax.tree_util.keystr(path)


def test_layer_grad_acc_rejects_a_wrong_layer_count():
    cfg, params, loss = _packed_loss_setup(False, "full")
    one_layer = jax.tree.map(lambda x: x[:1], params["layers"])
    with pytest.raises(ValueError, match=r"layer_grad_acc.* has shape \(1, "):
        loss(params, one_layer)
