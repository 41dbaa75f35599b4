"""Wiring for ``trainer.py``: builds every component of a run from its config, checks
what can be checked before long work starts, and owns shutdown.

Kept out of ``trainer.py`` so that the loop there reads as the six steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax import storage
from areal_jax.config import TrainConfig, to_dict

logger = logging.getLogger("areal_jax.trainer")

ASSETS_DIR = Path(__file__).resolve().parent / "data" / "assets"


class TrainerError(RuntimeError):
    """A problem with the run's inputs or environment, reported before long work starts."""


class RunStopped(TrainerError):
    """The run started but cannot go on (no progress, a non-finite loss, a failed weight
    update); the message says why. scripts/train.py exits with status 3."""


def user_key_message(message: str) -> str:
    """Learner config errors name the learner's fields; say the run config's keys instead."""
    for internal, user in (("ppo.temperature", "rollout.temperature"), ("ppo.", "algo."),
                           ("optimizer.total_steps", "train.total_versions x algo.ppo_n_minibatches"),
                           ("optimizer.", "optim.")):
        message = message.replace(internal, user)
    return message


# ----------------------------------------------------------------------------- paths
def resolve_model_path(spec: str, cache_dir: str | None = None, key: str = "model.path") -> Path:
    """``builtin:NAME`` -> the packaged asset; a ``gs://`` HF directory -> its local cached
    copy (downloaded once, see ``storage.local_copy``); otherwise a local HF directory."""
    if spec.startswith("builtin:"):
        path = ASSETS_DIR / spec.split(":", 1)[1]
        if not path.is_dir():
            known = sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir()) if ASSETS_DIR.is_dir() else []
            raise TrainerError(f"{key} {spec!r}: no packaged model of that name; known: {known}")
        return path
    try:
        if storage.is_url(spec):
            url = storage.check_location(spec, key, must_exist=True)
            if not storage.isfile(storage.join(url, "config.json")):
                raise TrainerError(f"{key} {spec} has no config.json (expected an HF model directory)")
            path = storage.local_copy(url, cache_dir, kind="models")
        else:
            path = Path(storage.normalize(spec))
    except storage.StorageError as e:
        raise TrainerError(f"{e}" if str(e).startswith(key) else f"{key} {e}") from None
    if not path.is_dir():
        raise TrainerError(f"model.path {spec} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise TrainerError(f"model.path {spec} has no config.json (expected an HF model directory)")
    return path


def saved_run_config(ckpt_dir: str, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The config of the run that wrote a checkpoint: from its meta (``run_config``), else
    the ``config.yaml`` next to the checkpoint directory (the run dir); None if neither."""
    if isinstance(meta.get("run_config"), dict):
        return meta["run_config"]
    import yaml

    path = storage.join(storage.parent_of(ckpt_dir), "config.yaml")
    try:
        if storage.exists(path):
            data = yaml.safe_load(storage.read_text(path))
            return data if isinstance(data, dict) else None
    except (OSError, yaml.YAMLError, storage.StorageError):
        return None
    return None


def resolve_dataset(spec: str, run_dir: Path, key: str) -> str:
    """``builtin:train|eval`` -> a JSONL written into the (local) run dir; else the path
    (local or ``gs://``), checked to exist."""
    if spec.startswith("builtin:"):
        from areal_jax.data import builtin_task

        split = spec.split(":", 1)[1]
        if split not in ("train", "eval"):
            raise TrainerError(f"{key} {spec!r}: the builtin task has splits 'train' and 'eval'")
        return str(builtin_task.write_split(run_dir / "data" / f"builtin_{split}.jsonl", split))
    try:
        return storage.check_location(spec, key, must_exist=True)
    except storage.StorageError as e:
        raise TrainerError(str(e)) from None


def check_writable(path: Path, key: str) -> None:
    """Creates ``path`` if needed and proves a file can be written there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TrainerError(f"{key} {path} is not writable: {e.strerror or e}") from None


def check_prompt_lengths(cfg: TrainConfig, tokenizer: Any, train_path: str,
                         max_rows: int = 512) -> None:
    """The longest of the first ``max_rows`` prompts + ``rollout.max_new_tokens`` must fit a
    packed row (``train.seq_len``) and, with embedded servers, their context. (A longer
    prompt further on stops the run when it is packed, naming train.seq_len.)"""
    from areal_jax.data.prompts import read_records

    rows = read_records(train_path)[:max_rows]
    key, ro = cfg.data.prompt_key, cfg.rollout
    longest, where = 0, None
    for i, row in enumerate(rows):
        if key not in row:
            raise TrainerError(f"data.train {train_path}: row {i} has no {key!r} key "
                               f"(data.prompt_key); keys: {sorted(row)}")
        n = len(tokenizer.encode_prompt(row[key]))
        if n > longest:
            longest, where = n, i
    if where is None:
        raise TrainerError(f"data.train {train_path} holds no prompts")
    if not ro.servers and longest >= ro.max_seq_len:
        raise TrainerError(f"rollout.max_seq_len ({ro.max_seq_len}) is too small: prompt {where} "
                           f"of data.train has {longest} tokens; raise rollout.max_seq_len above "
                           f"{longest + ro.max_new_tokens}")
    need = longest + ro.max_new_tokens
    if not ro.servers:  # the embedded engine stops a sequence at its context length
        need = min(need, ro.max_seq_len)
    if cfg.train.seq_len < need:
        raise TrainerError(f"train.seq_len ({cfg.train.seq_len}) is shorter than the longest "
                           f"prompt ({longest} tokens, row {where} of data.train) + "
                           f"rollout.max_new_tokens ({ro.max_new_tokens}); raise train.seq_len "
                           f"to at least {need}")


def check_servers_reachable(urls: list[str], api_key: str | None, timeout: float = 5.0) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for url in urls:
        try:
            r = httpx.get(url.rstrip("/") + "/health", timeout=timeout, headers=headers)
        except httpx.HTTPError as e:
            raise TrainerError(f"rollout server {url} is unreachable ({type(e).__name__}: {e}); "
                               "start it first (see README, 'Running with SGLang')") from None
        if r.status_code != 200:
            raise TrainerError(f"rollout server {url} answered /health with HTTP {r.status_code}")


def enable_compilation_cache(path: str | None) -> str | None:
    """``compile_cache.enable_compilation_cache``, with a TrainerError for a bad path."""
    from areal_jax.compile_cache import enable_compilation_cache as enable

    try:
        return enable(path)
    except OSError as e:
        raise TrainerError(f"compilation_cache_dir {path} cannot be created ({e}); "
                           "set compilation_cache_dir to a writable directory or null") from None


def process_start_time() -> float:
    """When this process started (seconds since the epoch), for start-up timings."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except (ImportError, OSError):
        return time.time()


# ----------------------------------------------------------------------------- metrics
class MetricsWriter:
    """metrics.jsonl (one row per version), TensorBoard events and a progress bar."""

    def __init__(self, run_dir: Path, total: int, initial: int, progress_bar: bool,
                 resumed: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        prompts_path = run_dir / "consumed_prompts.jsonl"
        if resumed:  # versions after the checkpoint are trained again: drop their old rows
            for path in (self.path, prompts_path):
                _drop_rows_after(path, initial)
        self._file = self.path.open("a")
        self._prompts_file = prompts_path.open("a")
        self._tb = None
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception as e:  # noqa: BLE001 - TensorBoard is optional output
            logger.warning("TensorBoard events disabled: %s", e)
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="versions", unit="v",
                             dynamic_ncols=True, file=sys.stderr)

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        row = {k: (float(v) if isinstance(v, np.floating | np.integer) else v) for k, v in row.items()}
        row["time"] = time.time()
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        step = int(row.get("version", 0))
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k != "time":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        summary = {k: row[k] for k in ("reward_mean", "eval_accuracy") if k in row}
        text = " ".join(f"{k}={v:.3f}" for k, v in summary.items())
        if self._bar is not None:
            if "reward_mean" in row:
                self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(text)
            if "eval_accuracy" in row:
                self._bar.write(f"version {step}: eval accuracy {row['eval_accuracy']:.3f}"
                                + (f", reward {row['reward_mean']:.3f}" if "reward_mean" in row else ""))
        elif text:
            print(f"version {step}: {text}", flush=True)
        return row

    def log_consumed(self, version: int, prompt_ids: list[str]) -> None:
        """Which prompts trained version ``version`` (an audit trail for resume)."""
        self._prompts_file.write(json.dumps({"version": version, "prompt_ids": prompt_ids}) + "\n")
        self._prompts_file.flush()

    def close(self) -> None:
        self._prompts_file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def _drop_rows_after(path: Path, version: int) -> None:
    """Rewrites a JSONL of per-version rows without those of versions > ``version``
    (atomically: a kill mid-way leaves the old file). Unparsable lines are kept."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            row_version = int(json.loads(line).get("version", -1))
        except (ValueError, AttributeError, TypeError):
            row_version = -1
        if row_version > version:
            dropped += 1
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        logger.info("%s: dropped %d rows of versions after %d (they are trained again)",
                    path.name, dropped, version)


# ----------------------------------------------------------------------------- advantages
def shaped_rewards_for(cfg: TrainConfig, trajs: list) -> np.ndarray:
    """Rewards after scale/bias/clip and the optional DAPO overlong penalty, [N] fp32."""
    from areal_jax.losses import overlong_penalty, shape_rewards

    rewards = np.array([t.reward for t in trajs], np.float32)
    r = cfg.reward
    shaped = shape_rewards(rewards, scale=r.scale, bias=r.bias, clip=r.clip)
    if r.overlong_penalty_tokens:
        lengths = np.array([t.num_generated for t in trajs], np.float32)
        shaped = shaped + overlong_penalty(lengths, max_response_length=cfg.rollout.max_new_tokens,
                                           overlong_tokens=r.overlong_penalty_tokens,
                                           penalty_factor=r.overlong_penalty_factor)
    return np.asarray(shaped, np.float32)


def group_advantages_for(cfg: TrainConfig, trajs: list, group_size: int) -> np.ndarray:
    """Shaped rewards -> per-trajectory advantages (GRPO / RLOO / Dr.GRPO)."""
    from areal_jax.losses import group_advantages

    adv = group_advantages(shaped_rewards_for(cfg, trajs), group_size, mode=cfg.algo.name)
    return np.asarray(adv, np.float32)


def learner_configs(cfg: TrainConfig) -> tuple[Any, Any]:
    """The learner's (OptimizerConfig, PPOConfig) for a run config (ValueError if invalid)."""
    from areal_jax.learner import OptimizerConfig, PPOConfig

    optim = OptimizerConfig.from_section(cfg.optim, total_steps=cfg.train.total_versions
                                         * cfg.algo.ppo_n_minibatches)
    seq_norm = (float(cfg.rollout.max_new_tokens) if cfg.algo.agg_mode == "seq-mean-token-sum"
                else None)  # Dr.GRPO: a constant normaliser, the max generation length
    ppo = PPOConfig.from_algo(cfg.algo, temperature=cfg.rollout.temperature,
                              logp_chunk_size=cfg.train.logp_chunk_size,
                              seq_token_sum_normalizer=seq_norm)
    return optim, ppo


# ----------------------------------------------------------------------------- the run
@dataclass
class RunContext:
    cfg: TrainConfig
    run_dir: str  # a local path or a gs:// URL; local run files live in run_files.local
    learner: Any
    executor: Any
    publisher: Any
    checkpointer: Any
    writer: MetricsWriter | None  # process 0 only
    tokenizer: Any
    tokenizer_dir: Path
    reward_pool: Any
    reward_fn: str
    eval_items: list[dict]
    ref_learner: Any = None
    batches: Any = None  # iterator of TrainBatch: this process's rows of each version's batch
    mesh: Any = None
    is_main: bool = True  # process 0: executor, servers, metrics and run files
    _pending_publish: Any = None  # (version, Future) of the last publish's write + server update
    update_s: dict[int, float] = field(default_factory=dict)  # version -> its server update's s
    write_s: dict[int, float] = field(default_factory=dict)  # version -> its weight write's s
    critic: Any = None  # algo.name == "ppo": the value model
    critic_ckpt: Any = None
    start_version: int = 0
    consumed_tokens: int = 0
    last_saved_version: int = -1
    t_start: float = field(default_factory=time.time)
    # Seconds from process start: setup steps, then (in the trainer) the first batch and step.
    startup: dict[str, float] = field(default_factory=dict)
    elapsed_before: float = 0.0
    rng_seed: int = 0
    run_files: Any = None  # storage.RunFiles: metrics, logs, config (uploaded for gs://)
    first_params: Any = None  # host copy of the start-up weights, until they are published

    def mark_startup(self, name: str) -> None:
        """Records the seconds from process start to now as start-up milestone ``name``."""
        self.startup[name] = time.time() - self.startup.get("process_start", self.t_start)

    def elapsed(self) -> float:
        return self.elapsed_before + (time.time() - self.t_start)

    # -- step 5: publishing
    def publish(self, version: int) -> None:
        """Exports weights v{version} and hands them to the servers.

        The learner waits only for a host copy of the params (with several processes, a
        gather that every process joins). Writing them to ``checkpoint.publish_dir/v{N}``
        (in a thread), then pausing the servers (aborting in-flight requests when
        ``interruptible``, else waiting for them to finish), the weight update (sent only
        once the version is completely written), ``executor.set_version`` and the resume
        run as one coroutine on process 0's executor loop while the learner trains on its
        next batch. In sync mode (η = 0) nothing starts under v{version} before
        ``set_version``, so sync runs stay exactly on-policy. The update must be done
        before the next one, an eval, a checkpoint or the end: ``wait_published``.
        """
        from areal_jax.checkpoint.publish import host_params

        self.wait_published()
        params = host_params(self.learner.model)  # a collective with several processes
        if not self.is_main:
            return
        self._pending_publish = (version, self.executor.submit_coroutine(
            self._write_and_update(params, version)))

    async def _write_and_update(self, params: Any, version: int) -> tuple[float, float]:
        """Runs on the executor's loop: the write, then the servers' update (seconds each)."""
        import asyncio

        t0 = time.perf_counter()
        path = await asyncio.to_thread(self.publisher.publish, params, self.learner.model_cfg,
                                       version, tokenizer_dir=self.tokenizer_dir)
        write_s = time.perf_counter() - t0
        return write_s, await self._update_servers(str(path), version)

    async def _update_servers(self, path: str, version: int) -> float:
        """Runs on the executor's loop. Returns the seconds it took."""
        import asyncio

        t0 = time.perf_counter()
        ex, client = self.executor, self.executor.client
        ex.pause()  # no new runs until the servers have v{version}
        try:
            if self.cfg.rollout.interruptible:
                await client.pause()  # in-flight requests return as abort and are resubmitted
            else:  # let in-flight runs finish under the old weights
                while ex.metrics()["running"] > 0:
                    await asyncio.sleep(0.005)
            await client.update_weights_from_disk(path, version)  # raises if a server refuses
            ex.set_version(version)
        finally:
            if self.cfg.rollout.interruptible:
                await client.continue_()
            ex.resume()
        return time.perf_counter() - t0

    def wait_published(self) -> float:
        """Waits for the last ``publish`` to be written and reach the servers; returns the
        seconds the servers' side took (0.0 if none was pending) and records the write's and
        the update's seconds in ``write_s`` / ``update_s``, whoever waits (the next publish,
        an eval or a checkpoint). Raises RunStopped if the write or the update failed."""
        if self._pending_publish is None:
            return 0.0
        version, future = self._pending_publish
        self._pending_publish = None
        try:
            write_s, seconds = future.result()
        except Exception as e:  # noqa: BLE001 - a storage, transport or server error
            raise RunStopped(f"weight update to v{version} failed: {type(e).__name__}: {e}") from e
        self.write_s[version], self.update_s[version] = write_s, seconds
        return seconds

    # -- step 6: checkpointing
    def save_checkpoint(self) -> None:
        import jax

        from areal_jax.checkpoint.orbax_ckpt import rng_to_json

        self.wait_published()  # the executor state must be at the published version

        st = self.learner.state_dict()
        meta = {  # every process saves; process 0 writes meta (only it has an executor)
            "step": int(st["step"]),
            "version": int(st["version"]),
            "executor": self.executor.state_dict() if self.executor is not None else {},
            "model_config": self.learner.model_cfg.to_hf_dict(),
            "run_config": to_dict(self.cfg),  # eval.py/convert.py: tokenizer, reward, keys
            "consumed_tokens": self.consumed_tokens,
            "elapsed_s": self.elapsed(),
            "rng": rng_to_json(jax.random.key(self.rng_seed + int(st["version"]))),
        }
        self.checkpointer.save(int(st["version"]), st["params"], st["opt_state"], meta)
        if self.critic is not None:
            cs = self.critic.state_dict()
            self.critic_ckpt.save(int(st["version"]), cs["params"], cs["opt_state"],
                                  {"step": int(cs["step"]), "version": int(cs["version"])})
        self.last_saved_version = int(st["version"])

    def sync_run_files(self, version: int) -> None:
        """Uploads the run files (gs:// run dirs) once the row of a checkpointed version is
        written, so a resumed run continues them from the checkpoint."""
        if self.run_files is not None and version == self.last_saved_version:
            self.run_files.sync()

    # -- evaluation
    def evaluate(self, prefix: str) -> dict[str, float]:
        from areal_jax.rollout.evaluate import evaluate_prompts
        from areal_jax.rollout.workflows import SamplingConfig

        self.wait_published()  # evaluate the latest weights
        e = self.cfg.eval
        sampling = SamplingConfig(max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                                  temperature=e.temperature, top_p=1.0 if e.temperature else 1.0)
        out = self.executor.run_coroutine(evaluate_prompts(
            self.executor.client, self.eval_items, tokenizer=self.tokenizer,
            reward_fn=self.reward_fn, sampling=sampling, n_samples=e.n_samples,
            reward_pool=self.reward_pool, answer_key="answer", seed=self.cfg.seed))
        return {f"{prefix}{k}": v for k, v in out.items()}

    def finish(self) -> None:
        self.wait_published()
        self.checkpointer.wait()
        if self.critic_ckpt is not None:
            self.critic_ckpt.wait()


CHECKPOINT_DIR_NAMES = ("checkpoints", "checkpoints-critic", "weights")  # written directly


def _prepare_run_dir(cfg: TrainConfig, resume: bool | None) -> tuple[str, str, bool]:
    """Checks run_dir (and checkpoint.dir), local or gs://, up front; returns
    (run_dir, ckpt_dir, has_ckpt) as local paths or URLs."""
    try:
        run_dir = storage.check_location(cfg.run_dir, "run_dir", write=True)
        ckpt_dir = (storage.check_location(cfg.checkpoint.dir, "checkpoint.dir", write=True)
                    if cfg.checkpoint.dir else storage.join(run_dir, "checkpoints"))
    except storage.StorageError as e:
        raise TrainerError(str(e)) from None
    if not storage.is_url(run_dir):
        check_writable(Path(run_dir), "run_dir")
    if not storage.is_url(ckpt_dir):
        check_writable(Path(ckpt_dir), "checkpoint.dir" if cfg.checkpoint.dir else "run_dir")
    from areal_jax.checkpoint import TrainCheckpointer

    has_ckpt = False
    if storage.is_url(ckpt_dir) or os.path.exists(ckpt_dir):
        with contextlib.suppress(Exception):
            probe = TrainCheckpointer(ckpt_dir, read_only=True)
            has_ckpt = probe.latest_step() is not None
            probe.close()
    if resume is True and not has_ckpt:
        raise TrainerError(f"--resume given but {ckpt_dir} holds no checkpoint")
    if resume is False and has_ckpt:
        raise TrainerError(f"run_dir {run_dir} already holds checkpoints in {ckpt_dir}; "
                           "use --resume (or drop --no-resume) to continue it, or pick a new run_dir")
    return run_dir, ckpt_dir, has_ckpt


def build_components(cfg: TrainConfig, resume: bool | None, stack: contextlib.ExitStack) -> RunContext:
    """Everything a run needs, in dependency order; registers shutdown on ``stack``.

    With several JAX processes every process builds the learner, the checkpointer and the
    trajectory pipeline's receiving end; process 0 alone also the run files, servers,
    executor and metrics writer."""
    t_process = process_start_time()
    # Several processes (JAX multi-controller): join before anything touches JAX devices.
    # A one-process run skips this; with nothing set, srun / TPU pod / mpirun jobs are
    # detected by JAX itself (distributed.auto_detect).
    from areal_jax.parallel import detected_cluster, initialize_distributed, start_job_guard

    d = cfg.distributed
    try:
        initialize_distributed(d.coordinator_address, d.num_processes, d.process_id,
                               auto_detect=d.auto_detect and detected_cluster() is not None)
    except ValueError as e:
        raise TrainerError(f"distributed: {e}") from None
    import jax

    is_main, multi = jax.process_index() == 0, jax.process_count() > 1
    xla_cache_dir = enable_compilation_cache(cfg.compilation_cache_dir)  # before any compile
    guard = start_job_guard(d.peer_timeout_s)  # one process failing ends all of them
    if guard is not None:
        guard.add_cleanup(lambda: [handle.kill() for handle in list(LIVE_SERVERS)])
    if multi and cfg.algo.name == "ppo":
        raise TrainerError("algo.name=ppo (a critic with GAE over whole trajectories) runs as one "
                           f"process; this job has {jax.process_count()}: use grpo/rloo/drgrpo")

    # Cheap checks first: nothing below this block takes long.
    cache_dir = cfg.storage.cache_dir
    model_path = resolve_model_path(cfg.model.path, cache_dir)
    tokenizer_dir = (resolve_model_path(cfg.model.tokenizer_path, cache_dir, "model.tokenizer_path")
                     if cfg.model.tokenizer_path else model_path)
    if cfg.rollout.servers and is_main:
        check_servers_reachable(list(cfg.rollout.servers), cfg.rollout.api_key)
    run_dir, ckpt_dir, has_ckpt = _prepare_run_dir(cfg, resume)
    if not is_main:  # a learner only: its rows of every batch come from process 0
        return _build_learner_side(cfg, resume, stack, model_path, run_dir, ckpt_dir, has_ckpt)[0]
    try:  # the run's own files: a local working copy, uploaded on a schedule for gs://
        run_files = storage.RunFiles(run_dir, cache_dir=cache_dir,
                                     upload_every_s=cfg.storage.upload_every_s,
                                     exclude=CHECKPOINT_DIR_NAMES)
    except (storage.StorageError, OSError) as e:
        raise TrainerError(f"run_dir {run_dir}: cannot set up the run files: {e}") from None
    stack.callback(run_files.close)  # the last upload, after the writer below has closed
    local_dir = run_files.local
    train_path = resolve_dataset(cfg.data.train, local_dir, "data.train")
    eval_path = resolve_dataset(cfg.data.eval, local_dir, "data.eval") if cfg.data.eval else None
    from areal_jax.data.tokenizer import load_tokenizer
    from areal_jax.rewards import reward_fn_spec

    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (ValueError, FileNotFoundError, ImportError, AttributeError) as e:
        raise TrainerError(f"tokenizer {tokenizer_dir}: {e}") from None
    try:
        reward_fn = reward_fn_spec(cfg.reward.fn)
        from areal_jax.rewards.pool import resolve_reward_fn

        resolve_reward_fn(reward_fn)
    except (ValueError, ImportError, AttributeError) as e:
        raise TrainerError(f"reward.fn {cfg.reward.fn!r}: {e}") from None
    try:
        check_prompt_lengths(cfg, tokenizer, train_path)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise TrainerError(f"data.train: {e}") from None
    if cfg.rollout.learner_cpu_cores:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, set(cfg.rollout.learner_cpu_cores))
    import yaml

    storage.write_text(local_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    run_files.sync()
    from areal_jax.checkpoint import WeightPublisher

    try:  # where the servers read the serving weights
        publish_dir = (storage.check_location(cfg.checkpoint.publish_dir, "checkpoint.publish_dir",
                                              write=True)
                       if cfg.checkpoint.publish_dir else storage.join(run_dir, "weights"))
        publisher = WeightPublisher(publish_dir, keep=cfg.checkpoint.keep_weights,
                                    dtype=cfg.model.dtype)  # bf16 safetensors for a bf16 model
    except (storage.StorageError, OSError, ValueError, RuntimeError) as e:
        raise TrainerError(f"checkpoint.publish_dir: {e}") from None

    # Learner on its mesh (spanning every process's devices), checkpoint restored.
    ctx, meta = _build_learner_side(cfg, resume, stack, model_path, run_dir, ckpt_dir, has_ckpt,
                                    tokenizer_dir=tokenizer_dir)
    learner, mesh, start_version = ctx.learner, ctx.mesh, ctx.start_version
    from areal_jax.parallel import n_batch_shards

    # Serving weights for the current version (every process joined the gather in
    # _build_learner_side; process 0 writes them), then the servers.
    first = publisher.publish(ctx.first_params, learner.model_cfg, start_version,
                              tokenizer_dir=tokenizer_dir)
    ctx.first_params = None
    handles = [] if cfg.rollout.servers else _launch_servers(cfg, first, start_version,
                                                             local_dir, stack, xla_cache_dir)
    # The learner compiles its train step while the servers compile their shapes.
    startup = {"learner_loaded_s": time.time() - t_process}
    if not multi:  # (process-local micro-batches have another shape per process)
        rows, seq_len = cfg.train.rows_per_micro_batch, cfg.train.seq_len
        learner.precompile(rows, seq_len)
        if ctx.ref_learner is not None:
            ctx.ref_learner.precompile(rows, seq_len)
    startup["learner_compiled_s"] = time.time() - t_process
    if handles:
        _wait_for_servers(cfg, handles)
        startup["servers_ready_s"] = time.time() - t_process
    addresses = list(cfg.rollout.servers) or [h.url for h in handles]

    # Rollout side (process 0): client, reward pool, workflow, prompts, executor.
    from areal_jax.data.prompts import load_prompt_dataset, read_records
    from areal_jax.rewards.pool import RewardPool
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.executor import RolloutExecutor
    from areal_jax.rollout.workflows import RLVRWorkflow, SamplingConfig

    reward_pool = RewardPool(cfg.reward.num_workers, cfg.reward.timeout_s,
                             max_abs=cfg.reward.max_abs)
    stack.callback(reward_pool.close)
    ro = cfg.rollout
    sampling = SamplingConfig(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                              top_p=ro.top_p, top_k=ro.top_k)
    group_filter = (lambda g: len({t.reward for t in g}) > 1) if cfg.algo.dynamic_filter else None
    if ro.workflow == "agent":
        from areal_jax.rollout.agent import AgenticWorkflow

        try:
            workflow: Any = AgenticWorkflow(
                ro.agent, n_samples=ro.n_samples, gconfig=sampling, tokenizer=tokenizer,
                max_turns=ro.max_turns, reward_max_abs=cfg.reward.max_abs,
                group_filter=group_filter, max_total_tokens=min(ro.max_total_tokens or cfg.train.seq_len, ro.max_seq_len))
        except ValueError as e:
            raise TrainerError(f"rollout.agent: {e}") from None
        stack.callback(workflow.close)
    else:
        workflow = RLVRWorkflow(reward_fn, n_samples=ro.n_samples, gconfig=sampling,
                                tokenizer=tokenizer, group_filter=group_filter)
    try:
        prompts = load_prompt_dataset(train_path, prompt_key=cfg.data.prompt_key,
                                      answer_key=cfg.data.answer_key, seed=cfg.seed,
                                      shuffle=cfg.data.shuffle, num_epochs=None)
        eval_items = []
        if eval_path:
            eval_items = [dict(r) for r in read_records(eval_path)]
            for r in eval_items:
                if cfg.data.prompt_key not in r or cfg.data.answer_key not in r:
                    raise ValueError(f"eval dataset {eval_path} rows need keys "
                                     f"{cfg.data.prompt_key!r} and {cfg.data.answer_key!r}; got {sorted(r)}")
                r["prompt"], r["answer"] = r[cfg.data.prompt_key], r[cfg.data.answer_key]
            eval_items = eval_items[: cfg.data.max_eval_prompts or None]
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise TrainerError(str(e)) from None
    client = RolloutClient(addresses, request_timeout=ro.request_timeout_s, api_key=ro.api_key,
                           retry_deadline_s=ro.request_retry_deadline_s)
    executor = RolloutExecutor(client, workflow, iter(prompts), batch_size=cfg.train.batch_size,
                               max_concurrent=cfg.max_concurrent, max_staleness=cfg.eta,
                               seed=cfg.seed, reward_pool=reward_pool, tokenizer=tokenizer,
                               reward_timeout_s=cfg.reward.timeout_s,
                               max_attempts_without_progress=cfg.watchdog.max_attempts_without_progress,
                               max_seconds_without_progress=cfg.watchdog.max_seconds_without_progress)
    if meta.get("executor"):
        executor.load_state_dict(meta["executor"])
    executor.set_version(start_version)
    executor.start()
    stack.callback(executor.stop, 30.0, True)
    if cfg.rollout.servers:  # external servers: bring them to the current weights
        from areal_jax.rollout.client import RolloutError

        try:
            executor.run_coroutine(client.update_weights_from_disk(str(first), start_version))
        except RolloutError as e:
            raise TrainerError(f"rollout.servers cannot load this run's weights v{start_version} "
                               f"(do they serve the same model as model.path?): {e}") from None

    writer = MetricsWriter(local_dir, cfg.train.total_versions, start_version, cfg.progress_bar,
                           resumed=bool(meta))
    stack.callback(writer.close)
    run_files.start()

    # The trajectory pipeline: the B oldest groups -> advantages -> packed micro-batches
    # (over the global batch shards), then, with several processes, each process's rows.
    from areal_jax.data.trajectories import ProcessRowsDataset, TrajectoryBatchDataset

    def advantages(groups: list) -> np.ndarray:
        return group_advantages_for(cfg, [t for g in groups for t in g], len(groups[0]))

    stream = TrajectoryBatchDataset(
        executor, seq_len=cfg.train.seq_len, rows_per_micro_batch=cfg.train.rows_per_micro_batch,
        batch_size=cfg.train.batch_size, n_shards=n_batch_shards(mesh),
        n_minibatches=cfg.algo.ppo_n_minibatches,
        advantages_fn=None if ctx.critic is not None else advantages)  # PPO: GAE after packing
    ctx.batches = iter(ProcessRowsDataset(stream, mesh, start_step=start_version) if multi
                       else stream)
    ctx.executor, ctx.publisher, ctx.writer, ctx.tokenizer = executor, publisher, writer, tokenizer
    ctx.reward_pool, ctx.reward_fn, ctx.eval_items = reward_pool, reward_fn, eval_items
    ctx.run_files = run_files
    ctx.startup = {**startup, "setup_s": time.time() - t_process, "process_start": t_process}
    return ctx


def _build_learner_side(cfg: TrainConfig, resume: bool | None, stack: contextlib.ExitStack,
                        model_path: Path, run_dir: str, ckpt_dir: str, has_ckpt: bool,
                        tokenizer_dir: Path | None = None) -> tuple[RunContext, dict[str, Any]]:
    """The learner (and reference model, critic) on the mesh, the checkpointer and the
    restored state: what every process has. Returns a context without the rollout side
    (which process 0 adds; other processes receive their rows of each batch), and the
    restored checkpoint's meta."""
    import jax

    from areal_jax.checkpoint import TrainCheckpointer
    from areal_jax.checkpoint.publish import host_params
    from areal_jax.learner import Learner
    from areal_jax.parallel import make_mesh

    multi, is_main = jax.process_count() > 1, jax.process_index() == 0
    try:
        mesh = make_mesh(cfg.mesh)
        optim, ppo = learner_configs(cfg)
    except ValueError as e:
        raise TrainerError(user_key_message(str(e))) from None
    # With several processes each one feeds only the rows its devices hold.
    learner = Learner.from_hf(str(model_path), optim, ppo, mesh=mesh, compute_dtype=cfg.model.dtype,
                              remat=cfg.model.remat, process_local_batches=multi)
    ref_learner = None
    if cfg.algo.kl_coef > 0:
        ref_learner = Learner.from_hf(str(model_path), optim, ppo, mesh=mesh,
                                      compute_dtype=cfg.model.dtype, remat=cfg.model.remat,
                                      trainable=False, process_local_batches=multi)
    checkpointer = TrainCheckpointer(ckpt_dir, keep=cfg.checkpoint.keep,
                                     async_save=cfg.checkpoint.async_save)
    stack.callback(checkpointer.close)
    critic = critic_ckpt = None
    if cfg.algo.name == "ppo":  # actor-critic: a value model with its own optimizer state
        from areal_jax.learner.critic import Critic

        critic = Critic.from_hf(str(model_path), optim, mesh=mesh,
                                value_eps_clip=cfg.algo.value_eps_clip,
                                value_coef=cfg.algo.value_coef,
                                ppo_n_minibatches=cfg.algo.ppo_n_minibatches,
                                compute_dtype=cfg.model.dtype, remat=cfg.model.remat)
        critic_ckpt = TrainCheckpointer(f"{ckpt_dir.rstrip('/')}-critic", keep=cfg.checkpoint.keep,
                                        async_save=cfg.checkpoint.async_save)
        stack.callback(critic_ckpt.close)
    meta: dict[str, Any] = {}
    if has_ckpt and resume is not False:
        st = learner.state_dict()
        params, opt_state, meta = checkpointer.restore(params_target=st["params"],
                                                       opt_state_target=st["opt_state"])
        learner.load_state(params, opt_state, step=meta["step"], version=meta["version"])
        if critic is not None:
            cst = critic.state_dict()
            cstep = meta["version"] if meta["version"] in critic_ckpt.all_steps() else None
            cp, co, cmeta = critic_ckpt.restore(cstep, params_target=cst["params"],
                                                opt_state_target=cst["opt_state"])
            critic.load_state(cp, co, step=cmeta["step"], version=cmeta["version"])
        if is_main:
            print(f"resumed from {ckpt_dir} at version {meta['version']} (step {meta['step']})",
                  flush=True)
    start_version = int(meta.get("version", 0))
    ctx = RunContext(
        cfg=cfg, run_dir=run_dir, learner=learner, executor=None, publisher=None,
        checkpointer=checkpointer, writer=None, tokenizer=None, tokenizer_dir=tokenizer_dir,
        reward_pool=None, reward_fn="", eval_items=[], ref_learner=ref_learner,
        critic=critic, critic_ckpt=critic_ckpt, mesh=mesh, is_main=is_main,
        start_version=start_version, consumed_tokens=int(meta.get("consumed_tokens", 0)),
        last_saved_version=start_version if meta else -1,
        elapsed_before=float(meta.get("elapsed_s", 0.0)), rng_seed=cfg.seed)
    # The current weights on the host, for publishing v{start_version} (a collective).
    ctx.first_params = host_params(learner.model)
    if not is_main:
        from areal_jax.data.trajectories import ProcessRowsDataset

        ctx.first_params = None
        ctx.batches = iter(ProcessRowsDataset(None, mesh, start_step=start_version))
    return ctx, meta


def engine_placement(ro: Any) -> tuple[str, dict[str, str] | None]:
    """(JAX_PLATFORMS, extra env) for the embedded engines: ``rollout.engine_platform``
    (default: this process's backend) and ``rollout.engine_devices`` as the platform's
    visible-device variable."""
    import jax

    platform = ro.engine_platform or jax.default_backend()
    if ro.engine_devices is None:
        # Sharing the learner's accelerator: allocate on demand rather than grabbing a
        # fixed fraction of a memory the learner already holds most of.
        return platform, (None if platform == "cpu" else {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if platform == "cpu":
        raise TrainerError("rollout.engine_devices selects accelerators; with engine_platform "
                           "cpu use rollout.server_cpu_cores to pick CPU cores")
    ids = ",".join(str(d) for d in ro.engine_devices)
    var = "TPU_VISIBLE_CHIPS" if platform == "tpu" else (
        "HIP_VISIBLE_DEVICES" if platform == "rocm" else "CUDA_VISIBLE_DEVICES")
    return platform, {var: ids}


def _server_start_error(i: int, e: Exception, cfg: TrainConfig) -> TrainerError:
    first, _, tail = str(e).partition("\n")
    hint = ""
    if "not healthy after" in first:
        hint = (f"; it may still be compiling: raise rollout.server_startup_timeout_s "
                f"(now {cfg.rollout.server_startup_timeout_s:g}s)")
    return TrainerError(f"embedded rollout server {i} failed to start: {first}{hint}"
                        + (f"\n{tail}" if tail else ""))


def _wait_for_servers(cfg: TrainConfig, handles: list) -> None:
    from areal_jax.engine.launch import ServerStartError, wait_healthy

    try:
        wait_healthy(handles, cfg.rollout.server_startup_timeout_s)
    except ServerStartError as e:
        failed = next((i for i, h in enumerate(handles) if h.url in str(e)), 0)
        raise _server_start_error(failed, e, cfg) from None


def _launch_servers(cfg: TrainConfig, weights: str, version: int, run_dir: Path,
                    stack: contextlib.ExitStack, cache_dir: str | None) -> list:
    """Starts the embedded servers without waiting for them (the caller waits with
    ``_wait_for_servers`` once the learner has compiled); returns their handles."""
    from areal_jax.engine.launch import ServerStartError, launch_server

    ro = cfg.rollout
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    platform, device_env = engine_placement(ro)
    handles = []
    for i in range(ro.num_servers):
        try:
            handle = launch_server(weights, max_slots=ro.max_slots, max_seq_len=ro.max_seq_len,
                                   dtype=cfg.model.dtype, jax_platforms=platform, env=device_env,
                                   cpu_affinity=ro.server_cpu_cores, api_key=ro.api_key,
                                   allowed_weight_dirs=[storage.parent_of(weights)],  # later versions
                                   warmup=True,  # compile every shape now, not mid-run
                                   log_path=logs / f"server{i}.log", wait=False,
                                   compilation_cache_dir=cache_dir,
                                   extra_args=["--weight-version", str(version)])
        except (ServerStartError, OSError) as e:
            raise _server_start_error(i, e, cfg) from None
        LIVE_SERVERS.append(handle)
        stack.callback(_forget_server, handle)
        stack.callback(handle.terminate)
        handles.append(handle)
    return handles


LIVE_SERVERS: list[Any] = []  # embedded servers of the running trainer (for a hard exit)


def _forget_server(handle: Any) -> None:
    with contextlib.suppress(ValueError):
        LIVE_SERVERS.remove(handle)


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
