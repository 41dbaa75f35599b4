"""Device side of the engine: params, the slot KV cache, jitted prefill and decode.

The cache holds one row per slot (see ``forward.SlotCache``). Besides the cache, the
device keeps per-slot state (last token, its position, sampling parameters), so a decode
step needs no host-to-device transfer and returns only the sampled tokens and their
logprobs.

Compiled shapes: one prefill function per prompt-length bucket (``prefill_rows`` prompts
at a time, padded with dummy rows) and one decode function per attention-length bucket
(all slots, ``decode_steps`` tokens per call, attending to the first ``kv_len`` cache
positions). Both use the same power-of-two buckets up to max_seq_len. Weight swaps keep
shapes, dtypes and shardings, so they never recompile. ``num_compilations`` counts step
calls that traced or compiled anything: a trace, or an XLA compile without one (which is
what an input placed differently costs, e.g. one committed to a device where the
compiled call saw an uncommitted array).

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

import operator
import threading
from collections.abc import Callable
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

MIN_PREFILL_BUCKET = 16
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
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


def prefill_buckets(max_seq_len: int, min_bucket: int = MIN_PREFILL_BUCKET) -> list[int]:
    """Powers of two >= min_bucket, capped by (and always ending at) max_seq_len."""
    buckets = []
    size = min_bucket
    while size < max_seq_len:
        buckets.append(size)
        size *= 2
    buckets.append(max_seq_len)
    return buckets


def bucket_for(length: int, buckets: list[int]) -> int:
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"prompt of {length} tokens exceeds the largest bucket {buckets[-1]}")


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
        self.buckets = prefill_buckets(max_seq_len)
        # Stacked cache and scanned layers on TPU, per-layer and unrolled elsewhere
        # (areal_jax.engine.forward's module doc).
        self.stacked_cache = scan_layers_by_default() if scan_layers is None else scan_layers
        self.num_compilations = 0
        self.compiled: list[str] = []
        prefill_impl, decode_impl = self._prefill_impl, self._decode_impl
        if self.mesh is not None:
            prefill_impl, decode_impl = self._sharded(prefill_impl, decode_impl)
        self._prefill = jax.jit(self._counted("prefill", prefill_impl), donate_argnums=(1, 2))
        self._decode = jax.jit(self._counted("decode", decode_impl), donate_argnums=(1, 2),
                               static_argnums=(5,))
        # ("prefill", bucket) / ("decode", kv_len) -> the program warmup() compiled ahead of
        # time; a shape without one goes through the jitted function (and compiles there).
        self._executables: dict[tuple[str, int], Any] = {}
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
            in_specs=(P(), cache_spec, slot_specs, *([P()] * 9)),
            out_specs=(cache_spec, slot_specs, P(), P()), check_vma=False)

        def decode(state, cache, slots, any_truncation, any_random, kv_len):
            return jax.shard_map(
                lambda st, c, sl, t, r: decode_impl(st, c, sl, t, r, kv_len), mesh=mesh,
                in_specs=(P(), cache_spec, slot_specs, P(), P()),
                out_specs=(cache_spec, slot_specs, P(None, "slots"), P(None, "slots")),
                check_vma=False)(state, cache, slots, any_truncation, any_random)

        return prefill, decode

    def _place_rows(self, tree: Any, spec: P = P("slots")) -> Any:
        """Slot-indexed arrays onto the mesh, split over the slot axis (the axis ``spec``
        names), or committed to the one device."""
        if self.mesh is None:
            return jax.device_put(tree, self.device)
        return jax.device_put(tree, NamedSharding(self.mesh, spec))

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Fresh (zero) cache and slot state."""
        b = self.max_slots
        self.cache = self._place_rows(
            init_slot_cache(self.cfg, b, self.max_seq_len, self.cache_dtype, self.stacked_cache),
            P(None, "slots") if self.stacked_cache else P("slots"))
        self.slots = self._place_rows({
            "token": jnp.zeros((b,), jnp.int32),
            "position": jnp.zeros((b,), jnp.int32),
            "temperature": jnp.zeros((b,), jnp.float32),
            "top_p": jnp.ones((b,), jnp.float32),
            "top_k": jnp.full((b,), -1, jnp.int32),
            "seed": jnp.zeros((b,), jnp.uint32),
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
                self.compiled.append(f"prefill(rows={args[3].shape[0]}, len={args[3].shape[1]})")
            else:
                self.compiled.append(f"decode(kv_len={args[5]}, steps={self.decode_steps})")
            return fn(*args, **kwargs)

        return traced

    def _prefill_impl(self, state, cache, slots, prompt_pt, prompt_len_p, slot_p, temperature_p,
                      top_p_p, top_k_p, seed_p, any_truncation, any_random):
        model = nnx.merge(self.graphdef, state)
        with fp32_matmuls(model.dtype):  # an fp32 engine computes in fp32 on GPU/TPU too
            logits_pv, cache = prefill_forward(model, prompt_pt, prompt_len_p, slot_p, cache)
        token_p, logprob_p = sample_tokens(logits_pv, temperature_p, top_p_p, top_k_p, seed_p,
                                           prompt_len_p, any_truncation, any_random)
        updates = {"token": token_p, "position": prompt_len_p, "temperature": temperature_p,
                   "top_p": top_p_p, "top_k": top_k_p, "seed": seed_p}
        # Rows whose slot is out of range (dummy padding rows) are dropped.
        slots = {k: v.at[slot_p].set(updates[k].astype(v.dtype), mode="drop")
                 for k, v in slots.items()}
        return cache, slots, token_p, logprob_p

    def _decode_impl(self, state, cache, slots, any_truncation, any_random, kv_len):
        model = nnx.merge(self.graphdef, state)

        def choose(logits_bv, step, next_position_b):
            token_b, logprob_b = sample_tokens(
                logits_bv, slots["temperature"], slots["top_p"], slots["top_k"], slots["seed"],
                next_position_b, any_truncation, any_random)
            return token_b, (token_b, logprob_b)

        with fp32_matmuls(model.dtype):
            (token_kb, logprob_kb), cache = decode_chunk(
                model, slots["token"], slots["position"], cache, kv_len, self.decode_steps,
                choose)
        # Finished or free slots keep stepping until the host notices; keep them in range.
        position_b = jnp.minimum(slots["position"] + self.decode_steps, self.max_seq_len - 1)
        slots = {**slots, "token": token_kb[-1], "position": position_b}
        return cache, slots, token_kb, logprob_kb

    # ------------------------------------------------------------------ host API
    def prefill(self, bucket: int, rows: list[dict[str, Any]], any_truncation: bool,
                any_random: bool) -> tuple[np.ndarray, np.ndarray]:
        """Prefills up to ``prefill_rows`` prompts of one bucket into their slots.

        Each row: {"input_ids", "slot", "temperature", "top_p", "top_k", "seed"}.
        Returns the first sampled token and its logprob per row (host numpy arrays).
        """
        p = self.prefill_rows
        if not 0 < len(rows) <= p:
            raise ValueError(f"prefill takes 1..{p} rows, got {len(rows)}")
        host_rows = self._dummy_prefill_rows(bucket)  # filled in place, row by row
        prompt_pt, prompt_len_p, slot_p, temperature_p, top_p_p, top_k_p, seed_p = host_rows
        for i, row in enumerate(rows):
            ids = row["input_ids"]
            prompt_pt[i, : len(ids)] = ids
            prompt_len_p[i] = len(ids)
            slot_p[i] = row["slot"]
            temperature_p[i] = row["temperature"]
            top_p_p[i] = row["top_p"]
            top_k_p[i] = row["top_k"]
            seed_p[i] = row["seed"]
        self.cache, self.slots, token_p, logprob_p = self._step(
            ("prefill", bucket), self._prefill, self.state, self.cache, self.slots, *host_rows,
            np.bool_(any_truncation), np.bool_(any_random))
        token_p, logprob_p = jax.device_get((token_p, logprob_p))
        return token_p[: len(rows)], logprob_p[: len(rows)]

    def kv_bucket(self, max_position: int) -> int:
        """The attention-length bucket for a decode call whose highest active slot sits at
        ``max_position`` (the call writes up to ``decode_steps`` more positions)."""
        return bucket_for(min(max_position + self.decode_steps + 1, self.max_seq_len),
                          self.buckets)

    def decode(self, kv_len: int, any_truncation: bool, any_random: bool
               ) -> tuple[jax.Array, jax.Array]:
        """Dispatches ``decode_steps`` steps over all slots, attending to the first
        ``kv_len`` cache positions; returns device arrays [k, B] (tokens, logprobs)."""
        self.cache, self.slots, token_kb, logprob_kb = self._step(
            ("decode", kv_len), self._decode, self.state, self.cache, self.slots,
            np.bool_(any_truncation), np.bool_(any_random), static=(kv_len,))
        return token_kb, logprob_kb

    def _dummy_prefill_rows(self, bucket: int) -> tuple[np.ndarray, ...]:
        """The host arrays of a prefill call with every row a dummy (prompt, length, slot,
        temperature, top_p, top_k, seed): a dummy row's slot is out of range, so it is
        dropped. ``prefill`` fills in its real rows; ``warmup`` compiles with them as is."""
        p = self.prefill_rows
        return (np.zeros((p, bucket), np.int32), np.ones((p,), np.int32),
                np.full((p,), self.max_slots, np.int32), np.zeros((p,), np.float32),
                np.ones((p,), np.float32), np.full((p,), -1, np.int32),
                np.zeros((p,), np.uint32))

    def _step(self, key: tuple[str, int], jitted: Callable, *args: Any,
              static: tuple = ()) -> Any:
        """Runs the step program for ``key`` (("prefill", bucket) or ("decode", kv_len)):
        the executable warmup() compiled for it, else the jitted function (``static``: its
        static arguments), whose compile, if any, is counted."""
        executable = self._executables.get(key)
        if executable is not None:
            return executable(*args)
        return self._watched(jitted, *args, *static)

    def warmup(self, workers: int | None = None) -> int:
        """Compiles every prefill and decode bucket ahead of time, ``workers`` programs at
        once (default: one per CPU core this process may use, at most one per program), and
        keeps the executables for the step calls. Returns how many it compiled.

        The programs are traced one after another here, then compiled side by side: XLA's
        compile releases the GIL, so on a GPU host's many cores the warm-up takes about as
        long as its slowest program instead of the sum of them all (a prefill and a decode
        per bucket). With the persistent compilation cache on, each is loaded from it."""
        import concurrent.futures

        flag = np.bool_(False)
        lowered: dict[tuple[str, int], Any] = {}
        for bucket in self.buckets:
            if ("prefill", bucket) not in self._executables:
                lowered[("prefill", bucket)] = self._prefill.lower(
                    self.state, self.cache, self.slots, *self._dummy_prefill_rows(bucket),
                    flag, flag)
            if ("decode", bucket) not in self._executables:
                lowered[("decode", bucket)] = self._decode.lower(
                    self.state, self.cache, self.slots, flag, flag, bucket)
        if workers is None:
            workers = max(1, min(usable_cpu_count(), len(lowered)))
        if workers == 1:
            compiled = {key: low.compile() for key, low in lowered.items()}
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                futures = {key: pool.submit(low.compile) for key, low in lowered.items()}
                compiled = {key: f.result() for key, f in futures.items()}
        self._executables.update(compiled)
        self.num_compilations += len(compiled)
        return len(compiled)
