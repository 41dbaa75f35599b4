"""TrainCheckpointer: Orbax save/restore of params, optimizer state and meta."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.checkpoint import CheckpointMeta
from areal_jax.checkpoint.orbax_ckpt import (
    CheckpointError,
    TrainCheckpointer,
    rng_from_json,
    rng_to_json,
)


class TinyNet(nnx.Module):
    """Eleven linear layers in an nnx.List (int keys 0..10: "10" sorts before "2" as a
    string, so a key-order mix-up shows) and an embedding."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(11)])


def _params_and_opt(seed: int = 0):
    model = TinyNet(nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params.to_pure_dict())
    # One real update so mu/nu/count are not the trivial init values.
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.1, params.to_pure_dict())
    _, opt_state = tx.update(grads, opt_state, params.to_pure_dict())
    return params, opt_state


def _assert_trees_equal(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_params_opt_state_meta(tmp_path):
    params, opt_state = _params_and_opt()
    key = jax.random.key(123)
    meta = CheckpointMeta(step=5, version=7, rng=rng_to_json(key),
                          executor={"accepted": 12, "running": 3},
                          model_config={"hidden_size": 16},
                          extra={"data_iter": {"next_index": 40}})
    ckpt = TrainCheckpointer(tmp_path / "ckpt", keep=3, async_save=True)
    assert ckpt.latest_step() is None
    assert ckpt.save(5, params, opt_state, meta)
    ckpt.wait()
    ckpt.close()

    ckpt = TrainCheckpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == 5
    # With targets: same container types (nnx.State, optax namedtuples) and values.
    abstract_params = jax.tree.map(lambda x: x, params)
    got_params, got_opt, got_meta = ckpt.restore(params_target=abstract_params,
                                                 opt_state_target=opt_state)
    assert isinstance(got_params, nnx.State)
    _assert_trees_equal(got_params, params)
    _assert_trees_equal(got_opt, opt_state)
    assert got_meta.step == 5 and got_meta.version == 7 and got_meta.has_opt_state is True
    assert got_meta.executor == {"accepted": 12, "running": 3}
    assert got_meta.extra == {"data_iter": {"next_index": 40}}
    assert got_meta.model_config == {"hidden_size": 16} and got_meta.run_config is None
    np.testing.assert_array_equal(jax.random.key_data(rng_from_json(got_meta.rng)),
                                  jax.random.key_data(key))
    # The restored nnx.State plugs back into a fresh model.
    fresh = TinyNet(nnx.Rngs(99))
    nnx.update(fresh, got_params)
    np.testing.assert_array_equal(fresh.embed.embedding[...],
                                  params.to_pure_dict()["embed"]["embedding"])

    # Without targets: pure containers, same leaves.
    pure_params, pure_opt, _ = ckpt.restore(5)
    state = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(state, pure_params)
    _assert_trees_equal(state, params)
    np.testing.assert_array_equal(pure_opt[0]["mu"]["layers"]["1"]["kernel"],
                                  opt_state[0].mu["layers"][1]["kernel"])
    assert int(pure_opt[0]["count"]) == 1
    ckpt.close()


def test_restore_onto_sharded_target(tmp_path):
    devices = np.array(jax.devices())
    assert devices.size == 8, "conftest sets 8 fake CPU devices"
    save_mesh = Mesh(devices.reshape(8), ("fsdp",))
    params, opt_state = _params_and_opt(seed=1)

    def place(tree, mesh, spec_2d):
        return jax.tree.map(lambda x: jax.device_put(
            x, NamedSharding(mesh, spec_2d if x.ndim == 2 else P())), tree)

    saved_params = place(params.to_pure_dict(), save_mesh, P("fsdp", None))
    saved_opt = place(opt_state, save_mesh, P("fsdp", None))
    with TrainCheckpointer(tmp_path / "ckpt", async_save=True) as ckpt:
        ckpt.save(1, saved_params, saved_opt, CheckpointMeta(version=1))

    restore_mesh = Mesh(devices.reshape(4, 2), ("fsdp", "tensor"))

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype,
            sharding=NamedSharding(restore_mesh, P("fsdp", "tensor") if x.ndim == 2 else P())),
            tree)

    params_target, opt_target = abstract(saved_params), abstract(saved_opt)
    with TrainCheckpointer(tmp_path / "ckpt") as ckpt:
        got_params, got_opt, _ = ckpt.restore(1, params_target=params_target,
                                              opt_state_target=opt_target)
    for got, want, tgt in zip(jax.tree.leaves(got_params), jax.tree.leaves(saved_params),
                              jax.tree.leaves(params_target), strict=True):
        assert got.sharding == tgt.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want, tgt in zip(jax.tree.leaves(got_opt), jax.tree.leaves(saved_opt),
                              jax.tree.leaves(opt_target), strict=True):
        assert got.sharding == tgt.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    kernel = got_params["layers"][0]["kernel"]
    assert kernel.sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 8)}


def test_learner_layout_nested_states_and_donated_buffers(tmp_path):
    """The learner keeps params as an nnx.State and tx.init(params) nests States in the
    optax state; the next train step donates both right after save() returns."""
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
    _, params, _ = nnx.split(TinyNet(nnx.Rngs(2)), nnx.Param, ...)
    shard = NamedSharding(mesh, P("fsdp", None))
    params = jax.tree.map(lambda x: jax.device_put(x, shard if x.ndim == 2 else NamedSharding(
        mesh, P())), params)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    _, opt_state = tx.update(jax.tree.map(jnp.sin, params), opt_state, params)
    want_params = jax.tree.map(np.asarray, params)
    want_opt = jax.tree.map(np.asarray, opt_state)
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    abstract_opt = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), opt_state)
    with TrainCheckpointer(tmp_path / "ckpt", async_save=True) as ckpt:
        ckpt.save(3, params, opt_state, CheckpointMeta(version=3))
        for x in jax.tree.leaves(params) + jax.tree.leaves(opt_state):
            x.delete()  # what buffer donation does to them
        ckpt.wait()
        got_params, got_opt, _ = ckpt.restore(params_target=abstract_params,
                                              opt_state_target=abstract_opt)
        assert isinstance(got_opt[0].mu, nnx.State)
        _assert_trees_equal(got_params, want_params)
        _assert_trees_equal(got_opt, want_opt)
        for got, tgt in zip(jax.tree.leaves(got_opt), jax.tree.leaves(abstract_opt), strict=True):
            assert got.sharding == tgt.sharding
        # On disk the nested States are plain dicts (no NNX Variable internals).
        _, pure_opt, _ = ckpt.restore()
        assert set(pure_opt[0]["mu"]["layers"]["0"]) == {"bias", "kernel"}
        np.testing.assert_array_equal(pure_opt[0]["nu"]["layers"]["0"]["kernel"],
                                      want_opt[0].nu["layers"][0]["kernel"][...])


def test_keep_k_and_missing_step(tmp_path):
    params, opt_state = _params_and_opt()
    with TrainCheckpointer(tmp_path / "ckpt", keep=2, async_save=False) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, params, opt_state, CheckpointMeta(version=step))
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
        assert sorted(p for p in os.listdir(tmp_path / "ckpt") if p.isdigit()) == ["3", "4"]
        with pytest.raises(CheckpointError, match=r"step 1 not found .*available steps: \[3, 4\]"):
            ckpt.restore(1)
        assert ckpt.restore_meta().version == 4
        with pytest.raises(CheckpointError, match="step 4 already exists"):
            ckpt.save(4, params, opt_state, CheckpointMeta())


def test_params_only_checkpoint(tmp_path):
    params, opt_state = _params_and_opt()
    with TrainCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(0, params, None, CheckpointMeta(extra={"source": "hf"}))
    with TrainCheckpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        got_params, got_opt, meta = ckpt.restore(params_target=params)
        assert got_opt is None and meta.has_opt_state is False and meta.extra == {"source": "hf"}
        _assert_trees_equal(got_params, params)
        with pytest.raises(CheckpointError, match="params only"):
            ckpt.restore(params_target=params, opt_state_target=opt_state)


def test_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        TrainCheckpointer(tmp_path / "nowhere", read_only=True)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        TrainCheckpointer(tmp_path / "afile")
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        TrainCheckpointer(tmp_path / "k", keep=0)
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(CheckpointError, match="gs://bucket/run: gs:// paths need the gcsfs"):
            TrainCheckpointer("gs://bucket/run")
    params, opt_state = _params_and_opt()
    with TrainCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        with pytest.raises(CheckpointError, match="no checkpoint found in .*ckpt"):
            ckpt.restore()
        with pytest.raises(TypeError, match=r"meta\['rng'\] is not JSON-serialisable"):
            ckpt.save(1, params, opt_state, CheckpointMeta(rng=jax.random.key(0)))
        with pytest.raises(TypeError, match="meta must be a CheckpointMeta, got dict"):
            ckpt.save(1, params, opt_state, {"version": 1})
        ckpt.save(1, params, opt_state, CheckpointMeta())
        # A target of a different model: shape mismatch named by key path.
        wrong = jax.tree.map(lambda x: x, params.to_pure_dict())
        wrong["embed"]["embedding"] = jnp.zeros((64, 16))
        with pytest.raises(CheckpointError, match=r"params/embed/embedding has shape \(32, 16\)"):
            ckpt.restore(params_target=wrong)
        wrong = params.to_pure_dict()
        del wrong["layers"]
        wrong["head"] = {"kernel": jnp.zeros((16, 4))}
        with pytest.raises(CheckpointError, match="keys only in the target: \\['head/kernel'\\]"):
            ckpt.restore(params_target=wrong)
    with pytest.raises(CheckpointError, match="2 uint32 words"):
        rng_from_json([1, 2, 3])


_KILL_CHILD = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np
    from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer
    ckpt = TrainCheckpointer(sys.argv[1], keep=100, async_save=True)
    def params(step):  # ~32 MB per save, values identify the step
        return {"w": np.full((2048, 4096), float(step), np.float32), "b": np.arange(7.0) + step}
    ckpt.save(1, params(1), None, CheckpointMeta(version=1))
    ckpt.wait()
    print("committed 1", flush=True)
    step = 2
    while True:
        ckpt.save(step, params(step), None, CheckpointMeta(version=step))
        ckpt.wait()
        step += 1
""")


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    child_log = tmp_path / "child_stderr.txt"
    with open(child_log, "w") as stderr:  # a file, so a chatty child never blocks on a pipe
        child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(ckpt_dir)],
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "committed 1", child_log.read_text()
        deadline = time.time() + 60
        tmp_seen = None
        while time.time() < deadline and tmp_seen is None:
            tmp_seen = next((n for n in os.listdir(ckpt_dir) if "tmp" in n), None)
        assert tmp_seen is not None, "child never had a save in flight"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # The in-flight save was a tmp dir: ignored by all_steps, removed before the next save.
    with TrainCheckpointer(ckpt_dir, keep=100) as ckpt:
        steps = ckpt.all_steps()
        assert steps and steps == list(range(1, steps[-1] + 1))
        latest = ckpt.latest_step()
        params, opt_state, meta = ckpt.restore()
        assert meta.version == latest and opt_state is None
        np.testing.assert_array_equal(np.asarray(params["b"]), np.arange(7.0) + latest)
        w = np.asarray(params["w"])
        assert float(w.min()) == float(w.max()) == latest
        # The run goes on: the next save after resume commits normally.
        ckpt.save(latest + 1, params, None, CheckpointMeta(version=latest + 1))
        ckpt.wait()
        assert ckpt.latest_step() == latest + 1
        assert ckpt.restore_meta().version == latest + 1
        assert not any("tmp" in n for n in os.listdir(ckpt_dir)), os.listdir(ckpt_dir)


# ----------------------------------------------------------------------------- corruption
def _truncate(path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def _files(root) -> list:
    return sorted(p for p in root.rglob("*") if p.is_file())


_CORRUPTIONS = {  # what a full disk, a killed copy or a lost file leaves behind
    "meta_truncated": lambda d: _truncate(d / "meta" / "metadata", 0.5),
    "meta_empty": lambda d: _truncate(d / "meta" / "metadata", 0.0),
    "every_file_half": lambda d: [_truncate(p, 0.5) for p in _files(d)],
    "params_d_missing": lambda d: [p.unlink() for p in _files(d / "params" / "d")],
    "array_data_missing": lambda d: [p.unlink() for p in _files(d / "params")
                                     if p.parent.name == "d" and "ocdbt" in str(p)],
    "array_data_half": lambda d: [_truncate(p, 0.5) for p in _files(d / "params")
                                  if p.parent.name == "d" and "ocdbt" in str(p)],
}


@pytest.mark.parametrize("corruption", sorted(_CORRUPTIONS))
def test_restore_newest_skips_a_corrupt_latest_checkpoint(tmp_path, corruption):
    """Issue 33: a corrupt latest checkpoint ended the run with a JSONDecodeError traceback
    while the previous one was intact. The newest one that restores is used, and the
    skipped one is named with its cause; reading removes nothing."""
    params, opt = _params_and_opt(0)
    newer, _ = _params_and_opt(1)
    ckpt = TrainCheckpointer(tmp_path / "ck", keep=3, async_save=False)
    ckpt.save(10, params, opt, CheckpointMeta(version=10))
    ckpt.save(20, newer, opt, CheckpointMeta(version=20))
    ckpt.wait()
    _CORRUPTIONS[corruption](tmp_path / "ck" / "20")
    files = _files(tmp_path / "ck")
    # Halving an OCDBT data file sometimes cuts only bytes no array needs (where a file's
    # chunks fall varies from run to run): step 20 then still restores, bit-exact, and is
    # rightly used. Whether it does is asked of restore() itself, step 20 alone.
    try:
        ckpt.restore(20, params_target=params, opt_state_target=opt)
        intact = True
    except Exception:  # noqa: BLE001 - any failure to restore is what restore_newest skips
        intact = False
    assert intact is False or corruption == "array_data_half", "the corruption did nothing"
    step, got, got_opt, meta, skipped = ckpt.restore_newest(params_target=params,
                                                            opt_state_target=opt)
    want_step, want = (20, newer) if intact else (10, params)
    assert step == want_step and meta.version == want_step
    assert [s for s, _ in skipped] == ([] if intact else [20]), skipped
    assert all(why for _, why in skipped), skipped
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # a copy: bit-exact
    assert got_opt is not None
    assert _files(tmp_path / "ck") == files
    if intact:
        return
    # Set aside (kept under another name), the run can save version 20 again.
    kept = ckpt.set_aside(20)
    assert os.path.isdir(kept) and ckpt.all_steps() == [10]
    ckpt.save(20, newer, opt, CheckpointMeta(version=20))
    ckpt.wait()
    assert ckpt.restore_newest(params_target=params, opt_state_target=opt)[0] == 20
    ckpt.close()


def test_restore_newest_when_none_restores_names_each(tmp_path):
    params, opt = _params_and_opt(0)
    ckpt = TrainCheckpointer(tmp_path / "ck", keep=3, async_save=False)
    for step in (1, 2):
        ckpt.save(step, params, opt, CheckpointMeta(version=step))
    ckpt.wait()
    _CORRUPTIONS["meta_truncated"](tmp_path / "ck" / "2")
    _CORRUPTIONS["params_d_missing"](tmp_path / "ck" / "1")
    files = _files(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"can be restored \(step 2: JSONDecodeError: .*; "
                                              r"step 1: "):
        ckpt.restore_newest(params_target=params, opt_state_target=opt)
    assert _files(tmp_path / "ck") == files
    ckpt.close()


# ------------------------------------------------------------------- the meta record
# A trainer checkpoint's meta as the trainer wrote it before CheckpointMeta (and writes it
# now): the file is the same JSON dict, key for key.
_TRAINER_META_JSON = {
    "step": 12, "version": 6,
    "executor": {"gate": {"accepted": 48, "running": 2}, "prompt_iter": {"next_index": 40}},
    "model_config": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 16},
    "run_config": {"model": {"path": "builtin:arith"}, "seed": 1},
    "consumed_tokens": 9123, "elapsed_s": 81.5, "rng": [0, 7], "has_opt_state": True,
}


def _write_meta_json(step_dir, meta_json: dict) -> None:
    """Replaces a saved checkpoint's meta item with ``meta_json`` (Orbax's JSON handler
    keeps the item as this one file)."""
    import json

    (step_dir / "meta" / "metadata").write_text(json.dumps(meta_json))


def test_meta_of_todays_format_restores_and_writes_back_identically(tmp_path):
    from areal_jax.trainer import Progress

    params, opt = _params_and_opt()
    with TrainCheckpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(6, params, opt, CheckpointMeta(version=6))
    _write_meta_json(tmp_path / "ck" / "6", _TRAINER_META_JSON)
    with TrainCheckpointer(tmp_path / "ck", read_only=True) as ckpt:
        meta = ckpt.restore_meta()
        _, got_opt, meta2 = ckpt.restore(params_target=params, opt_state_target=opt)
    assert meta == meta2 and got_opt is not None
    assert (meta.step, meta.version, meta.consumed_tokens, meta.elapsed_s) == (12, 6, 9123, 81.5)
    assert meta.executor["gate"] == {"accepted": 48, "running": 2}
    assert meta.model_config["hidden_size"] == 16 and meta.run_config["seed"] == 1
    assert meta.rng == [0, 7] and meta.has_opt_state is True and meta.extra == {}
    assert meta.to_json() == _TRAINER_META_JSON  # written back: the same JSON
    assert list(meta.to_json()) == list(_TRAINER_META_JSON)  # in the same key order
    progress = Progress.from_meta(meta)
    assert (progress.start_version, progress.consumed_tokens, progress.last_saved_version,
            progress.elapsed_before) == (6, 9123, 6, 81.5)
    # The critic's meta and convert.py's were smaller dicts, and still are.
    assert CheckpointMeta(step=3, version=3, has_opt_state=True).to_json() == {
        "step": 3, "version": 3, "has_opt_state": True}
    assert CheckpointMeta(model_config={"a": 1}, source_hf_dir="/m", source_hub_id="o/m",
                          has_opt_state=False).to_json() == {
        "step": 0, "version": 0, "model_config": {"a": 1}, "source_hf_dir": "/m",
        "source_hub_id": "o/m", "has_opt_state": False}


def test_meta_missing_newer_keys_takes_defaults_and_keeps_unknown_ones(tmp_path):
    """An older checkpoint: no has_opt_state, consumed_tokens, elapsed_s, model_config or
    run_config; a key no reader knows any more (data_iter)."""
    from areal_jax.trainer import Progress

    params, opt = _params_and_opt()
    old = {"step": 4, "version": 2, "executor": {"accepted": 8},
           "data_iter": {"next_index": 16}}
    with TrainCheckpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(2, params, opt, CheckpointMeta(version=2))
    _write_meta_json(tmp_path / "ck" / "2", old)
    with TrainCheckpointer(tmp_path / "ck", read_only=True) as ckpt:
        # has_opt_state missing: the saved items say there is an optimizer state
        step, _, got_opt, meta, skipped = ckpt.restore_newest(params_target=params,
                                                              opt_state_target=opt)
    assert step == 2 and not skipped and got_opt is not None
    assert meta == CheckpointMeta(step=4, version=2, executor={"accepted": 8},
                                  extra={"data_iter": {"next_index": 16}})
    assert meta.has_opt_state is None and meta.model_config is None and meta.rng is None
    assert meta.to_json() == old  # nothing lost
    progress = Progress.from_meta(meta)
    assert (progress.start_version, progress.consumed_tokens, progress.elapsed_before) == (2, 0, 0)
    assert Progress.from_meta(None).last_saved_version == -1  # a fresh run


def test_meta_record_errors():
    with pytest.raises(CheckpointError, match=r"meta\['version'\] is '3'; expected int"):
        CheckpointMeta.from_json({"version": "3"})
    with pytest.raises(CheckpointError, match=r"meta\['step'\] is True; expected int"):
        CheckpointMeta.from_json({"step": True})
    with pytest.raises(CheckpointError, match="must be a JSON object, got list"):
        CheckpointMeta.from_json([1, 2])
    with pytest.raises(ValueError, match=r"extra keys \['version'\] are fields"):
        CheckpointMeta(extra={"version": 3})


_FULL_DISK_CHILD = textwrap.dedent("""
    import resource, signal, sys
    import numpy as np
    from areal_jax.checkpoint import CheckpointMeta, CheckpointWriteError
    from areal_jax.checkpoint.orbax_ckpt import TrainCheckpointer

    ckpt = TrainCheckpointer(sys.argv[1], keep=3)
    small = {"w": np.ones((4,), np.float32)}
    ckpt.save(1, small, None, CheckpointMeta(version=1))
    ckpt.wait()
    # The disk fills up: no file may grow past 64 KiB (EFBIG, not a signal), so the 1 MiB
    # array of step 2 fails in Orbax's background write threads.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    big = {"w": np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)}
    try:
        ckpt.save(2, big, None, CheckpointMeta(version=2))
        ckpt.wait()
    except CheckpointWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    print("saved", file=sys.stderr)
""")


def test_a_save_that_cannot_be_written_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A full disk under checkpoint.dir (issue 50 item 10: 468 log lines and five Orbax
    tracebacks from its background write threads): the failure is raised once, by the next
    save or wait, as one line naming the directory and the newest complete checkpoint."""
    ckpt_dir = tmp_path / "ckpt"
    res = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(ckpt_dir)],
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 3, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith(f"error: checkpoint directory {ckpt_dir}: a checkpoint could "
                               "not be written ("), lines
    assert lines[0].endswith("the newest complete checkpoint is step 1"), lines
    with TrainCheckpointer(ckpt_dir, read_only=True) as ckpt:
        assert ckpt.all_steps() == [1]
        np.testing.assert_array_equal(np.asarray(ckpt.restore()[0]["w"]), np.ones(4))
