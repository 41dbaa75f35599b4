"""A run's model servers besides its rollout servers: the judge of ``reward.fn: judge``, the
reward model of ``reward.fn: reward_model`` and the distillation ``teacher``, and what the
run builds on them.

Each is an external server (``url``: SGLang, vLLM, a hosted API) or an embedded server of a
checkpoint (``model_path``) that the run starts next to its rollout servers, logs to
``logs/<name>.log``, waits for and stops at the end. The judge or the reward model becomes
the training reward (``rewards/judge.py``, ``rewards/reward_model.py``); the teacher wraps
the training workflow (``rollout/distill.py``) and its logprobs become the advantages
(``data.advantages.distill_advantages_for``). ``run.py`` calls :meth:`ModelServers.start`,
:meth:`ModelServers.wait`, :meth:`ModelServers.reward`, :meth:`ModelServers.wrap` and
:func:`advantages_fn`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from areal_jax.config import JudgeSection, ModelServerSection, RewardModelSection, TrainConfig
from areal_jax.data.advantages import distill_advantages_for, group_advantages_for
from areal_jax.engine.launch import ServerStartError, jax_platform_name, launch_server, wait_healthy
from areal_jax.process import LIVE_SERVERS
from areal_jax.rewards import MODEL_REWARDS
from areal_jax.rewards.judge import DEFAULT_TEMPLATE, JudgeReward, JudgeSettings, api_key_from_env
from areal_jax.rewards.reward_model import RewardModelReward, RewardModelSettings
from areal_jax.rewards.teacher import TeacherScorer, TeacherSettings
from areal_jax.rollout.distill import TeacherScoredWorkflow
from areal_jax.run_inputs import TrainerError, input_error, resolve_model_path
from areal_jax.trajectory import Trajectory

__all__ = ["ModelServers", "advantages_fn", "eval_reward_name"]


def eval_reward_name(cfg: TrainConfig) -> str:
    """What evals (and the pool) score with: ``reward.eval_fn``, else ``reward.fn``; a
    model-judged ``reward.fn`` needs ``reward.eval_fn`` (ValueError)."""
    r = cfg.reward
    if r.eval_fn:
        return r.eval_fn
    if r.fn in MODEL_REWARDS:
        raise ValueError(f"reward.fn: {r.fn} needs reward.eval_fn, the verifier evals score "
                         "with (builtin, math, code or module:function)")
    return r.fn


def advantages_fn(cfg: TrainConfig) -> Callable[[list[list[Trajectory]]],
                                                 np.ndarray | list[np.ndarray]]:
    """The trajectory pipeline's advantages: the teacher's per-token ones with a ``teacher``
    section, else the group advantages of ``algo.name``."""
    if cfg.teacher is not None:
        return lambda groups: distill_advantages_for(cfg, groups)
    return lambda groups: group_advantages_for(cfg, groups)


@dataclasses.dataclass
class _Server:
    name: str  # "judge" | "teacher", also its config key's last part
    key: str  # the config key: reward.judge | teacher
    url: str
    handle: Any = None  # the embedded server's ServerHandle; None for an external one


class ModelServers:
    """The run's judge and teacher servers (either may be absent)."""

    def __init__(self, cfg: TrainConfig, servers: dict[str, _Server]) -> None:
        self.cfg = cfg
        self.servers = servers

    @staticmethod
    def check(cfg: TrainConfig) -> None:
        """What bad input can break, checked before the learner loads (TrainerError naming
        the key): the combinations, each ``model_path`` (a hub id is fetched now), the
        templates and patterns, and each ``api_key_env``."""
        _check_combinations(cfg)
        for _, key, section in _sections(cfg):
            if section is not None and section.model_path is not None:
                resolve_model_path(section.model_path, cfg.storage.cache_dir,
                                   f"{key}.model_path")
        r = cfg.reward
        if r.judge is not None:
            with input_error("reward.judge", ValueError):
                judge_settings(r.judge, "check")
        if r.reward_model is not None:
            with input_error("reward.reward_model", ValueError):
                reward_model_settings(r.reward_model, "check")
        if cfg.teacher is not None:
            with input_error("teacher.api_key_env", ValueError, what="teacher"):
                api_key_from_env(cfg.teacher.api_key_env)

    @classmethod
    def start(cls, cfg: TrainConfig, run_dir: Path, stack: contextlib.ExitStack,
              cache_dir: str | None) -> ModelServers:
        """Starts the embedded ones (not waited for; see :meth:`wait`); registers their
        shutdown on ``stack``."""
        _check_combinations(cfg)
        servers: dict[str, _Server] = {}
        for name, key, section in _sections(cfg):
            if section is None:
                continue
            if section.url is not None:
                servers[name] = _Server(name, key, section.url)
                continue
            servers[name] = _launch(cfg, name, key, section, run_dir, stack, cache_dir)
        return cls(cfg, servers)

    def wait(self) -> None:
        """Until every embedded server answers /health (rollout.server_startup_timeout_s)."""
        for server in self.servers.values():
            if server.handle is None:
                continue
            try:
                wait_healthy([server.handle], self.cfg.rollout.server_startup_timeout_s)
            except ServerStartError as e:
                raise TrainerError(f"{server.key}: the embedded {server.name} server failed to "
                                   f"start: {e}") from None

    def reward(self, spec: str, stack: contextlib.ExitStack) -> Any:
        """The training reward: the judge (``JudgeReward``) with ``reward.fn: judge``, the
        reward model (``RewardModelReward``) with ``reward_model``, else the pool function
        ``spec``."""
        r = self.cfg.reward
        reward: JudgeReward
        if r.fn == "judge" and r.judge is not None:
            with input_error("reward.judge", ValueError, what="reward.judge"):
                reward = JudgeReward(judge_settings(r.judge, self.servers["judge"].url))
        elif r.fn == "reward_model" and r.reward_model is not None:
            with input_error("reward.reward_model", ValueError, what="reward.reward_model"):
                reward = RewardModelReward(reward_model_settings(
                    r.reward_model, self.servers["reward_model"].url))
        else:
            return spec
        stack.callback(reward.close)
        return reward

    def wrap(self, workflow: Any, stack: contextlib.ExitStack) -> Any:
        """The training workflow: with a teacher, ``workflow`` whose groups it scores."""
        teacher = self.cfg.teacher
        if teacher is None:
            return workflow
        with input_error("teacher.api_key_env", ValueError, what="teacher"):
            key = api_key_from_env(teacher.api_key_env)
        scorer = TeacherScorer(TeacherSettings(
            url=self.servers["teacher"].url, max_concurrency=teacher.max_concurrency,
            timeout_s=teacher.timeout_s, retries=teacher.retries, backoff_s=teacher.backoff_s,
            api_key=key))
        wrapped = TeacherScoredWorkflow(workflow, scorer)
        stack.callback(wrapped.close)
        return wrapped


def _check_combinations(cfg: TrainConfig) -> None:
    if cfg.teacher is not None and cfg.algo.name == "ppo":
        raise TrainerError("teacher (on-policy distillation) gives per-token advantages of "
                           "its own; use it with algo.name grpo, rloo, drgrpo or gspo, not "
                           "ppo (whose advantages come from the critic)")
    if cfg.reward.fn in MODEL_REWARDS and cfg.rollout.workflow == "agent":
        raise TrainerError(f"reward.fn: {cfg.reward.fn} scores single-turn answers; an agent "
                           "workflow (rollout.workflow: agent) computes its own rewards")


def _sections(cfg: TrainConfig) -> list[tuple[str, str, ModelServerSection | None]]:
    """(name, config key, section) of each model server the config may ask for."""
    return [("judge", "reward.judge", cfg.reward.judge),
            ("reward_model", "reward.reward_model", cfg.reward.reward_model),
            ("teacher", "teacher", cfg.teacher)]


def judge_settings(judge: JudgeSection, url: str) -> JudgeSettings:
    """``reward.judge`` as the judge's settings (the template and pattern checked; the key
    read from ``api_key_env``)."""
    return JudgeSettings(
        url=url, template=judge.template or DEFAULT_TEMPLATE, model=judge.model,
        endpoint=judge.endpoint, system_prompt=judge.system_prompt,
        score_pattern=judge.score_pattern, score_min=judge.score_min,
        score_max=judge.score_max, max_tokens=judge.max_tokens, temperature=judge.temperature,
        max_concurrency=judge.max_concurrency, timeout_s=judge.timeout_s,
        retries=judge.retries, backoff_s=judge.backoff_s, cache_size=judge.cache_size,
        on_failure=judge.on_failure, fallback_score=judge.fallback_score,
        api_key=api_key_from_env(judge.api_key_env))


def reward_model_settings(rm: RewardModelSection, url: str) -> RewardModelSettings:
    """``reward.reward_model`` as the reward model client's settings."""
    return RewardModelSettings(
        url=url, template=rm.template, label=rm.label, score_min=rm.score_min,
        score_max=rm.score_max, max_concurrency=rm.max_concurrency, timeout_s=rm.timeout_s,
        retries=rm.retries, backoff_s=rm.backoff_s, cache_size=rm.cache_size,
        on_failure=rm.on_failure, fallback_score=rm.fallback_score,
        api_key=api_key_from_env(rm.api_key_env))


def _placement(cfg: TrainConfig, section: ModelServerSection, key: str
               ) -> tuple[str, dict[str, str] | None]:
    """(JAX_PLATFORMS, extra env) of an embedded judge or teacher: its own platform and
    devices, else the rollout engines' platform (or this process's backend)."""
    platform = jax_platform_name(section.platform or cfg.rollout.engine_platform
                                 or jax.default_backend())
    if section.devices is None:
        return platform, (None if platform == "cpu" else {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if platform == "cpu":
        raise TrainerError(f"{key}.devices selects accelerators; on the CPU use {key}.cpu_cores")
    var = "TPU_VISIBLE_CHIPS" if platform == "tpu" else (
        "HIP_VISIBLE_DEVICES" if platform == "rocm" else "CUDA_VISIBLE_DEVICES")
    return platform, {var: ",".join(map(str, section.devices))}


def _launch(cfg: TrainConfig, name: str, key: str, section: ModelServerSection, run_dir: Path,
            stack: contextlib.ExitStack, cache_dir: str | None) -> _Server:
    assert section.model_path is not None
    path = resolve_model_path(section.model_path, cfg.storage.cache_dir, f"{key}.model_path")
    platform, env = _placement(cfg, section, key)
    # The teacher scores whole rows (prompt + completion): one more position than a prompt.
    max_seq_len = section.max_seq_len or cfg.rollout.max_seq_len + (name == "teacher")
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    try:
        handle = launch_server(path, wait=False, max_slots=section.max_slots,
                               max_seq_len=max_seq_len, dtype=section.dtype or cfg.serving_dtype,
                               jax_platforms=platform, env=env, cpu_affinity=section.cpu_cores,
                               log_path=logs / f"{name}.log", compilation_cache_dir=cache_dir)
    except (ServerStartError, OSError) as e:
        raise TrainerError(f"{key}: the embedded {name} server failed to start: {e}") from None
    LIVE_SERVERS.append(handle)
    stack.callback(_forget, handle)
    stack.callback(handle.terminate)
    return _Server(name, key, handle.url, handle)


def _forget(handle: Any) -> None:
    with contextlib.suppress(ValueError):
        LIVE_SERVERS.remove(handle)
