"""Vocabulary-chunked log-probs + entropy (value and grad) vs the naive full-logits version.

Both compute the same thing: per-token log-prob of the labels and entropy of
softmax(hidden @ w / temperature), and their gradients w.r.t. hidden and w. The naive
peer materialises [N, V] fp32 logits and log-softmax; ``logprobs_from_hidden`` keeps an
online logsumexp over vocabulary chunks. Reported side by side in one run: step time
and XLA's temp-buffer bytes from the compiled executable, plus the max abs difference.

    python -m areal_jax.bench losses --tokens 2048 --dim 512 --vocab 32768 --chunk 4096
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.bench.common import time_calls
from areal_jax.losses import logprobs_from_hidden


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=2048, help="N, tokens per step")
    parser.add_argument("--dim", type=int, default=512, help="D, hidden size")
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768], help="V values")
    parser.add_argument("--chunk", type=int, default=4096, help="vocabulary chunk size")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)


def _naive(hidden, w, labels, temperature):
    logits = jnp.einsum("nd,dv->nv", hidden, w, preferred_element_type=jnp.float32) / temperature
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return logp, entropy


def _objective(fn):
    def loss(hidden, w, labels):
        logp, entropy = fn(hidden, w, labels)
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _measure(step, args, repeats):
    compiled = step.lower(*args).compile()
    memory = compiled.memory_analysis()
    temp_mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
    out = jax.block_until_ready(compiled(*args))
    times = time_calls(lambda: jax.block_until_ready(compiled(*args)), repeats)
    return float(np.median(times)), temp_mib, out


def run(args: argparse.Namespace) -> dict:
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    rows, summary = [], {}
    for vocab in args.vocab:
        hidden = jnp.asarray(rng.normal(size=(args.tokens, args.dim)), dtype)
        w = jnp.asarray(rng.normal(size=(args.dim, vocab)) / np.sqrt(args.dim), dtype)
        labels = jnp.asarray(rng.integers(0, vocab, args.tokens), jnp.int32)
        naive_step = _objective(lambda h, w_, lab: _naive(h, w_, lab, 0.9))
        chunk = args.chunk
        chunked_step = _objective(
            lambda h, w_, lab, c=chunk: logprobs_from_hidden(h, w_, lab, 0.9, c))
        naive_s, naive_mib, naive_out = _measure(naive_step, (hidden, w, labels), args.repeats)
        chunk_s, chunk_mib, chunk_out = _measure(chunked_step, (hidden, w, labels), args.repeats)
        max_diff = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(jax.tree.leaves(naive_out), jax.tree.leaves(chunk_out), strict=True))
        logits_mib = args.tokens * vocab * 4 / 2**20
        rows.append([vocab, round(logits_mib, 1), "naive", round(naive_s * 1e3, 2),
                     round(naive_mib, 1), 1.0, 1.0, 0.0])
        rows.append([vocab, round(logits_mib, 1), f"chunked({chunk})", round(chunk_s * 1e3, 2),
                     round(chunk_mib, 1), round(naive_s / chunk_s, 3),
                     round(naive_mib / max(chunk_mib, 1e-9), 2), max_diff])
        summary[f"V{vocab}_speed_vs_naive"] = round(naive_s / chunk_s, 3)
        summary[f"V{vocab}_temp_memory_reduction"] = round(naive_mib / max(chunk_mib, 1e-9), 2)
    return {
        "title": f"log-probs + entropy, value+grad, N={args.tokens} D={args.dim} {args.dtype}",
        "columns": ["V", "[N,V] fp32 MiB", "impl", "ms/step", "XLA temp MiB",
                    "speed vs naive", "temp mem reduction", "max |diff| vs naive"],
        "rows": rows,
        "summary": summary,
    }
