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
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from areal_jax.config import TrainConfig, to_dict
from areal_jax.trainer_setup import (
    LIVE_SERVERS,
    MetricsWriter,
    RunContext,
    RunStopped,
    TrainerError,
    build_components,
    shaped_rewards_for,
)

__all__ = ["EXIT_CODES", "Interrupted", "RunStopped", "TrainerError", "main_guarded", "run_training"]

# scripts/train.py's exit status (README, "When things go wrong").
EXIT_CODES = {
    "done": 0,
    "crash": 1,  # an unexpected error (a traceback)
    "bad_input": 2,  # config or input error, found before training starts
    "stopped": 3,  # the run could not go on: no progress, non-finite loss, failed weight update
    "shutdown_timeout": 4,  # shutdown took longer than watchdog.shutdown_timeout_s
}  # and 128 + signal number after SIGINT (130) or SIGTERM (143)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: the run shuts down gracefully."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

logger = logging.getLogger("areal_jax.trainer")


def run_training(cfg: TrainConfig, resume: bool | None = None, *,
                 exit_deadline: bool = False) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns the last metrics row.

    ``resume``: None resumes when the run dir has a checkpoint, True requires one,
    False refuses a run dir that already has one. ``exit_deadline`` (scripts/train.py):
    once the run ends, the process has ``watchdog.shutdown_timeout_s`` to exit, or it
    kills its servers and exits with status 4.
    """
    with contextlib.ExitStack() as stack:
        ctx: RunContext = build_components(cfg, resume, stack)
        # Runs first when the stack unwinds: every shutdown step after it is time-bounded.
        if exit_deadline:
            stack.callback(arm_shutdown_deadline, cfg.watchdog.shutdown_timeout_s,
                           EXIT_CODES["shutdown_timeout"])
        try:
            return _train_loop(cfg, ctx)
        except Interrupted:
            if cfg.checkpoint.on_interrupt:
                _checkpoint_on_interrupt(cfg, ctx)
            raise


def _checkpoint_on_interrupt(cfg: TrainConfig, ctx: RunContext) -> None:
    """checkpoint.on_interrupt: save the current version before shutting down."""
    arm_shutdown_deadline(cfg.watchdog.shutdown_timeout_s, EXIT_CODES["shutdown_timeout"])
    try:
        if ctx.learner.version != ctx.last_saved_version:
            ctx.save_checkpoint()
            print(f"saved a checkpoint of version {ctx.learner.version} before stopping",
                  file=sys.stderr, flush=True)
        ctx.checkpointer.wait()
    except Exception as e:  # noqa: BLE001 - the last completed checkpoint is still there
        logger.error("checkpoint on interrupt failed (%s: %s); the last completed one is kept",
                     type(e).__name__, e)


def _train_loop(cfg: TrainConfig, ctx: RunContext) -> dict[str, Any]:
    """Every process runs this loop; only process 0 (``ctx.is_main``) has the executor,
    the servers and the metrics writer, and its batches reach the others' learners as rows."""
    learner, executor = ctx.learner, ctx.executor
    writer: MetricsWriter | None = ctx.writer
    total = cfg.train.total_versions
    row: dict[str, Any] = {}
    nonfinite = 0  # versions in a row with a non-finite loss
    if ctx.is_main and ctx.start_version == 0 and cfg.eval.at_start and ctx.eval_items:
        t0 = time.perf_counter()
        evaluated = ctx.evaluate("eval_")
        row = writer.log({"version": 0, "step": 0, **evaluated, "eval_s": time.perf_counter() - t0})

    for version in range(ctx.start_version, total):
        t_step = time.perf_counter()
        # Steps 1-3: the executor has been generating all along; the trajectory pipeline
        # takes the B oldest groups, computes advantages and packs (this process's rows).
        t0 = time.perf_counter()
        from areal_jax.rollout.executor import NoProgressError

        try:
            batch = next(ctx.batches)
        except NoProgressError as e:
            raise RunStopped(str(e)) from None
        except ValueError as e:  # e.g. a trajectory longer than a packed row
            raise RunStopped(f"cannot pack the batch of version {version + 1}: {e} "
                             f"(train.seq_len={cfg.train.seq_len})") from None
        wait_s = time.perf_counter() - t0
        first = version == ctx.start_version
        if first:
            ctx.mark_startup("first_batch_s")
        batches, groups, trajs = batch.micro_batches, batch.groups, batch.trajectories
        if cfg.train.record_batches and ctx.is_main:
            from areal_jax.data.trajectories import save_batch

            os.makedirs(os.path.join(ctx.run_files.local, "batches"), exist_ok=True)
            save_batch(os.path.join(ctx.run_files.local, "batches", f"v{version + 1}.npz"), batch)
        if ctx.is_main:
            writer.log_consumed(version + 1, [g[0].prompt_id for g in groups])
        rewards = np.array([t.reward for t in trajs], np.float32)
        if ctx.critic is not None:  # PPO (one process): GAE advantages from the critic's values
            targets = ctx.critic.gae_targets(batches, trajs, gamma=cfg.algo.gamma,
                                             lam=cfg.algo.lam, normalize=True,
                                             rewards=shaped_rewards_for(cfg, trajs))

        # Step 4: train (prox_logp recompute happens inside train_step when decoupled).
        if ctx.ref_learner is not None:
            for mb, ref in zip(batches, ctx.ref_learner.compute_logp(batches), strict=True):
                mb["ref_logp"] = ref
        train_metrics = learner.train_step(batches, current_version=version)
        if first:
            ctx.mark_startup("first_step_s")
        nonfinite = 0 if math.isfinite(float(train_metrics.get("loss", 0.0))) else nonfinite + 1
        limit = cfg.watchdog.max_nonfinite_versions
        if limit and nonfinite >= limit:
            seen = (f"; rewards this batch: min {rewards.min():g}, max {rewards.max():g}"
                    if len(rewards) else "")  # process 0 has the trajectories
            raise RunStopped(
                f"the training loss was not finite for {nonfinite} versions in a row (versions "
                f"{version + 2 - nonfinite}-{version + 1}{seen}): the learner skipped those "
                f"updates, so the run is not learning. Check the rewards' scale "
                f"(reward.max_abs, reward.scale) and optim.lr, then resume from the last "
                f"checkpoint (watchdog.max_nonfinite_versions={limit})")
        if ctx.critic is not None:
            critic_metrics = ctx.critic.train_step(batches, returns=targets.returns,
                                                   old_values=targets.old_values)
            train_metrics.update({f"critic_{k}": v for k, v in critic_metrics.items()})

        # Step 5: publish version + 1 and let rollouts continue under it.
        t0 = time.perf_counter()
        ctx.publish(version + 1)
        publish_s = time.perf_counter() - t0

        # Step 6: checkpoint (every process takes part).
        if cfg.checkpoint.every_versions and (version + 1) % cfg.checkpoint.every_versions == 0:
            ctx.save_checkpoint()

        if not ctx.is_main:
            continue
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
            "publish_s": publish_s,  # the learner's wait: a host copy of the params
            # the background write and server update of the weights this version trained
            # from (v`version`), whoever waited for them (this publish, an eval, a checkpoint)
            "publish_write_s": ctx.write_s.pop(version, 0.0),
            "publish_update_s": ctx.update_s.pop(version, 0.0),
            "wall_time_s": ctx.elapsed(),
            "token_version_max": int(max(int(t.versions.max()) for t in trajs)),
            "start_staleness_max": float(max(version - min(g[0].start_version for g in groups), 0)),
            **{f"train/{k}": v for k, v in train_metrics.items()},
            **{f"rollout/{k}": v for k, v in executor.metrics().items()
               if isinstance(v, int | float)},
        }
        if first:  # seconds from process start to each start-up milestone
            row.update({f"startup/{k}": v for k, v in ctx.startup.items() if k.endswith("_s")})
        row["logp_mismatch"] = train_metrics.get("logp_behav_abs_diff", float("nan"))
        row["clip_frac"] = train_metrics.get("clip_frac", float("nan"))
        row["cap_frac"] = train_metrics.get("cap_drop_frac", float("nan"))
        row["staleness_mean"] = train_metrics.get("staleness_mean", float("nan"))
        row["staleness_max"] = train_metrics.get("staleness_max", float("nan"))
        is_last = version + 1 == total
        if ctx.eval_items and ((cfg.eval.every_versions and (version + 1) % cfg.eval.every_versions == 0)
                               or (is_last and cfg.eval.at_end)):
            t0 = time.perf_counter()
            row.update(ctx.evaluate("eval_"))
            row["eval_s"] = time.perf_counter() - t0
        row = writer.log(row)
        ctx.sync_run_files(version + 1)  # gs:// run dirs: the checkpointed row is uploaded

    if ctx.learner.version != ctx.last_saved_version:
        ctx.save_checkpoint()
    ctx.finish()
    return row


def _hard_exit(code: int, why: str) -> None:
    """Kills the embedded servers and leaves at once (no cleanup handlers run)."""
    print(f"{why}; exiting now with status {code}", file=sys.stderr, flush=True)
    for handle in list(LIVE_SERVERS):
        with contextlib.suppress(Exception):
            handle.kill()
    os._exit(code)


_deadline_lock = threading.Lock()
_deadline_armed = False


def arm_shutdown_deadline(seconds: float, code: int) -> None:
    """From now on the process has ``seconds`` to exit; then it kills its servers and exits
    with ``code``. Idempotent: the first call sets the deadline."""
    global _deadline_armed
    with _deadline_lock:
        if _deadline_armed:
            return
        _deadline_armed = True
    timer = threading.Timer(seconds, _hard_exit,
                            (code, f"shutdown took longer than {seconds:g}s "
                                   "(watchdog.shutdown_timeout_s)"))
    timer.daemon = True
    timer.start()


def install_signal_handlers(shutdown_timeout_s: float) -> None:
    """SIGINT and SIGTERM: the first raises :class:`Interrupted` in the main thread (a
    graceful shutdown, bounded by ``shutdown_timeout_s``); a second one exits at once."""
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if received:
            _hard_exit(128 + signum, f"second signal ({signal.Signals(signum).name})")
        received.append(signum)
        print(f"{signal.Signals(signum).name}: stopping (servers, executor, files; at most "
              f"{shutdown_timeout_s:g}s); send it again to exit at once",
              file=sys.stderr, flush=True)
        arm_shutdown_deadline(shutdown_timeout_s, 128 + signum)
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main_guarded(cfg: TrainConfig, resume: bool | None) -> int:
    """Entry point used by scripts/train.py: runs training and returns its exit status
    (``EXIT_CODES``; 128 + signal number after SIGINT/SIGTERM). Errors for users are
    printed as one line, never a traceback. With several processes, a process that fails
    tells the others (which exit at once with status 1) and exits without waiting in
    JAX's shutdown barrier."""
    from areal_jax.parallel import job_guard

    code, message = _run_for_status(cfg, resume)
    guard = job_guard()
    if guard is not None:
        if code == EXIT_CODES["done"]:
            guard.done()
        else:
            guard.fail(message, code)  # does not return
    return code


def _run_for_status(cfg: TrainConfig, resume: bool | None) -> tuple[int, str]:
    from areal_jax.parallel import job_guard

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threading.current_thread() is threading.main_thread():
        install_signal_handlers(cfg.watchdog.shutdown_timeout_s)
    try:
        run_training(cfg, resume, exit_deadline=True)
    except Interrupted as e:
        saved = " (and a checkpoint of this version)" if cfg.checkpoint.on_interrupt else ""
        message = (f"interrupted by {signal.Signals(e.signum).name}: servers, executor and files "
                   f"closed; the last completed checkpoint is kept{saved}")
        code = 128 + e.signum
    except RunStopped as e:
        message, code = f"stopped: {e}", EXIT_CODES["stopped"]
    except TrainerError as e:
        message, code = f"error: {e}", EXIT_CODES["bad_input"]
    except Exception as e:  # with several processes the others must hear of it
        if job_guard() is None:
            raise
        import traceback

        traceback.print_exc()
        message, code = f"error: {type(e).__name__}: {e}", EXIT_CODES["crash"]
    else:
        return EXIT_CODES["done"], ""
    print(message, file=sys.stderr, flush=True)
    return code, message


def resolved_config_text(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def run_dir_of(cfg: TrainConfig) -> str:
    """The run dir as a local path or gs:// URL (never a ``Path``, which mangles URLs)."""
    from areal_jax import storage

    return storage.normalize(cfg.run_dir)
