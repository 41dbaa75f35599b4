"""LoRA: PEFT round trips both ways against peft + transformers, adapter-only training and
optimizer state, merged publishing, Orbax resume, and config errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _learner_data import (
    FAST_COMPILE,
    TINY,
    init_model,
    restore_learner,
    save_learner,
    standard_batches,
    train_version,
)
from flax import nnx
from hf_fixtures import hf_logits, jit_logits, logit_tolerance, make_tiny_hf_checkpoint

from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer
from areal_jax.checkpoint.publish import ADAPTER_SUBDIR, WeightPublisher, host_params
from areal_jax.config import ConfigError, load_config
from areal_jax.learner import AlgoConfig, Learner, OptimConfig
from areal_jax.parallel import make_mesh
from model_defs import (
    CheckpointError,
    LoraConfig,
    add_lora,
    load_hf,
    load_peft_adapter,
    lora_config,
    merge_lora,
    peft_adapter,
    save_peft_adapter,
)
from model_defs.config import ConfigError as ModelConfigError
from model_defs.lora import lora_adapters

IDS = np.random.default_rng(0).integers(0, 128, (2, 12))
REPO_CONFIG = "configs/tiny_demo_lora.yaml"


def randomize_b(model, seed=0, std=0.1):
    """Non-zero B (a fresh adapter's B is 0, which would hide any mix-up of A or B)."""
    rng = np.random.default_rng(seed)
    for _, adapter in lora_adapters(model):
        b = adapter.lora_b.get_value()
        adapter.lora_b.set_value(jnp.asarray(std * rng.standard_normal(b.shape), b.dtype))
    return model


def peft_model(base_dir, adapter_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.mark.parametrize("arch,targets", [
    ("qwen2", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("qwen3", ("q_proj", "v_proj", "down_proj")),
])
def test_our_adapter_loads_in_peft_with_the_same_logits(tmp_path, arch, targets):
    base_dir = make_tiny_hf_checkpoint(tmp_path, arch=arch, tie=False)
    model, _ = load_hf(base_dir)
    add_lora(model, LoraConfig(rank=4, alpha=12.0, target_modules=targets), rngs=nnx.Rngs(1))
    randomize_b(model)
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))

    cfg = json.loads((out / "adapter_config.json").read_text())
    got = (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"]))
    assert got == (4, 12.0, sorted(targets))
    reference = peft_model(base_dir, out)
    want = hf_logits(reference, IDS)
    got = np.asarray(jit_logits(model, IDS))
    np.testing.assert_allclose(got, want, rtol=0, atol=logit_tolerance(reference, IDS))
    # The adapter matters: without it the logits are far off.
    plain, _ = load_hf(base_dir)
    assert np.abs(np.asarray(jit_logits(plain, IDS)) - want).max() > 100 * logit_tolerance(
        reference, IDS)


def test_peft_made_adapter_loads_into_ours(tmp_path):
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = make_tiny_hf_checkpoint(tmp_path, arch="llama", tie=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    made = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=16, lora_dropout=0.0,
                                               target_modules=["q_proj", "o_proj", "up_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in made.named_parameters():
            if "lora_B" in name:  # peft initialises B to 0
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    made.eval().save_pretrained(tmp_path / "peft_adapter")
    want = hf_logits(made, IDS)

    model, _ = load_hf(base_dir)
    load_peft_adapter(model, tmp_path / "peft_adapter")
    assert lora_config(model).rank == 4 and lora_config(model).scale == 4.0
    got = np.asarray(jit_logits(model, IDS))
    np.testing.assert_allclose(got, want, rtol=0, atol=logit_tolerance(made, IDS))

    # ... and ours writes it back as the same tensors.
    again = save_peft_adapter(model, tmp_path / "ours")
    from safetensors.numpy import load_file

    theirs = load_file(str(tmp_path / "peft_adapter" / "adapter_model.safetensors"))
    ours = load_file(str(again / "adapter_model.safetensors"))
    assert sorted(theirs) == sorted(ours)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key])


def test_bad_peft_adapters_get_named_errors(tmp_path):
    base_dir = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True)
    model, _ = load_hf(base_dir)
    add_lora(model, LoraConfig(rank=2, alpha=2.0, target_modules=("q_proj",)), rngs=nnx.Rngs(0))
    out = save_peft_adapter(model, tmp_path / "a")
    cfg_path = out / "adapter_config.json"
    good = json.loads(cfg_path.read_text())
    for change, match in [({"use_dora": True}, "use_dora"),
                          ({"target_modules": "q_proj|v_proj"}, "regex"),
                          ({"target_modules": ["qkv_proj"]}, "qkv_proj"),
                          ({"r": 0}, "rank must be a positive int"),
                          ({"peft_type": "IA3"}, "only LORA")]:
        cfg_path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ModelConfigError, match=match):
            load_peft_adapter(load_hf(base_dir)[0], out)
    cfg_path.write_text(json.dumps({**good, "r": 3}))  # the tensors have r = 2
    with pytest.raises(CheckpointError, match=r"lora_A.weight has shape \[2, 32\], expected "
                                              r"\[3, 32\]"):
        load_peft_adapter(load_hf(base_dir)[0], out)
    with pytest.raises(ModelConfigError, match="not a PEFT adapter directory"):
        load_peft_adapter(load_hf(base_dir)[0], tmp_path)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(model, LoraConfig(rank=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapter(load_hf(base_dir)[0], tmp_path / "b")


def test_model_lora_config_errors_name_the_key():
    cfg = load_config(REPO_CONFIG)
    assert cfg.model.lora.spec() == LoraConfig(rank=8, alpha=16.0)
    assert load_config("configs/tiny_demo.yaml").model.lora is None  # off by default
    for override, match in [
        ("model.lora.rank=0", "model.lora.rank must be > 0"),
        ("model.lora.rank=2.5", "model.lora.rank: expected an integer"),
        ("model.lora.alpha=-1", "model.lora.alpha must be > 0"),
        ("model.lora.target_modules=[q_proj,qkv]", r"unknown \['qkv'\]; choose from"),
        ("model.lora.target_modules=[]", "empty"),
        ("model.lora.target_modules=[q_proj,q_proj]", "duplicates"),
        ("model.lora.dropout=0.05", "model.lora.dropout=0.05 is not supported"),
        ("model.lora.dropout=1.5", r"model.lora.dropout must be in \[0, 1\)"),
        ("model.lora.ranks=4", "unknown config key 'model.lora.ranks'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(REPO_CONFIG, [override])
    with pytest.raises(ModelConfigError, match="choose from"):
        LoraConfig(target_modules=("lm_head",))


def _lora_learner(mesh, seed=0):
    model = add_lora(init_model(TINY, seed), LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    randomize_b(model, seed=1, std=0.02)
    return Learner(model, TINY, OptimConfig(lr=1e-3, weight_decay=0.01, eps=1e-6),
                   AlgoConfig(ppo_n_minibatches=2), mesh=mesh, compiler_options=FAST_COMPILE)


@pytest.mark.devices(8)
def test_only_adapters_train_and_hold_optimizer_state_and_resume_from_orbax(tmp_path):
    learner = _lora_learner(make_mesh("data=2,fsdp=2,tensor=2"))
    adapter_sizes = sorted(x.size for x in jax.tree.leaves(learner.params))
    n_layers, n_targets = TINY.num_hidden_layers, 7
    assert len(adapter_sizes) == 2 * n_targets  # A and B per target, stacked over layers
    assert {x.shape[0] for x in jax.tree.leaves(learner.params)} == {n_layers}
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(learner.params)[0]]
    assert all("['lora_a']" in p or "['lora_b']" in p for p in paths), paths
    # AdamW's two moments per adapter array, nothing for the base weights.
    moment_sizes = sorted(x.size for x in jax.tree.leaves(learner.opt_state) if x.ndim >= 1)
    assert moment_sizes == sorted(adapter_sizes * 2)

    before = learner.model
    base_before = {k: np.asarray(v.get_value()) for k, v in
                   nnx.to_flat_state(nnx.state(before, nnx.Not(nnx.LoRAParam)))}
    lora_before = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    batches = standard_batches()
    train_version(learner, batches)
    after = learner.model
    base_after = {k: np.asarray(v.get_value()) for k, v in
                  nnx.to_flat_state(nnx.state(after, nnx.Not(nnx.LoRAParam)))}
    assert base_after.keys() == base_before.keys()
    for k in base_before:
        np.testing.assert_array_equal(base_after[k], base_before[k], err_msg=str(k))
    changed = [not np.array_equal(np.asarray(a), b)
               for a, b in zip(jax.tree.leaves(learner.params), lora_before, strict=True)]
    assert all(changed)

    # Orbax: the checkpoint holds the adapters and their moments; a restore onto a fresh
    # learner (same base, another adapter init) trains on exactly as before.
    save_learner(learner, tmp_path / "ckpt")
    want = train_version(learner, batches)
    want_params = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    fresh = _lora_learner(make_mesh("data=2,fsdp=2,tensor=2"))
    restore_learner(fresh, tmp_path / "ckpt")
    got = train_version(fresh, batches)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for g, w in zip(jax.tree.leaves(fresh.params), want_params, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_bf16_lora_keeps_fp32_adapters_and_a_bf16_frozen_base():
    model = add_lora(init_model(TINY), LoraConfig(rank=2), rngs=nnx.Rngs(0))
    learner = Learner(model, TINY, OptimConfig(), AlgoConfig(),
                      mesh=make_mesh("data=1", jax.devices()[:1]),
                      compute_dtype="bfloat16", compiler_options=FAST_COMPILE)
    assert {x.dtype for x in jax.tree.leaves(learner.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(learner._rest)} == {jnp.dtype(jnp.bfloat16)}


def test_merged_publish_serves_the_adapter_model(tmp_path):
    base_dir = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True)
    model, _ = load_hf(base_dir)
    model_cfg = load_hf(base_dir)[1]
    add_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "o_proj", "up_proj",
                                                                   "down_proj")),
             rngs=nnx.Rngs(2))
    randomize_b(model, seed=5)
    want = np.asarray(jit_logits(model, IDS))

    publisher = WeightPublisher(tmp_path / "weights", keep=2)
    path = publisher.publish(host_params(model), model_cfg, 3,
                             adapter=peft_adapter(model, str(base_dir)))
    served, _ = load_hf(path)  # what the embedded engine loads: a plain model
    assert lora_config(served) is None
    got = np.asarray(jit_logits(served, IDS))
    # The merged kernels round W + s*A@B once more than the adapter path: the same bound.
    np.testing.assert_allclose(got, want, rtol=0, atol=logit_tolerance(path, IDS))
    np.testing.assert_allclose(np.asarray(jit_logits(merge_lora(model), IDS)), want, rtol=0,
                               atol=logit_tolerance(path, IDS))

    reference = peft_model(base_dir, f"{path}/{ADAPTER_SUBDIR}")  # the adapter alone
    np.testing.assert_allclose(hf_logits(reference, IDS), want, rtol=0,
                               atol=logit_tolerance(reference, IDS))


def test_convert_writes_a_lora_checkpoint_merged_and_as_a_peft_adapter(tmp_path):
    import importlib.util

    from areal_jax.config import LoraSection, to_dict

    spec = importlib.util.spec_from_file_location("convert_script", "scripts/convert.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)

    base_dir = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True)
    model, model_cfg = load_hf(base_dir)
    section = LoraSection(rank=2, alpha=4.0, target_modules=["k_proj", "gate_proj"])
    randomize_b(add_lora(model, section.spec(), rngs=nnx.Rngs(4)), seed=2)
    want = np.asarray(jit_logits(model, IDS))
    meta = CheckpointMeta(step=1, version=1, model_config=model_cfg.to_hf_dict(),
                          run_config={"model": {"path": str(base_dir),
                                                "lora": to_dict(section)}})
    with TrainCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:  # as the trainer does
        ckpt.save(1, nnx.state(model, nnx.LoRAParam), None, meta)

    convert.orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                        adapter_out=str(tmp_path / "peft"))
    got = np.asarray(jit_logits(load_hf(tmp_path / "hf")[0], IDS))
    np.testing.assert_allclose(got, want, rtol=0, atol=logit_tolerance(tmp_path / "hf", IDS))
    reference = peft_model(base_dir, tmp_path / "peft")
    np.testing.assert_allclose(hf_logits(reference, IDS), want, rtol=0,
                               atol=logit_tolerance(reference, IDS))


@pytest.mark.slow
def test_lora_run_publishes_merged_weights_and_adapters_and_resumes(tmp_path):
    from safetensors.numpy import load_file
    from test_trainer import _rows, _run

    from areal_jax.run_inputs import ASSETS_DIR

    run_dir = tmp_path / "run"
    lora = ["model.lora.rank=4", "model.lora.publish_adapter=true", "optim.lr=1e-3"]
    res = _run([f"run_dir={run_dir}", "train.total_versions=2", "checkpoint.every_versions=1",
                *lora])
    assert res.returncode == 0, res.stderr[-4000:]
    weights = run_dir / "weights"
    base = load_file(str(ASSETS_DIR / "arith_sft" / "model.safetensors"))
    v0 = load_file(str(weights / "v0" / "model.safetensors"))
    v2 = load_file(str(weights / "v2" / "model.safetensors"))
    for key in base:  # v0: the base (B = 0); v2: only adapted kernels moved
        np.testing.assert_array_equal(v0[key], base[key])
        moved = not np.array_equal(v2[key], base[key])
        assert moved == key.endswith("proj.weight"), key
    adapter = weights / "v2" / ADAPTER_SUBDIR
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    base_model, _ = load_hf(ASSETS_DIR / "arith_sft")
    served = np.asarray(jit_logits(load_hf(weights / "v2")[0], IDS % 32))
    with_adapter = np.asarray(jit_logits(load_peft_adapter(base_model, adapter), IDS % 32))
    np.testing.assert_allclose(served, with_adapter, rtol=0,
                               atol=logit_tolerance(weights / "v2", IDS % 32))

    res = _run([f"run_dir={run_dir}", "train.total_versions=3", "checkpoint.every_versions=1",
                *lora, "--resume"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stdout + res.stderr
    assert [r["version"] for r in _rows(run_dir)][-1] == 3
