"""The engine's forward passes (``areal_jax.engine.forward``) against the model's full
forward, with the layer loop unrolled (the CPU and GPU default) and as a scan (the TPU
default; the cache's layout picks the loop), on a random 3-layer GQA model in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.engine.forward import (
    decode_chunk,
    init_slot_cache,
    prefill_forward,
    scan_layers_by_default,
)
from model_defs import CausalLM, ModelConfig

SLOTS, MAX_LEN, STEPS = 4, 32, 3


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny", num_hidden_layers=3)
    return CausalLM(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32, param_dtype=jnp.float32)


def _tol(ref: np.ndarray) -> float:
    # fp32 sums over a few hundred terms, each reordered between the paths: a few ulps of
    # the largest logit, times a margin for the 3 layers and the online softmax.
    return 64 * np.finfo(np.float32).eps * float(np.abs(ref).max())


def _run(model, scan: bool):
    """Prefills two prompts of different lengths into slots 2 and 0, then decodes STEPS
    tokens for every slot, feeding back fixed tokens. Returns (prefill logits, per-step
    logits, cache)."""
    rng = np.random.default_rng(0)
    prompt_pt = rng.integers(3, 256, (2, 8)).astype(np.int32)
    prompt_len_p = np.array([8, 5], np.int32)
    prompt_pt[1, 5:] = 0
    slot_p = np.array([2, 0], np.int32)
    cache = init_slot_cache(model.cfg, SLOTS, MAX_LEN, jnp.float32, stacked=scan)
    prefill_logits, cache = jax.jit(
        lambda m, c: prefill_forward(m, prompt_pt, prompt_len_p, slot_p, c))(model, cache)
    fed = rng.integers(3, 256, (STEPS, SLOTS)).astype(np.int32)
    position_b = np.array([5, 0, 8, 0], np.int32)

    def choose(logits_bv, step, _position_b):
        return jnp.asarray(fed)[jnp.minimum(step + 1, STEPS - 1)], logits_bv

    logits_kbv, cache = jax.jit(
        lambda m, c: decode_chunk(m, jnp.asarray(fed[0]), jnp.asarray(position_b), c, 16, STEPS,
                                  choose))(model, cache)
    return np.asarray(prefill_logits), np.asarray(logits_kbv), cache, prompt_pt, fed


def test_scan_default_is_unrolled_on_cpu():
    assert not scan_layers_by_default()
    assert not init_slot_cache(ModelConfig.preset("tiny"), 2, 8, jnp.float32).stacked


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_prefill_and_decode_match_the_full_forward(model, scan):
    prefill_logits, logits_kbv, cache, prompt_pt, fed = _run(model, scan)
    # Slot 2 holds prompt 0 (8 tokens) then fed[0..2]; its decode logits at each step are
    # the full forward's at those positions.
    seq = np.concatenate([prompt_pt[0], fed[:, 2]])[None]
    full = np.asarray(model(jnp.asarray(seq)))[0]
    tol = _tol(full)
    np.testing.assert_allclose(prefill_logits[0], full[7], atol=tol, rtol=0)
    np.testing.assert_allclose(logits_kbv[:, 2], full[8:11], atol=tol, rtol=0)
    # Slot 0: prompt 1's 5 real tokens, decoded from position 5 on.
    seq0 = np.concatenate([prompt_pt[1, :5], fed[:, 0]])[None]
    full0 = np.asarray(model(jnp.asarray(seq0)))[0]
    np.testing.assert_allclose(prefill_logits[1], full0[4], atol=_tol(full0), rtol=0)
    np.testing.assert_allclose(logits_kbv[:, 0], full0[5:8], atol=_tol(full0), rtol=0)
    k, v = (np.asarray(cache.k), np.asarray(cache.v)) if scan else (np.stack(cache.k),
                                                                     np.stack(cache.v))
    assert k.shape == (3, SLOTS, 2, 16, MAX_LEN) and v.shape == (3, SLOTS, 2, MAX_LEN, 16)


def test_scan_and_unrolled_give_the_same_cache_and_logits(model):
    a = _run(model, False)
    b = _run(model, True)
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        np.testing.assert_allclose(x, y, atol=_tol(x), rtol=0)
    for x, y in ((a[2].k, b[2].k), (a[2].v, b[2].v)):
        x, y = np.stack(x), np.asarray(y)  # per-layer tuple (unrolled), stacked (scan)
        np.testing.assert_allclose(x, y, atol=_tol(x), rtol=0)
    # Positions nobody wrote stay zero in both.
    assert not np.stack(a[2].v)[:, 1, :, 3:].any() and not np.asarray(b[2].v)[:, 1, :, 3:].any()


def test_the_scanned_programs_hold_one_layer(model):
    """The scan's program does not grow with depth; the unrolled one does."""
    deeper = CausalLM(model.cfg.replace(num_hidden_layers=6), rngs=nnx.Rngs(0),
                      dtype=jnp.float32, param_dtype=jnp.float32)

    def size(m, scan):
        cache = init_slot_cache(m.cfg, SLOTS, MAX_LEN, jnp.float32, stacked=scan)
        ids = np.ones((2, 8), np.int32)
        lens, slots = np.array([8, 5], np.int32), np.array([0, 1], np.int32)
        return len(jax.jit(lambda m, c: prefill_forward(m, ids, lens, slots, c))
                   .lower(m, cache).as_text())

    assert size(deeper, True) < 1.1 * size(model, True)
    assert size(deeper, False) > 1.5 * size(model, False)


def test_the_runner_serves_the_same_tokens_with_scanned_layers(model):
    """The accelerator layout (stacked cache, scanned layers) through ModelRunner's own jitted,
    donating step functions: the same greedy tokens and logprobs as the CPU layout."""
    from areal_jax.engine.runner import ModelRunner

    rows = [{"input_ids": [5, 9, 17, 33, 2, 8], "slot": 1, "temperature": 0.0, "top_p": 1.0,
             "top_k": -1, "seed": 0},
            {"input_ids": [7, 7, 100], "slot": 3, "temperature": 1.0, "top_p": 0.9,
             "top_k": 20, "seed": 11}]
    out = {}
    for scan in (False, True):
        runner = ModelRunner(model, max_slots=SLOTS, max_seq_len=MAX_LEN, prefill_rows=2,
                             decode_steps=4, scan_layers=scan)
        assert runner.cache.stacked == scan
        first = runner.prefill(16, rows, any_truncation=True, any_random=True)
        tokens, logprobs = runner.decode(runner.kv_len(6), True, True)
        out[scan] = (first, np.asarray(tokens)[:, [1, 3]], np.asarray(logprobs)[:, [1, 3]])
    np.testing.assert_array_equal(out[False][0][0], out[True][0][0])
    np.testing.assert_array_equal(out[False][1], out[True][1])
    np.testing.assert_allclose(out[False][2], out[True][2], atol=_tol(out[False][2]), rtol=0)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_one_step_decode_calls_continue_as_whole_calls_do(model, scan):
    """``decode(n_steps=1)`` (what the engine dispatches while a weight update is on its
    way) runs one step of the same program: calls of 1, 1, 1, 4 and 1 steps give the
    tokens and logprobs of two whole 4-step calls, greedy and sampled rows alike."""
    from areal_jax.engine.runner import ModelRunner

    rows = [{"input_ids": [5, 9, 17, 33, 2, 8], "slot": 1, "temperature": 0.0, "top_p": 1.0,
             "top_k": -1, "seed": 0},
            {"input_ids": [7, 7, 100], "slot": 3, "temperature": 1.0, "top_p": 0.9,
             "top_k": 20, "seed": 11}]
    out = {}
    for plan in ((4, 4), (1, 1, 1, 4, 1)):
        runner = ModelRunner(model, max_slots=SLOTS, max_seq_len=MAX_LEN, prefill_rows=2,
                             decode_steps=4, scan_layers=scan)
        runner.prefill(16, rows, any_truncation=True, any_random=True)
        tokens, logprobs, done = [], [], 0
        for n in plan:
            t_kb, lp_kb = runner.decode(runner.kv_len(6 + done), True, True, n_steps=n)
            assert t_kb.shape[0] == 4  # the program's rows; the first n are the steps run
            tokens.append(np.asarray(t_kb)[:n][:, [1, 3]])
            logprobs.append(np.asarray(lp_kb)[:n][:, [1, 3]])
            done += n
        out[plan] = np.concatenate(tokens), np.concatenate(logprobs)
    (t_whole, lp_whole), (t_steps, lp_steps) = out.values()
    np.testing.assert_array_equal(t_whole, t_steps)
    np.testing.assert_allclose(lp_whole, lp_steps, atol=_tol(lp_whole), rtol=0)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_chunked_prefill_and_the_key_block_loop_match_the_full_forward(model, scan,
                                                                       monkeypatch):
    """A prompt prefilled in two chunks (the second attending to the first in the cache,
    next to a fresh prompt in the same call), then decoded with the cache read in key
    blocks of 8 up to a length that is not a multiple of 8, in a cache of 30 positions
    (not one either): the full forward's logits at every position."""
    from areal_jax.engine import forward

    monkeypatch.setattr(forward, "DECODE_KV_BLOCK", 8)
    max_len = 30
    rng = np.random.default_rng(1)
    long_prompt = rng.integers(3, 256, 21).astype(np.int32)
    short_prompt = rng.integers(3, 256, 3).astype(np.int32)
    cache = init_slot_cache(model.cfg, SLOTS, max_len, jnp.float32, stacked=scan)
    prefill = jax.jit(lambda m, c, ids, lens, slots, starts, kv_len: prefill_forward(
        m, ids, lens, slots, c, starts, kv_len))
    # Chunk 1: the long prompt's first 16 tokens into slot 1 (and a dummy row, dropped).
    ids = np.zeros((2, 16), np.int32)
    ids[0] = long_prompt[:16]
    _, cache = prefill(model, cache, ids, np.array([16, 1], np.int32),
                       np.array([1, SLOTS], np.int32), np.zeros(2, np.int32), np.int32(0))
    # Chunk 2 (8 long): its last 5 tokens at positions 16..20, and the short prompt in slot 3.
    ids = np.zeros((2, 8), np.int32)
    ids[0, :5], ids[1, :3] = long_prompt[16:], short_prompt
    logits_pv, cache = prefill(model, cache, ids, np.array([5, 3], np.int32),
                               np.array([1, 3], np.int32), np.array([16, 0], np.int32),
                               np.int32(16))
    fed = rng.integers(3, 256, (STEPS, SLOTS)).astype(np.int32)
    position_b = np.array([0, 21, 0, 3], np.int32)

    def choose(logits_bv, step, _position_b):
        return jnp.asarray(fed)[jnp.minimum(step + 1, STEPS - 1)], logits_bv

    logits_kbv, cache = jax.jit(lambda m, c, kv_len: decode_chunk(
        m, jnp.asarray(fed[0]), jnp.asarray(position_b), c, kv_len, STEPS, choose))(
        model, cache, np.int32(22))
    full = np.asarray(model(jnp.asarray(np.concatenate([long_prompt, fed[:, 1]])[None])))[0]
    np.testing.assert_allclose(np.asarray(logits_pv)[0], full[20], atol=_tol(full), rtol=0)
    np.testing.assert_allclose(np.asarray(logits_kbv)[:, 1], full[21:24], atol=_tol(full),
                               rtol=0)
    short = np.asarray(model(jnp.asarray(np.concatenate([short_prompt, fed[:, 3]])[None])))[0]
    np.testing.assert_allclose(np.asarray(logits_pv)[1], short[2], atol=_tol(short), rtol=0)
    np.testing.assert_allclose(np.asarray(logits_kbv)[:, 3], short[3:6], atol=_tol(short),
                               rtol=0)


def test_the_runners_step_programs_copy_no_cache(model):
    """The compiled prefill (every chunk) and decode programs write the donated cache in
    place. A prefill that wrote into the cache its key-block loop had read from copied
    every layer's whole cache at every call (XLA's copy to keep the loop's reads safe):
    on the long-tail model 60% of a 4 x 256 prefill."""
    import re

    from areal_jax.engine.runner import ModelRunner

    runner = ModelRunner(model, max_slots=SLOTS, max_seq_len=MAX_LEN, prefill_rows=2,
                         decode_steps=2, scan_layers=False)
    cache_shapes = {f"f32[{','.join(map(str, x.shape))}]"
                    for x in jax.tree.leaves(runner.cache)}
    assert len(cache_shapes) == 2  # keys and values

    def cache_copies(hlo: str) -> list[str]:
        return [line.strip() for line in hlo.splitlines()
                if re.search(r"= (f32\[[0-9,]+\])\{[0-9,]*\} copy\(", line)
                and re.search(r"= (f32\[[0-9,]+\])", line).group(1) in cache_shapes]

    flags = (np.bool_(False), np.bool_(True))
    for chunk in runner.chunks:
        hlo = runner._prefill.lower(runner.params, runner.cache, runner.slots,
                                    *runner._dummy_prefill_rows(chunk), *flags
                                    ).compile().as_text()
        assert cache_copies(hlo) == [], f"prefill chunk {chunk}"
    for window in runner.windows:
        hlo = runner._decode.lower(runner.params, runner.cache, runner.slots, np.int32(9),
                                   np.int32(2), *flags, window).compile().as_text()
        assert cache_copies(hlo) == [], f"decode window {window}"
