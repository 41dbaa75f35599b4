"""Per-token logprobs of packed rows, aligned with ``input_ids`` like ``behav_logp``.

``logp_bt[r, t] = log softmax(h[r, t-1] @ W / temperature)[input_ids[r, t]]`` when token
t-1 is in the same segment as token t, else 0 (the first token of every segment and
padding). The vocabulary is processed in chunks (``areal_jax.losses.logprobs_from_hidden``),
so [tokens, vocab] fp32 logits never exist whole, forward or backward.

Temperature is applied as the engine applies it when sampling: logits are computed with
fp32 accumulation (``hidden @ W`` in the compute dtype, ``preferred_element_type=fp32``),
then divided by the temperature in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.losses import logprobs_from_hidden
from model_defs import CausalLM, PyTree, shard


def predicted_mask(segment_ids_bt: jax.Array) -> jax.Array:
    """True where token t has a logprob: t > 0 and tokens t-1, t are in the same segment."""
    same_bt = (segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]) & (segment_ids_bt[:, 1:] > 0)
    return jnp.pad(same_bt, ((0, 0), (1, 0)), constant_values=False)


def shift_right(x_bt: jax.Array) -> jax.Array:
    """x_bt[:, t] <- x_bt[:, t-1]; zeros in column 0."""
    return jnp.pad(x_bt[:, :-1], ((0, 0), (1, 0)))


def packed_token_logprobs(model: CausalLM, input_ids_bt: jax.Array, positions_bt: jax.Array,
                          segment_ids_bt: jax.Array, *, temperature: float, chunk_size: int,
                          layer_grad_acc: PyTree | None = None,
                          head_grad_acc: PyTree | None = None,
                          ) -> tuple[jax.Array, jax.Array]:
    """(logp_bt, entropy_bt), fp32 [B, T], for a ``model_defs.CausalLM``-like model.

    ``entropy_bt[r, t]`` is the entropy of the (tempered) distribution that token t was
    drawn from. Both are 0 where :func:`predicted_mask` is False. ``layer_grad_acc``: see
    ``CausalLM.hidden_states`` (only passed on when given); ``head_grad_acc``: a gradient
    buffer for the output matrix as stored (``model.unembed_weight()``: the embedding
    table when tied), see ``logprobs_from_hidden(w_grad_acc=...)``.
    """
    extra = {} if layer_grad_acc is None else {"layer_grad_acc": layer_grad_acc}
    hidden_btd = model.hidden_states(input_ids_bt, positions=positions_bt,
                                     segment_ids=segment_ids_bt, **extra)
    # FSDP semantics for the output layer: rows stay on their batch shard and the [D, V]
    # matrix is gathered over fsdp (vocab stays split over tensor). Without these, XLA may
    # shard the hidden dim like the weight and reshuffle activations in the backward pass.
    hidden_btd = shard(hidden_btd, ("batch", "seq", "act_embed"))
    # The output matrix as stored (a tied embedding table stays [V, D]) and in its own dtype:
    # the kernel casts one vocabulary chunk at a time, so neither a transposed nor a
    # compute-dtype copy of it (or of its gradient) is made.
    w, vocab_axis = model.unembed_weight()
    w = shard(w, ("vocab", "act_embed") if vocab_axis == 0 else ("act_embed", "vocab"))
    next_ids_bt = jnp.pad(input_ids_bt[:, 1:], ((0, 0), (0, 1)))  # label of position t is t+1
    logp_next_bt, entropy_next_bt = logprobs_from_hidden(
        hidden_btd, w, next_ids_bt, temperature=temperature, chunk_size=chunk_size,
        vocab_axis=vocab_axis, w_grad_acc=head_grad_acc)
    valid_bt = predicted_mask(segment_ids_bt)
    logp_bt = jnp.where(valid_bt, shift_right(logp_next_bt), 0.0)
    entropy_bt = jnp.where(valid_bt, shift_right(entropy_next_bt), 0.0)
    return logp_bt, entropy_bt
