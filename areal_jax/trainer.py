"""The training loop: asynchronous (or synchronous) RL, one version at a time.

    run_training(load_config("configs/tiny_demo.yaml"))  # areal_jax.run: builds, then runs

:meth:`Trainer.step` is one version, each step one call into the room that owns it
(docs/architecture.md):

1. Prompts: the executor (``rollout/``) submits a workflow per prompt while the
   staleness gate allows; it has been doing so all along.
2. Generation: workflows call the rollout servers and the reward pool, off this thread.
3. Batching: the trajectory pipeline (``data/trajectories.py``) takes the B oldest
   groups, computes advantages and packs micro-batches.
4. Training: the learner (``learner/``): prox_logp recompute + ``ppo_n_minibatches``
   decoupled-PPO steps.
5. Publishing: a host copy of the weights; ``WeightSync`` (``rollout/weight_sync.py``)
   writes ``weights/v{N}`` and updates the servers while the learner goes on
   (``checkpoint.publish_mode: inline``: written from the learner's arrays first, no copy).
6. Checkpointing: every K versions, Orbax (``checkpoint/``): params, optimizer,
   step/version, the executor's accounting and prompt iterator, asynchronously.

Sync mode is the same loop with eta = 0: batch v is generated entirely under weights v,
and nothing is generated while the learner trains. Construction (what each piece is
built from, what is checked up front) is ``run.build_trainer``, and ``run.py`` is the
entry above both; the process around the loop (signals, exit codes) is ``process.py``.

With several JAX processes every process runs the loop; only process 0 has the executor,
the servers and the metrics writer, and its batches reach the others' learners as rows.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from areal_jax.checkpoint.meta import CheckpointMeta
from areal_jax.checkpoint.orbax_ckpt import CheckpointWriteError, rng_to_json
from areal_jax.checkpoint.publish import join_inline_publish, serving_copy
from areal_jax.checkpoint.stream import ServingArrays, serving_arrays, warm_serving_cast
from areal_jax.config import TrainConfig, to_dict
from areal_jax.data.advantages import distill_metrics, gae_targets_for
from areal_jax.data.trajectories import save_batch
from areal_jax.interrupt import raise_if_interrupted
from areal_jax.losses.step_metrics import critic_entries, headline, row_entries
from areal_jax.metrics import MismatchWarner
from areal_jax.process import is_peer_gone
from areal_jax.rollout.evaluate import evaluate_prompts, evaluate_workflow
from areal_jax.rollout.executor import NoProgressError
from areal_jax.rollout.weight_sync import WeightSyncError
from areal_jax.run_inputs import RunStopped
from areal_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from areal_jax.checkpoint import TrainCheckpointer
    from areal_jax.data.trajectories import TrainBatch
    from areal_jax.learner import Learner
    from areal_jax.learner.critic import Critic
    from areal_jax.learner.trainable import MicroBatch
    from areal_jax.metrics import MetricsWriter
    from areal_jax.rewards.pool import RewardPool
    from areal_jax.rollout.executor import RolloutExecutor
    from areal_jax.rollout.weight_sync import WeightSync
    from areal_jax.rollout.workflows import PromptItem
    from areal_jax.storage import RunFiles
    from areal_jax.tokenizer import ChatTokenizer

__all__ = ["LearnerSide", "Progress", "RolloutSide", "SFTTrainer", "Trainer"]

logger = logging.getLogger("areal_jax.trainer")


@dataclass
class Progress:
    """Where the run is, restored from a checkpoint's meta."""

    start_version: int = 0
    consumed_tokens: int = 0
    last_saved_version: int = -1
    elapsed_before: float = 0.0  # seconds of earlier (resumed-from) processes
    t_start: float = field(default_factory=time.time)

    @classmethod
    def from_meta(cls, meta: CheckpointMeta | None) -> Progress:
        """The progress of a run resumed from a checkpoint with ``meta``; None: a fresh run."""
        if meta is None:
            return cls()
        return cls(start_version=meta.version, consumed_tokens=meta.consumed_tokens,
                   last_saved_version=meta.version, elapsed_before=meta.elapsed_s)

    def elapsed(self) -> float:
        return self.elapsed_before + (time.time() - self.t_start)


@dataclass
class RolloutSide:
    """What process 0 alone has: the executor and its servers' weight sync, the metrics
    files, and what evaluation needs."""

    executor: RolloutExecutor
    weights: WeightSync
    writer: MetricsWriter
    run_files: RunFiles  # metrics, logs, config (uploaded for gs://)
    tokenizer: ChatTokenizer
    reward_fn: str
    reward_pool: RewardPool
    eval_items: list[PromptItem]
    # An agent run's workflow for eval (its agent and tools); None: single-turn eval only.
    eval_workflow: Any = None


@dataclass(frozen=True)
class LearnerSide:
    """What every process has (``run.build_learner_side``): the learner on its mesh, with
    its reference model and critic, their checkpointers, and where the run resumes."""

    learner: Learner
    checkpointer: TrainCheckpointer
    progress: Progress
    mesh: Mesh  # over every process's devices; the batch pipeline shards rows over it
    meta: CheckpointMeta | None = None  # the checkpoint resumed from; None: a fresh run
    ref_learner: Learner | None = None  # algo.kl_coef > 0: the frozen reference policy
    critic: Critic | None = None  # algo.name == "ppo": the value model
    critic_checkpointer: TrainCheckpointer | None = None


class Trainer:
    """One run: the learner side (every process) and the rollout side (process 0)."""

    def __init__(self, cfg: TrainConfig, side: LearnerSide, *, batches: Iterator[TrainBatch],
                 rollout: RolloutSide | None, startup: dict[str, float] | None = None) -> None:
        self.cfg = cfg
        self.learner = side.learner
        self.batches = batches  # iterator of TrainBatch: this process's rows of each batch
        self.checkpointer = side.checkpointer
        self.progress = side.progress
        self.rollout = rollout  # None on processes other than 0
        self.ref_learner = side.ref_learner
        self.critic = side.critic
        self.critic_checkpointer = side.critic_checkpointer
        self.startup = dict(startup or {})  # seconds from process start to each milestone
        self._nonfinite = 0  # versions in a row with a non-finite loss
        self._mismatch_warner = MismatchWarner(cfg.algo.mismatch_warn_abs_diff)
        # The last version's serving cast, on a CPU learner: the next cast writes into it
        # (``serving_arrays``' reuse; fresh pages were most of the cast's time)
        self._last_cast: ServingArrays | None = None

    @property
    def _publishes_cast(self) -> bool:
        """Whether a version is published as the serving cast (``serving_arrays``) rather
        than as a host copy for the disk path."""
        return self.cfg.publish_path in ("memory", "delta", "distributed")

    @property
    def is_main(self) -> bool:
        return self.rollout is not None

    @property
    def rollout_side(self) -> RolloutSide:
        """The rollout side; only process 0 (``is_main``) has one and reads it."""
        if self.rollout is None:
            raise RuntimeError("the rollout side exists on process 0 only")
        return self.rollout

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        row: dict[str, Any] = {}
        start = self.progress.start_version
        if self.is_main and start == 0 and cfg.eval.at_start and self.rollout_side.eval_items:
            t0 = time.perf_counter()
            evaluated = self.evaluate()
            # The run's first row: the start-up breakdown so far (the first version's row
            # repeats it with the first batch and step).
            row = self.rollout_side.writer.log({"version": 0, "step": 0, **evaluated,
                                                "eval_s": time.perf_counter() - t0,
                                                **self.startup_entries()})
        try:
            for version in range(start, cfg.train.total_versions):
                raise_if_interrupted()  # SIGINT/SIGTERM are acted on at safe points like this
                row = self.step(version) or row
            if self.learner.version != self.progress.last_saved_version:
                self.save_checkpoint()
        except RunStopped as e:
            if isinstance(e.__cause__, WeightSyncError):
                self.checkpoint_after_failed_publish(e)  # raises RunStopped, saved or not
            raise
        except WeightSyncError as e:  # seen by the wait for a batch (executor.fail_waits)
            stop = RunStopped(str(e))
            stop.__cause__ = e
            self.checkpoint_after_failed_publish(stop)
            raise stop from e
        self.finish()
        return row

    def checkpoint_after_failed_publish(self, stop: RunStopped) -> None:
        """A publish failed (a full disk, every server dropped): the learner's versions since
        the last checkpoint are saved before the run stops (one process; the checkpoint
        may live elsewhere than the weights, and the failed write's partial files are gone).
        Raises RunStopped saying whether it was saved."""
        version, last = self.learner.version, self.progress.last_saved_version
        if version == last or jax.process_count() > 1:
            raise stop
        try:
            with _checkpoint_write_stops_the_run():
                self._save_checkpoint(published=False)
                self.checkpointer.wait()
                if self.critic_checkpointer is not None:
                    self.critic_checkpointer.wait()
        except Exception as e:  # noqa: BLE001 - the publish's failure is the run's message
            kept = f"version {last}" if last >= 0 else "none"
            raise RunStopped(f"{stop}; saving a checkpoint of version {version} before "
                             f"stopping failed too ({type(e).__name__}: {e}); the last "
                             f"completed checkpoint is {kept}") from None
        raise RunStopped(f"{stop}; a checkpoint of version {version} was saved before "
                         "stopping, so a resume loses no trained version") from None

    def step(self, version: int) -> dict[str, Any] | None:
        """Trains version ``version`` into ``version + 1``; returns its metrics row (process 0)."""
        cfg, first = self.cfg, version == self.progress.start_version
        if first and self._publishes_cast and jax.process_count() == 1:
            # the serving cast compiled and its buffers written while the batch comes
            self._last_cast = warm_serving_cast(self.learner.model, cfg.serving_dtype)
        t_step = time.perf_counter()
        # Steps 1-3: generation has been going on all along; take the next packed batch.
        batch = self.next_batch(version)
        wait_s = time.perf_counter() - t_step
        raise_if_interrupted()
        if first:
            self.mark_startup("first_batch_s")
        # Step 4: train.
        train_metrics = self.train(batch, version)
        if first:
            self.mark_startup("first_step_s")
        raise_if_interrupted()
        # Step 5: publish version + 1; rollouts continue under it.
        t0 = time.perf_counter()
        self.publish(version + 1)
        publish_s = time.perf_counter() - t0
        # Step 6: checkpoint (every process takes part).
        if cfg.checkpoint.every_versions and (version + 1) % cfg.checkpoint.every_versions == 0:
            self.save_checkpoint()
        if not self.is_main:
            return None
        row = self.metrics_row(version, batch, train_metrics, t_step=t_step, wait_s=wait_s,
                               publish_s=publish_s)
        is_last = version + 1 == cfg.train.total_versions
        every = cfg.eval.every_versions
        if self.rollout_side.eval_items and ((every and (version + 1) % every == 0)
                                        or (is_last and cfg.eval.at_end)):
            t0 = time.perf_counter()
            row.update(self.evaluate())
            row["eval_s"] = time.perf_counter() - t0
            raise_if_interrupted()
        row = self.rollout_side.writer.log(row)
        self._mismatch_warner(row)
        if version + 1 == self.progress.last_saved_version:
            self.rollout_side.run_files.sync()  # gs:// run dirs: the checkpointed row is uploaded
        return row

    # ------------------------------------------------------------------ steps 1-3
    def next_batch(self, version: int) -> TrainBatch:
        """The trajectory pipeline's next batch: the B oldest groups, advantages, packed rows
        (this process's rows of them)."""
        try:
            batch = next(self.batches)
        except NoProgressError as e:
            raise RunStopped(str(e)) from None
        except ValueError as e:  # e.g. a trajectory longer than a packed row
            if is_peer_gone(e):  # another process of the job died (process.py says so)
                raise
            raise RunStopped(f"cannot pack the batch of version {version + 1}: {e} "
                             f"(train.seq_len={self.cfg.train.seq_len})") from None
        if self.is_main:
            if self.cfg.train.record_batches:
                folder = os.path.join(self.rollout_side.run_files.local, "batches")
                os.makedirs(folder, exist_ok=True)
                save_batch(os.path.join(folder, f"v{version + 1}.npz"), batch)
            self.rollout_side.writer.log_consumed(version + 1,
                                                  [g[0].prompt_id for g in batch.groups])
        return batch

    # ------------------------------------------------------------------ step 4
    def train(self, batch: TrainBatch, version: int) -> dict[str, float]:
        """The learner's update (and the critic's, for PPO); stops the run after
        ``watchdog.max_nonfinite_versions`` non-finite losses in a row."""
        cfg, packed = self.cfg, batch.micro_batches
        targets = None
        if self.critic is not None:  # PPO (one process): GAE advantages from the critic's values
            targets = gae_targets_for(cfg, self.critic, packed, batch.trajectories)
            packed = targets.micro_batches  # new micro-batches: the batch is not modified
        micro: list[MicroBatch] = list(packed)
        if self.ref_learner is not None:  # new micro-batches with the reference logprobs
            micro = self.ref_learner.with_logp(micro, "ref_logp")
        metrics = self.learner.train_step(micro, current_version=version)
        finite = math.isfinite(float(metrics.get("loss", 0.0)))
        self._nonfinite = 0 if finite else self._nonfinite + 1
        limit = cfg.watchdog.max_nonfinite_versions
        if limit and self._nonfinite >= limit:
            rewards = [t.reward for t in batch.trajectories]  # process 0 has the trajectories
            seen = (f"; rewards this batch: min {min(rewards):g}, max {max(rewards):g}"
                    if rewards else "")
            raise RunStopped(
                f"the training loss was not finite for {self._nonfinite} versions in a row "
                f"(versions {version + 2 - self._nonfinite}-{version + 1}{seen}): the learner "
                f"skipped those updates, so the run is not learning. Check the rewards' scale "
                f"(reward.max_abs, reward.scale) and optim.lr, then resume from the last "
                f"checkpoint (watchdog.max_nonfinite_versions={limit})")
        if targets is not None and self.critic is not None:
            critic_metrics = self.critic.train_step(micro, returns=targets.returns,
                                                    old_values=targets.old_values)
            metrics.update(critic_entries(critic_metrics))
        return metrics

    # ------------------------------------------------------------------ step 5
    def publish(self, version: int) -> None:
        """``checkpoint.publish_mode: background``: a host copy of the params (with several
        processes, a gather every process joins); process 0 hands it to
        :class:`WeightSync`, which writes it and updates the servers while the learner
        trains on its next batch. ``inline``: process 0 writes the learner's own arrays
        now, one tensor at a time (the others join each tensor's gather), and only the
        servers' update runs in the background. ``checkpoint.publish: memory``: the learner
        only dispatches the cast to the serving dtype; :class:`WeightSync` streams the
        result to the servers, which stage it while they generate, then swap. ``delta``:
        the same cast; :class:`WeightSync` writes it as a delta file the servers apply.
        ``distributed``: the same cast; :class:`WeightSync` broadcasts it to the servers
        through SGLang's weight update group."""
        self.wait_published()
        if self._publishes_cast:
            # (the last version's cast is sent by now: on CPU the cast writes into it)
            arrays = serving_arrays(self.learner.model, self.cfg.serving_dtype,  # collective
                                    reuse=self._last_cast)
            self._last_cast = arrays if arrays.on_cpu else None
            if self.is_main:
                self.rollout_side.weights.publish(arrays, version)
            return
        if self.cfg.checkpoint.publish_mode == "inline":
            weights = serving_copy(self.learner.model, self.cfg.model, self.cfg.serving_dtype,
                                   inline=True)
            if not self.is_main:
                join_inline_publish(weights, self.learner.model_cfg, self.cfg.serving_dtype)
                return
            with _weight_sync_stops_the_run():
                self.rollout_side.weights.publish_inline(weights, version)
            return
        params = serving_copy(self.learner.model, self.cfg.model, self.cfg.serving_dtype)
        if self.is_main:
            self.rollout_side.weights.publish(params, version)

    def wait_published(self) -> None:
        """The last publish has reached the servers (before an eval, a checkpoint, the end)."""
        if self.is_main:
            with _weight_sync_stops_the_run():
                self.rollout_side.weights.wait()

    # ------------------------------------------------------------------ step 6
    def save_checkpoint(self) -> None:
        with _checkpoint_write_stops_the_run():
            self._save_checkpoint()

    def _save_checkpoint(self, published: bool = True) -> None:
        if published:  # (after a failed publish its version is saved without it)
            self.wait_published()  # the executor state must be at the published version
        st = self.learner.state_dict()
        version = int(st["version"])
        meta = CheckpointMeta(  # every process saves; process 0 writes meta (it has the executor)
            step=int(st["step"]),
            version=version,
            executor=self.rollout_side.executor.state_dict() if self.is_main else {},
            model_config=self.learner.model_cfg.to_hf_dict(),
            run_config=to_dict(self.cfg),  # eval.py/convert.py: tokenizer, reward, keys
            consumed_tokens=self.progress.consumed_tokens,
            elapsed_s=self.progress.elapsed(),
            rng=rng_to_json(jax.random.key(self.cfg.seed + version)),
        )
        self.checkpointer.save(version, st["params"], st["opt_state"], meta)
        if self.critic is not None and self.critic_checkpointer is not None:
            cs = self.critic.state_dict()
            self.critic_checkpointer.save(version, cs["params"], cs["opt_state"],
                                          CheckpointMeta(step=int(cs["step"]),
                                                         version=int(cs["version"])))
        self.progress.last_saved_version = version

    def checkpoint_on_interrupt(self) -> None:
        """checkpoint.on_interrupt: save the current version before shutting down."""
        try:
            if self.learner.version != self.progress.last_saved_version:
                self.save_checkpoint()
                print(f"saved a checkpoint of version {self.learner.version} before stopping",
                      file=sys.stderr, flush=True)
            self.checkpointer.wait()
        except Exception as e:  # noqa: BLE001 - the last completed checkpoint is still there
            logger.error("checkpoint on interrupt failed (%s: %s); the last completed one is "
                         "kept", type(e).__name__, e)

    def finish(self) -> None:
        self.wait_published()
        if self.cfg.publish_path != "disk":  # weights/v{N} for convert.py, eval.py
            params = serving_copy(self.learner.model, self.cfg.model, self.cfg.serving_dtype)
            if self.is_main:
                with _weight_sync_stops_the_run():
                    self.rollout_side.weights.write_files(params, self.learner.version)
        with _checkpoint_write_stops_the_run():
            self.checkpointer.wait()
            if self.critic_checkpointer is not None:
                self.critic_checkpointer.wait()

    # ------------------------------------------------------------------ eval and metrics
    def evaluate(self, prefix: str = "eval_") -> dict[str, float]:
        self.wait_published()  # evaluate the latest weights
        e, ro = self.cfg.eval, self.rollout_side
        sampling = SamplingParams(
            max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            temperature=e.temperature, top_p=1.0)
        out = ro.executor.run_coroutine(evaluate_prompts(
            ro.executor.client, ro.eval_items, tokenizer=ro.tokenizer, reward_fn=ro.reward_fn,
            sampling=sampling, n_samples=e.n_samples, reward_pool=ro.reward_pool,
            answer_key="answer", seed=self.cfg.seed))
        if ro.eval_workflow is None:
            return {f"{prefix}{k}": v for k, v in out.items()}
        # An agent run: eval_* is the run's own workflow (the agent with its tools, what it
        # trains on); eval_single_turn_* the prompt answered in one turn without tools.
        agent = ro.executor.run_coroutine(evaluate_workflow(
            ro.executor.client, ro.eval_items, ro.eval_workflow, tokenizer=ro.tokenizer,
            reward_pool=ro.reward_pool, seed=self.cfg.seed,
            episode_timeout_s=self.cfg.rollout.episode_timeout_s))
        return {**{f"{prefix}{k}": v for k, v in agent.items()},
                **{f"{prefix}single_turn_{k}": v for k, v in out.items()}}

    def startup_entries(self) -> dict[str, float]:
        """``startup/<milestone>_s``: seconds from process start to each milestone so far."""
        return {f"startup/{k}": v for k, v in self.startup.items() if k.endswith("_s")}

    def mark_startup(self, name: str) -> None:
        """Records the seconds from process start to now as start-up milestone ``name``."""
        self.startup[name] = time.time() - self.startup.get("process_start", self.progress.t_start)

    def metrics_row(self, version: int, batch: TrainBatch, train_metrics: dict[str, float], *,
                    t_step: float, wait_s: float, publish_s: float) -> dict[str, Any]:
        trajs, groups = batch.trajectories, batch.groups
        rewards = np.array([t.reward for t in trajs], np.float32)
        self.progress.consumed_tokens += int(sum(t.num_tokens for t in trajs))
        weights = self.rollout_side.weights
        row = {
            "version": version + 1,
            "step": self.learner.step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "n_trajectories": len(trajs),
            "completion_tokens_mean": float(np.mean([t.num_generated for t in trajs])),
            # cut at the length limit (no EOS): GAE bootstraps these (docs/losses.md)
            "truncated_frac": float(np.mean([t.truncated for t in trajs])),
            "tokens_consumed": self.progress.consumed_tokens,
            "step_time_s": time.perf_counter() - t_step,
            "rollout_wait_s": wait_s,
            "publish_s": publish_s,  # the learner's wait: a host copy of the params
            # the background write and server update of the weights this version trained
            # from (v`version`), whoever waited for them (this publish, an eval, a checkpoint)
            "publish_write_s": weights.write_s.pop(version, 0.0),
            "publish_update_s": weights.update_s.pop(version, 0.0),
            **({"publish_bytes": weights.bytes_written.pop(version),  # delta: the file(s)
                "publish_full_servers": weights.full_servers.pop(version, 0)}
               if version in weights.bytes_written else {}),
            "wall_time_s": self.progress.elapsed(),
            "token_version_max": int(max(int(t.versions.max()) for t in trajs)),
            "start_staleness_max": float(max(version - min(g[0].start_version for g in groups),
                                             0)),
            **row_entries(train_metrics),  # train/*, and mismatch/* in their own section
            **distill_metrics(trajs),  # distill/*: with a teacher only
            **{f"rollout/{k}": v for k, v in self.rollout_side.executor.metrics().items()
               if isinstance(v, int | float)},
        }
        if version == self.progress.start_version:  # seconds from process start
            row.update(self.startup_entries())
        row.update(headline(train_metrics))  # top-level copies for plots
        return row


@contextlib.contextmanager
def _checkpoint_write_stops_the_run() -> Iterator[None]:
    """A checkpoint that cannot be written (a full disk) stops the run with one line (exit
    3), the newest complete checkpoint kept."""
    try:
        yield
    except CheckpointWriteError as e:
        raise RunStopped(f"{e}. Free space (or set checkpoint.dir), then resume") from None


@contextlib.contextmanager
def _weight_sync_stops_the_run() -> Iterator[None]:
    """A failed weight write or server update (``WeightSyncError``) stops the run with its
    message."""
    try:
        yield
    except WeightSyncError as e:
        raise RunStopped(str(e)) from e


class SFTTrainer(Trainer):
    """Supervised fine-tuning (``mode: sft``): the same learner, mesh, checkpoints and run
    files as RL, one version per batch of examples (``data/sft.py``). Each version is one
    ``Learner.sft_step`` (the token-mean NLL over the loss mask); every
    ``eval.every_versions`` it measures the held-out loss on ``data.eval``'s examples and,
    after publishing the weights to the run's rollout servers, the task's accuracy as an
    RL run does (``Trainer.evaluate``). The last version is published too: ``weights/v{N}``
    (HF safetensors, config, tokenizer) is the model an RL run starts from."""

    def __init__(self, cfg: TrainConfig, side: LearnerSide, *, batches: Iterator[TrainBatch],
                 rollout: RolloutSide | None, eval_batches: Sequence[MicroBatch] = (),
                 startup: dict[str, float] | None = None) -> None:
        super().__init__(cfg, side, batches=batches, rollout=rollout, startup=startup)
        self.eval_batches = list(eval_batches)  # data.eval's examples, packed
        self.examples_consumed = 0
        self._published = side.progress.start_version  # the servers hold this version

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        row: dict[str, Any] = {}
        start = self.progress.start_version
        if self.is_main and start == 0 and cfg.eval.at_start:
            t0 = time.perf_counter()
            evaluated = self.evaluate_sft()
            if evaluated:
                row = self.rollout_side.writer.log({"version": 0, "step": 0, **evaluated,
                                                    "eval_s": time.perf_counter() - t0})
        for version in range(start, cfg.train.total_versions):
            raise_if_interrupted()
            row = self.step(version) or row
        self.publish_latest()  # weights/v{N}: the fine-tuned model, for RL and serving
        if self.learner.version != self.progress.last_saved_version:
            self.save_checkpoint()
        self.finish()
        return row

    def step(self, version: int) -> dict[str, Any] | None:
        """Trains version ``version`` into ``version + 1`` on the next batch of examples;
        returns its metrics row (process 0)."""
        cfg, first = self.cfg, version == self.progress.start_version
        t_step = time.perf_counter()
        batch = self.next_batch(version)
        if first:
            self.mark_startup("first_batch_s")
        metrics = self.learner.sft_step(batch.micro_batches)
        if first:
            self.mark_startup("first_step_s")
        self._check_finite(metrics, version)
        raise_if_interrupted()
        if cfg.checkpoint.every_versions and (version + 1) % cfg.checkpoint.every_versions == 0:
            self.save_checkpoint()
        if not self.is_main:
            return None
        trajs = batch.trajectories
        self.examples_consumed += len(trajs)
        self.progress.consumed_tokens += int(sum(t.num_tokens for t in trajs))
        row: dict[str, Any] = {
            "version": version + 1, "step": self.learner.step, "loss": metrics["loss"],
            "examples_consumed": self.examples_consumed,
            "tokens_consumed": self.progress.consumed_tokens,
            "step_time_s": time.perf_counter() - t_step,
            "wall_time_s": self.progress.elapsed(),
            **row_entries(metrics),
        }
        if version == self.progress.start_version:
            row.update({f"startup/{k}": v for k, v in self.startup.items() if k.endswith("_s")})
        every, is_last = cfg.eval.every_versions, version + 1 == cfg.train.total_versions
        if (every and (version + 1) % every == 0) or (is_last and cfg.eval.at_end):
            t0 = time.perf_counter()
            row.update(self.evaluate_sft())
            row["eval_s"] = time.perf_counter() - t0
            raise_if_interrupted()
        return self.rollout_side.writer.log(row)

    def _check_finite(self, metrics: dict[str, float], version: int) -> None:
        finite = math.isfinite(float(metrics.get("loss", 0.0)))
        self._nonfinite = 0 if finite else self._nonfinite + 1
        limit = self.cfg.watchdog.max_nonfinite_versions
        if limit and self._nonfinite >= limit:
            raise RunStopped(
                f"the SFT loss was not finite for {self._nonfinite} versions in a row "
                f"(versions {version + 2 - self._nonfinite}-{version + 1}): the learner "
                f"skipped those updates. Lower optim.lr (or set optim.max_grad_norm), then "
                f"resume from the last checkpoint (watchdog.max_nonfinite_versions={limit})")

    def publish_latest(self) -> None:
        """The learner's current version to the servers (and ``weights/v{N}``), unless they
        hold it already; every process takes part (the host copy is a gather)."""
        if self._published != self.learner.version:
            self.publish(self.learner.version)
            self._published = self.learner.version
        self.wait_published()

    def evaluate_sft(self) -> dict[str, float]:
        """``eval_loss`` (the token-mean NLL of data.eval's examples) and, with eval
        prompts, the accuracy of the current weights through the rollout servers
        (``eval_accuracy`` etc., as an RL run measures it)."""
        out: dict[str, float] = {}
        if self.eval_batches:
            loss, count = self.learner.sft_loss(self.eval_batches)
            out.update({"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)),
                        "eval_loss_tokens": float(count)})
        if self.rollout_side.eval_items:
            self.publish_latest()
            out.update(self.evaluate())
        return out
