"""On-policy distillation: the per-token advantages from known logprobs, the teacher-scored
workflow against a real embedded server, and a run with a teacher section end to end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from areal_jax.config import load_config
from areal_jax.data.advantages import distill_advantages_for, distill_metrics
from areal_jax.trajectory import Trajectory

REPO = Path(__file__).resolve().parent.parent


def traj(behav, teacher, reward=0.0, n_prompt=2):
    n = len(behav)
    return Trajectory(input_ids=np.arange(n_prompt + n), loss_mask=[0] * n_prompt + [1] * n,
                      behav_logp=[0.0] * n_prompt + behav, versions=[-1] * n_prompt + [0] * n,
                      reward=reward, teacher_logp=[0.0] * n_prompt + teacher)


def cfg_with(**teacher):
    overrides = [f"teacher.{k}={v}" for k, v in {"url": "127.0.0.1:1", **teacher}.items()]
    return load_config(REPO / "configs" / "tiny_demo.yaml", overrides)


def test_advantages_are_the_negative_reverse_kl_per_token():
    group = [traj([-0.5, -2.0], [-0.1, -3.0], reward=1.0), traj([-1.0], [-1.0], reward=0.0)]
    adv = distill_advantages_for(cfg_with(kl_coef=2.0), [group])
    np.testing.assert_array_equal(adv[0], np.float32([0, 0, 2 * 0.4, 2 * -1.0]))
    np.testing.assert_array_equal(adv[1], np.float32([0, 0, 0]))
    metrics = distill_metrics(group)
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.4 + 1.0 + 0.0) / 3)
    assert metrics["distill/teacher_logp_mean"] == pytest.approx((-0.1 - 3.0 - 1.0) / 3)


def test_reward_weight_adds_the_group_advantage():
    group = [traj([-1.0, -1.0], [-1.0, -1.0], reward=1.0),
             traj([-1.0, -1.0], [-1.0, -1.0], reward=0.0)]
    adv = distill_advantages_for(cfg_with(reward_weight=0.5), [group])
    # GRPO: (r - mean) / (unbiased std + eps) = +-0.7071; the KL term is 0 here
    g = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-5)
    np.testing.assert_allclose(adv[0], [0, 0, 0.5 * g, 0.5 * g], rtol=1e-6)
    np.testing.assert_allclose(adv[1], [0, 0, -0.5 * g, -0.5 * g], rtol=1e-6)


def test_trajectory_keeps_teacher_logp_through_its_dict_form():
    t = traj([-0.5], [-0.25])
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    np.testing.assert_array_equal(back.teacher_logp, t.teacher_logp)
    assert Trajectory.from_dict(json.loads(json.dumps(
        traj([-0.5], [-0.25]).to_dict() | {"teacher_logp": None}))).teacher_logp is None
    with pytest.raises(ValueError, match="teacher_logp has shape"):
        Trajectory(input_ids=[1, 2], loss_mask=[0, 1], behav_logp=[0, -1], versions=[-1, 0],
                   reward=0.0, teacher_logp=[0.0])


@pytest.mark.parametrize(("override", "message"), [
    ("teacher={}", "teacher needs exactly one of url"),
    ("teacher={url: a, model_path: b}", "teacher needs exactly one of url"),
    ("teacher={url: a, kl_coef: 0}", "teacher.kl_coef must be > 0"),
    ("teacher={url: a, reward_weight: -1}", "teacher.reward_weight must be >= 0"),
    ("teacher={url: a, platform: mps}", "teacher.platform must be one of"),
])
def test_teacher_section_errors_name_the_key(override, message):
    from areal_jax.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "tiny_demo.yaml", [override])


@pytest.fixture(scope="module")
def arith_server(tmp_path_factory):
    from areal_jax.run_inputs import ASSETS_DIR
    from tests.server_fixtures import start_server

    with start_server(ASSETS_DIR / "arith_sft", tmp_path_factory, max_slots=16,
                      max_seq_len=97) as handle:
        yield handle


def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl(arith_server):
    """The student samples at temperature 1 from the server, and the same server, as the
    teacher, scores those samples: teacher_logp equals behav_logp on every completion token
    (the sampler's and the scorer's fp32 logprobs of one model), so every advantage is ~0."""
    from areal_jax.rewards.teacher import TeacherScorer, TeacherSettings
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.distill import TeacherScoredWorkflow
    from areal_jax.rollout.workflows import RLVRWorkflow, WorkflowContext
    from areal_jax.run_inputs import ASSETS_DIR
    from areal_jax.sampling_params import SamplingParams
    from areal_jax.tokenizer import load_tokenizer
    from tests.hf_fixtures import token_logprob_tolerance

    tok = load_tokenizer(ASSETS_DIR / "arith_sft")
    inner = RLVRWorkflow("builtin", n_samples=2, tokenizer=tok,
                         gconfig=SamplingParams(max_new_tokens=12, temperature=1.0))
    workflow = TeacherScoredWorkflow(inner, TeacherScorer(TeacherSettings(url=arith_server.url)))
    counts: Counter = Counter()

    async def go():
        async with RolloutClient([arith_server.url]) as client:
            ctx = WorkflowContext(start_version=0, seed=11, group_id="g0", tokenizer=tok,
                                  _count=lambda name, n: counts.update({name: n}))
            return await workflow.arun(client, {"prompt_id": "p", "prompt": "Q:17+5-8=",
                                                "answer": "14"}, ctx)

    try:
        group = asyncio.run(go())
    finally:
        workflow.close()
    assert counts["teacher_scored_groups"] == 1 and len(group) == 2
    cfg = cfg_with()
    for t, adv in zip(group, distill_advantages_for(cfg, [group]), strict=True):
        assert t.teacher_logp is not None
        assert np.all(t.teacher_logp[t.loss_mask == 0] == 0)
        tol = token_logprob_tolerance(ASSETS_DIR / "arith_sft", t.input_ids.tolist())
        np.testing.assert_allclose(t.teacher_logp, t.behav_logp, rtol=0, atol=2 * tol)
        np.testing.assert_allclose(adv, 0.0, rtol=0, atol=2 * tol)


def test_a_failing_teacher_rejects_the_group_and_the_cause_is_noted(arith_server):
    from areal_jax.rewards.teacher import TeacherScorer, TeacherSettings
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.distill import TeacherScoredWorkflow
    from areal_jax.rollout.workflows import RLVRWorkflow, WorkflowContext
    from areal_jax.run_inputs import ASSETS_DIR
    from areal_jax.sampling_params import SamplingParams
    from areal_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(ASSETS_DIR / "arith_sft")
    inner = RLVRWorkflow("builtin", n_samples=2, tokenizer=tok,
                         gconfig=SamplingParams(max_new_tokens=8, temperature=1.0))
    # nothing listens on port 9 of 127.0.0.1: connection refused, then retried
    teacher = TeacherScorer(TeacherSettings(url="127.0.0.1:9", retries=1, backoff_s=0.01))
    workflow = TeacherScoredWorkflow(inner, teacher)
    counts: Counter = Counter()
    notes: list[str] = []

    async def go():
        async with RolloutClient([arith_server.url]) as client:
            ctx = WorkflowContext(start_version=0, seed=1, group_id="g1", tokenizer=tok,
                                  _count=lambda name, n: counts.update({name: n}),
                                  _note=notes.append)
            return await workflow.arun(client, {"prompt_id": "p", "prompt": "Q:3+4=",
                                                "answer": "7"}, ctx)

    try:
        assert asyncio.run(go()) is None
    finally:
        workflow.close()
    assert counts["teacher_failed_groups"] == 1 and teacher.metrics()["requests"] == 2
    assert "failed after 2 tries" in notes[-1]


@pytest.mark.slow
def test_a_run_with_an_embedded_teacher(tmp_path):
    """train.py with a teacher section: the run serves the teacher itself (logs/teacher.log),
    every version's row has distill/* and the teacher scored the groups it trained on."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "--config",
           str(REPO / "configs" / "tiny_demo_distill.yaml"), f"run_dir={run_dir}",
           "teacher.model_path=builtin:arith_sft", "teacher.cpu_cores=null",
           "train.total_versions=2", "train.batch_size=4", "rollout.n_samples=4",
           "rollout.max_new_tokens=40", "rollout.max_slots=16", "eval.every_versions=0",
           "eval.at_start=false", "progress_bar=false", "rollout.server_cpu_cores=null",
           "rollout.learner_cpu_cores=null", "checkpoint.every_versions=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "distill/reverse_kl" in r]
    assert len(trained) == 2
    # the teacher is the student's own checkpoint: the reverse KL starts at ~0
    assert abs(trained[0]["distill/reverse_kl"]) < 1e-3
    assert trained[-1]["rollout/teacher_scored_groups"] >= 8
    assert (run_dir / "logs" / "teacher.log").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward.fn=judge", "reward.judge={url: '127.0.0.1:1'}"],
     "reward.fn: judge needs reward.eval_fn"),
    (["teacher={model_path: /nonexistent/teacher}"],
     "teacher.model_path /nonexistent/teacher does not exist"),
])
def test_bad_judge_and_teacher_inputs_fail_early_naming_the_key(tmp_path, overrides, message):
    """One line naming the key, exit status 2, before anything is served or trained."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env.pop("AREAL_TEST_UNSET_KEY", None)
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "--config",
           str(REPO / "configs" / "tiny_demo.yaml"), f"run_dir={tmp_path / 'run'}",
           "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "weights").exists()
