"""Supervised fine-tuning: the token-mean negative log-likelihood over a loss mask.

    loss = sft_loss(logp_bt, loss_mask_bt)     # -sum(m * logp) / sum(m)

``logp_bt[b, t]`` is the log-probability of token t (predicted from the tokens before it),
aligned like the learner's logprobs; ``loss_mask_bt`` is 1 on the tokens to learn (the
assistant's, or a completion's) and 0 on the rest (prompt, other roles, padding), which
therefore contribute nothing to the loss or its gradient.

Under micro-batching the learner sums :func:`sft_loss_terms`' ``nll_sum`` over every
micro-batch of a minibatch and divides by the minibatch's global mask count, so the loss
is the same however the examples were packed or sharded (as for the PPO loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from areal_jax.losses.step_metrics import _optimizer_entries

__all__ = ["SFTLossTerms", "SFTStepMetrics", "SFTSums", "finalise_sft_step", "sft_loss",
           "sft_loss_terms"]


class SFTLossTerms(NamedTuple):
    """One micro-batch's sums: the masked NLL and the mask count (fp32 scalars)."""

    nll_sum: jax.Array
    token_count: jax.Array


def sft_loss_terms(logp: ArrayLike, loss_mask: ArrayLike) -> SFTLossTerms:
    """(-sum(mask * logp), sum(mask != 0)) in fp32; logp and loss_mask are [B, T].

    Tokens off the mask are selected away (``where``), not multiplied by 0: a -inf or NaN
    logprob there (a padding position) cannot reach the loss or its gradient."""
    logp = jnp.asarray(logp, jnp.float32)
    mask = jnp.asarray(loss_mask) != 0
    if logp.shape != mask.shape:
        raise ValueError(f"sft_loss_terms: logp has shape {logp.shape}, loss_mask "
                         f"{mask.shape}; they must match")
    nll_sum = -jnp.sum(jnp.where(mask, logp, 0.0))
    return SFTLossTerms(nll_sum=nll_sum, token_count=jnp.sum(mask).astype(jnp.float32))


def sft_loss(logp: ArrayLike, loss_mask: ArrayLike) -> jax.Array:
    """The token-mean NLL over the mask (0 when the mask is empty)."""
    terms = sft_loss_terms(logp, loss_mask)
    return terms.nll_sum / jnp.maximum(terms.token_count, 1.0)


class SFTSums(NamedTuple):
    """Sums over micro-batches of the SFT step (fp32 scalars; a pytree the learner's
    gradient program carries): ``loss`` adds each micro-batch's share of its minibatch's
    token-mean loss, ``nll_sum`` and ``token_count`` the masked NLL and mask count,
    ``n_tokens`` the tokens of the sequences (prompt included)."""

    loss: jax.Array
    nll_sum: jax.Array
    token_count: jax.Array
    n_tokens: jax.Array

    @classmethod
    def zeros(cls) -> SFTSums:
        return cls(*(jnp.zeros((), jnp.float32) for _ in cls._fields))

    def add(self, other: SFTSums) -> SFTSums:
        return SFTSums(*(a + b for a, b in zip(self, other, strict=True)))


@dataclass(frozen=True)
class SFTStepMetrics:
    """One SFT version's metrics (host floats), in the order a metrics row lists them
    (under ``train/``)."""

    loss: float  # mean over minibatches of the minibatch's token-mean NLL
    nll: float  # the version's token-mean NLL over every loss token
    perplexity: float  # exp(nll)
    n_tokens: float
    n_loss_tokens: float
    grad_norm: float
    grad_norm_max: float
    n_minibatches: float
    skipped_steps: float
    lr: float

    def as_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.__dataclass_fields__}


def finalise_sft_step(per_step: Sequence[SFTSums], grad_norms: Sequence[float],
                      applied: Sequence[bool], lr: float) -> SFTStepMetrics:
    """The metrics of an SFT version from each minibatch's sums (added in float64 on the
    host), gradient norm and whether its update was applied."""
    total = {k: sum(float(getattr(s, k)) for s in per_step) for k in SFTSums._fields}
    nll = total["nll_sum"] / max(total["token_count"], 1.0)
    return SFTStepMetrics(
        loss=total["loss"] / max(len(per_step), 1),
        nll=nll,
        perplexity=float(np.exp(min(nll, 80.0))),
        n_tokens=total["n_tokens"],
        n_loss_tokens=total["token_count"],
        **_optimizer_entries(grad_norms, applied, lr),
    )
