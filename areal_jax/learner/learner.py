"""The sharded learner: fp32 master weights + AdamW state on a mesh, a jitted PPO step.

    learner = Learner.from_hf("hf_dir", OptimConfig(), AlgoConfig(), mesh=make_mesh("fsdp=-1"))
    batches = pack_trajectories(trajs, advantages, seq_len=512, rows_per_micro_batch=8,
                                n_shards=n_batch_shards(learner.mesh),
                                n_minibatches=learner.algo.ppo_n_minibatches)
    metrics = learner.train_step(batches)    # ppo_n_minibatches AdamW steps

``train_step`` recomputes prox_logp under the current weights first (decoupled loss), into
new micro-batches (the ones given are never modified), except with one minibatch per
version: the proximal policy is then the current params before the only step, and the
loss takes prox_logp from its own forward pass instead of a separate one.

One ``train_step`` is one learner version. Each minibatch's gradient is accumulated over
its micro-batches (one jitted function per micro-batch shape, gradient buffers donated)
and normalised by the minibatch's *global* loss denominator, so results do not depend on
how sequences were packed into micro-batches or split over data shards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from areal_jax.learner.config import AlgoConfig, OptimConfig, check_positive
from areal_jax.learner.packing import OPTIONAL_FIELDS, PACKED_FIELDS
from areal_jax.learner.steps import (
    CompilerOptions,
    make_denominator_fn,
    make_grad_fn,
    make_logp_fn,
    make_sft_grad_fn,
    zero_sums,
)
from areal_jax.learner.trainable import (
    MicroBatch,
    Program,
    TrainableModel,
    configure_model,
    with_arrays,
)
from areal_jax.losses.sft import SFTSums, finalise_sft_step
from areal_jax.losses.step_metrics import StepSums, finalise_step, step_timing
from areal_jax.parallel.mesh import (
    make_mesh,
    replicated,
)
from model_defs import (
    CausalLM,
    LoraConfig,
    ModelConfig,
    PyTree,
    add_lora,
    load_hf,
    use_mesh,
)

LOGP_KEYS = ("input_ids", "positions", "segment_ids")
TRAIN_KEYS = tuple(PACKED_FIELDS)
SFT_KEYS = (*LOGP_KEYS, "loss_mask")  # what sft_step reads of a micro-batch

def _logp_program(params, rest, batch, *, graphdef, compute_dtype, temperature, chunk_size):
    return make_logp_fn(graphdef, compute_dtype, temperature, chunk_size)(params, rest, batch)[0]


def _sft_grad_program(params, rest, grads, sums, batch, n_loss_tokens, *, graphdef,
                      compute_dtype, chunk_size):
    fn = make_sft_grad_fn(graphdef, compute_dtype, logp_chunk_size=chunk_size)
    return fn(params, rest, grads, sums, batch, n_loss_tokens)


def _denominator_program(batch, *, agg_mode):
    return make_denominator_fn(agg_mode)(batch)


def _grad_program(params, rest, grads, sums, batch, denom, n_loss_tokens, version, *, graphdef,
                  compute_dtype, algo, temperature, chunk_size, seq_norm, prox_from_logp):
    fn = make_grad_fn(graphdef, compute_dtype, algo, temperature=temperature,
                      logp_chunk_size=chunk_size, seq_token_sum_normalizer=seq_norm,
                      prox_from_logp=prox_from_logp)
    return fn(params, rest, grads, sums, batch, denom, n_loss_tokens, version)


class Learner(TrainableModel[CausalLM]):
    """Training state (params, AdamW state, step, version) on a mesh, and the PPO update.

    Args:
      model: a ``model_defs.CausalLM``; its params become the fp32 master weights (keep
        ``param_dtype`` fp32 for bf16 compute with fp32 master weights). The learner takes
        ownership of its arrays: ``train_step`` donates them, so use ``learner.model``
        afterwards, not ``model``.
      model_cfg: its ``ModelConfig`` (kept for export).
      optim, algo: the run config's ``optim`` and ``algo`` sections
        (``areal_jax.learner.config``).
      temperature: the sampling temperature; logprobs are those of the sampled
        distribution (logits / temperature).
      logp_chunk_size: vocabulary chunk for logprobs (``[tokens, vocab]`` fp32 logits are
        never materialised whole).
      seq_token_sum_normalizer: the constant L of ``agg_mode="seq-mean-token-sum"``
        (Dr.GRPO: the max generation length); required by that mode only.
      mesh: the device mesh (default: every device on the ``data`` axis).
      compute_dtype: "float32" or "bfloat16" for activations and matmuls (default: the
        model's dtype). Logprobs are always accumulated and returned in fp32.
      remat: gradient checkpointing per decoder layer: a bool or a policy name of
        ``model_defs.model.REMAT_POLICIES`` ("none", "full", "dots", "dots_no_batch";
        default: the model's setting).
      attention: the self-attention kernel, ``model.attention`` (``auto``, ``xla``,
        ``splash``, ``cudnn``, ``pallas_gpu``; default: the model's setting, ``auto``).
      compiler_options: XLA options for every jitted function, e.g.
        ``{"xla_backend_optimization_level": 0}`` to compile faster on CPU in tests. On CPU
        they go over ``steps.CPU_MEMORY_OPTIONS`` (scheduling for memory).
      trainable: False for a frozen model that only computes logprobs (a reference
        policy): no optimizer state is allocated and ``train_step`` raises.
      process_local_batches: with several processes, each passes micro-batches holding only
        the rows of its own devices (``local_batch_rows``; e.g. its own trajectories packed
        with ``n_shards`` = its local share of data x fsdp) instead of the same global
        micro-batches everywhere; ``compute_logp`` then returns local rows too. Every process
        must pass the same number of micro-batches of the same shape.

    A model with LoRA adapters (``model_defs.add_lora``) trains only them: ``params`` and
    the optimizer state hold the ``nnx.LoRAParam`` adapters alone, and the frozen base
    weights sit with the rest of the state, sharded like params (and stored in the compute
    dtype, since they need no fp32 master copy).
    """

    def __init__(self, model: CausalLM, model_cfg: ModelConfig, optim: OptimConfig,
                 algo: AlgoConfig, *, temperature: float = 1.0, logp_chunk_size: int = 4096,
                 seq_token_sum_normalizer: float | None = None, mesh: Mesh | None = None,
                 compute_dtype: DTypeLike | None = None, remat: bool | str | None = None,
                 compiler_options: CompilerOptions | None = None, trainable: bool = True,
                 process_local_batches: bool = False, attention: str | None = None):
        if not isinstance(algo, AlgoConfig):
            raise TypeError(f"algo must be an AlgoConfig, got {type(algo).__name__}")
        check_positive("Learner", temperature=temperature, logp_chunk_size=logp_chunk_size)
        if (algo.agg_mode == "seq-mean-token-sum") != (seq_token_sum_normalizer is not None):
            raise ValueError("seq_token_sum_normalizer (> 0, Dr.GRPO: the max generation "
                             "length) is required by algo.agg_mode='seq-mean-token-sum' and "
                             f"used by no other mode; got {seq_token_sum_normalizer!r} with "
                             f"agg_mode={algo.agg_mode!r}")
        check_positive("Learner", seq_token_sum_normalizer=seq_token_sum_normalizer)
        self.algo = algo
        self.temperature, self.logp_chunk_size = float(temperature), int(logp_chunk_size)
        self.seq_token_sum_normalizer = seq_token_sum_normalizer
        configure_model(model, remat=remat, attention=attention)
        super().__init__(model, model_cfg, optim, n_minibatches=algo.ppo_n_minibatches,
                         mesh=mesh, compute_dtype=compute_dtype,
                         compiler_options=compiler_options, trainable=trainable,
                         process_local_batches=process_local_batches)

    @classmethod
    def from_hf(cls, path: str, optim: OptimConfig, algo: AlgoConfig, *,
                mesh: Mesh | None = None, compute_dtype: DTypeLike = "float32",
                remat: bool | str = False, lora: LoraConfig | None = None, lora_seed: int = 0,
                random_init_seed: int | None = None,
                **kwargs: Any) -> Learner:  # Any: the constructor's keywords, passed on
        """Loads an HF checkpoint as fp32 master weights, placed directly on the mesh;
        with ``lora``, fresh adapters (B = 0, A from ``lora_seed``) are the trainable part.
        ``random_init_seed``: the checkpoint's architecture with fresh weights drawn from
        this seed (``CausalLM``'s initialisers) instead of its own. ``kwargs`` as for the
        constructor."""
        mesh = make_mesh("data=-1") if mesh is None else mesh
        model, cfg = load_hf(path, dtype="float32", mesh=mesh)
        if random_init_seed is not None:
            fresh = CausalLM(cfg, rngs=nnx.Rngs(random_init_seed))
            nnx.update(model, nnx.state(fresh, nnx.Param))
        if lora is not None:
            add_lora(model, lora, rngs=nnx.Rngs(lora_seed))
        return cls(model, cfg, optim, algo, mesh=mesh, compute_dtype=compute_dtype, remat=remat,
                   **kwargs)

    # ------------------------------------------------------------------ compile
    def _compile(self) -> None:
        """The optimizer update and zero gradients (``TrainableModel``), then the loss
        denominator, the gradient program (with and without the prox_logp recompute) and
        the logprob programs."""
        super()._compile()
        param_sh, rep = self.param_shardings, replicated(self.mesh)
        opts = self._jit_options
        model = {"graphdef": self._graphdef, "compute_dtype": self.compute_dtype}
        self._denominator = Program(_denominator_program, {"agg_mode": self.algo.agg_mode},
                                    out_shardings=(rep, rep), **opts)
        self._grads = {p: Program(_grad_program, {
            **model, "algo": self.algo, "temperature": self.temperature,
            "chunk_size": self.logp_chunk_size, "seq_norm": self.seq_token_sum_normalizer,
            "prox_from_logp": p}, donate_argnums=(2, 3), out_shardings=(param_sh, rep), **opts)
            for p in (False, True)}
        self._sft_grads = Program(_sft_grad_program, {
            **model, "chunk_size": self.logp_chunk_size}, donate_argnums=(2, 3),
            out_shardings=(param_sh, rep), **opts)
        self._logp_programs: dict[float, Program] = {}

    def _logp_fn(self, temperature: float) -> Program:
        if temperature not in self._logp_programs:
            self._logp_programs[temperature] = Program(_logp_program, {
                "graphdef": self._graphdef, "compute_dtype": self.compute_dtype,
                "temperature": temperature, "chunk_size": self.logp_chunk_size},
                **self._jit_options)
        return self._logp_programs[temperature]

    # ------------------------------------------------------------------ data in/out
    # ------------------------------------------------------------------ public API
    def compute_logp(self, micro_batches: Sequence[MicroBatch], temperature: float | None = None
                     ) -> list[np.ndarray]:
        """Token logprobs under the current weights (no gradient), one fp32 [R, L] per
        micro-batch, aligned like ``behav_logp`` (0 on the first token of each segment and
        on padding). Used for prox_logp, and with a reference model for ref_logp."""
        temperature = self.temperature if temperature is None else float(temperature)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self._check_micro_batches(micro_batches, LOGP_KEYS)
        fn = self._logp_fn(temperature)
        with use_mesh(self.mesh):
            outs = [fn(self.params, self._rest, self._put(mb, LOGP_KEYS)) for mb in micro_batches]
        return [self._to_host(o) for o in outs]

    def with_logp(self, micro_batches: Sequence[MicroBatch], key: str) -> list[MicroBatch]:
        """New micro-batches: those given, with ``key`` (``prox_logp``, or ``ref_logp`` from
        a reference model) set to ``compute_logp``'s logprobs under the current weights.
        The micro-batches given are not modified."""
        logps = self.compute_logp(micro_batches)
        return [with_arrays(mb, **{key: logp})
                for mb, logp in zip(micro_batches, logps, strict=True)]

    def recompute_prox_logp(self, micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
        """New micro-batches with ``prox_logp`` from the current weights (``with_logp``)."""
        return self.with_logp(micro_batches, "prox_logp")

    def precompile(self, rows: int, seq_len: int) -> float:
        """Compiles, without running them, the programs that ``train_step`` (or, for a
        frozen learner, ``compute_logp``) runs on [rows, seq_len] micro-batches: logprobs,
        loss denominator, gradient accumulation and the optimizer update. Later calls with
        that shape compile nothing. Returns the seconds it took.

        The trainer calls this while the rollout servers compile their own shapes, so the
        two compilations overlap instead of following one another.
        """
        t0 = time.perf_counter()
        dummy: dict[str, np.ndarray] = {k: np.zeros((rows, seq_len), dtype)
                 for k, dtype in {**PACKED_FIELDS, **OPTIONAL_FIELDS}.items()}
        dummy["segment_ids"][:] = 1  # one segment per row, like a packed micro-batch
        with use_mesh(self.mesh):
            prox_from_logp = self._skips_prox_recompute()
            if not self.trainable or (self.algo.decoupled and not prox_from_logp):
                self._logp_fn(self.temperature).lower(
                    self.params, self._rest, self._put(dummy, LOGP_KEYS)).compile()
            if not self.trainable:
                return time.perf_counter() - t0
            batch = self._put(dummy, self._train_keys(prox_from_logp))
            grad_fn = self._grads[prox_from_logp]
            self._denominator.lower(batch).compile()
            denom = n_loss = jnp.zeros((), jnp.float32)
            d, n = self._denominator(batch)
            for _ in range(2):  # the sums' first add and the later ones (committed operands)
                denom, n_loss = denom + d, n_loss + n
            self._zeros.lower(self.params).compile()
            grads = self._zeros(self.params)
            version = jnp.asarray(0, jnp.float32)
            # One program for every micro-batch's call: the first one's zero sums are placed
            # like the later calls' (the previous call's outputs).
            grad_fn.lower(self.params, self._rest, grads, self._zero_sums(), batch, denom,
                          n_loss, version).compile()
            assert self._apply is not None  # a trainable learner's optimizer update
            self._apply.lower(self.params, self.opt_state, grads).compile()
            del grads
        return time.perf_counter() - t0

    def _zero_sums(self) -> StepSums:
        """Zero statistic sums, placed like the gradient program's output sums: the first
        micro-batch's call then runs the same compiled program as the later ones (unplaced
        zeros made jax trace, lower and load a second one)."""
        return jax.device_put(zero_sums(), replicated(self.mesh))

    def _skips_prox_recompute(self) -> bool:
        """With the decoupled loss and one minibatch per version, the proximal policy is
        the current params before the only step: prox_logp then comes from the loss's own
        forward pass (as a constant) instead of a separate logprob pass."""
        return self.algo.decoupled and self.algo.ppo_n_minibatches == 1

    def _prepare_prox(self, micro_batches: list[MicroBatch]
                      ) -> tuple[list[MicroBatch], bool]:
        """The micro-batches to train on, with prox_logp recomputed where it is missing and
        needed (new micro-batches; those given are not modified), and True when the loss
        takes prox_logp from its own forward pass instead (see ``_skips_prox_recompute``)."""
        if not self.algo.decoupled or all(_has(mb, "prox_logp") for mb in micro_batches):
            return micro_batches, False
        if self._skips_prox_recompute():
            return micro_batches, True
        return self.recompute_prox_logp(micro_batches), False

    def train_step(self, micro_batches: Sequence[MicroBatch], *,
                   current_version: int | None = None) -> dict[str, float]:
        """``ppo_n_minibatches`` AdamW steps of the decoupled PPO loss; returns metrics.

        Micro-batches need input_ids, positions, segment_ids, loss_mask, behav_logp,
        advantages and versions ([R, L] each); prox_logp, when missing (decoupled loss only),
        is recomputed here, or with one minibatch taken from the loss's own forward pass,
        which computes the same values; ref_logp is required when ``kl_coef > 0``.
        ``current_version`` (default: ``self.version``) is the version staleness counts from.
        """
        t0 = time.perf_counter()
        self._require_trainable("train_step")
        micro_batches = list(micro_batches)
        self._check_micro_batches(micro_batches, self._train_keys(prox_from_logp=True))
        micro_batches, prox_from_logp = self._prepare_prox(micro_batches)
        keys = self._train_keys(prox_from_logp)
        groups = self.minibatches(micro_batches)
        version = jnp.asarray(self.version if current_version is None else current_version,
                              jnp.float32)
        metrics = self._optimizer_steps(groups, keys, version,
                                        prox_from_logp=prox_from_logp)
        return metrics | step_timing(
            metrics, prox_logp_recomputed=self.algo.decoupled and not prox_from_logp,
            n_micro_batches=len(micro_batches), step_time_s=time.perf_counter() - t0)

    # ------------------------------------------------------------------ SFT
    def sft_step(self, micro_batches: Sequence[MicroBatch]) -> dict[str, float]:
        """Supervised fine-tuning: ``n_minibatches`` AdamW steps of the token-mean NLL over
        each micro-batch's ``loss_mask`` (``losses.sft_loss``, logprobs at temperature 1),
        normalised by each minibatch's global mask count; one version. Micro-batches need
        input_ids, positions, segment_ids and loss_mask (``SFT_KEYS``); returns metrics
        (``losses.sft.SFTStepMetrics`` and the step's timing)."""
        t0 = time.perf_counter()
        self._require_trainable("sft_step")
        micro_batches = list(micro_batches)
        self._check_micro_batches(micro_batches, SFT_KEYS)
        metrics = self._optimizer_steps(
            self.minibatches(micro_batches), SFT_KEYS, jnp.zeros((), jnp.float32),
            finalise=lambda per_step, lrs: finalise_sft_step(
                [p[0] for p in per_step], [float(p[1]) for p in per_step],
                [bool(p[2]) for p in per_step], lrs[-1]).as_dict(),
            sft=True)
        step_time_s = time.perf_counter() - t0
        return metrics | {"n_micro_batches": float(len(micro_batches)),
                          "step_time_s": step_time_s,
                          "tokens_per_s": metrics["n_tokens"] / max(step_time_s, 1e-9)}

    def sft_loss(self, micro_batches: Sequence[MicroBatch]) -> tuple[float, int]:
        """(token-mean NLL over the micro-batches' ``loss_mask``, the mask count) under the
        current weights, no gradient: the held-out loss of supervised fine-tuning."""
        logps = self.compute_logp(micro_batches, temperature=1.0)
        nll, count = 0.0, 0
        for mb, logp in zip(micro_batches, logps, strict=True):
            mask = np.asarray(mb["loss_mask"]) != 0
            nll -= float(np.sum(logp[mask], dtype=np.float64))
            count += int(mask.sum())
        return nll / max(count, 1), count

    def sft_gradients(self, micro_batches: Sequence[MicroBatch]) -> tuple[float, PyTree]:
        """(SFT loss, grads) of all ``micro_batches`` taken as ONE minibatch, without
        updating anything (checks and debugging; grads have the params' structure)."""
        self._require_trainable("sft_gradients")
        micro_batches = list(micro_batches)
        self._check_micro_batches(micro_batches, SFT_KEYS)
        with use_mesh(self.mesh):
            grads, sums = self._accumulate_sft(micro_batches, SFT_KEYS)
        return float(sums.loss), grads

    def _accumulate_sft(self, group: Sequence[MicroBatch], keys: Sequence[str]
                        ) -> tuple[PyTree, SFTSums]:
        """One minibatch's SFT gradient (sum over its micro-batches of nll_sum / global
        mask count) and sums, on device."""
        batches = [self._put(mb, keys) for mb in group]
        n_loss = jnp.zeros((), jnp.float32)
        for b in batches:
            n_loss = n_loss + self._denominator(b)[1]
        grads = self._zeros(self.params)
        sums = jax.device_put(SFTSums.zeros(), replicated(self.mesh))
        for b in batches:
            grads, sums = self._sft_grads(self.params, self._rest, grads, sums, b, n_loss)
        return grads, sums

    def precompile_sft(self, rows: int, seq_len: int) -> float:
        """``precompile`` for ``sft_step`` on [rows, seq_len] micro-batches (and the
        held-out loss's logprob program); returns the seconds it took."""
        t0 = time.perf_counter()
        self._require_trainable("precompile_sft")
        dummy = {k: np.zeros((rows, seq_len), np.int32) for k in SFT_KEYS}
        dummy["segment_ids"][:] = 1
        with use_mesh(self.mesh):
            batch = self._put(dummy, SFT_KEYS)
            self._logp_fn(1.0).lower(self.params, self._rest,
                                     self._put(dummy, LOGP_KEYS)).compile()
            self._denominator.lower(batch).compile()
            n_loss = jnp.zeros((), jnp.float32)
            for _ in range(2):  # committed operands, as the accumulation's later adds
                n_loss = n_loss + self._denominator(batch)[1]
            self._zeros.lower(self.params).compile()
            grads = self._zeros(self.params)
            sums = jax.device_put(SFTSums.zeros(), replicated(self.mesh))
            self._sft_grads.lower(self.params, self._rest, grads, sums, batch, n_loss).compile()
            assert self._apply is not None
            self._apply.lower(self.params, self.opt_state, grads).compile()
            del grads
        return time.perf_counter() - t0

    def _train_keys(self, prox_from_logp: bool) -> list[str]:
        keys = list(TRAIN_KEYS)
        if self.algo.decoupled and not prox_from_logp:
            keys.append("prox_logp")
        if self.algo.kl_coef > 0:
            keys.append("ref_logp")
        return keys

    def _accumulate(self, group: Sequence[MicroBatch], keys: Sequence[str], version: jax.Array,
                    prox_from_logp: bool = False, sft: bool = False, **_: bool
                    ) -> tuple[PyTree, StepSums | SFTSums]:
        """Gradient of one minibatch (sum over its micro-batches of loss_sum / global
        denominator) and its statistic sums, on device (``sft``: the SFT loss's)."""
        if sft:
            return self._accumulate_sft(group, keys)
        batches = [self._put(mb, keys) for mb in group]
        denom = n_loss = jnp.zeros((), jnp.float32)
        for b in batches:
            d, n = self._denominator(b)
            denom, n_loss = denom + d, n_loss + n
        grads, sums = self._zeros(self.params), self._zero_sums()
        for b in batches:
            grads, sums = self._grads[prox_from_logp](self.params, self._rest, grads, sums, b,
                                                      denom, n_loss, version)
        return grads, sums

    def compute_gradients(self, micro_batches: Sequence[MicroBatch], *,
                          current_version: int | None = None) -> tuple[float, PyTree]:
        """(loss, grads) of all ``micro_batches`` taken as ONE minibatch, without updating
        anything. For checks and debugging; grads have the params' structure and shardings."""
        self._require_trainable("compute_gradients")
        micro_batches = list(micro_batches)
        self._check_micro_batches(micro_batches, self._train_keys(prox_from_logp=True))
        micro_batches, prox_from_logp = self._prepare_prox(micro_batches)
        keys = self._train_keys(prox_from_logp)
        version = jnp.asarray(self.version if current_version is None else current_version,
                              jnp.float32)
        with use_mesh(self.mesh):
            grads, sums = self._accumulate(micro_batches, keys, version, prox_from_logp)
        return float(sums.loss), grads

    @staticmethod
    def _metrics(per_step: list, lrs: list[float]) -> dict[str, float]:
        """The step's metrics (``losses.step_metrics``) from each minibatch's (sums, grad
        norm, applied)."""
        sums, grad_norms, applied = zip(*per_step, strict=True)
        return finalise_step(sums, [float(g) for g in grad_norms],
                             [bool(ok) for ok in applied], lrs[-1]).as_dict()


def _has(mb: MicroBatch, key: str) -> bool:
    try:
        return mb[key] is not None
    except KeyError:
        return False
