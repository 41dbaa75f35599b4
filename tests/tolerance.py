"""Float tolerances derived from the precision and the size of the values, never from one run.

Two evaluations of the same math (another kernel, instruction set, sharding, packing or
library) differ by rounding alone. Each float sum of n terms is within γ·Σ|x_i| of the exact
value, with γ = λ·√n·u (Higham's probabilistic bound; u = eps/2 the unit roundoff; λ = 4
holds for all but ~1e-6 of sums), so two evaluations differ by at most twice that. A network is a
chain of such sums: its output's error is bounded by the same form with n the total length of
the reductions along the longest path (each layer's RMS norm resets the scale, so rounding
errors add across layers rather than multiply), and Σ|x_i| the magnitude of the terms that make
the final output (|h|·|W| for logits), which is what a fixed `atol` silently assumed.

    tol = sum_tolerance(abs_terms, n)                 # one reduction
    tol = network_tolerance(abs_terms, path_length)   # a whole forward pass
"""

from __future__ import annotations

import math

import numpy as np

# Machine epsilon (the gap above 1.0) of each float format the project uses.
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
UNIT_ROUNDOFF_F32 = EPS["float32"] / 2
LAMBDA = 4.0  # Higham's probabilistic constant for one sum
NETWORK_LAMBDA = 8.0  # the same, with room for the softmax/norm amplification along a forward


def unit_roundoff(dtype: str = "float32") -> float:
    return EPS[dtype] / 2


def sum_tolerance(abs_terms, n: int, dtype: str = "float32", lam: float = LAMBDA):
    """|a - b| bound for two evaluations of one sum of ``n`` terms with Σ|x_i| = ``abs_terms``
    (a scalar or an array, elementwise)."""
    return 2.0 * lam * math.sqrt(max(n, 1)) * unit_roundoff(dtype) * np.asarray(abs_terms)


def network_tolerance(abs_terms, path_length: int, dtype: str = "float32"):
    """|a - b| bound for two evaluations of a forward pass whose reductions along the longest
    path add up to ``path_length`` terms, with output term magnitude ``abs_terms``."""
    return sum_tolerance(abs_terms, path_length, dtype, lam=NETWORK_LAMBDA)


def decoder_path_length(hidden: int, intermediate: int, head_dim: int, n_layers: int,
                        seq_len: int) -> int:
    """Reduction lengths along one decoder layer's longest path (q/k/v projection, q·k, the
    attention-weighted sum over the sequence, o projection, gate/up, down), times the layers,
    plus the output head."""
    per_layer = hidden + head_dim + seq_len + hidden + hidden + intermediate
    return n_layers * per_layer + hidden


def hf_path_length(hf_config, seq_len: int) -> int:
    """``decoder_path_length`` for a transformers config."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    return decoder_path_length(hf_config.hidden_size, hf_config.intermediate_size, head_dim,
                               hf_config.num_hidden_layers, seq_len)


def logits_term_scale(hidden_btd: np.ndarray, head_vd: np.ndarray) -> np.ndarray:
    """Σ_d |h_d|·|W_vd| per logit: the magnitude of the terms the output head adds up."""
    return np.abs(np.asarray(hidden_btd, np.float64)) @ np.abs(np.asarray(head_vd, np.float64)).T


def logprob_tolerance(n_vocab: int, logit_tol: float, dtype: str = "float32") -> float:
    """|a - b| bound on log-softmax outputs whose logits differ by at most ``logit_tol``:
    log-softmax is 1-Lipschitz per logit in the max norm up to a factor 2 (the logit itself and
    the logsumexp), plus the rounding of a logsumexp over ``n_vocab`` terms of magnitude ≤ 1."""
    return 2.0 * logit_tol + float(sum_tolerance(1.0, n_vocab, dtype))


def reference_tolerance(abs_terms, n: int = 1, ops: int = 4, dtype: str = "float32"):
    """|computed - exact| bound for one evaluation, in ``dtype``, of a result that sums ``n``
    terms with Σ|term_i| = ``abs_terms`` (a scalar or an array, elementwise), each term made
    by at most ``ops`` rounded operations (+, -, *, /, sqrt, exp, log: each within u
    relative, a few u for exp and log, counted as such): ops·u per term plus the sum's
    λ·√n·u, relative to Σ|term_i|. For comparing an fp32 computation with a float64
    reference of the same formula; two fp32 evaluations differ by at most twice it."""
    return (ops + LAMBDA * math.sqrt(max(n, 1))) * unit_roundoff(dtype) * np.asarray(abs_terms)
