"""A run, from the top: ``main_guarded`` (scripts/train.py's entry: exit status and
one-line errors), ``run_training`` (build, run, shut down) and ``build_trainer``, which
builds every component of a run from its config, in dependency order, after checking
what can be checked up front (``run_inputs``), and registers their shutdown on an
ExitStack. The loop itself is ``trainer.py``; signals and exit codes are ``process.py``.
Nothing in the package imports this module: the arrows go down from here.

With several JAX processes every process builds the learner, the checkpointer and the
trajectory pipeline's receiving end; process 0 alone also the run files, servers,
executor, weight sync and metrics writer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import yaml
from jax.experimental import multihost_utils

from areal_jax import storage
from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer, WeightPublisher
from areal_jax.checkpoint.orbax_ckpt import CheckpointError
from areal_jax.checkpoint.publish import ADAPTER_SUBDIR, serving_copy
from areal_jax.config import RolloutConfig, TrainConfig, to_dict
from areal_jax.cpu_affinity import check_cpus_available, pin_process_to_cpus
from areal_jax.data.advantages import group_advantages_for
from areal_jax.data.prompts import load_prompt_dataset
from areal_jax.data.trajectories import ProcessRowsDataset, TrajectoryBatchDataset
from areal_jax.engine.launch import (
    ServerStartError,
    jax_platform_name,
    launch_servers,
    wait_healthy,
)
from areal_jax.interrupt import Interrupted, raise_if_interrupted
from areal_jax.learner import Learner
from areal_jax.learner.config import AlgoConfig, OptimConfig
from areal_jax.learner.critic import Critic
from areal_jax.learner.packing import micro_batch_shapes
from areal_jax.metrics import MetricsWriter, read_rows, run_summary
from areal_jax.parallel import (
    detected_cluster,
    initialize_distributed,
    job_guard,
    make_mesh,
    n_batch_shards,
    start_job_guard,
)
from areal_jax.process import (
    EXIT_CODES,
    LIVE_SERVERS,
    arm_shutdown_deadline,
    install_signal_handlers,
    is_peer_gone,
)
from areal_jax.rewards import reward_fn_spec
from areal_jax.rewards.pool import RewardPool, resolve_reward_fn
from areal_jax.rollout.client import RolloutClient, RolloutError
from areal_jax.rollout.executor import RolloutExecutor
from areal_jax.rollout.weight_sync import WeightSync
from areal_jax.rollout.workflows import RLVRWorkflow
from areal_jax.run_inputs import (
    CHECKPOINT_DIR_NAMES,
    RunStopped,
    TrainerError,
    check_optional_packages,
    check_prompt_lengths,
    check_servers_reachable,
    enable_compilation_cache,
    load_eval_items,
    prepare_run_dir,
    resolve_dataset,
    resolve_model_path,
)
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import ChatTokenizer, load_tokenizer
from areal_jax.trainer import Progress, RolloutSide, Trainer
from model_defs import PyTree

__all__ = ["build_trainer", "main_guarded", "run_training"]


def main_guarded(cfg: TrainConfig, resume: bool | None) -> int:
    """Entry point used by scripts/train.py: runs training and returns its exit status
    (``EXIT_CODES``; 128 + signal number after SIGINT/SIGTERM). Errors for users are
    printed as one line, never a traceback. With several processes, a process that fails
    tells the others (which exit at once with status 1) and exits without waiting in
    JAX's shutdown barrier."""
    code, message = _run_for_status(cfg, resume)
    guard = job_guard()
    if guard is not None:
        if code == EXIT_CODES["done"]:
            guard.done()
        else:
            guard.fail(message, code)  # does not return
    return code


def _lost_peer_message(e: BaseException, guard: Any) -> str | None:
    """One line for a collective that failed because another process of the job died (a
    bare traceback from deep inside XLA before), naming the peer; None for other errors."""
    text = " ".join(str(e).split())
    if not is_peer_gone(e):
        return None
    peers = guard.silent_peers(wait_s=3 * guard.interval_s + 1.0)
    who = (f"process {', '.join(map(str, peers))} of this job is gone" if peers
           else "another process of this job is gone")
    return (f"error: {who} (a collective of process {guard.process_id} failed: "
            f"{type(e).__name__}: {text[:200]}). Look in {'its' if len(peers) == 1 else 'their'} "
            "log for why it ended, then restart every process of the job: the run resumes "
            "from its last checkpoint")


def _run_for_status(cfg: TrainConfig, resume: bool | None) -> tuple[int, str]:
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
        guard = job_guard()
        if guard is None:
            raise
        lost = _lost_peer_message(e, guard)
        if lost:
            message, code = lost, EXIT_CODES["crash"]
        else:
            traceback.print_exc()
            message, code = f"error: {type(e).__name__}: {e}", EXIT_CODES["crash"]
    else:
        return EXIT_CODES["done"], ""
    print(message, file=sys.stderr, flush=True)
    return code, message


def run_training(cfg: TrainConfig, resume: bool | None = None, *,
                 exit_deadline: bool = False) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns the last metrics row.

    ``resume``: None resumes when the run dir has a checkpoint, True requires one,
    False refuses a run dir that already has one. ``exit_deadline`` (scripts/train.py):
    once the run ends, the process has ``watchdog.shutdown_timeout_s`` to exit, or it
    kills its servers and exits with status 4.
    """
    with contextlib.ExitStack() as stack:
        trainer = build_trainer(cfg, resume, stack)
        # Runs first when the stack unwinds: every shutdown step after it is time-bounded.
        if exit_deadline:
            stack.callback(arm_shutdown_deadline, cfg.watchdog.shutdown_timeout_s,
                           EXIT_CODES["shutdown_timeout"])
        try:
            row = trainer.run()
        except Interrupted:
            if cfg.checkpoint.on_interrupt:
                arm_shutdown_deadline(cfg.watchdog.shutdown_timeout_s,
                                      EXIT_CODES["shutdown_timeout"])
                trainer.checkpoint_on_interrupt()
            raise
        summary = _summary(cfg, trainer) if trainer.is_main else None
    if summary:  # after the shutdown: the last lines on the console
        print(summary, flush=True)
    return row


def _summary(cfg: TrainConfig, trainer: Trainer) -> str:
    """The end-of-run summary (metrics.run_summary) with this run's paths."""
    version = trainer.learner.version

    def where(path: str) -> str:  # absolute: the commands work from any directory
        return path if storage.is_url(path) else os.path.abspath(path)

    run_dir = where(cfg.run_dir)
    published: str | None = storage.join(
        where(cfg.checkpoint.publish_dir or storage.join(run_dir, "weights")), f"v{version}")
    with contextlib.suppress(storage.StorageError, OSError):  # LoRA adapters: no model there
        if not storage.exists(storage.join(published, "config.json")):
            published = None
    # eval.py takes the run's config (reward, keys) from next to RUN_DIR/weights only.
    weights = None if cfg.checkpoint.publish_dir else published
    return run_summary(read_rows(trainer.rollout.writer.path),
                       wall_s=time.time() - process_start_time(), run_dir=run_dir,
                       version=version, weights=weights,
                       ckpt_dir=where(cfg.checkpoint.dir or storage.join(run_dir, "checkpoints")),
                       eval_data=cfg.data.eval or cfg.data.train,
                       serve_model=published or cfg.model.path)


def build_trainer(cfg: TrainConfig, resume: bool | None, stack: contextlib.ExitStack) -> Trainer:
    """Everything a run needs, in dependency order; registers shutdown on ``stack``."""
    t_process = process_start_time()
    check_optional_packages(cfg)  # an extra the config needs and pip did not install
    if cfg.rollout.server_cpu_cores and not cfg.rollout.servers:
        # Checked here, before the learner pins this process, so the error names the key
        # (the servers would report their own flag, --cpu-affinity).
        try:
            check_cpus_available(cfg.rollout.server_cpu_cores)
        except ValueError as e:
            raise TrainerError(f"rollout.server_cpu_cores: {e}") from None
    if cfg.rollout.learner_cpu_cores:
        # Before JAX starts its CPU backend: XLA sizes its thread pools to these cores, and
        # every thread of the process stays on them (cpu_affinity.py).
        try:
            pin_process_to_cpus(cfg.rollout.learner_cpu_cores)
        except ValueError as e:
            raise TrainerError(f"rollout.learner_cpu_cores: {e}") from None
    # Several processes (JAX multi-controller): join before anything touches JAX devices.
    # A one-process run skips this; with nothing set, srun / TPU pod / mpirun jobs are
    # detected by JAX itself (distributed.auto_detect).
    d = cfg.distributed
    try:
        initialize_distributed(d.coordinator_address, d.num_processes, d.process_id,
                               auto_detect=d.auto_detect and detected_cluster() is not None)
    except ValueError as e:
        raise TrainerError(f"distributed: {e}") from None

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
    model_path = resolve_model_path(cfg.model.path, cache_dir, revision=cfg.model.revision)
    tokenizer_dir = (resolve_model_path(cfg.model.tokenizer_path, cache_dir, "model.tokenizer_path")
                     if cfg.model.tokenizer_path else model_path)
    if cfg.rollout.servers and is_main:
        check_servers_reachable(list(cfg.rollout.servers), cfg.rollout.api_key)
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM
    run_dir, ckpt_dir, has_ckpt = prepare_run_dir(cfg, resume)
    if is_main:
        print(f"run directory: {run_dir} (metrics.jsonl, weights/, checkpoints/, logs/)",
              flush=True)
    if not is_main:  # a learner only: its rows of every batch come from process 0
        learner_side = _build_learner_side(cfg, resume, stack, model_path, ckpt_dir, has_ckpt)
        learner_side.pop("first_params"), learner_side.pop("meta")
        start = learner_side["progress"].start_version
        batches = iter(ProcessRowsDataset(None, learner_side.pop("mesh"), start_step=start))
        return Trainer(cfg, batches=batches, rollout=None, **learner_side)

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
    tokenizer = _load_tokenizer(tokenizer_dir)
    reward_fn = _check_reward_fn(cfg.reward.fn)
    try:
        check_prompt_lengths(cfg, tokenizer, train_path)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise TrainerError(f"data.train: {e}") from None
    eval_items = load_eval_items(cfg, eval_path)
    storage.write_text(local_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    run_files.sync()
    publisher = _weight_publisher(cfg, run_dir)
    startup: dict[str, float] = {}
    # A fresh run's first weights are the model's own checkpoint (with its tokenizer): the
    # embedded servers start from it now, while the learner loads and compiles.
    # LoRA adapter mode: the servers serve the base model, always, and load each version's
    # adapter (the first one before anything is generated, below).
    adapter_mode = cfg.model.lora is not None and cfg.model.lora.serving == "adapter"
    handles, fresh = [], not (has_ckpt and resume is not False)
    if not cfg.rollout.servers and (adapter_mode or fresh and tokenizer_dir == model_path):
        handles = _launch_servers(cfg, str(model_path), 0, local_dir, stack, xla_cache_dir,
                                  publisher.weights_dir)
        startup["servers_launched_s"] = time.time() - t_process

    # Learner on its mesh (spanning every process's devices), checkpoint restored.
    learner_side = _build_learner_side(cfg, resume, stack, model_path, ckpt_dir, has_ckpt)
    learner, mesh = learner_side["learner"], learner_side.pop("mesh")
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM
    progress, meta = learner_side["progress"], learner_side.pop("meta")
    start_version = progress.start_version

    # Serving weights for the current version (every process joined the gather in
    # _build_learner_side; process 0 writes them), then the servers if not started yet.
    first = publisher.publish(learner_side.pop("first_params"), learner.model_cfg, start_version,
                              tokenizer_dir=tokenizer_dir)
    if not cfg.rollout.servers and not handles:
        handles = _launch_servers(cfg, first, start_version, local_dir, stack, xla_cache_dir,
                                  publisher.weights_dir)
        startup["servers_launched_s"] = time.time() - t_process
    # The learner compiles its train step while the servers compile their shapes.
    startup["learner_loaded_s"] = time.time() - t_process
    if not multi:  # (process-local micro-batches have another shape per process)
        t = cfg.train
        for rows, seq_len in micro_batch_shapes(t.seq_len, t.rows_per_micro_batch,
                                                n_batch_shards(mesh), t.row_lengths):
            learner.precompile(rows, seq_len)
            if learner_side["ref_learner"] is not None:
                learner_side["ref_learner"].precompile(rows, seq_len)
    startup["learner_compiled_s"] = time.time() - t_process
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM

    # Rollout side (process 0): reward pool, workflow, metrics files, prompts, executor,
    # built while the servers may still be compiling (the metrics writer's TensorBoard
    # import alone, which pulls in torch, takes seconds); then the executor starts.
    reward_pool = RewardPool.from_config(cfg.reward)
    stack.callback(reward_pool.close)
    workflow = _workflow(cfg, tokenizer, reward_fn, stack)
    writer = MetricsWriter.from_config(cfg, local_dir, start_version, resumed=meta is not None)
    stack.callback(writer.close)
    executor = _executor(cfg, workflow, tokenizer, reward_pool, train_path,
                         list(cfg.rollout.servers) or [h.url for h in handles], meta)
    if handles:
        _wait_for_servers(cfg, handles)
        startup["servers_ready_s"] = time.time() - t_process
    executor.set_version(start_version)
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM
    load_first = bool(cfg.rollout.servers) or adapter_mode
    if load_first:
        executor.pause()  # nothing is generated before the servers hold this version
    executor.start()
    stack.callback(executor.stop, 30.0, True)

    weights = WeightSync(executor, lambda params, version: publisher.publish(
        params, learner.model_cfg, version, tokenizer_dir=tokenizer_dir),
        interruptible=cfg.rollout.interruptible,
        adapter_subdir=ADAPTER_SUBDIR if adapter_mode else None)
    if load_first:  # external servers, or adapter mode: bring them to the current weights
        try:
            executor.run_coroutine(weights.update_servers(str(first), start_version))
        except RolloutError as e:
            where = "rollout.servers" if cfg.rollout.servers else "the embedded servers"
            raise TrainerError(f"{where} cannot load this run's weights v{start_version} "
                               f"(do they serve the same model as model.path?): {e}") from None

    run_files.start()

    # The trajectory pipeline: the B oldest groups -> advantages -> packed micro-batches
    # (over the global batch shards), then, with several processes, each process's rows.
    stream = TrajectoryBatchDataset(
        executor, seq_len=cfg.train.seq_len, rows_per_micro_batch=cfg.train.rows_per_micro_batch,
        batch_size=cfg.train.batch_size, n_shards=n_batch_shards(mesh),
        row_lengths=cfg.train.row_lengths,
        n_minibatches=cfg.algo.ppo_n_minibatches,
        advantages_fn=(None if learner_side["critic"] is not None  # PPO: GAE after packing
                       else lambda groups: group_advantages_for(cfg, groups)))
    batches = iter(ProcessRowsDataset(stream, mesh, start_step=start_version) if multi
                   else stream)
    rollout = RolloutSide(executor=executor, weights=weights, writer=writer, run_files=run_files,
                          tokenizer=tokenizer, reward_fn=reward_fn, reward_pool=reward_pool,
                          eval_items=eval_items,
                          eval_workflow=_eval_workflow(cfg, workflow, stack))
    startup.update(setup_s=time.time() - t_process, process_start=t_process)
    return Trainer(cfg, batches=batches, rollout=rollout, startup=startup, **learner_side)


def _load_tokenizer(tokenizer_dir: Path) -> ChatTokenizer:
    try:
        return load_tokenizer(tokenizer_dir)
    except (ValueError, FileNotFoundError, ImportError, AttributeError) as e:
        raise TrainerError(f"tokenizer {tokenizer_dir}: {e}") from None


def _check_reward_fn(spec: str) -> str:
    """The reward function's import spec, checked to resolve now (not in a worker later)."""
    try:
        reward_fn = reward_fn_spec(spec)
        resolve_reward_fn(reward_fn)
    except (ValueError, ImportError, AttributeError) as e:
        raise TrainerError(f"reward.fn {spec!r}: {e}") from None
    return reward_fn


def _weight_publisher(cfg: TrainConfig, run_dir: str) -> WeightPublisher:
    """Where the servers read the serving weights (bf16 safetensors for a bf16 model)."""
    try:
        return WeightPublisher.from_config(cfg.checkpoint, run_dir, cfg.serving_dtype)
    except (storage.StorageError, OSError, ValueError, RuntimeError) as e:
        raise TrainerError(f"checkpoint.publish_dir: {e}") from None


def _workflow(cfg: TrainConfig, tokenizer: Any, reward_fn: str, stack: contextlib.ExitStack) -> Any:
    ro = cfg.rollout
    sampling = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                              top_p=ro.top_p, top_k=ro.top_k)
    group_filter = (lambda g: len({t.reward for t in g}) > 1) if cfg.algo.dynamic_filter else None
    if ro.workflow != "agent":
        return RLVRWorkflow(reward_fn, n_samples=ro.n_samples, gconfig=sampling,
                            tokenizer=tokenizer, group_filter=group_filter)
    from areal_jax.rollout.agent import AgenticWorkflow

    try:
        workflow = AgenticWorkflow(
            ro.agent, n_samples=ro.n_samples, gconfig=sampling, tokenizer=tokenizer,
            max_turns=ro.max_turns, reward_max_abs=cfg.reward.max_abs, group_filter=group_filter,
            max_total_tokens=min(ro.max_total_tokens or cfg.train.seq_len, ro.max_seq_len))
    except ValueError as e:
        raise TrainerError(f"rollout.agent: {e}") from None
    stack.callback(workflow.close)
    return workflow


def _eval_workflow(cfg: TrainConfig, workflow: Any, stack: contextlib.ExitStack) -> Any:
    """An agent run evaluates with its own agent and tools (eval sampling); None: the
    single-turn evaluation only."""
    if cfg.rollout.workflow != "agent":
        return None
    e = cfg.eval
    sampling = SamplingParams(max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
                              temperature=e.temperature, top_p=1.0)
    evaluation = workflow.for_eval(sampling, e.n_samples)
    stack.callback(evaluation.close)
    return evaluation


def _executor(cfg: TrainConfig, workflow: Any, tokenizer: Any, reward_pool: RewardPool,
              train_path: str, addresses: list[str],
              meta: CheckpointMeta | None) -> RolloutExecutor:
    """The rollout executor over the training prompts (its accounting restored from the
    checkpoint's meta; None: a fresh run)."""
    data = cfg.data
    try:
        prompts = load_prompt_dataset(train_path, prompt_key=data.prompt_key,
                                      answer_key=data.answer_key, seed=cfg.seed,
                                      shuffle=data.shuffle, num_epochs=None)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise TrainerError(f"data.train: {e}") from None
    executor = RolloutExecutor.from_config(cfg, RolloutClient.from_config(cfg.rollout, addresses),
                                           workflow, iter(prompts), reward_pool=reward_pool,
                                           tokenizer=tokenizer)
    if meta is not None and meta.executor:
        executor.load_state_dict(meta.executor)
    return executor


def _build_learner_side(cfg: TrainConfig, resume: bool | None, stack: contextlib.ExitStack,
                        model_path: Path, ckpt_dir: str, has_ckpt: bool) -> dict[str, Any]:
    """What every process has: the learner (and reference model, critic) on the mesh, the
    checkpointer, the restored state and progress. Returns the Trainer's learner-side
    arguments plus ``mesh``, the checkpoint's ``meta`` (None for a fresh run) and
    ``first_params`` (a host copy of
    the current weights, for publishing; gathering it is a collective)."""
    multi, is_main = jax.process_count() > 1, jax.process_index() == 0
    try:
        mesh = make_mesh(cfg.mesh)
    except ValueError as e:
        raise TrainerError(str(e)) from None
    optim, algo, loss_kw = learner_configs(cfg)
    model_kw = dict(mesh=mesh, compute_dtype=cfg.model.dtype, remat=cfg.model.remat,
                    attention=cfg.model.attention)
    lora = cfg.model.lora.spec() if cfg.model.lora is not None else None
    # With several processes each one feeds only the rows its devices hold.
    learner = Learner.from_hf(str(model_path), optim, algo, process_local_batches=multi,
                              lora=lora, lora_seed=cfg.seed, **model_kw, **loss_kw)
    ref_learner = None
    if cfg.algo.kl_coef > 0:
        ref_learner = Learner.from_hf(str(model_path), optim, algo, trainable=False,
                                      process_local_batches=multi, **model_kw, **loss_kw)
    checkpointer = TrainCheckpointer.from_config(cfg.checkpoint, ckpt_dir)
    stack.callback(checkpointer.close)
    critic = critic_ckpt = None
    if cfg.algo.name == "ppo":  # actor-critic: a value model with its own optimizer state
        critic = Critic.from_hf(str(model_path), optim, value_eps_clip=cfg.algo.value_eps_clip,
                                value_coef=cfg.algo.value_coef,
                                ppo_n_minibatches=cfg.algo.ppo_n_minibatches, **model_kw)
        critic_ckpt = TrainCheckpointer.from_config(cfg.checkpoint,
                                                    f"{ckpt_dir.rstrip('/')}-critic")
        stack.callback(critic_ckpt.close)
    meta: CheckpointMeta | None = None
    if has_ckpt and resume is not False:
        st = learner.state_dict()
        params, opt_state, meta = _restore_newest(checkpointer, st, is_main)
        learner.load_state(params, opt_state, step=meta.step, version=meta.version)
        if critic is not None:
            cst = critic.state_dict()
            cstep = meta.version if meta.version in critic_ckpt.all_steps() else None
            cp, co, cmeta = critic_ckpt.restore(cstep, params_target=cst["params"],
                                                opt_state_target=cst["opt_state"])
            critic.load_state(cp, co, step=cmeta.step, version=cmeta.version)
        if is_main:
            print(f"resumed from {ckpt_dir} at version {meta.version} (step {meta.step})",
                  flush=True)
    return dict(learner=learner, ref_learner=ref_learner, critic=critic,
                critic_checkpointer=critic_ckpt, checkpointer=checkpointer,
                progress=Progress.from_meta(meta), mesh=mesh, meta=meta,
                first_params=serving_copy(learner.model, cfg.model, cfg.serving_dtype))


def _restore_newest(checkpointer: TrainCheckpointer, state: dict[str, Any], is_main: bool
                    ) -> tuple[PyTree, PyTree | None, CheckpointMeta]:
    """The newest checkpoint that restores. Newer ones that do not (truncated or missing
    files) are named with their cause and renamed ``<step>.unrestorable``, kept; none
    restoring is a TrainerError."""
    try:
        step, params, opt_state, meta, skipped = checkpointer.restore_newest(
            params_target=state["params"], opt_state_target=state["opt_state"])
    except CheckpointError as e:
        raise TrainerError(f"{e}. The run dir is left as it is: start the run in another "
                           "run_dir (or fix or move the checkpoints)") from None
    for bad, why in skipped:
        if is_main:
            kept = checkpointer.set_aside(bad)
            print(f"checkpoint {bad} cannot be restored ({why}); resuming from checkpoint "
                  f"{step} instead (the broken one is kept as {kept})", file=sys.stderr,
                  flush=True)
    if skipped and jax.process_count() > 1:
        multihost_utils.sync_global_devices("areal_jax: unrestorable checkpoints set aside")
        checkpointer.reload()
    return params, opt_state, meta


def learner_configs(cfg: TrainConfig) -> tuple[OptimConfig, AlgoConfig, dict[str, Any]]:
    """The learner's (optim, algo, keyword arguments) for a run config: the ``algo`` section
    as is, ``optim`` with the cosine schedule's length filled in, and the settings that other
    sections hold (the sampling temperature, the logprob chunk, Dr.GRPO's normaliser)."""
    optim = dataclasses.replace(cfg.optim, total_steps=cfg.optimizer_steps)
    seq_norm = (float(cfg.rollout.max_new_tokens) if cfg.algo.agg_mode == "seq-mean-token-sum"
                else None)  # Dr.GRPO: a constant normaliser, the max generation length
    return optim, cfg.algo, {"temperature": cfg.rollout.temperature,
                             "logp_chunk_size": cfg.train.logp_chunk_size,
                             "seq_token_sum_normalizer": seq_norm}


def process_start_time() -> float:
    """When this process started (seconds since the epoch), for start-up timings."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except (ImportError, OSError):
        return time.time()


def engine_placement(ro: RolloutConfig) -> tuple[str, dict[str, str] | None]:
    """(JAX_PLATFORMS, extra env) for the embedded engines: ``rollout.engine_platform``
    (default: this process's backend) and ``rollout.engine_devices`` as the platform's
    visible-device variable."""
    # One platform JAX accepts alone: jax calls a CUDA device "gpu", and JAX_PLATFORMS=gpu
    # means cuda *and* rocm (a child without both plugins would not start).
    platform = jax_platform_name(ro.engine_platform or jax.default_backend())
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
    try:
        wait_healthy(handles, cfg.rollout.server_startup_timeout_s)
    except ServerStartError as e:
        raise _server_start_error(e.index or 0, e, cfg) from None


def _launch_servers(cfg: TrainConfig, weights: str, version: int, run_dir: Path,
                    stack: contextlib.ExitStack, cache_dir: str | None,
                    publish_dir: str) -> list:
    """Starts the embedded servers on ``weights`` without waiting for them (the caller
    waits with ``_wait_for_servers`` once the learner has compiled); later versions come
    from ``publish_dir``. Returns their handles."""
    ro = cfg.rollout
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    platform, device_env = engine_placement(ro)

    def register(handle: Any) -> None:
        LIVE_SERVERS.append(handle)
        stack.callback(_forget_server, handle)
        stack.callback(handle.terminate)

    try:
        return launch_servers(weights, ro.num_servers, wait=False, log_dir=logs, on_start=register,
                              max_slots=ro.max_slots, max_seq_len=ro.max_seq_len,
                              dtype=cfg.serving_dtype, jax_platforms=platform, env=device_env,
                              cpu_affinity=ro.server_cpu_cores, api_key=ro.api_key,
                              allowed_weight_dirs=[publish_dir],  # later versions
                              warmup=True,  # compile every shape now, not mid-run
                              compilation_cache_dir=cache_dir,
                              extra_args=["--weight-version", str(version),
                                          *engine_tuning_args(ro)])
    except ServerStartError as e:
        raise _server_start_error(e.index or 0, e, cfg) from None


def engine_tuning_args(ro: RolloutConfig) -> list[str]:
    """``serve.py`` flags for the rollout section's engine tuning keys that are set."""
    args = []
    if ro.prefill_rows is not None:
        args += ["--prefill-rows", str(ro.prefill_rows)]
    if ro.decode_steps is not None:
        args += ["--decode-steps", str(ro.decode_steps)]
    if ro.engine_layer_loop != "auto":
        args += ["--layer-loop", ro.engine_layer_loop]
    return args


def _forget_server(handle: Any) -> None:
    with contextlib.suppress(ValueError):
        LIVE_SERVERS.remove(handle)
