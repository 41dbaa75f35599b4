"""Device side of the engine: params, the slot KV cache, jitted prefill and decode.

The cache holds one row per slot (see ``forward.SlotCache``). Besides the cache, the
device keeps per-slot state (last token, its position, sampling parameters), so a decode
step needs no host-to-device transfer and returns only the sampled tokens and their
logprobs.

Compiled programs: a decode program (all slots, ``decode_steps`` tokens per call) per
window in ``DECODE_WINDOWS``: each serves every filled length (``kv_len``, an argument,
not a shape), reading the cache's first ``window`` keys as one slice per call and the
keys beyond them, up to the longest live sequence, in a loop over key blocks (so a
call attends to what the live sequences need; the smallest window whose slice covers
them is fastest), and one prefill program per chunk length
in ``PREFILL_CHUNKS`` (``prefill_rows`` prompt chunks at a time, padded with dummy rows;
a long prompt is prefilled chunk after chunk, each attending to the ones before it in the
cache). Neither count grows with max_seq_len. Weight swaps keep shapes, dtypes and
shardings, so they never recompile. ``num_compilations`` counts step calls that traced
or compiled anything: a trace, or an XLA compile without one (which is what an input
placed differently costs, e.g. one committed to a device where the compiled call saw an
uncommitted array), and each program compiled ahead of time (``compile_programs``: at
start-up the ones small requests need, the larger prefill chunks in the background).

Params, cache and slot state are therefore committed to their device(s) when created,
like the swapped-in weights (``place_like_current``). Left uncommitted, the first weight
swap silently recompiled every shape: seconds per bucket.

Data parallelism (``data_parallel=n``): the slots are split over the first n local
devices, each holding a full copy of the params and its own share of the cache and slot
state. Both step functions run under ``shard_map`` with no communication: decode is
per-slot anyway, and prefill runs the (few, replicated) prompt rows on every device,
each device keeping the rows whose slots it owns. On a CPU host the n devices are
``--xla_force_host_platform_device_count`` devices, one per core, which is how a
small-batch decode uses more than one core (XLA does not split its small matmuls
across threads); on a multi-GPU host they are GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from areal_jax.cpu_affinity import usable_cpu_count
from areal_jax.engine.forward import (
    SlotCache,
    decode_chunk,
    init_slot_cache,
    prefill_forward,
    scan_layers_by_default,
)
from areal_jax.engine.sampling import sample_tokens
from model_defs import CausalLM, fp32_matmuls

# Prompt chunk lengths of the prefill programs (each capped at max_seq_len). The first is
# the one program every prompt can be served with (a long prompt in several chunks);
# the larger ones cut the calls for long prompts and are compiled in the background.
PREFILL_CHUNKS = (16, 64, 256)
# The decode programs' windows (each capped at max_seq_len): the cache's first keys each
# reads as one slice per call. The first serves every request while the others compile.
# 512 (the long-tail config's 448): reading keys 257-448 through the key-block loop cost
# a decode call 1.5x what one slice of them does (long-tail model, 64 slots, 8 steps:
# 32-40 ms against 22-25 ms at 350-440 cached keys), and the long tail lives there.
DECODE_WINDOWS = (64, 128, 256, 512)
# A prefill call's fixed cost on a CPU, in tokens of a chunk's work: on the long-tail
# model, 4 rows, one core, a 16/64/256-token chunk took 1.26/3.81/16.5 ms (about 0.5 ms a
# call and 0.062 ms a padded token). ``chunk_plan`` weighs calls against padding with it;
# elsewhere (a GPU's or TPU's launch dwarfs a chunk's padding) prompts take the fewest calls.
CPU_PREFILL_CALL_TOKENS = 8
logger = logging.getLogger(__name__)
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# How much lower the background compile's thread runs than the step loop (its nice value
# above the process's, Linux): a request served while the larger programs compile gets
# the cores first, the compile what is left (a tenth of a busy core at nice 10).
BACKGROUND_COMPILE_NICE = 10
_compile_watch = threading.local()  # .hit: set while a step call runs on this thread
_listener_installed = False


def _on_duration_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == _BACKEND_COMPILE_EVENT and getattr(_compile_watch, "hit", None) is not None:
        _compile_watch.hit[0] = True


def _install_compile_listener() -> None:
    global _listener_installed
    if not _listener_installed:
        jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
        _listener_installed = True


def _lower_thread_priority(increment: int) -> int | None:
    """Raises the calling thread's nice value by ``increment`` (on Linux a thread has its
    own); returns the new value, or None where it cannot (another OS, no permission)."""
    if not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"):
        return None
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Hands the C heap's free pages back to the OS (glibc's ``malloc_trim``; False where
    there is none). XLA's compile leaves what it allocated free but held by the heap: at
    the 0.5B shape 0.23 to 0.28 GB of a server's resident set after its programs compile,
    which a weight update's new version would otherwise come on top of."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def prefill_chunks(max_seq_len: int) -> list[int]:
    """The prefill programs' chunk lengths for ``max_seq_len``: ``PREFILL_CHUNKS`` capped."""
    return sorted({min(c, max_seq_len) for c in PREFILL_CHUNKS})


def decode_windows(max_seq_len: int) -> list[int]:
    """The decode programs' windows for ``max_seq_len``: ``DECODE_WINDOWS`` capped."""
    return sorted({min(w, max_seq_len) for w in DECODE_WINDOWS})


def program_name(key: tuple[str, int]) -> str:
    """``decode_<window>`` or ``prefill_<chunk>``: how /get_server_info and the start-up
    report name a program."""
    return f"{key[0]}_{key[1]}"


def chunk_plan(length: int, sizes: list[int], call_tokens: int | None = None
               ) -> list[tuple[int, int, int]]:
    """The (start, tokens, chunk length) pieces a prompt of ``length`` tokens is prefilled
    in with chunk lengths ``sizes`` (ascending).

    ``call_tokens`` None: the fewest calls (the shortest chunk that holds the rest, else a
    full chunk of the longest), for a device where a call's fixed cost dwarfs its padded
    tokens. Else the pieces of least estimated work, each call counted as its chunk
    length plus ``call_tokens`` (ties to fewer calls): on a CPU, where a call costs about
    its padded length, an 85-token prompt goes in 64 + 16 + 16, not in a 256 chunk that
    computes three times the tokens.
    """
    pieces = (_fewest_pieces(length, sizes) if call_tokens is None
              else _cheapest_pieces(length, tuple(sizes), call_tokens))
    plan, start = [], 0
    for size in pieces:
        n = min(length - start, size)
        plan.append((start, n, size))
        start += n
    return plan


def _fewest_pieces(length: int, sizes: list[int]) -> list[int]:
    """Full chunks of the longest size, then the shortest chunk that holds the rest."""
    pieces, rest = [], length
    while rest > 0:
        size = next((c for c in sizes if c >= rest), sizes[-1])
        pieces.append(size)
        rest -= min(rest, size)
    return pieces


# Per (sizes, call_tokens): the cheapest plan's (work, calls, -first size) for each number
# of tokens, grown as longer prompts come (a table for one length is the start of the
# table for any longer one, so each length is worked out once per process; from scratch,
# a new 32k-token length cost the engine loop 47 ms).
_piece_tables: dict[tuple[tuple[int, ...], int], list[tuple[int, int, int]]] = {}
_piece_tables_lock = threading.Lock()


def _cheapest_pieces(length: int, sizes: tuple[int, ...], call_tokens: int) -> list[int]:
    """The chunk lengths (longest first) covering ``length`` tokens at the least total of
    ``size + call_tokens``; among equal totals, the fewest calls."""
    with _piece_tables_lock:
        best = _piece_tables.setdefault((sizes, call_tokens), [(0, 0, 0)])
        for rest in range(len(best), length + 1):
            best.append(min((size + call_tokens + best[max(0, rest - size)][0],
                             1 + best[max(0, rest - size)][1], -size) for size in sizes))
    pieces, rest = [], length
    while rest > 0:
        size = -best[rest][2]
        pieces.append(size)
        rest = max(0, rest - size)
    return sorted(pieces, reverse=True)


class ModelRunner:
    """Owns the params, the slot cache and the compiled step functions."""

    def __init__(
        self,
        model: CausalLM,
        *,
        max_slots: int,
        max_seq_len: int,
        cache_dtype: DTypeLike = jnp.float32,
        prefill_rows: int = 4,
        decode_steps: int = 1,
        data_parallel: int = 1,
        scan_layers: bool | None = None,
    ):
        """``scan_layers``: loop over the layers with a ``lax.scan`` over a stacked cache
        (default: on TPU; see ``areal_jax.engine.forward``)."""
        self.cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self.data_parallel = data_parallel
        self.mesh: Mesh | None = None
        devices = jax.local_devices()
        self.device = devices[0]
        if data_parallel > 1:
            if len(devices) < data_parallel:
                raise ValueError(
                    f"data_parallel={data_parallel} needs that many local devices, found "
                    f"{len(devices)} ({devices[0].platform}); on CPU start the process with "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={data_parallel}")
            if max_slots % data_parallel:
                raise ValueError(f"max_slots={max_slots} must be a multiple of "
                                 f"data_parallel={data_parallel}")
            self.mesh = Mesh(np.array(devices[:data_parallel]), ("slots",))
            self.state = jax.device_put(self.state, NamedSharding(self.mesh, P()))
        else:
            self.state = jax.device_put(self.state, self.device)  # committed, see module doc
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.cache_dtype = jnp.dtype(cache_dtype)
        self.prefill_rows = prefill_rows
        self.decode_steps = decode_steps
        self.chunks = prefill_chunks(max_seq_len)
        self.prefill_call_tokens = (CPU_PREFILL_CALL_TOKENS if self.device.platform == "cpu"
                                    else None)  # chunk_plan's weighing, see the constant
        self.windows = decode_windows(max_seq_len)
        # Stacked cache and scanned layers on TPU, per-layer and unrolled elsewhere
        # (areal_jax.engine.forward's module doc).
        self.stacked_cache = scan_layers_by_default() if scan_layers is None else scan_layers
        self.layer_views = self._layer_views(self.state)
        self.num_compilations = 0
        self.last_probe_logprob = float("nan")  # prefill(probe_ids=...): the probe row's
        self.compiled: list[str] = []
        prefill_impl, decode_impl = self._prefill_impl, self._decode_impl
        if self.mesh is not None:
            prefill_impl, decode_impl = self._sharded(prefill_impl, decode_impl)
        self._prefill = jax.jit(self._counted("prefill", prefill_impl), donate_argnums=(1, 2))
        self._decode = jax.jit(self._counted("decode", decode_impl), donate_argnums=(1, 2),
                               static_argnums=(7,))
        # ("prefill", chunk) / ("decode", window) -> the program compiled ahead of time; one without
        # one goes through the jitted function (and compiles there). Guarded by _programs_lock,
        # as are _compiling (key -> the compile under way, in any thread) and program_stats
        # (key -> {"compile_s", "hlo_chars"} of each program compiled ahead of time).
        self._executables: dict[tuple[str, int], Any] = {}
        self._compiling: dict[tuple[str, int], Future] = {}
        self.program_stats: dict[str, dict[str, float]] = {}
        self._programs_lock = threading.Lock()
        # key -> lowered program whose HLO size is still to be measured: printing a deep
        # model's module takes seconds, so it is done off the start-up path.
        self._unmeasured: dict[tuple[str, int], Any] = {}
        # The background compile thread's nice value once it runs (None: not lowered).
        self.background_nice: int | None = None
        self._measure_lock = threading.Lock()
        _install_compile_listener()
        self.reset()

    def _sharded(self, prefill_impl: Callable, decode_impl: Callable) -> tuple[Callable, Callable]:
        """The step functions under shard_map over the slot axis (see the module doc)."""
        mesh, n = self.mesh, self.data_parallel
        local_slots = self.max_slots // n
        row = P("slots")
        if self.stacked_cache:  # [L, B_slots, ...]
            cache_spec = SlotCache(k=P(None, "slots"), v=P(None, "slots"))
        else:
            layers = range(self.cfg.num_hidden_layers)
            cache_spec = SlotCache(k=tuple(row for _ in layers), v=tuple(row for _ in layers))
        slot_specs = dict.fromkeys(
            ("token", "position", "temperature", "top_p", "top_k", "seed"), row)

        def prefill_local(state, cache, slots, prompt_pt, prompt_len_p, slot_p, *rest):
            local = slot_p - jax.lax.axis_index("slots") * local_slots
            local = jnp.where((local >= 0) & (local < local_slots), local, local_slots)  # drop
            return prefill_impl(state, cache, slots, prompt_pt, prompt_len_p, local, *rest)

        # Prefill returns the same first tokens on every device (same rows, same seeds).
        prefill = jax.shard_map(
            prefill_local, mesh=mesh,
            in_specs=(P(), cache_spec, slot_specs, *([P()] * 11)),
            out_specs=(cache_spec, slot_specs, P(), P()), check_vma=False)

        def decode(state, cache, slots, kv_len, n_steps, any_truncation, any_random, window):
            return jax.shard_map(
                lambda st, c, sl, k, n, t, r: decode_impl(st, c, sl, k, n, t, r, window),
                mesh=mesh, in_specs=(P(), cache_spec, slot_specs, P(), P(), P(), P()),
                out_specs=(cache_spec, slot_specs, P(None, "slots"), P(None, "slots")),
                check_vma=False)(state, cache, slots, kv_len, n_steps, any_truncation, any_random)

        return prefill, decode

    def _place_rows(self, tree: Any, spec: P = P("slots")) -> Any:
        """Slot-indexed arrays onto the mesh, split over the slot axis (the axis ``spec``
        names), or committed to the one device."""
        if self.mesh is None:
            return jax.device_put(tree, self.device)
        return jax.device_put(tree, NamedSharding(self.mesh, spec))

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Fresh (zero) cache and slot state, made on the host and placed: ``jnp.zeros``
        and the like compile a program per shape and dtype (8 at a server's start-up)."""
        b = self.max_slots
        shapes = jax.eval_shape(lambda: init_slot_cache(
            self.cfg, b, self.max_seq_len, self.cache_dtype, self.stacked_cache))
        self.cache = self._place_rows(
            jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes),
            P(None, "slots") if self.stacked_cache else P("slots"))
        self.slots = self._place_rows({
            "token": np.zeros((b,), np.int32),
            "position": np.zeros((b,), np.int32),
            "temperature": np.zeros((b,), np.float32),
            "top_p": np.ones((b,), np.float32),
            "top_k": np.full((b,), -1, np.int32),
            "seed": np.zeros((b,), np.uint32),
        })

    def state_intact(self) -> bool:
        """False if a failed step call consumed (donated) the cache or slot state."""
        leaves = jax.tree.leaves((self.cache, self.slots, self.state))
        return not any(leaf.is_deleted() for leaf in leaves)

    def check_compatible(self, new_state: nnx.State) -> str | None:
        """None if ``new_state`` can replace the params without recompiling, else why not."""
        old_leaves = jax.tree_util.tree_leaves_with_path(self.state)
        new_leaves = jax.tree_util.tree_leaves_with_path(new_state)
        # operator.ne: jaxlib's PyTreeDef has no stub, so mypy rejects a plain !=.
        if operator.ne(jax.tree.structure(self.state), jax.tree.structure(new_state)):
            old_keys = {jax.tree_util.keystr(p) for p, _ in old_leaves}
            new_keys = {jax.tree_util.keystr(p) for p, _ in new_leaves}
            missing = sorted(old_keys - new_keys)[:3]
            extra = sorted(new_keys - old_keys)[:3]
            return f"parameter tree differs (missing {missing}, unexpected {extra})"
        for (path, old), (_, new) in zip(old_leaves, new_leaves, strict=True):
            if old.shape != new.shape:
                return (f"parameter {jax.tree_util.keystr(path)} has shape {tuple(new.shape)}, "
                        f"the served model has {tuple(old.shape)}")
        return None

    def place_like_current(self, new_state: nnx.State) -> nnx.State:
        """Casts/places new params exactly like the served ones (dtype and sharding)."""
        return jax.tree.map(
            lambda new, old: jax.device_put(jnp.asarray(new, old.dtype), old.sharding),
            new_state, self.state,
        )

    def swap_params(self, new_state: nnx.State) -> None:
        self.state = new_state
        self.layer_views = self._layer_views(new_state)

    @property
    def params(self) -> tuple[nnx.State, list[list[jax.Array]] | None]:
        """What the step programs take: the params and :meth:`_layer_views` of them."""
        return self.state, self.layer_views

    def _layer_views(self, state: nnx.State) -> list[list[jax.Array]] | None:
        """On one CPU device with the layers unrolled: each layer's variables as arrays
        that alias its slice of the stacked ones (a view of the same host memory, no
        copy), which the step programs take instead of slicing the stack themselves: a
        slice the program takes is a copy of every weight on every call (XLA's CPU
        backend, measured at the 0.5B shape: 2.3 GB of temporaries per decode call).
        Elsewhere None: the programs slice (a scan reads its slice in place)."""
        if self.stacked_cache or self.mesh is not None or self.device.platform != "cpu":
            return None
        host = [np.asarray(x) for x in jax.tree.leaves(state["layers"])]
        return [[jax.device_put(h[i], self.device) for h in host]
                for i in range(self.cfg.num_hidden_layers)]

    # ------------------------------------------------------------------ compiled fns
    def _watched(self, fn: Callable, *args: Any) -> Any:
        """Calls a step function, counting the call in ``num_compilations`` if it traced
        or compiled (on this thread)."""
        _compile_watch.hit = [False]
        try:
            return fn(*args)
        finally:
            if _compile_watch.hit[0]:
                self.num_compilations += 1
            _compile_watch.hit = None

    def _counted(self, name: str, fn: Callable) -> Callable:
        def traced(*args, **kwargs):
            if getattr(_compile_watch, "hit", None) is not None:
                _compile_watch.hit[0] = True
            if name == "prefill":
                self.compiled.append(f"prefill(rows={args[3].shape[0]}, chunk={args[3].shape[1]})")
            else:
                self.compiled.append(f"decode(window={args[7]}, steps={self.decode_steps})")
            return fn(*args, **kwargs)

        return traced

    def _prefill_impl(self, params, cache, slots, prompt_pt, prompt_len_p, slot_p, temperature_p,
                      top_p_p, top_k_p, seed_p, start_p, kv_len, any_truncation, any_random):
        state, views = params
        model = nnx.merge(self.graphdef, state)
        with fp32_matmuls(model.dtype):  # an fp32 engine computes in fp32 on GPU/TPU too
            logits_pv, cache = prefill_forward(model, prompt_pt, prompt_len_p, slot_p, cache,
                                               start_p, kv_len, layer_leaves=views)
        end_p = start_p + prompt_len_p  # where the sampled token sits (the prompt's length)
        token_p, logprob_p = sample_tokens(logits_pv, temperature_p, top_p_p, top_k_p, seed_p,
                                           end_p, any_truncation, any_random)
        updates = {"token": token_p, "position": end_p, "temperature": temperature_p,
                   "top_p": top_p_p, "top_k": top_k_p, "seed": seed_p}
        # Rows whose slot is out of range (dummy padding rows) are dropped.
        slots = {k: v.at[slot_p].set(updates[k].astype(v.dtype), mode="drop")
                 for k, v in slots.items()}
        return cache, slots, token_p, logprob_p

    def _decode_impl(self, params, cache, slots, kv_len, n_steps, any_truncation, any_random,
                     window):
        state, views = params
        model = nnx.merge(self.graphdef, state)

        def choose(logits_bv, step, next_position_b):
            token_b, logprob_b = sample_tokens(
                logits_bv, slots["temperature"], slots["top_p"], slots["top_k"], slots["seed"],
                next_position_b, any_truncation, any_random)
            return token_b, (token_b, logprob_b)

        with fp32_matmuls(model.dtype):
            (token_kb, logprob_kb), cache = decode_chunk(
                model, slots["token"], slots["position"], cache, kv_len, self.decode_steps,
                choose, window, layer_leaves=views, n_steps=n_steps)
        # Finished or free slots keep stepping until the host notices; keep them in range.
        n = jnp.clip(n_steps, 1, self.decode_steps)
        position_b = jnp.minimum(slots["position"] + n, self.max_seq_len - 1)
        last_b = jax.lax.dynamic_index_in_dim(token_kb, n - 1, 0, keepdims=False)
        slots = {**slots, "token": last_b, "position": position_b}
        return cache, slots, token_kb, logprob_kb

    # ------------------------------------------------------------------ host API
    def prefill(self, chunk: int, rows: list[dict[str, Any]], any_truncation: bool,
                any_random: bool, probe_ids: list[int] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """Prefills up to ``prefill_rows`` prompt chunks of length <= ``chunk`` (one of
        ``chunks``) into their slots.

        ``probe_ids`` (at most ``prefill_rows - 1`` rows then): the weight check's probe
        prompt rides in a row of its own (greedy, from position 0, its slot out of range so
        nothing of it is written); its greedy logprob lands in ``last_probe_logprob``. A
        new version's probe thus costs no pass over the weights of its own.

        Each row: {"input_ids" (this chunk's tokens), "start" (their first position; the
        slot's cache holds the prompt before it), "slot", "temperature", "top_p", "top_k",
        "seed"}. Returns the token sampled after each row's chunk and its logprob (host
        numpy arrays): the first output token when the chunk ends the prompt.
        """
        p = self.prefill_rows - (probe_ids is not None)
        if not 0 < len(rows) <= p:
            raise ValueError(f"prefill takes 1..{p} rows, got {len(rows)}")
        host_rows = self._dummy_prefill_rows(chunk)  # filled in place, row by row
        if probe_ids is not None:  # a dummy row (greedy, start 0, dropped) with the probe
            ids = list(probe_ids)[:chunk]
            host_rows[0][len(rows), :len(ids)] = ids
            host_rows[1][len(rows)] = len(ids)
        prompt_pt, prompt_len_p, slot_p, temperature_p, top_p_p, top_k_p, seed_p, start_p, \
            kv_len = host_rows
        for i, row in enumerate(rows):
            ids = row["input_ids"]
            prompt_pt[i, : len(ids)] = ids
            prompt_len_p[i] = len(ids)
            slot_p[i] = row["slot"]
            temperature_p[i] = row["temperature"]
            top_p_p[i] = row["top_p"]
            top_k_p[i] = row["top_k"]
            seed_p[i] = row["seed"]
            start_p[i] = row.get("start", 0)
        kv_len[...] = start_p.max()  # the earlier chunks' keys, read by the attention loop
        self.cache, self.slots, token_p, logprob_p = self._step(
            ("prefill", chunk), self._prefill, self.params, self.cache, self.slots, *host_rows,
            np.bool_(any_truncation), np.bool_(any_random))
        token_p, logprob_p = jax.device_get((token_p, logprob_p))
        if probe_ids is not None:
            self.last_probe_logprob = float(logprob_p[len(rows)])
        return token_p[: len(rows)], logprob_p[: len(rows)]

    def probe_logprob(self, state: nnx.State, ids: list[int]) -> float:
        """The greedy logprob of the token after ``ids`` (at most the shortest prefill
        chunk) under params ``state`` (shaped and placed like the served ones), run by that
        chunk's prefill program on a scratch cache: the served weights and cache are not
        touched, nothing new compiles, and no weight is copied (the weight check's probe)."""
        chunk = self.chunks[0]
        ids = list(ids)[:chunk]
        host_rows = self._dummy_prefill_rows(chunk)
        prompt_pt, prompt_len_p, slot_p, temperature_p, top_p_p, top_k_p, _, _, _ = host_rows
        prompt_pt[0, :len(ids)] = ids
        prompt_len_p[0], slot_p[0], temperature_p[0], top_p_p[0], top_k_p[0] = (
            len(ids), 0, 0.0, 1.0, -1)
        scratch = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding),
                               self._specs((self.cache, self.slots)))
        _, _, _, logprob_p = self._step(
            ("prefill", chunk), self._prefill, (state, self._layer_views(state)), *scratch,
            *host_rows, np.bool_(False), np.bool_(False))
        return float(jax.device_get(logprob_p)[0])

    def kv_len(self, max_position: int) -> int:
        """The cache prefix a decode call reads when its highest active slot feeds the token
        at ``max_position``: keys [0, max_position) (one more, for safety), in key blocks."""
        return min(max_position + 1, self.max_seq_len)

    def decode_window(self, kv_len: int, compiled_only: bool = False) -> int:
        """The decode program for ``kv_len``: the smallest window that covers it (with
        ``compiled_only``, among the compiled ones and the first), else the largest."""
        windows = self.windows
        if compiled_only:
            windows = [w for w in windows if w == windows[0] or self.ready(("decode", w))]
        return next((w for w in windows if w >= kv_len), windows[-1])

    def decode(self, kv_len: int, any_truncation: bool, any_random: bool,
               window: int | None = None, n_steps: int | None = None
               ) -> tuple[jax.Array, jax.Array]:
        """Dispatches ``n_steps`` (default ``decode_steps``, at most that) steps over all
        slots, attending to the first ``kv_len`` cache positions with the program of
        ``window`` (default: the one for ``kv_len``); returns device arrays [decode_steps, B]
        (tokens, logprobs), of which the first ``n_steps`` rows are the steps run. Fewer
        steps is the same program (a swap due soon waits for one step, not a whole call)."""
        window = self.decode_window(kv_len) if window is None else window
        n = self.decode_steps if n_steps is None else min(max(int(n_steps), 1), self.decode_steps)
        self.cache, self.slots, token_kb, logprob_kb = self._step(
            ("decode", window), self._decode, self.params, self.cache, self.slots,
            np.int32(kv_len), np.int32(n), np.bool_(any_truncation), np.bool_(any_random),
            static=(window,))
        return token_kb, logprob_kb

    def _dummy_prefill_rows(self, chunk: int) -> tuple[np.ndarray, ...]:
        """The host arrays of a prefill call with every row a dummy (prompt, length, slot,
        temperature, top_p, top_k, seed, start, and the cache length read): a dummy row's
        slot is out of range, so it is dropped. ``prefill`` fills in its real rows."""
        p = self.prefill_rows
        return (np.zeros((p, chunk), np.int32), np.ones((p,), np.int32),
                np.full((p,), self.max_slots, np.int32), np.zeros((p,), np.float32),
                np.ones((p,), np.float32), np.full((p,), -1, np.int32),
                np.zeros((p,), np.uint32), np.zeros((p,), np.int32), np.zeros((), np.int32))

    def _step(self, key: tuple[str, int], jitted: Callable, *args: Any,
              static: tuple = ()) -> Any:
        """Runs the step program for ``key``: the one compiled ahead of time (waiting for it
        if another thread is compiling it now), else the jitted function, whose compile, if
        any, is counted (``static``: its static arguments)."""
        with self._programs_lock:
            executable = self._executables.get(key)
            pending = self._compiling.get(key)
        if executable is None and pending is not None:
            executable = pending.result()
        if executable is not None:
            return executable(*args)
        return self._watched(jitted, *args, *static)

    # ------------------------------------------------------------------ programs
    def program_keys(self) -> list[tuple[str, int]]:
        """Every program this runner serves with: a decode per window and a prefill per
        chunk length, the ones every request can be served with first (``essential_keys``)."""
        return [*self.essential_keys(), *(("decode", w) for w in self.windows[1:]),
                *(("prefill", c) for c in self.chunks[1:])]

    def essential_keys(self) -> list[tuple[str, int]]:
        """The programs that serve any request: the smallest decode window (longer
        sequences read the rest of the cache in its loop) and the shortest prefill chunk
        (a longer prompt takes several calls) until the others exist."""
        return [("decode", self.windows[0]), ("prefill", self.chunks[0])]

    def ready(self, key: tuple[str, int]) -> bool:
        """Whether ``key``'s program is compiled (a call would not compile it)."""
        with self._programs_lock:
            return key in self._executables

    def _specs(self, tree: Any) -> Any:
        """Shapes, dtypes and placements of live arrays, to lower with (the arrays
        themselves may be donated by a step running meanwhile)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), tree)

    def _lower(self, key: tuple[str, int]) -> Any:
        flag = np.bool_(False)
        fixed = (self._specs(self.params), self._specs(self.cache), self._specs(self.slots))
        if key[0] == "decode":
            return self._decode.lower(*fixed, np.int32(0), np.int32(1), flag, flag, key[1])
        return self._prefill.lower(*fixed, *self._dummy_prefill_rows(key[1]), flag, flag)

    def _compile_one(self, key: tuple[str, int]) -> bool:
        """Compiles ``key``'s program in this thread unless it is compiled (False) or being
        compiled by another (waits for it; False). Records its compile seconds and HLO size."""
        with self._programs_lock:
            if key in self._executables:
                return False
            pending = self._compiling.get(key)
            if pending is None:
                mine: Future = Future()
                self._compiling[key] = mine
        if pending is not None:
            pending.result()
            return False
        try:
            t0 = time.perf_counter()
            lowered = self._lower(key)
            t_lowered = time.perf_counter()
            executable = lowered.compile()
            # compile_s: the whole; lower_s: tracing and lowering it (paid on a cache hit too)
            stats = {"compile_s": round(time.perf_counter() - t0, 3),
                     "lower_s": round(t_lowered - t0, 3)}
            with contextlib.suppress(Exception):  # not every backend reports it
                stats["temp_mb"] = round(
                    executable.memory_analysis().temp_size_in_bytes / 1e6, 3)
        except BaseException as e:
            with self._programs_lock:
                del self._compiling[key]
            mine.set_exception(e)
            raise
        with self._programs_lock:
            self._executables[key] = executable
            self.program_stats[program_name(key)] = stats
            self._unmeasured[key] = lowered
            self.num_compilations += 1
            del self._compiling[key]
        mine.set_result(executable)
        return True

    def compile_programs(self, keys: list[tuple[str, int]] | None = None,
                         workers: int | None = None) -> int:
        """Compiles ``keys``' programs (default: all) ahead of time, ``workers`` at once
        (default: one per CPU core this process may use, at most one per program), and
        keeps them for the step calls. Returns how many this call compiled.

        XLA's compile releases the GIL, so on a GPU host's many cores this takes about as
        long as the slowest program instead of the sum of them all. With the persistent
        compilation cache on, each is loaded from it."""
        import concurrent.futures

        keys = self.program_keys() if keys is None else keys
        if workers is None:
            workers = max(1, min(usable_cpu_count(), len(keys)))
        if workers == 1:
            count = sum(self._compile_one(key) for key in keys)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                count = sum(pool.map(self._compile_one, keys))
        if count:
            release_freed_memory()
        return count

    def measure_programs(self) -> None:
        """Adds ``hlo_chars`` (the size of its StableHLO text) to each compiled program's
        ``program_stats`` that lacks it."""
        with self._measure_lock:  # one measurer at a time: returns when all are measured
            while True:
                with self._programs_lock:
                    if not self._unmeasured:
                        return
                    key, lowered = self._unmeasured.popitem()
                chars = len(lowered.as_text())
                with self._programs_lock:
                    self.program_stats[program_name(key)]["hlo_chars"] = chars

    def warmup(self, workers: int | None = None) -> int:
        """Compiles every program ahead of time (see ``compile_programs``) and measures
        their HLO; returns how many it compiled."""
        count = self.compile_programs(None, workers)
        self.measure_programs()
        return count

    def compile_in_background(self, keys: list[tuple[str, int]]) -> threading.Thread:
        """Compiles ``keys`` one after another in a daemon thread (the step loop goes on
        with the programs it has; a step that needs one of these waits only for it)."""

        def run() -> None:
            self.background_nice = _lower_thread_priority(BACKGROUND_COMPILE_NICE)
            for key in keys:
                try:
                    self._compile_one(key)
                except Exception:  # noqa: BLE001 - the step call compiles it itself then
                    logger.exception("background compile of %s failed", key)
            self.measure_programs()
            release_freed_memory()

        thread = threading.Thread(target=run, name="engine-compile", daemon=True)
        thread.start()
        return thread
