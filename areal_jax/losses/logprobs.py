"""Token log-probs and entropy of softmax(logits / temperature), chunked over the vocabulary.

A pass over vocabulary chunks keeps an online logsumexp (running max m, sum of
exp(z - m), and sum of exp(z - m) * z), so only [N, chunk] fp32 arrays ever exist:

    lse = m + log(s),   entropy = lse - t / s,   logp = z[label] - lse.

The backward pass (a ``jax.custom_vjp``) recomputes each chunk and uses
``d logp / dz = onehot - p`` and ``d entropy / dz = -p * (log p + entropy)``.

- :func:`logprobs_from_hidden` takes final hidden states and the unembedding matrix,
  so the [N, V] logits are never materialised, in the forward or the backward pass.
- :func:`logprobs_from_logits` / :func:`entropy_from_logits` take existing logits (any
  float dtype) and never hold a second [N, V] fp32 copy of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from areal_jax.losses import _checks

DEFAULT_CHUNK_SIZE = 4096

ChunkFn = Callable[[Any, int], jax.Array]  # (start, size) -> z [N, size] fp32


def _chunking(vocab: int, chunk_size: int) -> tuple[int, int]:
    """(n, size): ``n`` chunks of one ``size`` <= ``chunk_size`` that cover [0, vocab).

    Every chunk has the same shape, so the pass is one loop body and nothing else: a
    short last chunk would be a second copy of every chunk program, outside the loop
    (for Qwen's 151,936-token vocabulary in chunks of 4,096, a 384-wide tail whose
    programs took a quarter of the learner's TPU compile). The size is a multiple of 128
    (a TPU lane) where ``chunk_size`` is; the last chunk then ends at ``vocab`` and
    overlaps the one before it (3,712 columns of 155,648 for Qwen, 2.4%), and its
    overlapping columns are masked out.
    """
    n = -(-vocab // chunk_size)
    if n == 1:
        return 1, vocab
    size = -(-vocab // n)
    if chunk_size % 128 == 0:
        size = min(-(-size // 128) * 128, chunk_size)
    return n, size


def _for_each_chunk(vocab: int, chunk_size: int, body: Callable, carry: Any) -> Any:
    """``carry = body(carry, start, size, lo)`` over [0, vocab) in equal chunks
    (:func:`_chunking`). Columns ``< lo`` of a chunk were covered by the chunk before it
    and must be ignored; ``lo`` is None where chunks cannot overlap."""
    n, size = _chunking(vocab, chunk_size)
    if n == 1:
        return body(carry, 0, size, None)
    overlaps = n * size > vocab

    def step(i, c):
        nominal = i * size
        start = jnp.minimum(nominal, vocab - size) if overlaps else nominal
        return body(c, start, size, nominal - start if overlaps else None)

    return jax.lax.fori_loop(0, n, step, carry)


def _new_columns(size: int, lo: Any) -> jax.Array:
    """[1, size] bool: the columns of a chunk no earlier chunk covered."""
    return (jnp.arange(size) >= lo)[None, :]


def _online_forward(
    chunk_logits: ChunkFn, labels_n: jax.Array, n: int, vocab: int, chunk_size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (logp [N], entropy [N], lse [N]), all fp32."""

    def body(carry, start, size, lo):
        m_n, s_n, t_n, zlabel_n = carry
        z_nc = chunk_logits(start, size)
        if lo is not None:
            z_nc = jnp.where(_new_columns(size, lo), z_nc, -jnp.inf)
        m_new = jnp.maximum(m_n, jnp.max(z_nc, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        e_nc = jnp.exp(z_nc - m_safe[:, None])
        rescale = jnp.exp(m_n - m_safe)
        s_n = s_n * rescale + jnp.sum(e_nc, axis=-1)
        t_n = t_n * rescale + jnp.sum(jnp.where(e_nc > 0, e_nc * z_nc, 0.0), axis=-1)
        offset_n = labels_n - start
        inside_n = (offset_n >= (0 if lo is None else lo)) & (offset_n < size)
        index_n1 = jnp.clip(offset_n, 0, size - 1)[:, None]
        picked_n = jnp.take_along_axis(z_nc, index_n1, axis=-1)[:, 0]
        zlabel_n = jnp.where(inside_n, picked_n, zlabel_n)
        return m_new, s_n, t_n, zlabel_n

    zeros = jnp.zeros((n,), jnp.float32)
    init = (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    m_n, s_n, t_n, zlabel_n = _for_each_chunk(vocab, chunk_size, body, init)
    lse_n = m_n + jnp.log(s_n)
    entropy_n = lse_n - t_n / s_n
    return zlabel_n - lse_n, entropy_n, lse_n


def _grad_chunk_logits(z_nc, start, size, lo, labels_n, lse_n, entropy_n, g_logp_n, g_ent_n):
    """Cotangent of z = logits / temperature for one chunk, fp32 [N, size]; zero in the
    columns an earlier chunk covered (``lo``, see :func:`_for_each_chunk`)."""
    log_p_nc = z_nc - lse_n[:, None]
    p_nc = jnp.exp(log_p_nc)
    onehot_nc = (labels_n[:, None] - start) == jnp.arange(size)[None, :]
    g_z = g_logp_n[:, None] * (onehot_nc.astype(jnp.float32) - p_nc)
    g_z = g_z - g_ent_n[:, None] * p_nc * (log_p_nc + entropy_n[:, None])
    g_z = jnp.where(p_nc > 0, g_z, g_logp_n[:, None] * onehot_nc)
    return g_z if lo is None else jnp.where(_new_columns(size, lo), g_z, 0.0)


# ----------------------------------------------------------------------------- from logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _logits_kernel(logits_nv, labels_n, temperature, chunk_size):
    out, _ = _logits_kernel_fwd(logits_nv, labels_n, temperature, chunk_size)
    return out


def _logits_chunk_fn(logits_nv, temperature) -> ChunkFn:
    def chunk(start, size):
        raw = jax.lax.dynamic_slice_in_dim(logits_nv, start, size, axis=1)
        return raw.astype(jnp.float32) / temperature

    return chunk


def _logits_kernel_fwd(logits_nv, labels_n, temperature, chunk_size):
    n, vocab = logits_nv.shape
    chunk = _logits_chunk_fn(logits_nv, temperature)
    logp_n, entropy_n, lse_n = _online_forward(chunk, labels_n, n, vocab, chunk_size)
    return (logp_n, entropy_n), (logits_nv, labels_n, lse_n, entropy_n)


def _logits_kernel_bwd(temperature, chunk_size, residuals, cotangents):
    logits_nv, labels_n, lse_n, entropy_n = residuals
    g_logp_n, g_ent_n = cotangents
    n, vocab = logits_nv.shape
    chunk = _logits_chunk_fn(logits_nv, temperature)

    def body(g_logits_nv, start, size, lo):
        g_z = _grad_chunk_logits(chunk(start, size), start, size, lo, labels_n, lse_n,
                                 entropy_n, g_logp_n, g_ent_n)
        g_chunk = (g_z / temperature).astype(logits_nv.dtype)
        if lo is not None:  # keep what the chunk before wrote in the shared columns
            g_chunk = jnp.where(_new_columns(size, lo), g_chunk, jax.lax.dynamic_slice_in_dim(
                g_logits_nv, start, size, axis=1))
        return jax.lax.dynamic_update_slice_in_dim(g_logits_nv, g_chunk, start, axis=1)

    g_logits_nv = _for_each_chunk(vocab, chunk_size, body, jnp.zeros_like(logits_nv))
    return g_logits_nv, None


_logits_kernel.defvjp(_logits_kernel_fwd, _logits_kernel_bwd)


# ----------------------------------------------------------------------------- from hidden


# The unembedding matrix is [D, V] (vocab_axis 1) or [V, D] (vocab_axis 0, e.g. a tied
# embedding table used as is: a transposed copy would cost a second matrix, and so would
# the gradient's transpose back).
_W_SPECS = {1: ("nd,dc->nc", "nc,dc->nd", "nd,nc->dc"), 0: ("nd,cd->nc", "nc,cd->nd", "nd,nc->cd")}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _hidden_kernel(hidden_nd, w, w_acc, labels_n, temperature, chunk_size, vocab_axis):
    out, _ = _hidden_kernel_fwd(hidden_nd, w, w_acc, labels_n, temperature, chunk_size,
                                vocab_axis)
    return out


def _w_chunk(w, start, size, vocab_axis, dtype):
    """One vocabulary chunk of ``w`` in the hidden states' dtype (e.g. bf16 of fp32 master
    weights: only a chunk is ever cast, never the whole matrix)."""
    return jax.lax.dynamic_slice_in_dim(w, start, size, axis=vocab_axis).astype(dtype)


def _hidden_chunk_fn(hidden_nd, w, temperature, vocab_axis) -> ChunkFn:
    def chunk(start, size):
        w_chunk = _w_chunk(w, start, size, vocab_axis, hidden_nd.dtype)
        logits_nc = jnp.einsum(_W_SPECS[vocab_axis][0], hidden_nd, w_chunk,
                               preferred_element_type=jnp.float32)
        return logits_nc / temperature

    return chunk


def _hidden_kernel_fwd(hidden_nd, w, w_acc, labels_n, temperature, chunk_size, vocab_axis):
    n = hidden_nd.shape[0]
    chunk = _hidden_chunk_fn(hidden_nd, w, temperature, vocab_axis)
    logp_n, entropy_n, lse_n = _online_forward(chunk, labels_n, n, w.shape[vocab_axis],
                                               chunk_size)
    return (logp_n, entropy_n), (hidden_nd, w, w_acc, labels_n, lse_n, entropy_n)


def _hidden_kernel_bwd(temperature, chunk_size, vocab_axis, residuals, cotangents):
    """Chunk by chunk: the hidden states' gradient accumulates in fp32; ``w``'s gradient
    is written into a [V, D] / [D, V] buffer one chunk at a time: zeros, or with ``w_acc``
    that buffer itself (each chunk added to it), so the gradient comes out as
    ``w_acc`` + gradient without a second matrix."""
    hidden_nd, w, w_acc, labels_n, lse_n, entropy_n = residuals
    g_logp_n, g_ent_n = cotangents
    chunk = _hidden_chunk_fn(hidden_nd, w, temperature, vocab_axis)
    _, hidden_spec, w_spec = _W_SPECS[vocab_axis]

    def body(carry, start, size, lo):
        g_hidden_nd, g_w = carry
        g_logits_nc = _grad_chunk_logits(chunk(start, size), start, size, lo, labels_n, lse_n,
                                          entropy_n, g_logp_n, g_ent_n) / temperature
        w_chunk = _w_chunk(w, start, size, vocab_axis, hidden_nd.dtype)
        g_hidden_nd = g_hidden_nd + jnp.einsum(
            hidden_spec, g_logits_nc, w_chunk, preferred_element_type=jnp.float32)
        g_w_chunk = jnp.einsum(w_spec, hidden_nd, g_logits_nc,
                               preferred_element_type=jnp.float32)
        if w_acc is not None or lo is not None:  # lo: the shared rows hold a gradient
            g_w_chunk = g_w_chunk + jax.lax.dynamic_slice_in_dim(g_w, start, size,
                                                                 axis=vocab_axis)
        return g_hidden_nd, jax.lax.dynamic_update_slice_in_dim(
            g_w, g_w_chunk.astype(g_w.dtype), start, axis=vocab_axis)

    init = (jnp.zeros(hidden_nd.shape, jnp.float32),
            jnp.zeros_like(w) if w_acc is None else w_acc)
    g_hidden_nd, g_w = _for_each_chunk(w.shape[vocab_axis], chunk_size, body, init)
    return g_hidden_nd.astype(hidden_nd.dtype), g_w, None, None


_hidden_kernel.defvjp(_hidden_kernel_fwd, _hidden_kernel_bwd)


# ----------------------------------------------------------------------------- public API


def _static_options(fn: str, temperature: Any, chunk_size: Any) -> tuple[float, int]:
    if isinstance(temperature, jax.core.Tracer):
        raise TypeError(f"{fn}: temperature must be a Python float (static), not a traced value")
    _checks.positive(fn, "temperature", temperature)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size={chunk_size!r}; expected an int >= 1")
    return float(temperature), chunk_size


def _labels(fn: str, labels: ArrayLike, lead_shape: tuple[int, ...], what: str) -> jax.Array:
    labels_arr = _checks.int_input(fn, "labels", labels)
    if labels_arr.shape != lead_shape:
        raise ValueError(
            f"{fn}: labels has shape {tuple(labels_arr.shape)}; expected {lead_shape} "
            f"(the leading dims of {what})"
        )
    return labels_arr.reshape(-1).astype(jnp.int32)


def logprobs_from_logits(
    logits: ArrayLike, labels: ArrayLike, temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``labels`` and entropy under softmax(logits / temperature).

    Args:
        logits: [..., V] any float dtype (e.g. [B, T, V] bf16), read chunk by chunk.
        labels: int [...] token ids. Ids outside [0, V) give logp = -logsumexp (mask them).
        temperature: static Python float > 0.
        chunk_size: the widest vocabulary chunk (static); the chunks are of one width,
            at most this (see ``_chunking``).

    Returns:
        ``(logp, entropy)``, fp32 [...]. Differentiable in ``logits``.
    """
    fn = "logprobs_from_logits"
    temperature, chunk_size = _static_options(fn, temperature, chunk_size)
    logits_arr = _checks.as_array(fn, "logits", logits)
    if not jnp.issubdtype(logits_arr.dtype, jnp.floating) or logits_arr.ndim < 1:
        raise TypeError(f"{fn}: logits has dtype {logits_arr.dtype} and shape "
                        f"{tuple(logits_arr.shape)}; expected a float array [..., V]")
    lead, vocab = logits_arr.shape[:-1], logits_arr.shape[-1]
    labels_n = _labels(fn, labels, lead, "logits")
    logp_n, entropy_n = _logits_kernel(logits_arr.reshape(-1, vocab), labels_n, temperature,
                                       chunk_size)
    return logp_n.reshape(lead), entropy_n.reshape(lead)


def entropy_from_logits(
    logits: ArrayLike, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> jax.Array:
    """Entropy of softmax(logits / temperature), fp32 [...] for logits [..., V]."""
    logits_arr = _checks.as_array("entropy_from_logits", "logits", logits)
    labels = jnp.zeros(logits_arr.shape[:-1], jnp.int32) if logits_arr.ndim >= 1 else 0
    try:
        return logprobs_from_logits(logits_arr, labels, temperature, chunk_size)[1]
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("logprobs_from_logits", "entropy_from_logits")) from None


def logprobs_from_hidden(
    hidden: ArrayLike,
    w_dv: ArrayLike,
    labels: ArrayLike,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    vocab_axis: int = 1,
    w_grad_acc: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``labels`` and entropy under softmax(hidden @ w_dv / temperature).

    The [N, V] logits are never materialised: each vocabulary chunk's logits are computed
    (matmul accumulated in fp32), folded into an online logsumexp and dropped, and the
    backward pass recomputes them chunk by chunk.

    Args:
        hidden: [..., D] final hidden states (after the final norm), e.g. [B, T, D].
        w_dv: [D, V] unembedding matrix, or [V, D] with ``vocab_axis=0``.
        labels: int [...] the token whose log-prob is wanted at each position.
        temperature: static Python float > 0.
        chunk_size: the widest vocabulary chunk (static); the chunks are of one width,
            at most this (see ``_chunking``).
        vocab_axis: 1 (default) for ``w_dv`` [D, V]; 0 for a [V, D] matrix, e.g. a tied
            embedding table passed as is, which saves a transposed copy of it (and of its
            gradient).
        w_grad_acc: optional gradient buffer shaped like ``w_dv`` (a learner's gradient
            accumulator): the gradient of ``w_dv`` then comes out as ``w_grad_acc`` plus
            this call's gradient, each chunk added into the buffer in the backward pass,
            so no second [V, D] matrix is made (the buffer is donated in practice).

    ``w_dv`` may be wider than ``hidden`` (fp32 master weights, bf16 hidden states): each
    chunk is cast to ``hidden``'s dtype for the matmul, and the gradient of ``w_dv`` is
    accumulated in ``w_dv``'s own dtype.

    Returns:
        ``(logp, entropy)``, fp32 [...]. Differentiable in ``hidden`` and ``w_dv``.
    """
    fn = "logprobs_from_hidden"
    temperature, chunk_size = _static_options(fn, temperature, chunk_size)
    hidden_arr = _checks.as_array(fn, "hidden", hidden)
    w_arr = _checks.as_array(fn, "w_dv", w_dv)
    for name, arr in (("hidden", hidden_arr), ("w_dv", w_arr)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{fn}: {name} has dtype {arr.dtype}; expected a float dtype")
    if isinstance(vocab_axis, bool) or vocab_axis not in (0, 1):
        raise ValueError(f"{fn}: vocab_axis={vocab_axis!r}; expected 1 (w_dv [D, V]) or 0 "
                         "([V, D])")
    layout = "[D, V]" if vocab_axis == 1 else "[V, D] (vocab_axis=0)"
    if (hidden_arr.ndim < 1 or w_arr.ndim != 2
            or hidden_arr.shape[-1] != w_arr.shape[1 - vocab_axis]):
        raise ValueError(
            f"{fn}: hidden has shape {tuple(hidden_arr.shape)} and w_dv has shape "
            f"{tuple(w_arr.shape)}; expected hidden [..., D] and w_dv {layout} with the "
            "same D"
        )
    lead, dim = hidden_arr.shape[:-1], hidden_arr.shape[-1]
    labels_n = _labels(fn, labels, lead, "hidden")
    if w_grad_acc is not None:
        w_grad_acc = _checks.as_array(fn, "w_grad_acc", w_grad_acc)
        if w_grad_acc.shape != w_arr.shape or w_grad_acc.dtype != w_arr.dtype:
            raise ValueError(f"{fn}: w_grad_acc is {w_grad_acc.dtype}{list(w_grad_acc.shape)}; "
                             f"expected w_dv's {w_arr.dtype}{list(w_arr.shape)}")
    logp_n, entropy_n = _hidden_kernel(hidden_arr.reshape(-1, dim), w_arr, w_grad_acc,
                                       labels_n, temperature, chunk_size, vocab_axis)
    return logp_n.reshape(lead), entropy_n.reshape(lead)
