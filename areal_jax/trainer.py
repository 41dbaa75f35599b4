"""The training loop: asynchronous (or synchronous) RL, as the six steps of ARCHITECTURE.md.

    run_training(load_config("configs/tiny_demo.yaml"))

1. Prompts: the executor submits a workflow per prompt while the staleness gate allows.
2. Generation: workflows call the rollout servers and the reward pool (off this thread).
3. Batching: the B oldest accepted groups, rewards -> advantages, packed micro-batches.
4. Training: prox_logp recompute + ``ppo_n_minibatches`` decoupled-PPO steps.
5. Publishing: pause servers, export HF weights ``weights/v{N}``, update, continue.
6. Checkpointing: every K versions, Orbax (params, optimizer, step/version, prompt
   iterator, executor accounting, RNG), asynchronously.

Sync mode is the same loop with eta = 0: batch v is generated entirely under weights v,
and nothing is generated while the learner trains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.config import TrainConfig, to_dict
from areal_jax.trainer_setup import (
    MetricsWriter,
    RunContext,
    TrainerError,
    build_components,
    group_advantages_for,
    shaped_rewards_for,
)

__all__ = ["TrainerError", "run_training"]

logger = logging.getLogger("areal_jax.trainer")


def run_training(cfg: TrainConfig, resume: bool | None = None) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns the last metrics row.

    ``resume``: None resumes when the run dir has a checkpoint, True requires one,
    False refuses a run dir that already has one.
    """
    with contextlib.ExitStack() as stack:
        ctx: RunContext = build_components(cfg, resume, stack)
        return _train_loop(cfg, ctx)


def _train_loop(cfg: TrainConfig, ctx: RunContext) -> dict[str, Any]:
    learner, executor, _publisher = ctx.learner, ctx.executor, ctx.publisher
    writer: MetricsWriter = ctx.writer
    total = cfg.train.total_versions
    row: dict[str, Any] = {}
    if ctx.start_version == 0 and cfg.eval.at_start and ctx.eval_items:
        row = writer.log({"version": 0, "step": 0, **ctx.evaluate("eval_")})

    for version in range(ctx.start_version, total):
        t_step = time.perf_counter()
        # Steps 1-3: the executor has been generating all along; take the B oldest groups.
        t0 = time.perf_counter()
        groups = executor.prepare_batch(cfg.train.batch_size)
        wait_s = time.perf_counter() - t0
        trajs = [t for g in groups for t in g]
        writer.log_consumed(version + 1, [g[0].prompt_id for g in groups])
        rewards = np.array([t.reward for t in trajs], np.float32)
        if ctx.critic is not None:  # PPO: GAE advantages from the critic's values
            batches = ctx.pack(trajs, np.zeros(len(trajs), np.float32))
            targets = ctx.critic.gae_targets(batches, trajs, gamma=cfg.algo.gamma, lam=cfg.algo.lam,
                                             rewards=shaped_rewards_for(cfg, trajs), normalize=True)
        else:  # GRPO / RLOO / Dr.GRPO: group baselines
            batches = ctx.pack(trajs, group_advantages_for(cfg, trajs, len(groups[0])))

        # Step 4: train (prox_logp recompute happens inside train_step when decoupled).
        if ctx.ref_learner is not None:
            for mb, ref in zip(batches, ctx.ref_learner.compute_logp(batches), strict=True):
                mb["ref_logp"] = ref
        train_metrics = learner.train_step(batches, current_version=version)
        if ctx.critic is not None:
            critic_metrics = ctx.critic.train_step(batches, returns=targets.returns,
                                                   old_values=targets.old_values)
            train_metrics.update({f"critic_{k}": v for k, v in critic_metrics.items()})

        # Step 5: publish version + 1 and let rollouts continue under it.
        t0 = time.perf_counter()
        ctx.publish(version + 1)
        publish_s = time.perf_counter() - t0

        # Step 6: checkpoint.
        if cfg.checkpoint.every_versions and (version + 1) % cfg.checkpoint.every_versions == 0:
            ctx.save_checkpoint()

        ctx.consumed_tokens += int(sum(t.num_tokens for t in trajs))
        row = {
            "version": version + 1,
            "step": learner.step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "n_trajectories": len(trajs),
            "completion_tokens_mean": float(np.mean([t.num_generated for t in trajs])),
            "tokens_consumed": ctx.consumed_tokens,
            "step_time_s": time.perf_counter() - t_step,
            "rollout_wait_s": wait_s,
            "publish_s": publish_s,  # the learner's share: the weight export
            "publish_update_s": ctx.last_update_s,  # the previous version's server update
            "wall_time_s": ctx.elapsed(),
            "token_version_max": int(max(int(t.versions.max()) for t in trajs)),
            "start_staleness_max": float(max(version - min(g[0].start_version for g in groups), 0)),
            **{f"train/{k}": v for k, v in train_metrics.items()},
            **{f"rollout/{k}": v for k, v in executor.metrics().items()
               if isinstance(v, int | float)},
        }
        row["logp_mismatch"] = train_metrics.get("logp_behav_abs_diff", float("nan"))
        row["clip_frac"] = train_metrics.get("clip_frac", float("nan"))
        row["cap_frac"] = train_metrics.get("cap_drop_frac", float("nan"))
        row["staleness_mean"] = train_metrics.get("staleness_mean", float("nan"))
        row["staleness_max"] = train_metrics.get("staleness_max", float("nan"))
        is_last = version + 1 == total
        if ctx.eval_items and ((cfg.eval.every_versions and (version + 1) % cfg.eval.every_versions == 0)
                               or (is_last and cfg.eval.at_end)):
            row.update(ctx.evaluate("eval_"))
        row = writer.log(row)

    if ctx.learner.version != ctx.last_saved_version:
        ctx.save_checkpoint()
    ctx.finish()
    return row


def main_guarded(cfg: TrainConfig, resume: bool | None) -> int:
    """Entry point used by scripts/train.py: SIGTERM behaves like Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_training(cfg, resume)
    return 0


def resolved_config_text(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def run_dir_of(cfg: TrainConfig) -> Path:
    return Path(cfg.run_dir)
