"""The engine's forward passes over its slot KV cache.

They run the model through its public API (``embed``, ``rope``, each layer's
``attention_inputs`` and ``finish``, ``final_norm``, ``logits_from_hidden``) and the one
attention function, ``model_defs.attention.attention``, that the learner uses too. They
own only what serving needs differently from the learner: the cache layout and how much
of it attention reads.

* The layer loop is a ``lax.scan`` on TPU and unrolled elsewhere
  (``scan_layers_by_default``); the cache's layout says which (``SlotCache``). A scan puts
  one layer in the compiled program whatever the depth: unrolled, the 28-layer prefill of
  a 1.5B model took 655 s to compile for a TPU on this project's 2-core planning machine,
  70 s scanned. Each scan step reads its layer's slice of the stacked weights and cache,
  which TPU fuses into the matmul's operand, read in place. XLA's CPU and GPU backends
  copy such a slice before the matmul (neither hoists it out of a loop either): planned
  for one H100, the 1.5B decode call moved 192.7 GB scanned against 124.3 GB unrolled. So
  elsewhere the layers are unrolled over slices taken once per call, before the step loop.
  (Slicing inside the step loop copied every layer's weights at every step: a 4-layer,
  50 MB model's 8-step decode call moved 1.32 GB instead of 0.71 GB on the CPU by
  ``plan/hlo_cost``.) The price of unrolling is compile time that grows with depth and,
  in decode, the slices' copy of the weights, live through the call.

* The slot cache is head-major: values ``[B_slots, K, S_max, Dh]`` and keys stored
  transposed, ``[B_slots, K, Dh, S_max]``, per layer. Decode attention is then two plain
  matrix products per (slot, kv-head), ``q[G, Dh] @ k[Dh, S]`` and ``p[G, S] @ v[S, Dh]``,
  each reading its operand in its natural layout. (With keys as ``[S, Dh]`` the score
  product contracts the minor axis of both operands, which XLA's CPU dot runs 2-3x
  slower on these shapes: it was the largest op of a decode step.)
* Decode attends to the first ``kv_len`` cache positions only (a traced length that
  covers every active slot), read in blocks of ``DECODE_KV_BLOCK`` keys by a loop that
  stops after the last filled block (``model_defs.attention.cache_attention``): a step
  costs what the live sequences need, not S_max, and one program serves every length
  (a program per power-of-two length before: the engine's start-up compiled each).
  A call runs several steps and writes the cache once.
* Prefill computes a chunk of prompts (the learner's causal self-attention over the
  chunk, blockwise) plus, for a long prompt's later chunks, the same key-block loop over
  the slot's cache below the chunk, and writes their keys/values into their slots.
* Decode attends to the cache prefix and to this call's keys separately and merges the
  two by their log-sum-exp (``merge_attention``), exactly equal to one softmax over both.

Exactness is tested against model_defs' full forward and transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from areal_jax.engine.sampling import first_argmax
from model_defs import CausalLM, ModelConfig, PyTree
from model_defs.attention import attention, cache_attention, merge_attention
from model_defs.fused_attention import active_platform

Array = jax.Array
# Cache keys per step of the attention loop over a slot's filled prefix (decode, and
# prefill chunks after a long prompt's first): a call reads the blocks up to the longest
# live sequence. Each step of the loop costs a little fixed work, each key read past the
# live length a little compute: 64 keeps both small on the CPU for demo-sized contexts.
DECODE_KV_BLOCK = 64


Leaf = TypeVar("Leaf")  # an array, or a PartitionSpec where the cache's layout is described


@struct.dataclass
class SlotCache(Generic[Leaf]):
    """Keys/values of every slot: ``k`` [B_slots, K, Dh, S_max] (transposed, see the module
    doc) and ``v`` [B_slots, K, S_max, Dh] per layer, either stacked into one [L, ...] array
    each (for the scanned layer loop) or as a tuple of L arrays (for the unrolled one, where
    each layer's buffer is written in place and read directly, with no slice to copy).
    The forward functions loop over the layers the way the cache is laid out."""

    k: Leaf | tuple[Leaf, ...]
    v: Leaf | tuple[Leaf, ...]

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)


def init_slot_cache(cfg: ModelConfig, slots: int, max_len: int, dtype: DTypeLike,
                    stacked: bool | None = None) -> SlotCache:
    """A zero cache; ``stacked`` (default: ``scan_layers_by_default()``) picks the layout."""
    stacked = scan_layers_by_default() if stacked is None else stacked
    n = cfg.num_hidden_layers
    v_shape = (slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
    k_shape = (slots, cfg.num_key_value_heads, cfg.head_dim, max_len)
    if stacked:
        return SlotCache(k=jnp.zeros((n, *k_shape), dtype), v=jnp.zeros((n, *v_shape), dtype))
    return SlotCache(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(n)),
                     v=tuple(jnp.zeros(v_shape, dtype) for _ in range(n)))


def scan_layers_by_default() -> bool:
    """Whether the engine loops over its layers with a ``lax.scan`` (and stacks its cache)
    where it is traced: on TPU only (see the module doc)."""
    return active_platform() == "tpu"


# Per layer, its variables (``CausalLM.layers_of``), or None: the loop slices the stack.
LayerLeaves = Sequence[Sequence[Array]] | None


class _LayerLoop:
    """The engine's loop over the decoder layers: a ``lax.scan`` for a stacked cache (one
    layer in the program, each step reading its slice of the stacked weights), else
    unrolled over layers sliced once, when the loop is built (a slice is a copy on the
    CPU, so one taken inside a step loop would be taken at every step), or over the
    per-layer arrays ``layer_leaves`` when the caller has them (the runner passes arrays
    aliasing the stacked weights on a CPU, so its programs copy no weights at all).

    Per-layer operands are stacked [L, ...] arrays for a scan and lists of L arrays when
    unrolled (``per_layer``)."""

    def __init__(self, model: CausalLM, scan: bool, layer_leaves: LayerLeaves = None):
        self.model, self.scan, self.n = model, scan, model.num_layers
        if scan:
            self.layers = None
        elif layer_leaves is not None:  # per-layer arrays given: nothing to slice
            self.layers = model.layers_of(layer_leaves)
        else:
            self.layers = model.unstacked_layers()

    def per_layer(self, cache_part: Array | tuple[Array, ...],
                  fn: Callable[[Array], Array] = lambda a: a) -> Array | list[Array]:
        """``fn`` (a slice, a cast) of a cache part, laid out for the loop."""
        if self.scan:
            return fn(cast(Array, cache_part))  # one stacked array when scanned
        return [fn(c) for c in cache_part]

    def zeros(self, shape: tuple[int, ...], dtype: DTypeLike) -> Array | list[Array]:
        if self.scan:
            return jnp.zeros((self.n, *shape), dtype)
        return [jnp.zeros(shape, dtype) for _ in range(self.n)]

    def run(self, body: Callable, carry: PyTree, xs: tuple) -> tuple[PyTree, tuple]:
        """``body(carry, layer, xs_l) -> (carry, ys_l)`` over the layers in order; returns
        the carry and the ys (stacked for a scan, lists when unrolled)."""
        if self.scan:
            def step(c, i_xs):
                i, xs_l = i_xs
                return body(c, self.model.layer(i), xs_l)
            return jax.lax.scan(step, carry, (jnp.arange(self.n), xs))
        outs = []
        assert self.layers is not None  # unrolled: __init__ unstacked them
        for i, layer in enumerate(self.layers):
            carry, y = body(carry, layer, tuple(x[i] for x in xs))
            outs.append(y)
        return carry, tuple(list(ys) for ys in zip(*outs, strict=True))

    def write(self, cache_part: Array | tuple[Array, ...], new: Array | list[Array],
              write_one: Callable[[Array, Array], Array]) -> Array | tuple[Array, ...]:
        """``write_one(buffer, new)`` (an indexed ``.at[...].set``, written for one layer's
        [B_slots, ...] buffer) applied to every layer: once over the stack, with a leading
        layer axis added to both, or per layer."""
        if self.scan:
            return jax.vmap(write_one)(cast(Array, cache_part), cast(Array, new))
        return tuple(write_one(c, x) for c, x in zip(cache_part, new, strict=True))


def prefill_forward(model: CausalLM, prompt_pt: Array, prompt_len_p: Array, slot_p: Array,
                    cache: SlotCache, start_p: Array | None = None,
                    kv_len: Array | int = 0, layer_leaves: LayerLeaves = None
                    ) -> tuple[Array, SlotCache]:
    """Runs a chunk of right-padded prompts [P, C] sitting at positions ``start_p + [0, C)``
    (default 0: whole prompts) and stores their keys/values in slots ``slot_p``
    (out-of-range slots, used for padding rows, are dropped). Each row's tokens attend to
    its slot's cache below ``start_p`` (the earlier chunks of a long prompt; the loop
    reads keys [0, ``kv_len``), ``kv_len`` >= every row's start) and causally to the chunk.
    ``prompt_len_p``: each row's real tokens in the chunk. Returns the fp32 logits at each
    row's last real token [P, V] and the cache. ``layer_leaves``: see ``_LayerLoop``."""
    rows, chunk = prompt_pt.shape
    loop = _LayerLoop(model, cache.stacked, layer_leaves)
    start_p = jnp.zeros((rows,), jnp.int32) if start_p is None else jnp.asarray(start_p)
    positions_pt = start_p[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    cos_sin = model.rope(positions_pt)
    prefix_limit_pt = jnp.broadcast_to((start_p - 1)[:, None], (rows, chunk))

    def layer_step(x_ptd, layer, xs_l):
        pk, pv = xs_l
        q_pkgtd, k_pktd, v_pktd = layer.attention_inputs(x_ptd, cos_sin)
        # Right padding comes after every real token, so causal attention alone keeps it
        # out of the real tokens' outputs.
        own = attention(q_pkgtd, k_pktd, v_pktd, impl=model.attention_impl, return_lse=True)
        # Unrolled, each layer's cache comes back as the key-block loop carried it and the
        # write below goes into that one, in place (cache_attention's pass_through). A
        # scan would stack what comes back into a new cache: there the write goes into
        # the stacked cache given.
        out, lse, *read = cache_attention(q_pkgtd, pk, pv, prefix_limit_pt, kv_len,
                                          block=DECODE_KV_BLOCK, rows_b=slot_p,
                                          pass_through=not loop.scan)
        x_ptd = layer.finish(x_ptd, merge_attention([(out, lse), own], model.dtype))
        return x_ptd, (k_pktd.swapaxes(2, 3), v_pktd, *read)

    x_ptd, (new_k, new_v, *read) = loop.run(
        layer_step, model.embed(prompt_pt), (loop.per_layer(cache.k), loop.per_layer(cache.v)))
    rows_pc = jnp.broadcast_to(slot_p[:, None], (rows, chunk))
    pos_pc = positions_pt

    def write_k(c, new_pkdc):
        return c.at[rows_pc, :, :, pos_pc].set(new_pkdc.transpose(0, 3, 1, 2).astype(c.dtype),
                                                mode="drop")

    def write_v(c, new_pkcd):
        return c.at[rows_pc, :, pos_pc].set(new_pkcd.transpose(0, 2, 1, 3).astype(c.dtype),
                                             mode="drop")

    read_k, read_v = (cache.k, cache.v) if loop.scan else (tuple(read[0]), tuple(read[1]))
    cache = SlotCache(k=loop.write(read_k, new_k, write_k), v=loop.write(read_v, new_v, write_v))
    last_pd = jnp.take_along_axis(x_ptd, (prompt_len_p - 1)[:, None, None], axis=1)[:, 0]
    hidden_p1d = model.final_norm(last_pd[:, None, :])
    return model.logits_from_hidden(hidden_p1d)[:, 0], cache


def decode_forward(model: CausalLM, token_b: Array, position_b: Array, cache: SlotCache,
                   kv_len: int) -> tuple[Array, SlotCache]:
    """One token per slot at its own position (< kv_len). Returns logits [B, V], cache.
    (A one-step ``decode_chunk``; kept as the simple reference path.)"""
    logits_kbv, cache = decode_chunk(model, token_b, position_b, cache, kv_len, 1,
                                     lambda logits_bv, step, position_b: (
                                         first_argmax(logits_bv), logits_bv))
    return logits_kbv[0], cache


def decode_chunk(model: CausalLM, token_b: Array, position_b: Array, cache: SlotCache,
                 kv_len: Array | int, steps: int,
                 choose: Callable[[Array, Array, Array], tuple[Array, PyTree]],
                 window: int | None = None, layer_leaves: LayerLeaves = None,
                 n_steps: Array | None = None) -> tuple[PyTree, SlotCache]:
    """``steps`` decode steps for every slot, feeding back ``choose``'s tokens.

    ``n_steps`` (traced, 1..steps; default all): only the first ``n_steps`` steps run (one
    program serves every count: a loop whose bound is an argument); the extras' later rows
    are zeros, and the cache positions they would have filled get zeros, which no later
    call reads before it writes them (it attends below its own start).

    Slot b feeds ``token_b[b]`` at ``position_b[b]``, then its own choices at the next
    positions. Attention reads the cache prefix [0, kv_len) (positions below each slot's
    start): its first ``window`` keys (default ``DECODE_KV_BLOCK``; static) sliced once
    per call, the rest, up to ``kv_len`` (which may be traced: one program serves every
    length), in blocks by a loop; plus the keys/values this call produced, kept in a
    small local buffer. The cache is written once, after the last step.

    ``choose(logits_bv, step, position_b) -> (token_b, extra)`` picks the next tokens
    (``position_b`` is where they will sit); the stacked ``extra`` [steps, ...] is returned.
    """
    b = token_b.shape[0]
    loop = _LayerLoop(model, cache.stacked, layer_leaves)
    kv, _, dh = loop.per_layer(cache.v)[0].shape[-3:]
    start_b = position_b
    # The cache's first keys [B, K, Dh, W] and values [B, K, W, Dh], sliced once per call
    # (every step reads them: a sequence within the window needs no loop), and the whole
    # cache [B, K, Dh, S] / [B, K, S, Dh], whose later blocks cache_attention's loop reads
    # up to kv_len (no loop at all when the window is the whole cache).
    s_max = loop.per_layer(cache.v)[0].shape[-2]
    head = min(DECODE_KV_BLOCK if window is None else window, s_max)
    head_k = loop.per_layer(cache.k, lambda k: k[..., :head].astype(model.dtype))
    head_v = loop.per_layer(cache.v, lambda v: v[..., :head, :].astype(model.dtype))
    prefix_k, prefix_v = loop.per_layer(cache.k), loop.per_layer(cache.v)
    local_k0 = loop.zeros((b, kv, dh, steps), model.dtype)
    local_v0 = loop.zeros((b, kv, steps, dh), model.dtype)
    # The prefix holds positions [0, start_b) of each slot; later indices are stale.
    prefix_limit_b1 = (start_b - 1)[:, None]

    def one_step(carry, step):
        local_k, local_v, token_b, position_b = carry
        cos_sin = model.rope(position_b[:, None])
        local_limit_b1 = jnp.full((b, 1), step, jnp.int32)  # this call's keys 0..step

        def layer_step(x_b1d, layer, xs_l):
            hk, hv, pk, pv, lk, lv = xs_l
            q_bkg1d, k_bk1d, v_bk1d = layer.attention_inputs(x_b1d, cos_sin)
            lk = jax.lax.dynamic_update_slice_in_dim(lk, k_bk1d.swapaxes(2, 3), step, axis=3)
            lv = jax.lax.dynamic_update_slice_in_dim(lv, v_bk1d, step, axis=2)
            parts = [attention(q_bkg1d, hk, hv, kv_limit_bt=prefix_limit_b1,
                               keys_transposed=True, return_lse=True),
                     attention(q_bkg1d, lk, lv, kv_limit_bt=local_limit_b1,
                               keys_transposed=True, return_lse=True)]
            if head < s_max:
                parts.append(cache_attention(q_bkg1d, pk, pv, prefix_limit_b1, kv_len,
                                             block=DECODE_KV_BLOCK, start=head))
            return layer.finish(x_b1d, merge_attention(parts, model.dtype)), (lk, lv)

        x_b1d, (local_k, local_v) = loop.run(
            layer_step, model.embed(token_b[:, None]),
            (head_k, head_v, prefix_k, prefix_v, local_k, local_v))
        logits_bv = model.logits_from_hidden(model.final_norm(x_b1d))[:, 0]
        next_token_b, extra = choose(logits_bv, step, position_b + 1)
        return (local_k, local_v, next_token_b, position_b + 1), extra

    if n_steps is None:
        (local_k, local_v, _, _), extras = jax.lax.scan(
            one_step, (local_k0, local_v0, token_b, position_b), jnp.arange(steps))
    else:
        carry0 = (local_k0, local_v0, token_b, position_b)
        extra_shapes = jax.eval_shape(one_step, carry0, jnp.int32(0))[1]
        extras0 = jax.tree.map(lambda e: jnp.zeros((steps, *e.shape), e.dtype), extra_shapes)

        def body(loop_carry):
            step, carry, extras = loop_carry
            carry, extra = one_step(carry, step)
            extras = jax.tree.map(
                lambda buf, e: jax.lax.dynamic_update_index_in_dim(buf, e, step, 0),
                extras, extra)
            return step + 1, carry, extras

        _, (local_k, local_v, _, _), extras = jax.lax.while_loop(
            lambda loop_carry: loop_carry[0] < jnp.minimum(n_steps, steps), body,
            (jnp.int32(0), carry0, extras0))
    # Write this call's keys/values at positions start_b + [0, steps); beyond S_max: dropped.
    rows_bc = jnp.broadcast_to(jnp.arange(b)[:, None], (b, steps))
    pos_bc = start_b[:, None] + jnp.arange(steps)[None, :]

    def commit_k(c, local_bkdc):
        return c.at[rows_bc, :, :, pos_bc].set(local_bkdc.transpose(0, 3, 1, 2).astype(c.dtype),
                                                mode="drop")

    def commit_v(c, local_bkcd):
        return c.at[rows_bc, :, pos_bc].set(local_bkcd.transpose(0, 2, 1, 3).astype(c.dtype),
                                             mode="drop")

    return extras, SlotCache(k=loop.write(cache.k, local_k, commit_k),
                             v=loop.write(cache.v, local_v, commit_v))
