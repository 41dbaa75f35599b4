"""The training loop end to end: a real embedded server, real weights, real checkpoints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from areal_jax.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "scripts" / "train.py"),
         "--config", str(REPO / "configs" / "tiny_demo.yaml")]

# A tiny, fast run of the demo config: 4 prompts x 4 samples per version.
SMALL = [
    "train.batch_size=4", "rollout.n_samples=4", "rollout.max_new_tokens=40",
    "rollout.max_slots=16", "train.rows_per_micro_batch=8", "data.max_eval_prompts=16",
    "eval.every_versions=0", "eval.at_start=false", "progress_bar=false",
    "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user would have
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(TRAIN + SMALL + args, capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=REPO)


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = run_dir / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _external_server(tmp_path: Path, run_dir: Path, dtype: str = "float32"):
    """A server of the demo's model for a run to use (rollout.servers): it outlives the
    run, so a test can ask it what it serves afterwards."""
    from areal_jax.engine.launch import launch_server
    from areal_jax.run_inputs import resolve_model_path

    (run_dir / "weights").mkdir(parents=True)
    return launch_server(resolve_model_path("builtin:arith_sft", None), max_slots=16,
                         max_seq_len=96, dtype=dtype, log_path=tmp_path / "server.log",
                         allowed_weight_dirs=[run_dir / "weights"])


FIXED_PROMPT = [1, 7, 12, 9, 15]  # token ids of the demo's 32-token vocabulary


def _greedy(url: str, prompt: list[int] = FIXED_PROMPT, new_tokens: int = 16):
    """The server's greedy completion of ``prompt``: (token ids, their logprobs, the weight
    version it reports)."""
    import httpx
    import numpy as np

    r = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                            "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return ([e[1] for e in meta["output_token_logprobs"]],
            np.array([e[0] for e in meta["output_token_logprobs"]]), meta["weight_version"])


def _checkpointed_weights(run_dir: Path, version: int, out_dir: Path, dtype: str) -> Path:
    """The learner's params at ``version`` (its Orbax checkpoint), written as the servers'
    weights are: an HF dir of ``dtype`` tensors."""
    from areal_jax.checkpoint import TrainCheckpointer
    from areal_jax.checkpoint.publish import params_to_hf_dir

    ckpt = TrainCheckpointer(str(run_dir / "checkpoints"), read_only=True)
    params, _, meta = ckpt.restore(version, params_only=True)
    ckpt.close()
    assert meta.version == version
    return params_to_hf_dir(params, meta.model_config, out_dir, dtype=dtype)


def _assert_published_tensors_are_the_learners(run_dir: Path, version: int, want_dir: Path):
    """weights/v{version}, tensor for tensor, is the learner's checkpointed params."""
    import numpy as np
    from safetensors.numpy import load_file

    served, want = (load_file(str(d / "model.safetensors"))
                    for d in (run_dir / "weights" / f"v{version}", want_dir))
    assert served.keys() == want.keys()
    for name, value in want.items():
        assert served[name].dtype == value.dtype, name
        np.testing.assert_array_equal(served[name], value, err_msg=f"v{version} {name}")


def _reference_logprobs(model_dir: Path, prompt: list[int], ids: list[int]):
    """transformers' logprobs of ``ids`` after ``prompt`` (fp32, temperature 1)."""
    import torch

    from tests.hf_fixtures import _load_reference

    model = _load_reference(str(model_dir))
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].double(), -1)
    return logp[len(prompt) - 1:-1].gather(-1, seq[0, len(prompt):, None])[:, 0].numpy()


# ----------------------------------------------------------------------------- early errors
def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="train.bsz"):
        load_config(REPO / "configs" / "tiny_demo.yaml", ["train.bsz=3"])
    with pytest.raises(ConfigError, match="mode"):
        load_config(REPO / "configs" / "tiny_demo.yaml", ["mode=fast"])
    with pytest.raises(ConfigError, match="rollout.temperature"):
        load_config(REPO / "configs" / "tiny_demo.yaml", ["rollout.temperature=hot"])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(REPO / "configs" / "tiny_demo.yaml", ["rollout.max_new_tokens=500"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(REPO / "configs" / "nope.yaml")


def test_an_input_error_becomes_one_line_naming_its_key():
    """run_inputs.input_error, which every wrapper of build_trainer's inputs uses: the key
    (or what is given) before the cause, named once; an OSError without its errno."""
    from areal_jax.run_inputs import TrainerError, input_error

    def message(key: str, error: Exception, **kw) -> str:
        with pytest.raises(TrainerError) as e, input_error(key, type(error), **kw):
            raise error
        return str(e.value)

    assert message("data.train", ValueError("x.jsonl:3: invalid JSON line")) == (
        "data.train: x.jsonl:3: invalid JSON line")
    assert message("reward.fn", ImportError("no module 'x'"), what="reward.fn 'x:f'") == (
        "reward.fn 'x:f': no module 'x'")
    assert message("mesh", ValueError("mesh data=3 needs 3 devices, found 1")) == (
        "mesh data=3 needs 3 devices, found 1")  # the cause names the key already
    assert message("run_dir", OSError(20, "Not a directory", "/x/run"),
                   what="run_dir /x/run is not writable") == (
        "run_dir /x/run is not writable: Not a directory")
    assert message("checkpoint.publish_dir", OSError(13, "Permission denied", "/p")) == (
        "checkpoint.publish_dir: Permission denied: /p")
    assert message("checkpoint.dir", RuntimeError("no checkpoint in /c can be restored"),
                   what="", hint="start the run in another run_dir") == (
        "no checkpoint in /c can be restored; start the run in another run_dir")
    with pytest.raises(KeyError), input_error("data.train", ValueError):
        raise KeyError("other errors pass through")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.batch_size=0", "train.batch_size must be > 0"),
        ("algo.name=ppo2", "algo.name"),
        ("model.path=/does/not/exist", "/does/not/exist does not exist"),
        ("data.train=/no/such/prompts.jsonl", "/no/such/prompts.jsonl does not exist"),
        ("rollout.servers=[http://127.0.0.1:9]", "unreachable"),
        ("train.seq_len=50", "train.seq_len (50) is shorter than the longest prompt"),
        ("reward.fn=no_such_module_xyz:fn", "reward.fn 'no_such_module_xyz:fn'"),
        ("rollout.learner_cpu_cores=[4096]", "rollout.learner_cpu_cores: cannot pin to CPU"),
        # issue 33 item 7: the server's failure named its flag --cpu-affinity instead
        ("rollout.server_cpu_cores=[4096]", "rollout.server_cpu_cores: cannot pin to CPU"),
    ],
)
def test_cli_fails_early_with_a_clear_message(tmp_path, override, message):
    t0 = time.monotonic()
    res = _run([f"run_dir={tmp_path / 'run'}", override], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    # Nothing long started: no weights were published, no checkpoint written.
    assert not (tmp_path / "run" / "weights").exists()
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("correction, key", [("icepop", "algo.behav_correction_high"),
                                             ("tis", "algo.behav_correction_cap")])
def test_infinite_correction_bound_fails_at_load(tmp_path, correction, key):
    """issue 39 item 10: an infinite bound passed the config check, started the servers and
    crashed at the first step with a traceback (exit 1)."""
    res = _run([f"run_dir={tmp_path / 'run'}", f"algo.behav_correction={correction}",
                "algo.behav_imp_weight_cap=null", f"{key}=.inf"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"{key} must be a finite number" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # found before anything was started or written


def test_eval_rows_without_the_keys_name_data_eval_and_the_option(tmp_path):
    """issue 39 item 14: a missing column in data.eval named neither data.eval nor the key's
    option (data.train's did), and was found only after the servers had started."""
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"question": "1+1", "solution": "2"}\n')
    res = _run([f"run_dir={tmp_path / 'run'}", f"data.eval={eval_file}"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert (f"data.eval {eval_file}: row 0 has no 'answer' key (data.answer_key); keys: "
            "['question', 'solution']") in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "weights").exists()  # before anything started


@pytest.mark.parametrize("row, words", [
    ('{"question": null, "answer": "2"}', "'question' (data.prompt_key) is null (None); "
                                             "expected a string or a list of chat messages"),
    ('{"question": 12345, "answer": "2"}', "'question' (data.prompt_key) is int (12345)"),
    ('{"question": [{"content": "1+1"}], "answer": "2"}',
     "'question' (data.prompt_key) message 0 has role None; expected one of system"),
])
def test_a_prompt_that_is_not_text_names_its_row_and_key(tmp_path, row, words):
    """issue 50 item 10: a null or numeric prompt was a TypeError traceback; a chat message
    without a role an unclear line."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' + row + "\n")
    res = _run([f"run_dir={tmp_path / 'run'}", f"data.train={data}"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"data.train {data}: row 1: {words}" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "weights").exists()  # before anything started


def test_model_config_json_that_is_not_an_object_names_the_file(tmp_path):
    """issue 39 item 13: a config.json holding a JSON list failed as
    "tokenizer ...: 'list' object has no attribute 'get'"."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(REPO / "areal_jax" / "data" / "assets" / "arith_sft", model)
    (model / "config.json").write_text("[1, 2]")
    res = _run([f"run_dir={tmp_path / 'run'}", f"model.path={model}"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert (f"{model / 'config.json'} holds a JSON list; expected a JSON object"
            in res.stderr), res.stderr[-2000:]
    assert "has no attribute" not in res.stderr and "Traceback" not in res.stderr


def test_unwritable_run_dir_fails_early(tmp_path):
    (tmp_path / "a_file").write_text("")
    res = _run([f"run_dir={tmp_path / 'a_file' / 'run'}"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "run_dir" in res.stderr and "is not writable" in res.stderr
    assert "Traceback" not in res.stderr


def test_no_resume_refuses_existing_checkpoints(tmp_path):
    from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer

    ckpt = TrainCheckpointer(str(tmp_path / "run" / "checkpoints"), async_save=False)
    ckpt.save(1, {"w": __import__("numpy").zeros(2)}, None, CheckpointMeta(step=1, version=1))
    ckpt.close()
    res = _run([f"run_dir={tmp_path / 'run'}", "--no-resume"], timeout=120)
    assert res.returncode == 2
    assert "already holds checkpoints" in res.stderr
    res = _run([f"run_dir={tmp_path / 'empty'}", "--resume"], timeout=120)
    assert res.returncode == 2
    assert "holds no checkpoint" in res.stderr


# ----------------------------------------------------------------------------- end to end
def test_async_training_end_to_end(tmp_path):
    """Four versions with background publishing (the default) against a rollout server
    that outlives the run, so that what it serves at the end can be checked: the weights
    of each checkpointed version are, tensor for tensor, the learner's, and the server's
    greedy logprobs at version 4 are transformers' on the learner's version-4 params."""
    from tests.hf_fixtures import token_logprob_tolerance

    run_dir = tmp_path / "run"
    server = _external_server(tmp_path, run_dir)
    # eta = 1: batches 1-2 may come from prompts submitted under v0, batch 3 onwards
    # must have been (at least partly) generated under published weights v >= 1.
    try:
        res = _run([f"run_dir={run_dir}", "train.total_versions=4",
                    "checkpoint.every_versions=2", "rollout.max_staleness=1",
                    "eval.at_end=true", f"rollout.servers=[{server.url}]"])
        assert res.returncode == 0, res.stderr[-4000:]
        ids, served_logp, served_version = _greedy(server.url)
    finally:
        server.terminate()
    assert served_version == "4"
    want = {v: _checkpointed_weights(run_dir, v, tmp_path / f"want{v}", "float32")
            for v in (2, 4)}
    for v, want_dir in want.items():
        _assert_published_tensors_are_the_learners(run_dir, v, want_dir)
    ref_logp = _reference_logprobs(want[4], FIXED_PROMPT, ids)
    tol = token_logprob_tolerance(want[4], FIXED_PROMPT + ids, temperature=0)
    np.testing.assert_allclose(served_logp, ref_logp, rtol=0, atol=tol)
    # The check can tell versions apart: version 2's weights give other logprobs.
    assert np.abs(_reference_logprobs(want[2], FIXED_PROMPT, ids) - ref_logp).max() > tol
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    # Rewards are recorded and are real verifier rewards in [0, 1].
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert all(r["n_trajectories"] == 16 for r in rows)
    assert "eval_accuracy" in rows[-1]
    # Weights were published for every version, and rollouts picked them up: a later batch
    # holds tokens generated under a version > 0.
    weights = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("v"))
    assert "v4" in weights
    assert rows[2]["token_version_max"] >= 1 and rows[3]["token_version_max"] >= 1
    assert max(r["staleness_max"] for r in rows) <= 1  # eta: the bound holds at training time
    # Checkpoints every 2 versions (2 and 4).
    ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == [2, 4]
    assert (run_dir / "config.yaml").exists()
    assert any((run_dir / "tensorboard").iterdir())
    # The learner trained: the loss is finite and gradients flowed.
    assert all(r["train/grad_norm"] > 0 for r in rows)
    # issue 39 items 1-2: the console says where the run is, ends with a summary whose next
    # commands name this run's real paths, and a healthy run prints no warning.
    out = res.stdout.splitlines()
    assert out[0] == f"run directory: {run_dir} (metrics.jsonl, weights/, checkpoints/, logs/)"
    done = next(i for i, line in enumerate(out) if line.startswith("done: version 4 in "))
    assert out[done].endswith(f"; run directory {run_dir}")
    assert out[done + 1] == f"  eval accuracy {rows[-1]['eval_accuracy']:.3f} (version 4)"
    assert out[done + 2] == f"  reward {rows[-1]['reward_mean']:.3f} (version 4)"
    assert out[done + 3:] == [
        "next:", f"  python scripts/plot.py {run_dir}",
        f"  python scripts/eval.py --model {run_dir}/weights/v4 --data builtin:eval -n 4",
        f"  python scripts/serve.py --model-path {run_dir}/weights/v4 --port 30000"]
    assert (run_dir / "weights" / "v4" / "config.json").exists()
    warnings = [line for line in res.stderr.splitlines() if "WARNING" in line]
    assert not warnings, warnings


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", "train.total_versions=5", "checkpoint.every_versions=1"]
    proc = subprocess.Popen(TRAIN + SMALL + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=_env(), cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = [r["version"] for r in _rows(run_dir)]
        if done and max(done) >= 3:
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    from areal_jax.checkpoint import TrainCheckpointer

    ck = TrainCheckpointer(str(run_dir / "checkpoints"), read_only=True)
    saved = ck.latest_step()
    ck.close()
    assert saved is not None and saved >= 2

    res = _run(args + ["--resume"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stdout + res.stderr
    rows = _rows(run_dir)
    after = [r for r in rows if r["version"] > saved]
    # Step and version continue from the checkpoint: the resumed run starts at saved + 1.
    resumed = after[-(5 - saved):]
    assert [r["version"] for r in resumed] == list(range(saved + 1, 6))
    # Prompt accounting: the last record of each version counts (versions after the
    # checkpoint are redone by the resumed run). No prompt trains two versions.
    consumed: dict[int, list[str]] = {}
    for r in _rows(run_dir, "consumed_prompts.jsonl"):
        consumed[r["version"]] = r["prompt_ids"]
    assert sorted(consumed) == [1, 2, 3, 4, 5]
    ids = [i for v in sorted(consumed) for i in consumed[v]]
    assert len(ids) == 5 * 4
    assert len(set(ids)) == len(ids)


@pytest.mark.slow
def test_external_server_with_another_model_fails_with_a_clear_error(tmp_path):
    """An external server that serves a different model refuses the run's weights at
    start-up: a one-line error naming the mismatch, before any training."""
    from areal_jax.engine.launch import launch_server
    from tests.hf_fixtures import make_tiny_hf_checkpoint

    other = make_tiny_hf_checkpoint(tmp_path, vocab_size=32, hidden_size=48, seed=3)
    server = launch_server(other, max_slots=16, max_seq_len=96, log_path=tmp_path / "server.log",
                           allowed_weight_dirs=[tmp_path])
    try:
        run_dir = tmp_path / "run"
        res = _run([f"run_dir={run_dir}", "train.total_versions=3",
                    f"rollout.servers=[{server.url}]"])
    finally:
        server.terminate()
    assert res.returncode != 0
    assert "rollout.servers cannot load this run's weights v0" in res.stderr, res.stderr[-3000:]
    assert "hidden_size=128 but the server runs hidden_size=48" in res.stderr
    assert "Traceback" not in res.stderr
    assert _rows(run_dir) == []


def test_inline_publish_serves_the_learners_own_bf16_weights(tmp_path):
    """checkpoint.publish_mode=inline with model.dtype=bfloat16: the learner writes each
    version from its own arrays (no host copy) and the server loads it. The published v2
    is, tensor for tensor, the bf16 cast of the checkpointed v2 params; and the server, at
    the end of the run, serves exactly those tensors: its greedy tokens and logprobs are
    the ones it gives after loading weights/v2 itself again (the same program on the same
    tensors), and not the ones of v1."""
    import httpx

    run_dir = tmp_path / "run"
    server = _external_server(tmp_path, run_dir, dtype="bfloat16")

    def load(version: int) -> None:
        r = httpx.post(f"{server.url}/update_weights_from_disk", timeout=120, json={
            "model_path": str(run_dir / "weights" / f"v{version}"),
            "weight_version": f"reloaded-v{version}"})
        assert r.status_code == 200 and r.json()["success"], r.text

    try:
        res = _run([f"run_dir={run_dir}", "train.total_versions=2",
                    "checkpoint.every_versions=2", "checkpoint.publish_mode=inline",
                    "model.dtype=bfloat16", f"rollout.servers=[{server.url}]"])
        assert res.returncode == 0, res.stderr[-4000:]
        served = _greedy(server.url)
        load(2)
        from_file = _greedy(server.url)
        load(1)
        from_v1 = _greedy(server.url)
    finally:
        server.terminate()
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    assert all(r["publish_write_s"] > 0 for r in rows[1:])
    assert served[2] == "2" and from_file[2] == "reloaded-v2"
    assert served[0] == from_file[0]
    np.testing.assert_array_equal(served[1], from_file[1])
    assert served[0] != from_v1[0] or not np.array_equal(served[1], from_v1[1])
    want_dir = _checkpointed_weights(run_dir, 2, tmp_path / "want", "bfloat16")
    _assert_published_tensors_are_the_learners(run_dir, 2, want_dir)
    from safetensors.numpy import load_file

    assert all(str(t.dtype) == "bfloat16"
               for t in load_file(str(run_dir / "weights" / "v2" / "model.safetensors")).values())


def test_publish_mode_is_checked():
    with pytest.raises(ConfigError, match="checkpoint.publish_mode"):
        load_config(REPO / "configs" / "tiny_demo.yaml", ["checkpoint.publish_mode=later"])


def test_publish_is_checked():
    demo = REPO / "configs" / "tiny_demo.yaml"
    assert load_config(demo).publish_path == "memory"  # auto: the run's own embedded servers
    assert load_config(demo, ["checkpoint.publish=disk"]).publish_path == "disk"
    assert load_config(demo, ["rollout.servers=[http://127.0.0.1:1]"]).publish_path == "disk"
    with pytest.raises(ConfigError, match="checkpoint.publish"):
        load_config(demo, ["checkpoint.publish=later"])
    with pytest.raises(ConfigError, match="checkpoint.publish: memory streams weights to the "
                                          "embedded servers"):
        load_config(demo, ["checkpoint.publish=memory", "rollout.servers=[http://127.0.0.1:1]"])


def test_memory_publish_reaches_the_embedded_servers_without_files(tmp_path):
    """checkpoint.publish: auto with embedded servers streams each version from the
    learner's memory: no weights/v1..v2 files; rollouts pick the versions up (tokens
    generated under v >= 1), each bump's transfer and pause are recorded, and the last
    version is written at the end, tensor for tensor the learner's."""
    run_dir = tmp_path / "run"
    res = _run([f"run_dir={run_dir}", "train.total_versions=3", "rollout.max_staleness=1",
                "checkpoint.every_versions=3"])
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["publish_write_s"] > 0 and r["publish_update_s"] > 0 for r in rows[1:])
    assert rows[2]["token_version_max"] >= 1
    assert max(r["staleness_max"] for r in rows) <= 1
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v0", "v3"]
    want = _checkpointed_weights(run_dir, 3, tmp_path / "want", "float32")
    _assert_published_tensors_are_the_learners(run_dir, 3, want)
    # The shared-memory files the sender kept between bumps went with the run.
    left = []
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        m = re.match(r"areal-weights-(?:kept|spare)-(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            left.append(name)
    assert left == []


def test_ppo_trains_policy_and_critic_on_gae_advantages(tmp_path):
    """algo.name=ppo end to end: each version's advantages come from the critic's values by
    GAE on the packed rows, and both the policy and the critic take their steps on them."""
    run_dir = tmp_path / "run"
    res = _run([f"run_dir={run_dir}", "train.total_versions=2", "mode=sync", "algo.name=ppo",
                "algo.gamma=0.99", "algo.lam=0.95", "algo.ppo_n_minibatches=2"])
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/n_minibatches"] == r["train/critic_n_minibatches"] == 2
        assert r["train/critic_n_loss_tokens"] == r["train/n_loss_tokens"] > 0
        assert r["train/skipped_steps"] == r["train/critic_skipped_steps"] == 0
        assert r["train/grad_norm"] > 0 and r["train/critic_grad_norm"] > 0
        assert np.isfinite(r["train/loss"]) and r["train/critic_value_loss"] > 0
    # The critic learns from its own start at 0: its values move off zero.
    assert rows[0]["train/critic_value_mean"] != rows[1]["train/critic_value_mean"]


def test_sync_mode_stays_on_policy_with_background_publishing(tmp_path):
    """mode=sync: every batch is generated entirely under the weights of its version,
    although the servers' weight update runs in the background of the learner."""
    run_dir = tmp_path / "run"
    res = _run([f"run_dir={run_dir}", "train.total_versions=4", "mode=sync"])
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # batch for version v was generated under weights v - 1, no older
        assert r["token_version_max"] == r["version"] - 1, r
        assert r["staleness_max"] == 0 and r["start_staleness_max"] == 0, r
    assert all(r["publish_update_s"] > 0 for r in rows[1:])  # the previous update was waited for


# ----------------------------------------------------------------------------- configs
@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_validate_as_shipped(path):
    """Every shipped config loads and validates unchanged, and holds no placeholder that
    would fail late (a bucket name to fill in)."""
    cfg = load_config(path)
    text = path.read_text()
    assert "YOUR_" not in text and "<your" not in text.split("#")[0]
    for line in text.splitlines():
        value = line.split("#", 1)[0]
        assert "<" not in value and "YOUR" not in value, f"placeholder in {path.name}: {line}"
    assert cfg.checkpoint.dir is None or "://" not in cfg.checkpoint.dir, \
        "a shipped config must not need cloud credentials to run"
    assert cfg.train.seq_len > cfg.rollout.max_new_tokens


@pytest.mark.parametrize("override, key", [
    ("rollout.temperature=.nan", "rollout.temperature"),
    ("optim.lr=.nan", "optim.lr"),
    ("optim.eps=0", "optim.eps"),
    ("optim.b2=1.0", "optim.b2"),
    ("algo.eps_clip_higher=-0.1", "algo.eps_clip_higher"),
    ("rollout.top_k=0", "rollout.top_k"),
    ("train.seq_len=40", "train.seq_len"),
    ("algo.gamma=1.5", "algo.gamma"),
    ("watchdog.shutdown_timeout_s=0", "watchdog.shutdown_timeout_s"),
    ("reward.max_abs=-1", "reward.max_abs"),
    # issue 50: accepted, then an OverflowError at every request, ~1,300 warnings, no
    # shutdown deadline, a seed error blaming data.train, an infinite learning rate
    ("rollout.request_timeout_s=.inf", "rollout.request_timeout_s must be a finite number"),
    ("rollout.request_timeout_s=0.001", "rollout.request_timeout_s must be >= 1"),
    ("watchdog.shutdown_timeout_s=.inf", "watchdog.shutdown_timeout_s must be a finite"),
    ("seed=4294967296", "seed must be in [0, 2**32 - 1]"),
    ("seed=-1", "seed must be in [0, 2**32 - 1]"),
    ("optim.lr=.inf", "optim.lr must be a finite number"),
    ("train.row_lengths=[1]", "train.row_lengths must be a list of ints in [2,"),
    ("rollout.n_samples=1", "algo.dynamic_filter needs rollout.n_samples >= 2"),
])
def test_config_errors_name_the_users_key(override, key):
    """Values that used to pass the config and fail inside the learner under its own names
    (ppo.temperature, optimizer.lr) now fail at load time, naming the run config's key."""
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "tiny_demo.yaml",
                    [override, "optim.schedule=cosine",
                     *(["algo.dynamic_filter=true"] if "n_samples" in override else [])])
    assert key in str(info.value)
    assert "ppo." not in str(info.value) and "optimizer." not in str(info.value)


def test_null_for_a_list_that_defaults_to_empty_is_empty():
    """rollout.servers=null means no external servers (was 'expected a list, got None')."""
    cfg = load_config(REPO / "configs" / "tiny_demo.yaml", ["rollout.servers=null"])
    assert cfg.rollout.servers == []
    with pytest.raises(ConfigError, match="rollout.servers: expected a list, got 3"):
        load_config(REPO / "configs" / "tiny_demo.yaml", ["rollout.servers=3"])


def test_cosine_warmup_longer_than_the_run_names_the_users_keys():
    with pytest.raises(ConfigError, match=r"optim.warmup_steps \(50\).*train.total_versions"):
        load_config(REPO / "configs" / "tiny_demo.yaml",
                    ["optim.schedule=cosine", "optim.warmup_steps=50", "train.total_versions=10"])


def test_the_learner_takes_the_run_configs_sections_as_they_are():
    """One class per section: the run config's optim and algo are the learner's configs
    (so its errors name the user's keys); the trainer only adds what other sections hold."""
    from areal_jax.learner import AlgoConfig, OptimConfig
    from areal_jax.run import learner_configs

    cfg = load_config(REPO / "configs" / "tiny_demo.yaml",
                      ["optim.schedule=cosine", "train.total_versions=7",
                       "algo.ppo_n_minibatches=3", "algo.agg_mode=seq-mean-token-sum",
                       "rollout.temperature=0.5"])
    assert type(cfg.optim) is OptimConfig and type(cfg.algo) is AlgoConfig
    optim, algo, kwargs = learner_configs(cfg)
    assert algo is cfg.algo and optim.total_steps == 21  # 7 versions x 3 minibatches
    assert kwargs == {"temperature": 0.5, "logp_chunk_size": cfg.train.logp_chunk_size,
                      "seq_token_sum_normalizer": float(cfg.rollout.max_new_tokens)}
    explicit = load_config(REPO / "configs" / "tiny_demo.yaml",
                           ["optim.schedule=cosine", "optim.total_steps=50"])
    assert learner_configs(explicit)[0].total_steps == 50
    with pytest.raises(ValueError, match="algo.c_clip must be > 1"):
        AlgoConfig(c_clip=0.5)
