"""A run, from the top: ``main_guarded`` (scripts/train.py's entry: exit status and
one-line errors), ``run_training`` (build, run, shut down) and ``build_trainer``, which
builds every component of a run from its config, in dependency order, after checking
what can be checked up front (``run_inputs``), and registers their shutdown on an
ExitStack. The loop itself is ``trainer.py``; signals and exit codes are ``process.py``.
Nothing in the package imports this module: the arrows go down from here.

Every process builds the learner side (``build_learner_side`` -> ``LearnerSide``: the
learner on the mesh, its reference model and critic, their checkpointers, the restored
progress); process 0 alone also the rollout side (``RolloutSide``: the run files,
servers, executor, weight sync and metrics writer) and the trajectory pipeline, whose
rows reach the other processes' learners. An input that fails a check is a
``TrainerError`` naming its config key (``run_inputs.input_error``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import yaml
from jax.experimental import multihost_utils

from areal_jax import storage
from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer, WeightPublisher
from areal_jax.checkpoint.delta import DeltaPublisher
from areal_jax.checkpoint.distributed import DistributedPublisher
from areal_jax.checkpoint.orbax_ckpt import CheckpointError
from areal_jax.checkpoint.publish import ADAPTER_SUBDIR, serving_copy
from areal_jax.checkpoint.stream import StreamPublisher, serving_shapes
from areal_jax.config import RolloutConfig, TrainConfig, to_dict
from areal_jax.cpu_affinity import check_cpus_available, pin_process_to_cpus
from areal_jax.data.prompts import load_prompt_dataset
from areal_jax.data.sft import SFTBatches, sft_examples
from areal_jax.data.trajectories import ProcessRowsDataset, TrainBatch, TrajectoryBatchDataset
from areal_jax.engine.launch import (
    ServerStartError,
    engine_startup,
    jax_platform_name,
    launch_server,
    wait_healthy,
)
from areal_jax.interrupt import Interrupted, raise_if_interrupted
from areal_jax.learner import Learner
from areal_jax.learner.config import AlgoConfig, OptimConfig
from areal_jax.learner.critic import Critic
from areal_jax.learner.packing import PackedBatch, micro_batch_shapes, pack_trajectories
from areal_jax.learner.trainable import TrainableModel
from areal_jax.metrics import MetricsWriter, read_rows, run_summary
from areal_jax.parallel import (
    Placement,
    PlacementError,
    check_learner_backend,
    detected_cluster,
    initialize_distributed,
    job_guard,
    make_mesh,
    n_batch_shards,
    start_job_guard,
    start_placement,
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
from areal_jax.rollout.workflows import DistinctRewards, RLVRWorkflow
from areal_jax.run_inputs import (
    CHECKPOINT_DIR_NAMES,
    RunStopped,
    TrainerError,
    check_optional_packages,
    check_prompt_lengths,
    check_servers_reachable,
    enable_compilation_cache,
    input_error,
    load_eval_items,
    prepare_run_dir,
    resolve_dataset,
    resolve_model_path,
)
from areal_jax.run_lock import lock_run_dir
from areal_jax.run_models import ModelServers, advantages_fn, eval_reward_name
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import ChatTokenizer, load_tokenizer
from areal_jax.trainer import LearnerSide, Progress, RolloutSide, SFTTrainer, Trainer
from areal_jax.trajectory import Trajectory
from model_defs import ModelConfig

__all__ = ["build_learner_side", "build_trainer", "main_guarded", "run_training"]


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
    version_dir = storage.join(
        where(cfg.checkpoint.publish_dir or storage.join(run_dir, "weights")), f"v{version}")
    published: str | None = version_dir
    with contextlib.suppress(storage.StorageError, OSError):  # LoRA adapters: no model there
        if not storage.exists(storage.join(version_dir, "config.json")):
            published = None
    # eval.py takes the run's config (reward, keys) from next to RUN_DIR/weights only.
    weights = None if cfg.checkpoint.publish_dir else published
    assert trainer.rollout is not None  # process 0's summary
    return run_summary(read_rows(trainer.rollout.writer.path),
                       wall_s=time.time() - process_start_time(), run_dir=run_dir,
                       version=version, weights=weights,
                       ckpt_dir=where(cfg.checkpoint.dir or storage.join(run_dir, "checkpoints")),
                       eval_data=cfg.data.eval or cfg.data.train,
                       serve_model=published or cfg.model.path)


def build_trainer(cfg: TrainConfig, resume: bool | None, stack: contextlib.ExitStack) -> Trainer:
    """Everything a run needs, in dependency order; registers shutdown on ``stack``."""
    startup = {"process_start": process_start_time()}  # then seconds to each milestone
    _mark(startup, "imports_s")  # the interpreter, train.py's imports and the config
    xla_cache_dir = _start_process(cfg)
    # Cheap checks first: nothing below this block takes long.
    is_main, cache_dir = jax.process_index() == 0, cfg.storage.cache_dir
    model_path = resolve_model_path(cfg.model.path, cache_dir, revision=cfg.model.revision)
    tokenizer_dir = (resolve_model_path(cfg.model.tokenizer_path, cache_dir, "model.tokenizer_path")
                     if cfg.model.tokenizer_path else model_path)
    if cfg.rollout.servers and is_main:
        check_servers_reachable(list(cfg.rollout.servers), cfg.rollout.api_key)
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM
    run_dir, ckpt_dir, has_ckpt = prepare_run_dir(cfg, resume)
    if is_main:  # one trainer per run dir (a second one exits 2 naming the holder)
        stack.enter_context(lock_run_dir(run_dir))
    restore = has_ckpt and resume is not False
    if not is_main:  # a learner only: its rows of every batch come from process 0
        side = build_learner_side(cfg, stack, model_path, ckpt_dir, restore=restore)
        serving_copy(side.learner.model, cfg.model, cfg.serving_dtype)  # process 0's gather
        return Trainer(cfg, side, batches=_trajectory_batches(cfg, None, side), rollout=None)

    print(f"run directory: {run_dir} (metrics.jsonl, weights/, checkpoints/, logs/)", flush=True)
    print(run_placement(cfg).describe(), flush=True)  # the plan (parallel/placement.py)
    inputs = _rollout_inputs(cfg, run_dir, tokenizer_dir, stack)
    sft_data = _sft_examples(cfg, inputs) if cfg.mode == "sft" else None  # checked up front
    launch = functools.partial(_launch_servers, cfg, run_dir=inputs.run_files.local, stack=stack,
                               cache_dir=xla_cache_dir, publish_dir=inputs.publisher.weights_dir)
    # A fresh run's first weights are the model's own checkpoint (with its tokenizer): the
    # embedded servers start from it now, while the learner loads and compiles.
    # LoRA adapter mode: the servers serve the base model, always, and load each version's
    # adapter (the first one before anything is generated, in _rollout_side).
    handles: list = []
    fresh_weights = cfg.mode == "sft" and cfg.sft.random_init  # not the checkpoint's own
    if not cfg.rollout.servers and (_serves_adapters(cfg) or not restore and not fresh_weights
                                    and tokenizer_dir == model_path):
        handles = launch(str(model_path), 0)
        _mark(startup, "servers_launched_s")

    # Learner on its mesh (spanning every process's devices), checkpoint restored, and a
    # host copy of its weights (gathering it is a collective every process joins).
    side = build_learner_side(cfg, stack, model_path, ckpt_dir, restore=restore)
    first_params = serving_copy(side.learner.model, cfg.model, cfg.serving_dtype)
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM
    # Serving weights for the current version, then the servers if not started yet.
    version = side.progress.start_version
    first = inputs.publisher.publish(first_params, side.learner.model_cfg, version,
                                     tokenizer_dir=tokenizer_dir)
    if inputs.deltas is not None:  # the next version's delta is against this one
        inputs.deltas.seed(first_params, version)
    del first_params  # written: the run does not keep this host copy
    if not cfg.rollout.servers and not handles:
        handles = launch(first, version)
        _mark(startup, "servers_launched_s")
    # The learner compiles its train step while the servers compile their shapes.
    _mark(startup, "learner_loaded_s")
    _precompile(cfg, side)
    _mark(startup, "learner_compiled_s")
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM

    rollout = _rollout_side(cfg, stack, inputs, side, handles, first, startup)
    if sft_data is not None:
        batches, eval_batches = _sft_batches(cfg, side, *sft_data)
        _mark(startup, "setup_s")
        return SFTTrainer(cfg, side, batches=batches, rollout=rollout,
                          eval_batches=eval_batches, startup=startup)
    batches = _trajectory_batches(cfg, rollout.executor, side)
    _mark(startup, "setup_s")
    return Trainer(cfg, side, batches=batches, rollout=rollout, startup=startup)


def _sft_examples(cfg: TrainConfig, inputs: _RolloutInputs
                  ) -> tuple[list[Trajectory], list[Trajectory]]:
    """mode=sft: the training and held-out examples of data.train and data.eval (chat
    messages or prompt/completion rows, ``data/sft.py``), tokenized and checked now."""
    from areal_jax.data.prompts import read_records

    def examples(path: str, key: str, limit: int | None = None) -> list[Trajectory]:
        with input_error(key, ValueError, FileNotFoundError):
            rows = read_records(path)[:limit]
            return sft_examples(rows, inputs.tokenizer, prompt_key=cfg.data.prompt_key,
                                completion_key=cfg.sft.completion_key,
                                messages_key=cfg.sft.messages_key, max_tokens=cfg.train.seq_len,
                                source=f"{key} {path}")

    train = examples(inputs.train_path, "data.train")
    held_out = (examples(inputs.eval_path, "data.eval", cfg.data.max_eval_prompts)
                if inputs.eval_path else [])
    return train, held_out


def _sft_batches(cfg: TrainConfig, side: LearnerSide, train: list[Trajectory],
                 held_out: list[Trajectory]) -> tuple[Iterator[TrainBatch], list[PackedBatch]]:
    """mode=sft: the stream of training batches from the run's version on, and the held-out
    examples packed once."""
    t = cfg.train
    pack: dict[str, Any] = dict(seq_len=t.seq_len, rows_per_micro_batch=t.rows_per_micro_batch,
                                n_shards=n_batch_shards(side.mesh), row_lengths=t.row_lengths)
    stream = SFTBatches(train, batch_size=t.batch_size, seed=cfg.seed,
                        pack_kwargs={**pack, "n_minibatches": cfg.algo.ppo_n_minibatches},
                        start_version=side.progress.start_version)
    return iter(stream), (pack_trajectories(held_out, None, **pack) if held_out else [])


def _mark(startup: dict[str, float], milestone: str) -> None:
    """Seconds from process start (``startup["process_start"]``) to ``milestone``, now."""
    startup[milestone] = time.time() - startup["process_start"]


def _start_process(cfg: TrainConfig) -> str | None:
    """This process's place in the job, before anything touches JAX devices: the optional
    packages the config needs, CPU pinning, joining the job's other processes, the XLA
    compilation cache and the job guard. Returns the cache's directory (None: off)."""
    check_optional_packages(cfg)  # an extra the config needs and pip did not install
    placement = run_placement(cfg)  # this process's devices, before JAX starts
    ro, d = cfg.rollout, cfg.distributed
    if ro.server_cpu_cores and not ro.servers:
        # Checked here, before the learner pins this process, so the error names the key
        # (the servers would report their own flag, --cpu-affinity).
        with input_error("rollout.server_cpu_cores", ValueError):
            check_cpus_available(ro.server_cpu_cores)
    if ro.learner_cpu_cores:
        # Before JAX starts its CPU backend: XLA sizes its thread pools to these cores, and
        # every thread of the process stays on them (cpu_affinity.py).
        with input_error("rollout.learner_cpu_cores", ValueError):
            pin_process_to_cpus(ro.learner_cpu_cores)
    # Several processes (JAX multi-controller): join before anything touches JAX devices.
    # A one-process run skips this; with nothing set, srun / TPU pod / mpirun jobs are
    # detected by JAX itself (distributed.auto_detect).
    with input_error("distributed", ValueError):
        initialize_distributed(d.coordinator_address, d.num_processes, d.process_id,
                               auto_detect=d.auto_detect and detected_cluster() is not None)
    xla_cache_dir = enable_compilation_cache(cfg.compilation_cache_dir)  # before any compile
    guard = start_job_guard(d.peer_timeout_s)  # one process failing ends all of them
    if guard is not None:
        guard.add_cleanup(lambda: [handle.kill() for handle in list(LIVE_SERVERS)])
    with input_error("hardware", PlacementError, what=""):
        check_learner_backend(placement)  # JAX started where the placement put the learner
    if jax.process_count() > 1 and cfg.mode == "sft":
        raise TrainerError(f"mode=sft runs as one process (one host's devices, any mesh); this "
                           f"job has {jax.process_count()}")
    if jax.process_count() > 1 and cfg.algo.name == "ppo":
        raise TrainerError("algo.name=ppo (a critic with GAE over whole trajectories) runs as one "
                           f"process; this job has {jax.process_count()}: use grpo/rloo/drgrpo")
    return xla_cache_dir


def _serves_adapters(cfg: TrainConfig) -> bool:
    """LoRA adapter mode: the servers keep the base model and load each version's adapter."""
    return cfg.model.lora is not None and cfg.model.lora.serving == "adapter"


@dataclasses.dataclass(frozen=True)
class _RolloutInputs:
    """What process 0 checks and writes before the learner loads."""

    run_files: storage.RunFiles  # the run's own files: metrics, logs, config
    train_path: str
    tokenizer_dir: Path
    tokenizer: ChatTokenizer
    reward_fn: str  # the reward function's import spec, checked to resolve
    eval_items: list[dict[str, Any]]
    publisher: WeightPublisher  # where the servers read the serving weights
    eval_path: str | None = None  # data.eval, resolved (SFT: the held-out examples)
    deltas: DeltaPublisher | None = None  # checkpoint.publish: delta, in the publish dir


def _rollout_inputs(cfg: TrainConfig, run_dir: str, tokenizer_dir: Path,
                    stack: contextlib.ExitStack) -> _RolloutInputs:
    """The run files (a local working copy, uploaded on a schedule for gs://), the datasets,
    tokenizer, reward function and eval prompts, each checked now rather than in a worker
    later; the run's config.yaml written; the serving weights' publisher."""
    with input_error("run_dir", storage.StorageError, OSError,
                     what=f"run_dir {run_dir}: cannot set up the run files"):
        run_files = storage.RunFiles(run_dir, cache_dir=cfg.storage.cache_dir,
                                     upload_every_s=cfg.storage.upload_every_s,
                                     exclude=CHECKPOINT_DIR_NAMES)
    stack.callback(run_files.close)  # the last upload, after the metrics writer has closed
    local_dir = run_files.local
    train_path = resolve_dataset(cfg.data.train, local_dir, "data.train")
    eval_path = resolve_dataset(cfg.data.eval, local_dir, "data.eval") if cfg.data.eval else None
    with input_error("tokenizer", ValueError, FileNotFoundError, ImportError, AttributeError,
                     what=f"tokenizer {tokenizer_dir}"):
        tokenizer = load_tokenizer(tokenizer_dir)
    with input_error("reward.fn", ValueError, ImportError, AttributeError,
                     what=f"reward.fn {cfg.reward.fn!r}"):
        reward_fn = reward_fn_spec(eval_reward_name(cfg))  # the pool's (evals'); see run_models
        resolve_reward_fn(reward_fn)
    ModelServers.check(cfg)  # the judge's, reward model's and teacher's inputs, now
    sft = cfg.mode == "sft"  # SFT rows hold examples, checked when they are tokenized
    if not sft:
        with input_error("data.train", ValueError, KeyError, FileNotFoundError):
            check_prompt_lengths(cfg, tokenizer, train_path)
    eval_items = load_eval_items(cfg, eval_path) if not sft or cfg.sft.eval_accuracy else []
    storage.write_text(local_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    run_files.sync()
    with input_error("checkpoint.publish_dir", storage.StorageError, OSError, ValueError,
                     RuntimeError):  # bf16 safetensors for a bf16 model
        publisher = WeightPublisher.from_config(cfg.checkpoint, run_dir, cfg.serving_dtype)
        deltas = (DeltaPublisher.from_config(cfg.checkpoint, publisher.weights_dir)
                  if cfg.publish_path == "delta" else None)
    return _RolloutInputs(run_files=run_files, train_path=train_path, tokenizer_dir=tokenizer_dir,
                          tokenizer=tokenizer, reward_fn=reward_fn, eval_items=eval_items,
                          publisher=publisher, eval_path=eval_path, deltas=deltas)


def _precompile(cfg: TrainConfig, side: LearnerSide) -> None:
    """The learner's (and reference model's) programs for every micro-batch shape, compiled
    now. One process only: process-local micro-batches have another shape per process."""
    if jax.process_count() > 1:
        return
    t = cfg.train
    for rows, seq_len in micro_batch_shapes(t.seq_len, t.rows_per_micro_batch,
                                            n_batch_shards(side.mesh), t.row_lengths):
        if cfg.mode == "sft":
            side.learner.precompile_sft(rows, seq_len)
            continue
        side.learner.precompile(rows, seq_len)
        if side.ref_learner is not None:
            side.ref_learner.precompile(rows, seq_len)


def _rollout_side(cfg: TrainConfig, stack: contextlib.ExitStack, inputs: _RolloutInputs,
                  side: LearnerSide, handles: list, first: str,
                  startup: dict[str, float]) -> RolloutSide:
    """Process 0's side: reward pool, workflow, metrics files, prompts and executor, built
    while the servers may still be compiling (the metrics writer's TensorBoard import
    alone, which pulls in torch, takes seconds); then, the servers ready, the executor
    starts at the current version, and the servers that do not hold it yet (external
    ones, adapter mode) load the first weights ``first``."""
    version, meta = side.progress.start_version, side.meta
    reward_pool = RewardPool.from_config(cfg.reward)
    stack.callback(reward_pool.close)
    # The judge and teacher servers (run_models.py): the judge is the training reward, the
    # teacher scores the training workflow's samples.
    models = ModelServers.start(cfg, inputs.run_files.local, stack, cfg.compilation_cache_dir)
    workflow = make_workflow(cfg, inputs.tokenizer, models.reward(inputs.reward_fn, stack),
                             stack)
    writer = MetricsWriter.from_config(cfg, inputs.run_files.local, version,
                                       resumed=meta is not None)
    stack.callback(writer.close)
    train_workflow = models.wrap(workflow, stack)  # the teacher scores training samples only
    executor = _executor(cfg, train_workflow, inputs.tokenizer, reward_pool, inputs.train_path,
                         list(cfg.rollout.servers) or [h.url for h in handles], meta)
    if handles:
        _wait_for_servers(cfg, handles)
        _mark(startup, "servers_ready_s")
        startup.update(engine_startup(handles[0]))  # the first server's own breakdown
    models.wait()
    executor.set_version(version)
    raise_if_interrupted()  # a safe point for SIGINT/SIGTERM
    load_first = bool(cfg.rollout.servers) or _serves_adapters(cfg)
    if load_first:
        executor.pause()  # nothing is generated before the servers hold this version
    executor.start()
    stack.callback(executor.stop, 30.0, True)

    def write_files(params: Any, v: int) -> str:
        return inputs.publisher.publish(params, side.learner.model_cfg, v,
                                        tokenizer_dir=inputs.tokenizer_dir)

    memory = cfg.publish_path == "memory"  # checkpoint.publish
    write: Callable[[Any, int], str] = write_files
    if memory:
        sender = StreamPublisher([h.url for h in handles], api_key=cfg.rollout.api_key,
                                 bucket_bytes=cfg.checkpoint.publish_bucket_mb << 20,
                                 spare_file=cfg.checkpoint.publish_spare_file,
                                 swap_aborts=cfg.rollout.interruptible)
        stack.callback(sender.close)
        # the first version's file, made while the first batch is generated and trained on
        sender.prepare(serving_shapes(side.learner.model, cfg.serving_dtype))
        write = sender.send
    push = None
    if cfg.publish_path == "distributed":  # SGLang's torch-group update, learner at rank 0
        push = _distributed_sender(cfg, side.learner.model_cfg,
                                   list(cfg.rollout.servers) or [h.url for h in handles],
                                   stack).send
    weights = WeightSync(executor, write,
                         interruptible=cfg.rollout.interruptible,
                         adapter_subdir=ADAPTER_SUBDIR if _serves_adapters(cfg) else None,
                         staged=memory, files=write_files, deltas=inputs.deltas,
                         push=push, pause_servers=cfg.rollout.sglang is not None
                         or bool(cfg.rollout.servers))
    if load_first:
        where = "rollout.servers" if cfg.rollout.servers else "the embedded servers"
        with input_error("rollout.servers", RolloutError,
                         what=f"{where} cannot load this run's weights v{version} "
                              "(do they serve the same model as model.path?)"):
            executor.run_coroutine(weights.update_servers(str(first), version))
    inputs.run_files.start()
    return RolloutSide(executor=executor, weights=weights, writer=writer,
                       run_files=inputs.run_files, tokenizer=inputs.tokenizer,
                       reward_fn=inputs.reward_fn, reward_pool=reward_pool,
                       eval_items=inputs.eval_items,
                       eval_workflow=_eval_workflow(cfg, workflow, stack))


def _distributed_sender(cfg: TrainConfig, model_cfg: ModelConfig, urls: list[str],
                        stack: contextlib.ExitStack) -> DistributedPublisher:
    """checkpoint.publish: distributed's sender (``checkpoint/distributed.py``); the group
    is made at the first version and left when the run ends."""
    ck = cfg.checkpoint
    embedded = not cfg.rollout.servers and cfg.rollout.sglang is None
    sender = DistributedPublisher(
        urls, model_cfg, backend=ck.distributed_backend,
        master_address=ck.distributed_master_address, master_port=ck.distributed_master_port,
        api_key=cfg.rollout.api_key, bucket_bytes=ck.publish_bucket_mb << 20,
        timeout_s=ck.distributed_timeout_s,
        server_timeout_s=ck.distributed_timeout_s if embedded else None)  # SGLang: its own
    stack.callback(sender.close)
    return sender


def _trajectory_batches(cfg: TrainConfig, executor: RolloutExecutor | None,
                        side: LearnerSide) -> Iterator[TrainBatch]:
    """This process's rows of each batch. On process 0 (``executor``), the trajectory
    pipeline: the B oldest groups -> advantages -> packed micro-batches (over the global
    batch shards); with several processes, each process's rows of them, which the others
    (no ``executor``) receive from process 0."""
    stream = None
    if executor is not None:
        stream = TrajectoryBatchDataset(
            executor, seq_len=cfg.train.seq_len,
            rows_per_micro_batch=cfg.train.rows_per_micro_batch,
            batch_size=cfg.train.batch_size, n_shards=n_batch_shards(side.mesh),
            row_lengths=cfg.train.row_lengths,
            n_minibatches=cfg.algo.ppo_n_minibatches,
            advantages_fn=(None if side.critic is not None  # PPO: GAE after packing
                           else advantages_fn(cfg)))
    if jax.process_count() > 1:
        return iter(ProcessRowsDataset(stream, side.mesh, start_step=side.progress.start_version))
    assert stream is not None  # one process: process 0
    return iter(stream)


def make_workflow(cfg: TrainConfig, tokenizer: Any, reward_fn: Any,  # a pool spec or a judge
                  stack: contextlib.ExitStack) -> Any:
    """The run's workflow from its config (single-turn RLVR or the agent's), its sampling,
    group size and ``algo.dynamic_filter``."""
    ro = cfg.rollout
    sampling = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                              top_p=ro.top_p, top_k=ro.top_k)
    group_filter = DistinctRewards("algo.dynamic_filter") if cfg.algo.dynamic_filter else None
    if ro.workflow != "agent":
        return RLVRWorkflow(reward_fn, n_samples=ro.n_samples, gconfig=sampling,
                            tokenizer=tokenizer, group_filter=group_filter)
    from areal_jax.rollout.agent import AgenticWorkflow

    assert ro.agent is not None  # the config requires it with workflow: agent
    with input_error("rollout.agent", ValueError):
        workflow = AgenticWorkflow(
            ro.agent, n_samples=ro.n_samples, gconfig=sampling, tokenizer=tokenizer,
            max_turns=ro.max_turns, reward_max_abs=cfg.reward.max_abs, group_filter=group_filter,
            max_total_tokens=min(ro.max_total_tokens or cfg.train.seq_len, ro.max_seq_len))
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
    data, prompts = cfg.data, None  # SFT: no prompts (the executor serves eval and updates)
    if cfg.mode != "sft":
        with input_error("data.train", ValueError, KeyError, FileNotFoundError):
            prompts = iter(load_prompt_dataset(train_path, prompt_key=data.prompt_key,
                                               answer_key=data.answer_key, seed=cfg.seed,
                                               shuffle=data.shuffle, num_epochs=None))
    executor = RolloutExecutor.from_config(cfg, RolloutClient.from_config(cfg.rollout, addresses),
                                           workflow, prompts, reward_pool=reward_pool,
                                           tokenizer=tokenizer)
    if meta is not None and meta.executor:
        executor.load_state_dict(meta.executor)
    return executor


def build_learner_side(cfg: TrainConfig, stack: contextlib.ExitStack, model_path: Path,
                       ckpt_dir: str, *, restore: bool) -> LearnerSide:
    """What every process has: the learner (and reference model, critic) on the mesh and
    their checkpointers in ``ckpt_dir``; with ``restore``, their state and the run's
    progress from the newest checkpoint there that restores."""
    multi, is_main = jax.process_count() > 1, jax.process_index() == 0
    with input_error("mesh", ValueError):
        mesh = make_mesh(cfg.mesh)
    optim, algo, loss_kw = learner_configs(cfg)
    model_kw: dict[str, Any] = dict(mesh=mesh, compute_dtype=cfg.model.dtype,
                                    remat=cfg.model.remat, attention=cfg.model.attention)
    lora = cfg.model.lora.spec() if cfg.model.lora is not None else None
    # With several processes each one feeds only the rows its devices hold.
    sft = cfg.mode == "sft"  # no reference model or critic: the algo section is RL's
    learner = Learner.from_hf(str(model_path), optim, algo, process_local_batches=multi,
                              lora=lora, lora_seed=cfg.seed,
                              random_init_seed=cfg.seed if sft and cfg.sft.random_init else None,
                              **model_kw, **loss_kw)
    ref_learner = None
    if cfg.algo.kl_coef > 0 and not sft:
        ref_learner = Learner.from_hf(str(model_path), optim, algo, trainable=False,
                                      process_local_batches=multi, **model_kw, **loss_kw)
    checkpointer = TrainCheckpointer.from_config(cfg.checkpoint, ckpt_dir)
    stack.callback(checkpointer.close)
    critic, critic_ckpt = None, None
    if cfg.algo.name == "ppo" and not sft:  # actor-critic: a value model, its own optimizer
        critic = Critic.from_hf(str(model_path), optim, value_eps_clip=cfg.algo.value_eps_clip,
                                value_coef=cfg.algo.value_coef,
                                ppo_n_minibatches=cfg.algo.ppo_n_minibatches,
                                value_loss=cfg.critic.loss,
                                huber_delta=cfg.critic.huber_delta, **model_kw)
        critic_ckpt = TrainCheckpointer.from_config(cfg.checkpoint,
                                                    f"{ckpt_dir.rstrip('/')}-critic")
        stack.callback(critic_ckpt.close)
    meta = None
    if restore:
        meta = _restore_newest(checkpointer, learner, is_main)
        if critic is not None and critic_ckpt is not None:
            _restore_critic(critic_ckpt, critic, meta.version, is_main)
        if is_main:
            print(f"resumed from {ckpt_dir} at version {meta.version} (step {meta.step})",
                  flush=True)
    return LearnerSide(learner=learner, checkpointer=checkpointer,
                       progress=Progress.from_meta(meta), mesh=mesh, meta=meta,
                       ref_learner=ref_learner, critic=critic, critic_checkpointer=critic_ckpt)


def _restore_newest(checkpointer: TrainCheckpointer, model: TrainableModel,
                    is_main: bool) -> CheckpointMeta:
    """Loads the newest checkpoint that restores into ``model``; returns its meta. Newer
    ones that do not (truncated or missing files) are named with their cause and renamed
    ``<step>.unrestorable``, kept; none restoring is a TrainerError."""
    state = model.state_dict()
    with input_error("checkpoint.dir", CheckpointError, what="",
                     hint="the run dir is left as it is: start the run in another run_dir "
                          "(or fix or move the checkpoints)"):
        step, params, opt_state, meta, skipped = checkpointer.restore_newest(
            params_target=state["params"], opt_state_target=state["opt_state"])
    for bad, why in skipped:
        if is_main:
            kept = checkpointer.set_aside(bad)
            print(f"checkpoint {bad} cannot be restored ({why}); resuming from checkpoint "
                  f"{step} instead (the broken one is kept as {kept})", file=sys.stderr,
                  flush=True)
    if skipped and jax.process_count() > 1:
        multihost_utils.sync_global_devices("areal_jax: unrestorable checkpoints set aside")
        checkpointer.reload()
    model.load_state(params, opt_state, step=meta.step, version=meta.version)
    return meta


def _restore_critic(checkpointer: TrainCheckpointer, critic: Critic, version: int,
                    is_main: bool) -> None:
    """The critic's checkpoint of the policy's restored ``version``, loaded into ``critic``:
    the two always resume together. Newer critic checkpoints (a timeline the policy fell
    back from: its newest checkpoint did not restore) are renamed ``<step>.unrestorable``,
    kept, so that version can be saved again. A critic checkpoint of that version that is
    missing (a run trained without a critic, e.g. algo.name=grpo, resumed as ppo) or does
    not restore is a TrainerError: one line, the run dir left as it is."""
    where = checkpointer.directory
    hint = ("the run dir is left as it is: resume it with the algo.name it was trained with, "
            "or start the run in another run_dir")
    steps = checkpointer.all_steps()
    if version not in steps:
        held = f"it holds versions {steps}" if steps else "it holds no critic checkpoint"
        raise TrainerError(
            f"checkpoint.dir: algo.name=ppo resumes the critic with the policy, but {where} "
            f"has no critic checkpoint of the policy's version {version} ({held}; was the run "
            f"trained with another algo.name?); {hint}")
    newer = [s for s in steps if s > version]
    state = critic.state_dict()
    try:
        params, opt_state, meta = checkpointer.restore(version, params_target=state["params"],
                                                       opt_state_target=state["opt_state"])
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore/json raise many kinds
        cause = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ else e
        text = " ".join(str(cause).split())[:300]
        raise TrainerError(f"checkpoint.dir: the critic's checkpoint of version {version} in "
                           f"{where} cannot be restored ({type(cause).__name__}: {text}); "
                           f"{hint}") from None
    if newer and is_main:
        for step in newer:
            kept = checkpointer.set_aside(step)
            print(f"critic checkpoint {step} is newer than the policy's restored version "
                  f"{version} (the policy fell back); set aside as {kept}", file=sys.stderr,
                  flush=True)
    if newer and jax.process_count() > 1:
        multihost_utils.sync_global_devices("areal_jax: newer critic checkpoints set aside")
        checkpointer.reload()
    critic.load_state(params, opt_state, step=meta.step, version=meta.version)


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


PROCESS_START_ENV = "AREAL_JAX_PROCESS_START"  # scripts/train.py's first statement sets it


def process_start_time() -> float:
    """When this process started (seconds since the epoch), for start-up timings and the
    run summary: the later of its creation (a shell that execs python created it earlier,
    e.g. ``bash -c "...; python scripts/train.py"``) and ``$AREAL_JAX_PROCESS_START``,
    which train.py sets as it starts (one inherited from a parent is older: ignored)."""
    try:
        import psutil

        created = float(psutil.Process().create_time())
    except (ImportError, OSError):
        created = time.time()
    try:
        marked = float(os.environ.get(PROCESS_START_ENV, "") or 0.0)
    except ValueError:
        marked = 0.0
    return max(created, marked) if marked <= time.time() else created


def run_placement(cfg: TrainConfig) -> Placement:
    """The run's placement (parallel/placement.py): which devices the learner and each
    rollout server get, and the environment that gives them; the one train.py printed."""
    try:
        return start_placement(cfg, announce=False)
    except PlacementError as e:
        raise TrainerError(str(e)) from None


def engine_placement(cfg: TrainConfig) -> list[tuple[str, dict[str, str] | None]]:
    """(JAX_PLATFORMS, extra env) of each embedded engine: its platform, and, on an
    accelerator, the device the run's placement gave it (and its memory share on a card
    it shares)."""
    engines = run_placement(cfg).engines
    if not engines:  # on the CPU
        return [("cpu", None)] * cfg.rollout.num_servers
    # One platform JAX accepts alone: jax calls a CUDA device "gpu", and JAX_PLATFORMS=gpu
    # means cuda *and* rocm (a child without both plugins would not start).
    return [(jax_platform_name(p.platform), dict(p.env) or None) for p in engines]


def _server_start_error(i: int, e: Exception, cfg: TrainConfig) -> TrainerError:
    first, _, tail = str(e).partition("\n")
    hint = ""
    if "not healthy after" in first:
        hint = (f"; it may still be compiling: raise rollout.server_startup_timeout_s "
                f"(now {cfg.rollout.server_startup_timeout_s:g}s)")
    return TrainerError(f"embedded rollout server {i} failed to start: {first}{hint}"
                        + (f"\n{tail}" if tail else ""))


def _wait_for_servers(cfg: TrainConfig, handles: list) -> None:
    sg = cfg.rollout.sglang
    try:
        wait_healthy(handles, sg.startup_timeout_s if sg else cfg.rollout.server_startup_timeout_s)
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

    def register(handle: Any) -> None:
        LIVE_SERVERS.append(handle)
        stack.callback(_forget_server, handle)
        stack.callback(handle.terminate)

    if ro.sglang is not None:
        return _launch_sglang(cfg, weights, version, logs, register)
    handles: list = []
    try:  # each engine with its own devices (the same ones for every engine on the CPU)
        for i, (platform, device_env) in enumerate(engine_placement(cfg)):
            handle = launch_server(
                weights, wait=False, max_slots=ro.max_slots,
                log_path=logs / f"server{i}.log", max_seq_len=ro.max_seq_len,
                dtype=cfg.serving_dtype, jax_platforms=platform, env=device_env,
                cpu_affinity=ro.server_cpu_cores, api_key=ro.api_key,
                allowed_weight_dirs=[publish_dir],  # later versions
                warmup=True,  # compile every shape now, not mid-run
                compilation_cache_dir=cache_dir,
                extra_args=["--weight-version", str(version), *engine_tuning_args(ro)])
            register(handle)
            handles.append(handle)
    except (ServerStartError, OSError) as e:
        raise _server_start_error(len(handles), e, cfg) from None
    return handles


def _launch_sglang(cfg: TrainConfig, weights: str, version: int, logs: Path,
                   register: Any) -> list:
    """rollout.sglang's servers on ``weights`` at ``version``, each on the GPUs and memory
    share the run's placement gave it (not waited for)."""
    from areal_jax.engine.sglang_launch import launch_sglang, sglang_command

    sg, ro = cfg.rollout.sglang, cfg.rollout
    assert sg is not None
    handles = []
    for p in run_placement(cfg).sglang:
        port = sg.port + p.index
        cmd = sglang_command(os.path.expanduser(sg.python) if sg.python else sys.executable,
                             weights, port=port, weight_version=version,
                             dtype=cfg.serving_dtype, context_length=ro.max_seq_len,
                             placement_args=p.args, api_key=ro.api_key,
                             extra_args=sg.extra_args)
        handle = launch_sglang(cmd, url=f"http://127.0.0.1:{port}", env=p.env,
                               log_path=logs / f"sglang{p.index}.log", api_key=ro.api_key)
        register(handle)
        handles.append(handle)
    return handles


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
