"""The pure functions the learner jits: logprobs, loss denominators, gradient accumulation
over micro-batches, and the optimizer update.

Each takes parameters as an ``nnx.State`` of fp32 master weights and a ``batch`` dict of
[R, L] arrays whose rows are sharded over ("data", "fsdp"). Under a mesh, XLA inserts the
FSDP all-gathers / reduce-scatters and the tensor-parallel collectives from the shardings.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.typing import DTypeLike

from areal_jax.learner.config import AlgoConfig
from areal_jax.learner.token_logp import packed_token_logprobs
from areal_jax.losses import (
    PPOInputs,
    PPOLossTerms,
    SFTSums,
    StepSums,
    decoupled_ppo_loss_terms,
    loss_denominator,
    sft_loss_terms,
    token_kl,
)
from areal_jax.losses.mismatch import mismatch_terms
from model_defs import PyTree, fp32_matmuls

# XLA compiler options (``jax.jit(compiler_options=...)``): flag name -> value.
CompilerOptions = dict[str, str | bool | int | float]


def zero_sums() -> StepSums:
    """The statistic sums of no micro-batch (the gradient program's first ``sums``)."""
    return StepSums.zeros()


def cast_params(params: PyTree, compute_dtype: DTypeLike | None) -> PyTree:
    """Floating params in the compute dtype (bf16 compute from fp32 master weights)."""
    if jnp.dtype(compute_dtype) == jnp.float32:
        return params
    return jax.tree.map(
        lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def make_logp_fn(graphdef: nnx.GraphDef, compute_dtype: DTypeLike | None, temperature: float,
                 chunk_size: int) -> Callable:
    """(params, rest, batch) -> (logp_bt, entropy_bt), no gradient. ``rest`` holds the
    frozen weights (LoRA's base), cast to the compute dtype.

    ``params`` (fp32 master weights) are merged as they are: the graph's modules carry the
    compute dtype and cast each weight where it is used (inside a rematerialised layer,
    the output matrix one vocabulary chunk at a time). A bf16 copy of the whole model made
    up front instead stays alive from the forward to the backward pass: 2 bytes/param more
    in the gradient program (a Qwen2.5-0.5B shape at 1 x 4096 tokens: ~1 GB), and the tied
    embedding's gradient was rounded to bf16 on the way back."""

    def logp_fn(params, rest, batch, layer_grad_acc=None, head_grad_acc=None):
        model = nnx.merge(graphdef, params, cast_params(rest, compute_dtype))
        # fp32 compute stays fp32 on GPU/TPU (model_defs.precision).
        with fp32_matmuls(compute_dtype):
            return packed_token_logprobs(model, batch["input_ids"], batch["positions"],
                                         batch["segment_ids"], temperature=temperature,
                                         chunk_size=chunk_size, layer_grad_acc=layer_grad_acc,
                                         head_grad_acc=head_grad_acc)

    return logp_fn


def make_denominator_fn(agg_mode: str) -> Callable:
    """batch -> (loss denominator, loss-token count) of one micro-batch (global arrays)."""

    def denominator_fn(batch):
        mask_bt = batch["loss_mask"]
        denom = loss_denominator(mask_bt, agg_mode=agg_mode, segment_ids=batch["segment_ids"],
                                 max_segments=mask_bt.shape[1])
        return denom, jnp.sum(mask_bt != 0).astype(jnp.float32)

    return denominator_fn


def _layer_accumulators(grads: PyTree) -> PyTree | None:
    """The stacked decoder layers' part of the gradient accumulator (``grads["layers"]``),
    or None when it has none."""
    try:
        return grads["layers"]
    except (KeyError, TypeError):
        return None


def _head_key(params: PyTree, rest: PyTree) -> str:
    """The variable the output matrix is: ``lm_head_dv``, or the tied ``embed_vd``."""
    untied = any(_has_key(tree, "lm_head_dv") for tree in (params, rest))
    return "lm_head_dv" if untied else "embed_vd"


def _has_key(tree: PyTree, key: str) -> bool:
    try:
        return key in tree
    except TypeError:
        return False


def _head_accumulator(grads: PyTree, key: str) -> PyTree | None:
    """The gradient accumulator's entry for the output matrix (a bare array), or None."""
    if not _has_key(grads, key):
        return None
    leaves = jax.tree.leaves(grads[key])
    return leaves[0] if len(leaves) == 1 else None


def accumulate(grads: PyTree, g: PyTree, layers_done: bool, head_done: str | None = None
               ) -> PyTree:
    """``grads + g``; with ``layers_done`` the decoder layers' entries of ``g`` already
    include ``grads`` (they were added inside each layer's backward step), and so does
    the top-level entry ``head_done`` (the output matrix, added chunk by chunk in the
    logprob kernel's backward pass): those are taken as they are."""
    if not layers_done and head_done is None:
        return jax.tree.map(jnp.add, grads, g)

    def done(path: tuple) -> bool:
        first = getattr(path[0], "key", None) if path else None
        return (layers_done and first == "layers") or (head_done is not None
                                                       and first == head_done)

    acc_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    g_leaves = jax.tree.leaves(g)
    return jax.tree.unflatten(treedef, [
        gl if done(path) else a + gl
        for (path, a), gl in zip(acc_leaves, g_leaves, strict=True)])


def make_grad_fn(graphdef: nnx.GraphDef, compute_dtype: DTypeLike | None, algo: AlgoConfig, *,
                 temperature: float = 1.0, logp_chunk_size: int = 4096,
                 seq_token_sum_normalizer: float | None = None,
                 prox_from_logp: bool = False) -> Callable:
    """(params, rest, grads, sums, batch, denom, n_loss_tokens, version) -> (grads, sums).

    Adds this micro-batch's gradient of ``loss_sum / denom`` (denom: the global denominator
    of the whole minibatch) to ``grads``, and its statistics to ``sums``.

    ``prox_from_logp`` (decoupled loss with one minibatch per version): the proximal
    policy is the current params, so prox_logp is this forward pass's own logp, as a
    constant, instead of a separately recomputed ``batch["prox_logp"]``.
    """
    logp_fn = make_logp_fn(graphdef, compute_dtype, temperature, logp_chunk_size)
    loss_cfg = algo.ppo_loss_config(seq_token_sum_normalizer)

    def loss_fn(params, rest, batch, denom, n_loss_tokens, version, layer_grad_acc,
                head_grad_acc):
        logp_bt, entropy_bt = logp_fn(params, rest, batch, layer_grad_acc, head_grad_acc)
        mask_bt = batch["loss_mask"]
        prox_bt = None  # naive PPO: prox = behav
        if algo.decoupled:
            prox_bt = jax.lax.stop_gradient(logp_bt) if prox_from_logp else batch["prox_logp"]
        inputs = PPOInputs(logp=logp_bt, prox_logp=prox_bt, behav_logp=batch["behav_logp"],
                           advantages=batch["advantages"], loss_mask=mask_bt,
                           versions=batch["versions"], current_version=version,
                           segment_ids=batch["segment_ids"], max_segments=mask_bt.shape[1])
        terms = decoupled_ppo_loss_terms(inputs, loss_cfg)
        loss = terms.loss_sum / jnp.maximum(denom, 1.0)
        kl_ref = jnp.zeros((), jnp.float32)
        if algo.kl_coef > 0:
            kl_bt = token_kl(logp_bt, batch["ref_logp"], algo.kl_estimator, mask=mask_bt,
                             clamp=algo.kl_clamp)
            kl_ref = jnp.sum(kl_bt) / jnp.maximum(n_loss_tokens, 1.0)
            loss = loss + algo.kl_coef * kl_ref
        # The learner's logprobs under the weights it holds: prox (decoupled), else logp.
        held_bt = logp_bt if prox_bt is None else prox_bt
        return loss, (terms, logp_bt, entropy_bt, kl_ref, held_bt)

    def grad_fn(params, rest, grads, sums, batch, denom, n_loss_tokens, version):
        # The accumulator's layer entries go into the model: each layer's backward step
        # adds its gradient to them (with remat: full, inside that step, so no layer's
        # fresh gradient waits for the end of the backward pass; see
        # model_defs.model._run_layer_remat_full). The rest is added here.
        # Likewise the output matrix's entry goes into the logprob kernel, which adds its
        # gradient chunk by chunk (no second [V, D] matrix; with a tied embedding the
        # lookup's gradient is then scattered into the same buffer).
        layer_acc = _layer_accumulators(grads)
        head_key = _head_key(params, rest)
        head_acc = _head_accumulator(grads, head_key)
        # Around the whole gradient: custom-VJP backward rules (the logprob head's, the
        # attention kernels') are traced here, outside logp_fn's own context.
        with fp32_matmuls(compute_dtype):
            (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(
                params, rest, batch, denom, n_loss_tokens, version, layer_acc, head_acc)
        terms, logp_bt, entropy_bt, kl_ref, held_bt = aux
        grads = accumulate(grads, g, layers_done=layer_acc is not None,
                           head_done=head_key if head_acc is not None else None)

        new = _micro_batch_sums(batch, version, loss, kl_ref, terms, logp_bt, entropy_bt,
                                held_bt)
        sums = sums.add(new)
        return grads, sums

    return grad_fn


def make_sft_grad_fn(graphdef: nnx.GraphDef, compute_dtype: DTypeLike | None, *,
                     logp_chunk_size: int = 4096) -> Callable:
    """(params, rest, grads, sums, batch, n_loss_tokens) -> (grads, sums): supervised
    fine-tuning's gradient program, the same accumulation as :func:`make_grad_fn` with the
    token-mean NLL (``losses.sft_loss_terms``) over ``batch["loss_mask"]`` in place of the
    PPO loss. ``n_loss_tokens`` is the minibatch's global mask count. Logprobs are those
    of the model itself (temperature 1)."""
    logp_fn = make_logp_fn(graphdef, compute_dtype, 1.0, logp_chunk_size)

    def loss_fn(params, rest, batch, n_loss_tokens, layer_grad_acc, head_grad_acc):
        logp_bt, _ = logp_fn(params, rest, batch, layer_grad_acc, head_grad_acc)
        terms = sft_loss_terms(logp_bt, batch["loss_mask"])
        return terms.nll_sum / jnp.maximum(n_loss_tokens, 1.0), terms

    def grad_fn(params, rest, grads, sums, batch, n_loss_tokens):
        layer_acc = _layer_accumulators(grads)  # as in make_grad_fn
        head_key = _head_key(params, rest)
        head_acc = _head_accumulator(grads, head_key)
        with fp32_matmuls(compute_dtype):
            (loss, terms), g = jax.value_and_grad(loss_fn, has_aux=True)(
                params, rest, batch, n_loss_tokens, layer_acc, head_acc)
        grads = accumulate(grads, g, layers_done=layer_acc is not None,
                           head_done=head_key if head_acc is not None else None)
        n_tokens = jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)
        return grads, sums.add(SFTSums(loss=loss, nll_sum=terms.nll_sum,
                                       token_count=terms.token_count, n_tokens=n_tokens))

    return grad_fn


def _micro_batch_sums(batch: dict[str, jax.Array], version: jax.Array, loss: jax.Array,
                      kl_ref: jax.Array, terms: PPOLossTerms, logp_bt: jax.Array,
                      entropy_bt: jax.Array, held_bt: jax.Array) -> StepSums:
    """One micro-batch's statistic sums: the loss terms' and the learner's own (entropy,
    |logp - behav_logp|, the rollout-training mismatch of ``held_bt``, the learner's
    logprobs under the version it holds)."""
    mask_bt = batch["loss_mask"] != 0
    diff_bt = jnp.where(mask_bt, logp_bt - batch["behav_logp"], 0.0)
    mm_sums, mm_maxes = mismatch_terms(held_bt, batch["behav_logp"], mask_bt,
                                       batch["versions"], version)
    return StepSums(
        loss=loss,
        kl_ref=kl_ref,
        token_count=terms.token_count,
        n_tokens=jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32),
        entropy=jnp.sum(jnp.where(mask_bt, entropy_bt, 0.0)),
        logp_behav_abs_diff=jnp.sum(jnp.abs(diff_bt)),
        # k3 estimate of KL(behav || pi) from tokens sampled by the behaviour policy.
        logp_behav_kl=jnp.sum(jnp.where(mask_bt, jnp.expm1(diff_bt) - diff_bt, 0.0)),
        **terms.stat_sums,
        **terms.stat_maxes,
        mismatch_sums=mm_sums,
        mismatch_maxes=mm_maxes,
    )


def make_apply_fn(tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, grads) -> (params, opt_state, grad_norm, applied).

    A step whose gradient norm is not finite is skipped (params and optimizer state
    unchanged, ``applied`` False), so one bad batch cannot poison the weights. The skip is
    a ``lax.cond``, not a select over the whole state: a select keeps the old and the new
    optimizer state alive together, while a cond updates the (donated) buffers in place.
    """

    def step(operands):
        params, opt_state, grads = operands
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def skip(operands):
        params, opt_state, _ = operands
        return params, opt_state

    def apply_fn(params, opt_state, grads):
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(grad_norm)
        params, opt_state = jax.lax.cond(finite, step, skip, (params, opt_state, grads))
        return params, opt_state, grad_norm, finite

    return apply_fn


# XLA:CPU options for the learner's programs (other backends' schedulers and collective
# combiners are memory-aware already):
# - a memory-optimising schedule: the default favours concurrency and runs independent
#   work early, e.g. every parameter's AdamW update before the first is applied, or every
#   decoder layer's rematerialised forward before the backward pass reaches it, which
#   keeps all those temporaries alive at once (``model.remat`` then saves nothing);
# - no all-reduce combiner: under a sharded mesh it merges every layer's gradient
#   all-reduce into one at the end of the backward pass, so every layer's full-size
#   gradient (and what it needs) stays alive until then, and fsdp=2 held more per device
#   than one device did.
CPU_MEMORY_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                      "xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def learner_compiler_options(platform: str, options: CompilerOptions | None = None
                             ) -> CompilerOptions:
    """XLA options for the learner's jitted programs on ``platform`` ("cpu", "gpu", "tpu"):
    ``CPU_MEMORY_OPTIONS`` on CPU, under the caller's ``options``."""
    base = dict(CPU_MEMORY_OPTIONS) if platform == "cpu" else {}
    return {**base, **(options or {})}
