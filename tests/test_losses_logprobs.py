"""Vocabulary-chunked log-probs and entropy against NumPy and against naive JAX autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.losses import entropy_from_logits, logprobs_from_hidden, logprobs_from_logits
from tests.tolerance import UNIT_ROUNDOFF_F32, network_tolerance, sum_tolerance


def reference_logp_entropy(logits_btv, labels_bt, temperature):
    """float64 loops over positions."""
    logits = np.asarray(logits_btv, np.float64) / temperature
    rows, cols, _ = logits.shape
    logp = np.zeros((rows, cols))
    entropy = np.zeros((rows, cols))
    for b in range(rows):
        for t in range(cols):
            z = logits[b, t]
            lse = z.max() + np.log(np.exp(z - z.max()).sum())
            p = np.exp(z - lse)
            logp[b, t] = z[labels_bt[b, t]] - lse
            entropy[b, t] = -(p * (z - lse)).sum()
    return logp, entropy


def naive_logp_entropy(logits_btv, labels_bt, temperature):
    """The obvious JAX version (materialises [B, T, V] fp32), used as the gradient reference."""
    log_probs = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(log_probs, labels_bt[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return logp, entropy


def value_tolerances(logits, temperature, matmul_terms=None):
    """fp32 bounds on (logp, entropy) against the float64 reference: x - logsumexp rounds at
    the size of the scaled logits, the sum of exp(x - max) <= 1 over V terms rounds at 1, and
    an fp32 matmul (``matmul_terms``: Σ|h|·|w| per logit, over the hidden size) adds its own
    rounding through the 2-Lipschitz log-softmax. Entropy is a V-term sum of p·(z - lse)."""
    z = np.abs(np.asarray(logits, np.float64)).max() / temperature
    vocab = np.shape(logits)[-1]
    from_matmul = 0.0
    if matmul_terms is not None:
        terms, dim = matmul_terms
        from_matmul = 2 * float(sum_tolerance(np.max(terms), dim)) / temperature
    logp_tol = 8 * UNIT_ROUNDOFF_F32 * z + float(sum_tolerance(1.0, vocab)) + from_matmul
    entropy_tol = float(sum_tolerance(2 * z + np.log(vocab), vocab)) + from_matmul
    return logp_tol, entropy_tol


def random_case(seed, rows=2, cols=5, vocab=37, dim=16):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(rows, cols, dim)).astype(np.float32)
    w = (rng.normal(size=(dim, vocab)) / np.sqrt(dim) * 3).astype(np.float32)
    labels = rng.integers(0, vocab, (rows, cols)).astype(np.int32)
    return hidden, w, labels


@pytest.mark.parametrize("chunk_size, temperature", [(8, 1.0), (37, 0.7), (64, 0.7), (1, 1.3)])
def test_logprobs_from_logits_match_reference(chunk_size, temperature):
    hidden, w, labels = random_case(seed=chunk_size)
    logits = hidden @ w
    logp, entropy = jax.jit(logprobs_from_logits, static_argnums=(2, 3))(
        logits, labels, temperature, chunk_size)
    ref_logp, ref_entropy = reference_logp_entropy(logits, labels, temperature)
    assert logp.dtype == entropy.dtype == jnp.float32 and logp.shape == labels.shape
    logp_tol, entropy_tol = value_tolerances(logits, temperature)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=0, atol=logp_tol)
    np.testing.assert_allclose(np.asarray(entropy), ref_entropy, rtol=0, atol=entropy_tol)
    np.testing.assert_allclose(
        np.asarray(entropy_from_logits(logits, temperature, chunk_size)), ref_entropy,
        rtol=0, atol=entropy_tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logprobs_from_logits_gradient_matches_naive(dtype):
    hidden, w, labels = random_case(seed=1)
    logits = jnp.asarray(hidden @ w, dtype)
    coef_logp, coef_ent = 0.7, -0.3  # arbitrary cotangents for both outputs

    def objective(fn, x):
        logp, entropy = fn(x)
        return jnp.sum(coef_logp * logp + coef_ent * entropy)

    chunked = jax.jit(jax.grad(lambda x: objective(
        lambda y: logprobs_from_logits(y, labels, 0.8, 8), x)))(logits)
    naive = jax.grad(lambda x: objective(lambda y: naive_logp_entropy(y, labels, 0.8), x))(logits)
    assert chunked.dtype == dtype
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(chunked), np.asarray(naive), rtol=1e-5, atol=1e-6)
    else:  # both are fp32 internally and rounded to bf16 once at the end
        np.testing.assert_allclose(np.asarray(chunked, np.float32), np.asarray(naive, np.float32),
                                   rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("chunk_size", [8, 100])
def test_logprobs_from_hidden_values_and_gradients_match_naive(chunk_size):
    hidden, w, labels = random_case(seed=2)
    logp, entropy = logprobs_from_hidden(hidden, w, labels, 0.9, chunk_size)
    ref_logp, ref_entropy = reference_logp_entropy(hidden.astype(np.float64) @ w, labels, 0.9)
    logp_tol, entropy_tol = value_tolerances(
        hidden.astype(np.float64) @ w, 0.9, (np.abs(hidden) @ np.abs(w), hidden.shape[-1]))
    np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=0, atol=logp_tol)
    np.testing.assert_allclose(np.asarray(entropy), ref_entropy, rtol=0, atol=entropy_tol)

    def objective(lp_ent):
        return jnp.sum(1.3 * lp_ent[0] + 0.4 * lp_ent[1])

    chunked = jax.jit(jax.grad(
        lambda h, w_: objective(logprobs_from_hidden(h, w_, labels, 0.9, chunk_size)),
        argnums=(0, 1)))(hidden, w)
    naive = jax.grad(lambda h, w_: objective(naive_logp_entropy(h @ w_, labels, 0.9)),
                     argnums=(0, 1))(hidden, w)
    for got, want in zip(chunked, naive, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_logprobs_from_hidden_bf16_inputs():
    hidden, w, labels = random_case(seed=3)
    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    @jax.jit
    def forward_and_grads(h, w_):
        (logp, entropy), vjp = jax.vjp(
            lambda a, b: logprobs_from_hidden(a, b, labels, 1.0, 8), h, w_)
        return logp, entropy, vjp((jnp.ones_like(logp), jnp.ones_like(entropy)))

    logp, entropy, (g_h, g_w) = forward_and_grads(h16, w16)
    assert logp.dtype == entropy.dtype == jnp.float32
    # fp32 accumulation of the bf16 matmul: equal to the fp32 computation on upcast inputs.
    h32, w32 = np.asarray(h16, np.float64), np.asarray(w16, np.float64)
    ref_logp, ref_entropy = reference_logp_entropy(h32 @ w32, labels, 1.0)
    logp_tol, entropy_tol = value_tolerances(
        h32 @ w32, 1.0, (np.abs(h32) @ np.abs(w32), h32.shape[-1]))
    np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=0, atol=logp_tol)
    np.testing.assert_allclose(np.asarray(entropy), ref_entropy, rtol=0, atol=entropy_tol)
    assert g_h.dtype == g_w.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(g_h, np.float32)))


def test_masked_vocabulary_entries_give_no_nan():
    hidden, w, labels = random_case(seed=4)
    logits = (hidden @ w).astype(np.float32)
    logits[..., 30:] = -np.inf  # e.g. padded vocabulary
    labels = labels % 30

    def objective(x):
        logp, entropy = logprobs_from_logits(x, labels, 1.0, 8)
        return jnp.sum(logp + entropy), (logp, entropy)

    (_, (logp, entropy)), grad = jax.value_and_grad(objective, has_aux=True)(logits)
    ref_logp, ref_entropy = reference_logp_entropy(logits[..., :30], labels, 1.0)
    logp_tol, entropy_tol = value_tolerances(logits[..., :30], 1.0)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=0, atol=logp_tol)
    np.testing.assert_allclose(np.asarray(entropy), ref_entropy, rtol=0, atol=entropy_tol)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[..., 30:] == 0.0)


def test_chunked_hidden_version_never_materialises_the_logits():
    """XLA's own buffer accounting: temp memory of value+grad stays below one [N, V] fp32."""
    n, dim, vocab = 256, 32, 4096
    hidden = jnp.zeros((n, dim), jnp.float32)
    w = jnp.zeros((dim, vocab), jnp.float32)
    labels = jnp.zeros((n,), jnp.int32)
    logits_bytes = n * vocab * 4

    def temp_bytes(fn):
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, w).compile()
        stats = compiled.memory_analysis()
        if stats is None:
            pytest.fail("this backend reports no memory analysis")
        return stats.temp_size_in_bytes

    def chunked(h, w_):
        logp, entropy = logprobs_from_hidden(h, w_, labels, 1.0, 512)
        return jnp.sum(logp + entropy)

    def naive(h, w_):
        logp, entropy = naive_logp_entropy(h @ w_, labels, 1.0)
        return jnp.sum(logp + entropy)

    assert temp_bytes(naive) >= logits_bytes  # the measurement does see [N, V] arrays
    assert temp_bytes(chunked) < logits_bytes / 2


def test_chunked_logits_version_holds_no_second_fp32_copy():
    """fp32 logits in, value+grad: no [N, V] fp32 temporaries beyond the input and its grad."""
    n, vocab = 256, 4096
    logits = jnp.zeros((n, vocab), jnp.float32)
    labels = jnp.zeros((n,), jnp.int32)

    def objective(x):
        logp, entropy = logprobs_from_logits(x, labels, 1.0, 512)
        return jnp.sum(logp + entropy)

    compiled = jax.jit(jax.value_and_grad(objective)).lower(logits).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < n * vocab * 4 / 2


@pytest.mark.parametrize("call, match", [
    (lambda h, w, lab: logprobs_from_hidden(h, w[:5], lab),
     r"hidden has shape \(2, 5, 16\) and w_dv has shape \(5, 37\)"),
    (lambda h, w, lab: logprobs_from_hidden(h, w, lab[:, :3]),
     r"labels has shape \(2, 3\); expected \(2, 5\)"),
    (lambda h, w, lab: logprobs_from_hidden(h, w, lab.astype(np.float32)),
     r"labels has dtype float32"),
    (lambda h, w, lab: logprobs_from_logits(h @ w, lab, temperature=0.0),
     r"temperature=0.0; expected a number > 0"),
    (lambda h, w, lab: logprobs_from_logits(h @ w, lab, chunk_size=0), r"chunk_size=0"),
    (lambda h, w, lab: entropy_from_logits((h @ w).astype(np.int32)),
     r"entropy_from_logits: logits has dtype int32"),
])
def test_bad_input_gets_a_specific_error(call, match):
    hidden, w, labels = random_case(seed=5)
    with pytest.raises((ValueError, TypeError), match=match):
        call(hidden, w, labels)


def test_logprobs_from_hidden_vocab_major_matrix_is_the_same_computation():
    """``vocab_axis=0`` takes the [V, D] matrix (a tied embedding table, no transposed
    copy): the same values, and the transposed gradient. The logits' products contract
    the other layout, and XLA:CPU may sum them in another order (seen on a CPU without
    AVX-512), so values agree within the rounding of a D-term sum, not bit for bit."""
    hidden, w, labels = random_case(seed=4)
    w_vd = np.ascontiguousarray(w.T)

    def run(h, w_, axis):
        def objective(h, w_):
            logp, entropy = logprobs_from_hidden(h, w_, labels, 0.9, 8, vocab_axis=axis)
            return jnp.sum(1.3 * logp + 0.4 * entropy), (logp, entropy)
        return jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(h, w_)

    (_, (logp_dv, ent_dv)), (g_h_dv, g_w_dv) = run(hidden, w, 1)
    (_, (logp_vd, ent_vd)), (g_h_vd, g_w_vd) = run(hidden, w_vd, 0)
    # |dz| <= the D-term sum bound of each logit; logp = z_y/T - logsumexp(z/T) moves by at
    # most 2 max|dz| / T, the entropy (a mean of z/T under p minus logsumexp) likewise.
    dz = sum_tolerance(np.abs(hidden) @ np.abs(w), hidden.shape[-1]).max() / 0.9
    for ours, theirs in ((logp_vd, logp_dv), (ent_vd, ent_dv)):
        ours, theirs = np.asarray(ours), np.asarray(theirs)
        bound = 2 * dz + 4 * np.finfo(np.float32).eps * np.abs(theirs)
        assert np.all(np.abs(ours - theirs) <= bound), np.abs(ours - theirs).max()
    # The gradients' matmuls contract the other layout, so their sums may round in
    # another order: bounded by the sums' magnitudes (|dL/dz| against |w| and |h|).
    g_z = np.abs(np.asarray(jax.grad(lambda z: jnp.sum(
        1.3 * naive_logp_entropy(z, labels, 0.9)[0]
        + 0.4 * naive_logp_entropy(z, labels, 0.9)[1]))(jnp.asarray(hidden @ w))))
    vocab, tokens = w.shape[1], labels.size
    # The logits themselves may differ by dz (above), which moves dL/dz by at most
    # lip * dz per element: lip bounds the objective's second derivative in z (logp's
    # softmax Hessian, 1/T^2, the entropy's, (2 + max|log p|)/T^2), dz already over T.
    logp_all = np.asarray(jax.nn.log_softmax(jnp.asarray(hidden @ w) / 0.9, axis=-1))
    lip = (1.3 + 0.4 * (2 + np.abs(logp_all).max())) / 0.9
    g_z_moved = lip * dz
    g_h_diff = np.abs(np.asarray(g_h_vd) - np.asarray(g_h_dv))
    g_h_bound = (sum_tolerance(g_z @ np.abs(w).T, vocab)
                 + g_z_moved * np.abs(w).sum(axis=1))
    assert np.all(g_h_diff <= g_h_bound), g_h_diff.max()
    g_w_diff = np.abs(np.asarray(g_w_vd) - np.asarray(g_w_dv).T)
    g_w_abs = np.einsum("rcd,rcv->vd", np.abs(hidden), g_z)
    g_w_bound = (sum_tolerance(g_w_abs, tokens)
                 + g_z_moved * np.abs(hidden).reshape(-1, hidden.shape[-1]).sum(axis=0))
    assert np.all(g_w_diff <= g_w_bound), g_w_diff.max()


def test_logprobs_from_hidden_fp32_matrix_with_bf16_hidden():
    """fp32 master weights with bf16 hidden states: each chunk is cast to bf16, so the
    values equal those of a bf16 matrix exactly; the matrix's gradient comes back fp32
    and equals the bf16 one up to the bf16 rounding the latter carries."""
    hidden, w, labels = random_case(seed=5)
    h16 = jnp.asarray(hidden, jnp.bfloat16)
    w32 = jnp.asarray(np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32))  # bf16 values

    @jax.jit
    def run(w_):
        (logp, entropy), vjp = jax.vjp(
            lambda b: logprobs_from_hidden(h16, b, labels, 1.0, 8), w_)
        return logp, entropy, vjp((jnp.ones_like(logp), jnp.ones_like(entropy)))[0]

    logp32, ent32, g32 = run(w32)
    logp16, ent16, g16 = run(w32.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(logp32), np.asarray(logp16))
    np.testing.assert_array_equal(np.asarray(ent32), np.asarray(ent16))
    assert g32.dtype == jnp.float32 and g16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g16, np.float32), np.asarray(g32),
                               rtol=float(jnp.finfo(jnp.bfloat16).eps), atol=0)


def test_logprobs_from_hidden_rejects_a_bad_vocab_axis():
    hidden, w, labels = random_case(seed=6)
    with pytest.raises(ValueError, match=r"vocab_axis=2; expected 1"):
        logprobs_from_hidden(hidden, w, labels, vocab_axis=2)
    with pytest.raises(ValueError, match=r"w_dv \[V, D\] \(vocab_axis=0\)"):
        logprobs_from_hidden(hidden, w, labels, vocab_axis=0)


@pytest.mark.parametrize("vocab_axis", [1, 0])
@pytest.mark.parametrize("hidden_dtype", [jnp.float32, jnp.bfloat16])
def test_w_grad_acc_adds_the_gradient_of_w_to_the_buffer(vocab_axis, hidden_dtype):
    """``w_grad_acc``: the gradient of the matrix comes out as buffer + gradient (chunks of
    7 over a vocabulary of 30: a short last chunk), the hidden states' gradient as
    without it; fp32 master matrix, fp32 or bf16 hidden states."""
    key = jax.random.key(0)
    n, d, v = 12, 16, 30
    hidden = jax.random.normal(key, (n, d)).astype(hidden_dtype)
    w = jax.random.normal(jax.random.key(1), (d, v) if vocab_axis == 1 else (v, d)) * 0.3
    labels = jax.random.randint(jax.random.key(2), (n,), 0, v)
    acc = jax.random.normal(jax.random.key(3), w.shape) * 5.0

    def loss(h, w_, a):
        logp, ent = logprobs_from_hidden(h, w_, labels, 0.8, chunk_size=7,
                                         vocab_axis=vocab_axis, w_grad_acc=a)
        return jnp.sum(logp * jnp.arange(n)) + 0.1 * jnp.sum(ent)

    g_h, g_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, w, None)
    g_h_acc, g_w_acc = jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, w, acc)
    g_h, g_w, g_h_acc, g_w_acc, acc = map(np.asarray, (g_h, g_w, g_h_acc, g_w_acc, acc))
    # Two separately compiled programs: each may round the chunked recomputation its own
    # way (logits over D, softmax over V, the gradients' sums over V and N terms), and the
    # hidden states' gradient is rounded to their dtype at the end.
    path = d + 2 * v + n
    h_dtype = "bfloat16" if hidden_dtype == jnp.bfloat16 else "float32"
    assert np.all(np.abs(g_h_acc.astype(np.float32) - g_h.astype(np.float32))
                  <= network_tolerance(np.abs(g_h.astype(np.float32)).max(), path, h_dtype))
    # plus one more fp32 rounding of each entry's sum with the buffer
    bound = (2 * UNIT_ROUNDOFF_F32 * (np.abs(acc) + np.abs(g_w))
             + network_tolerance(np.abs(g_w).max(), path))
    assert np.all(np.abs(g_w_acc - (acc + g_w)) <= bound)
    assert np.any(g_w != 0)


def test_w_grad_acc_of_another_shape_is_refused():
    hidden, w = jnp.ones((3, 4)), jnp.ones((4, 5))
    with pytest.raises(ValueError, match="w_grad_acc is float32\\[5, 4\\]; expected w_dv's "
                                         "float32\\[4, 5\\]"):
        logprobs_from_hidden(hidden, w, jnp.zeros((3,), jnp.int32), w_grad_acc=jnp.ones((5, 4)))


@pytest.mark.parametrize("vocab_axis", [1, 0])
def test_overlapping_last_chunk_counts_each_column_once(vocab_axis):
    """Chunks of 128 over a vocabulary of 300: three chunks of 128, the last starting at
    172, so columns 172-255 are in two chunks. Labels sit in that overlap and on both
    sides of it; values, the gradients of hidden and matrix, the gradient added into a
    buffer, and the from-logits kernel's gradient all match the naive computation."""
    from areal_jax.losses.logprobs import _chunking

    assert _chunking(300, 128) == (3, 128)
    rng = np.random.default_rng(7)
    n, d, v = 9, 16, 300
    hidden = rng.normal(size=(n, d)).astype(np.float32)
    w_dv = (rng.normal(size=(d, v)) / np.sqrt(d) * 3).astype(np.float32)
    labels = np.array([0, 100, 171, 172, 200, 255, 256, 299, 230], np.int32)
    w = w_dv if vocab_axis == 1 else np.ascontiguousarray(w_dv.T)
    acc = rng.normal(size=w.shape).astype(np.float32)

    def objective(lp_ent):
        return jnp.sum(lp_ent[0] * jnp.arange(1, n + 1)) + 0.3 * jnp.sum(lp_ent[1])

    def chunked(h, w_, a):
        return objective(logprobs_from_hidden(h, w_, labels, 0.9, chunk_size=128,
                                              vocab_axis=vocab_axis, w_grad_acc=a))

    def naive(h, w_):
        logits = h @ (w_ if vocab_axis == 1 else w_.T)
        return objective(naive_logp_entropy(logits, labels, 0.9))

    logp, entropy = logprobs_from_hidden(hidden, w, labels, 0.9, chunk_size=128,
                                         vocab_axis=vocab_axis)
    ref_logp, ref_entropy = reference_logp_entropy(
        (hidden.astype(np.float64) @ w_dv)[None], labels[None], 0.9)
    logp_tol, entropy_tol = value_tolerances(
        hidden.astype(np.float64) @ w_dv, 0.9, (np.abs(hidden) @ np.abs(w_dv), d))
    np.testing.assert_allclose(np.asarray(logp), ref_logp[0], rtol=0, atol=logp_tol)
    np.testing.assert_allclose(np.asarray(entropy), ref_entropy[0], rtol=0, atol=entropy_tol)

    want_h, want_w = jax.grad(naive, argnums=(0, 1))(hidden, w)
    got_h, got_w = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, w, None)
    _, got_w_acc = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, w, acc)
    # the gradients' sums run over V (softmax) and N (the matrix) terms in fp32
    scale = max(float(np.abs(want_h).max()), float(np.abs(want_w).max()))
    tol = float(sum_tolerance(scale, v + n)) * 8
    np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(got_w_acc), acc + np.asarray(want_w), rtol=0,
                               atol=tol + 2 * UNIT_ROUNDOFF_F32 * float(np.abs(acc).max()))

    logits = hidden @ w_dv
    got = jax.grad(lambda z: objective(logprobs_from_logits(z, labels, 0.9, 128)))(logits)
    want = jax.grad(lambda z: objective(naive_logp_entropy(z, labels, 0.9)))(logits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=float(sum_tolerance(float(np.abs(want).max()), v)) * 8)


def test_vocabulary_chunks_are_one_loop_body():
    """Qwen's vocabulary (151,936 = 37 x 4,096 + 384) in chunks of 4,096 traces to the same
    number of matrix products as a vocabulary that divides evenly: no second, short-chunk
    copy of the forward and backward programs after the loop (on TPU that tail took a
    quarter of the 0.5B learner's compile time)."""
    from areal_jax.losses.logprobs import _chunking

    assert _chunking(151936, 4096) == (38, 4096)

    def n_products(vocab):
        hidden = jax.ShapeDtypeStruct((16, 8), jnp.float32)
        w = jax.ShapeDtypeStruct((8, vocab), jnp.float32)
        labels = jnp.zeros((16,), jnp.int32)
        grad = jax.grad(lambda h, w_: jnp.sum(logprobs_from_hidden(h, w_, labels)[0]),
                        argnums=(0, 1))
        return str(jax.make_jaxpr(grad)(hidden, w)).count("dot_general")

    assert n_products(151936) == n_products(37 * 4096)
