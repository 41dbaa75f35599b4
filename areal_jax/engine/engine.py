"""The generation engine: continuous batching over a fixed set of KV-cache slots.

A background thread runs the step loop:

1. run control commands (abort, pause, continue, weight swap) posted by other threads;
2. admit waiting requests into free slots: prefill them in chunks of the prefill
   programs' lengths (a long prompt in several), the last of which samples each one's
   first token;
3. dispatch one jitted decode call over all slots (``decode_steps`` tokens each,
   sampling on device);
4. then, while that call runs, fetch the previous call's tokens and logprobs, append
   them, and finish requests on stop / eos / max_new_tokens / context length, freeing
   their slots.

Steps 3 and 4 are pipelined: the host's bookkeeping for call N overlaps the device's
call N+1, so the device never waits for Python. The cost is that a request which
finishes in call N has its slot stepped once more in call N+1. Each call remembers
which request occupied each slot when it was dispatched, and its tokens go only to
requests that still occupy the same slot: a slot freed or refilled in the meantime
discards them. (A refilled slot is prefilled after the in-flight call, in device order,
because both update the donated cache.)

Requests therefore join and leave the running batch between steps. Weight swaps happen
only between steps and only when no request is running (requests are either aborted
first or allowed to finish), so every response was produced by a single weight version.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from areal_jax.engine.adapters import load_adapter_update
from areal_jax.engine.config import EngineConfig
from areal_jax.engine.model_dir import ModelPathError, check_model_dir, read_eos_token_ids
from areal_jax.engine.request import EngineRequest
from areal_jax.engine.runner import ModelRunner, chunk_plan, program_name, release_freed_memory
from areal_jax.engine.staging import StagingError, WeightStaging, load_delta
from areal_jax.engine.weight_check import (
    PROBE_FAILED,
    WeightCheckError,
    check_probe_forward,
    load_update,
    probe_ids,
)
from areal_jax.sampling_params import SamplingParams
from areal_jax.tokenizer import ChatTokenizer, load_tokenizer
from model_defs import JsonDict, load_hf


def process_start_time() -> float:
    """When this process started (seconds since the epoch), for start-up timings."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except (ImportError, OSError):
        return time.time()

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048


def _optional_tokenizer(path: Path) -> ChatTokenizer | None:
    """The model directory's tokenizer and chat template, or None (responses then have
    empty text and the OpenAI routes take token ids only)."""
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        return load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - text output is optional
        logger.warning("could not load the tokenizer of %s (%s); responses will have empty "
                       "text and the OpenAI routes take token ids only", path, e)
        return None

# A staged swap's probe waits this long for a prefill to ride in when the swap aborted
# requests (they come back within milliseconds) before it runs alone.
VERIFY_IDLE_S = 0.25


@dataclasses.dataclass
class _Verify:
    """A version swapped in whose probe has not run yet, and what comes back if it fails."""

    old_base: tuple[Any, Any, Any]
    transfer: str
    old_state: Any = None
    old_version: str = ""
    old_served_load_id: int | None = None
    done: Future | None = None
    result: JsonDict | None = None
    since: float = 0.0
    due: float = 0.0  # when it runs alone if no prefill has carried it


class EngineRequestError(ValueError):
    """A request the engine cannot run (bad prompt, duplicate rid); maps to HTTP 400."""


class EngineStoppedError(RuntimeError):
    """The engine's step loop has ended (shut down or crashed); maps to HTTP 503."""


class GenerationEngine:
    """Serves one model with continuous batching. Thread-safe public methods."""

    def __init__(self, config: EngineConfig):
        self.config = config
        # Seconds from this process's start to each start-up milestone, and what each took
        # (``startup_line`` prints them; /get_server_info reports them).
        self._process_start = process_start_time()
        t0 = time.perf_counter()
        self.startup: dict[str, float] = {"imports_s": time.time() - self._process_start}
        path = check_model_dir(config.model_path)
        model, cfg = load_hf(path, dtype=config.dtype)
        max_seq_len = config.max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings} ({path / 'config.json'})"
            )
        self.model_config = cfg
        self.model_path = str(path)
        self.max_seq_len = max_seq_len
        self.eos_token_ids = read_eos_token_ids(path, cfg)
        self.tokenizer = _optional_tokenizer(path)
        self.runner = ModelRunner(
            model,
            max_slots=config.max_slots,
            max_seq_len=max_seq_len,
            cache_dtype=config.cache_dtype or config.dtype,
            prefill_rows=min(config.prefill_rows, config.max_slots),
            decode_steps=config.decode_steps,
            scan_layers={"auto": None, "scan": True, "unrolled": False}[config.layer_loop],
            data_parallel=config.data_parallel,
        )
        del model
        release_freed_memory()  # the load's freed host buffers (0.19 GB at the 0.5B shape)
        self.startup["load_s"] = time.perf_counter() - t0
        self._base_state = self.runner.state  # what LoRA adapters merge onto
        self._adapter: tuple[str, str] | None = None  # the active adapter (name, path)
        # Each adapter load gets an id. A request naming an adapter pins the id current at
        # submit and runs only while the runner serves that load (guarded by _lock).
        self._adapter_loads = 0
        self._adapter_load_id: int | None = None  # the load that new requests pin
        self._served_load_id: int | None = None  # the load in the runner (engine thread)
        self.weight_version = config.weight_version
        self._seed_rng = np.random.default_rng(config.seed)

        self._lock = threading.Condition()
        self._waiting: deque[EngineRequest] = deque()  # guarded by _lock
        # (fn, future) run on the engine thread between steps; guarded by _lock.
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        # set (under _lock) once the step loop has ended; nothing is queued after
        self._dead = False
        self._inflight: dict[str, EngineRequest] = {}  # rid -> request, guarded by _lock
        self._slots: list[EngineRequest | None] = [None] * config.max_slots  # engine thread
        # The decode call in flight: (device tokens [k, B], device logprobs [k, B], the
        # request in each slot when it was dispatched, the steps it runs). Engine thread only.
        self._in_flight: tuple[Any, Any, list[EngineRequest | None], int] | None = None
        self._paused = False
        # (params, weight version, reply future, aborted count, adapter load id or None)
        self._pending_update: tuple[nnx.State, str | None, Future, int, int | None] | None = None
        # swap_staged with abort_all_requests: the running requests are aborted at the
        # boundary after the decode call in flight (none is dispatched meanwhile), so its
        # tokens reach them and the swap finds the device idle. Engine thread only.
        self._pending_abort = False
        # swap_staged with check_weights: the probe of the version being swapped in, run in
        # a row of the first prefill under it (or alone once the engine idles VERIFY_IDLE_S);
        # the old version is kept until then and comes back if the probe fails. Engine
        # thread only (_pending_verify is set by the command that asks for the swap).
        self._pending_verify: _Verify | None = None
        self._verifying: _Verify | None = None
        # Wall-clock times (time.time) of the last weight swap and of the first token
        # generated after it: how soon a new version generates (/get_server_info).
        self.swapped_at: float | None = None
        self.first_token_at: float | None = None
        self._update_lock = threading.Lock()
        # In-memory updates (weight_wire's format) received while generation goes on.
        self.staging = WeightStaging(self.runner)
        self._stop = False
        self.fatal_error: str | None = None
        self.stats = {"decode_calls": 0, "prefill_calls": 0, "generated_tokens": 0,
                      "finished_requests": 0, "aborted_requests": 0}

        # With warmup: the programs any request can be served with are compiled now, the
        # larger prefill chunks in the background (used once compiled).
        self._compile_thread: threading.Thread | None = None
        if config.warmup:
            t0 = time.perf_counter()
            self.runner.compile_programs(self.runner.essential_keys())
            self.startup["programs_s"] = time.perf_counter() - t0
            if config.check_weights:  # the start weights pass the probe (no program of its own)
                try:
                    check_probe_forward(self.runner.state, self.runner)
                except WeightCheckError as e:
                    raise ModelPathError(f"model_path {path}: {e}") from None
            self.startup["compile_s"] = time.perf_counter() - t0
            rest = [k for k in self.runner.program_keys() if not self.runner.ready(k)]
            # (and the programs' HLO sizes, measured off the start-up path)
            self._compile_thread = self.runner.compile_in_background(rest)
        self.startup["ready_s"] = time.time() - self._process_start
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    # ================================================================== public API
    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def healthy(self) -> bool:
        return self.fatal_error is None and self._thread.is_alive()

    def submit(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        rid: str | None = None,
        on_finish: Callable[[EngineRequest], None] | None = None,
        lora_name: str | None = None,
        on_tokens: Callable[[EngineRequest], None] | None = None,
    ) -> EngineRequest:
        """Queues a request; it runs as soon as a slot is free (and the engine not paused).
        ``on_tokens`` is called (engine thread) after each device call that gave it tokens.

        ``lora_name`` (SGLang's ``lora_path``) must name the loaded LoRA adapter; without it
        the request runs on the served weights too (the adapter if one is loaded)."""
        if self.fatal_error is not None:
            raise EngineStoppedError(f"engine stopped after an internal error: {self.fatal_error}")
        ids = [int(t) for t in input_ids]
        if not ids:
            raise EngineRequestError("input_ids is empty; the prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineRequestError(
                f"input_ids contains token id {bad[0]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        if len(ids) >= self.max_seq_len:
            raise EngineRequestError(
                f"prompt has {len(ids)} tokens; the context length (max_seq_len) is "
                f"{self.max_seq_len}, so prompts must have at most {self.max_seq_len - 1}"
            )
        rid = rid if rid is not None else uuid.uuid4().hex
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        req = EngineRequest(rid=rid, input_ids=ids, params=params, on_finish=on_finish,
                            on_tokens=on_tokens, seed=seed % 2**32)
        with self._lock:
            if self._dead:
                raise EngineStoppedError(
                    f"engine is not running: {self.fatal_error or 'shut down'}")
            if rid in self._inflight:
                raise EngineRequestError(f"rid {rid!r} is already in flight; rids must be unique")
            if lora_name is not None and (self._adapter is None or self._adapter[0] != lora_name):
                loaded = [self._adapter[0]] if self._adapter is not None else []
                raise EngineRequestError(
                    f"lora_path {lora_name!r} names no loaded LoRA adapter (loaded: "
                    f"{loaded or 'none'}); load it with /load_lora_adapter first")
            if lora_name is not None:
                assert self._adapter_load_id is not None
                req.lora = (lora_name, self._adapter_load_id)
            self._inflight[rid] = req
            self._waiting.append(req)
            self._lock.notify_all()
        return req

    def generate(self, input_ids: Sequence[int], params: SamplingParams,
                 rid: str | None = None, timeout: float | None = None,
                 lora_name: str | None = None) -> EngineRequest:
        """Blocking helper: submits and waits for the request to finish."""
        req = self.submit(input_ids, params, rid=rid, lora_name=lora_name)
        if not req.done.wait(timeout):
            raise TimeoutError(f"request {req.rid} did not finish within {timeout}s")
        return req

    def score(self, sequences: Sequence[Sequence[int]], timeout: float | None = None
              ) -> tuple[list[list[float]], str]:
        """Input-token logprobs of each sequence under the served weights, and their weight
        version (``areal_jax.engine.scoring``); runs on the engine thread between steps, so
        a weight swap never lands mid-forward."""
        def run() -> tuple[list[list[float]], str]:
            from areal_jax.engine.scoring import token_logprobs

            return (token_logprobs(self.runner.graphdef, self.runner.state, sequences),
                    self.weight_version)
        return self._call(run, timeout)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Aborts one request (or all); they return their partial output. Returns the count."""
        return self._call(lambda: self._abort_matching(
            lambda r: abort_all or r.rid == rid, "aborted by /abort_request"))

    def pause(self) -> int:
        """Aborts running requests (partial output, finish_reason abort) and stops admitting
        new ones until ``continue_generation``. Returns the number aborted."""

        def pause_now() -> int:
            self._paused = True
            return self._abort_running("generation paused (/pause_generation mode=abort)")

        return self._call(pause_now)

    def continue_generation(self) -> None:
        def resume() -> None:
            self._paused = False

        self._call(resume)

    @property
    def paused(self) -> bool:
        return self._paused

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 abort_all_requests: bool = False) -> JsonDict:
        """Loads an HF checkpoint (in the calling thread) and swaps it in between steps.

        Running requests are aborted first if ``abort_all_requests`` (before the load, as
        SGLang does, and again at the swap for any admitted meanwhile), otherwise the swap
        waits for them to finish; waiting requests stay queued. Returns SGLang's reply
        fields ``success``, ``message``, ``num_paused_requests`` (here: requests aborted).
        On failure the served weights are untouched. The loaded weights become the base
        that LoRA adapters merge onto; an active adapter is dropped.
        """

        def load() -> nnx.State:
            return load_update(model_path, self.model_config, self.config.dtype, self.runner,
                               check=self.config.check_weights)

        return self._swap_in(load, weight_version, abort_all_requests, model_path,
                             adapter=None)

    def load_lora_adapter(self, name: str, path: str) -> JsonDict:
        """Merges the PEFT adapter in ``path`` onto the base weights and serves the result
        as adapter ``name``, replacing the active adapter if there is one (one adapter at a
        time). Waits for running requests to finish; the weight version is unchanged
        (SGLang's behaviour: set it with ``update_weight_version``). Returns SGLang's reply
        fields ``success``, ``error_message``, ``loaded_adapters`` ({name: path})."""

        def load() -> nnx.State:
            return load_adapter_update(path, self._base_state, self.runner,
                                       check=self.config.check_weights)

        result = self._swap_in(load, None, False, path, adapter=(name, path))
        if result["success"]:
            logger.info("serving LoRA adapter %r from %s %s", name, path, result["message"])
        return self._lora_reply(result, f"Loaded LoRA adapter {name!r} from {path}")

    def unload_lora_adapter(self, name: str) -> JsonDict:
        """Serves the base weights again. Fails if ``name`` is not the active adapter."""
        active = self.lora_adapters
        if name not in active:
            return self._lora_reply({"success": False, "message": (
                f"LoRA adapter {name!r} is not loaded; loaded: {sorted(active) or 'none'}")})
        result = self._swap_in(lambda: self._base_state, None, False, name, adapter=None)
        return self._lora_reply(result, f"Unloaded LoRA adapter {name!r}; serving the base")

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapter, {name: path} (empty: the base weights are served)."""
        with self._lock:
            return dict([self._adapter]) if self._adapter is not None else {}

    def _lora_reply(self, result: JsonDict, done: str = "") -> JsonDict:
        """SGLang's LoRAUpdateOutput fields (and a ``message``) of a swap's result."""
        ok = result["success"]
        return {"success": ok, "error_message": "" if ok else result["message"],
                "message": done if ok else result["message"],
                "loaded_adapters": self.lora_adapters}

    def _swap_in(self, load: Callable[[], nnx.State], weight_version: str | None,
                 abort_all_requests: bool, source: str,
                 adapter: tuple[str, str] | None) -> JsonDict:
        """Runs ``load`` (in the calling thread) and swaps its params in between steps; see
        :meth:`update_weights_from_disk`. ``adapter``: the (name, path) the new params
        serve, or None when they are base weights."""
        with self._update_lock:
            t0 = time.perf_counter()
            aborted_early = 0
            try:
                if abort_all_requests:
                    aborted_early = self._call(
                        lambda: self._abort_running("aborted for a weight update"))
                new_state = load()
            except EngineStoppedError as e:
                return {"success": False, "message": f"weights not updated: {e}",
                        "num_paused_requests": 0}
            except (ModelPathError, ValueError, OSError) as e:
                return {"success": False, "message": f"weights not updated: {e}",
                        "num_paused_requests": aborted_early}
            except Exception as e:  # noqa: BLE001 - any unreadable file refuses the update
                logger.warning("weight update from %s refused", source, exc_info=True)
                return {"success": False, "num_paused_requests": aborted_early,
                        "message": f"weights not updated: {type(e).__name__}: {e}"}
            load_s = time.perf_counter() - t0
            done: Future = Future()

            def begin() -> None:
                aborted = aborted_early
                if abort_all_requests:
                    aborted += self._abort_running("aborted for a weight update")
                # Requests submitted from now on run after the swap: they see the new names.
                with self._lock:
                    if adapter is None:
                        self._base_state = new_state
                        load_id = None
                    else:
                        self._adapter_loads += 1
                        load_id = self._adapter_loads
                    self._adapter = adapter
                    self._adapter_load_id = load_id
                self._pending_update = (new_state, weight_version, done, aborted, load_id)

            try:
                self._call(begin)
            except StagingError as e:
                return {"success": False, "message": str(e), "num_paused_requests": 0}
            except EngineStoppedError as e:
                return {"success": False, "message": f"weights not updated: {e}",
                        "num_paused_requests": 0}
            result = done.result()
            result.pop("_stopped_at", None)
            result.pop("_swapped_at", None)
            result["message"] += f" (loaded in {load_s:.2f}s)"
            return result

    def update_weights_from_delta(self, path: str, weight_version: str | None = None,
                                  abort_all_requests: bool = False) -> JsonDict:
        """Applies the weight delta file ``path`` (``areal_jax.weight_wire``: the XOR with
        the served version's bits, compressed, or a full version) to the served weights in
        the calling thread, while generation goes on, then swaps the result in between
        steps as :meth:`update_weights_from_disk` does. A delta against another version
        than the served one, or a corrupted one, is refused: the served weights stay."""
        served = self.weight_version
        return self._swap_in(
            lambda: load_delta(path, served, self.runner, self.config.check_weights),
            weight_version, abort_all_requests, path, adapter=None)

    def swap_staged(self, transfer: str, weight_version: str | None = None,
                    abort_all_requests: bool = False) -> JsonDict:
        """Serves the weights staged by in-memory transfer ``transfer`` (``self.staging``)
        from the next step boundary on: with ``abort_all_requests`` no further decode call
        is dispatched, the one in flight is collected (its tokens reach the requests), then
        the running requests are aborted (they return their partial output) and the weights
        swapped, the device idle; without, the swap waits for them to finish. Requests that
        arrive meanwhile wait for the new weights. The reply's ``wait_s`` is the wait for
        that boundary (generation went on under the old weights) and ``paused_s`` the time
        from the old weights' last step to the new ones in place. The new weights become the
        base that LoRA adapters merge onto; an active adapter is dropped.

        With ``check_weights`` the new version's probe (``weight_check.check_probe_forward``)
        runs in a row of its own in the first prefill under it, which follows the swap at
        once when the requests it aborted come back, so it costs no pass over the weights of
        its own; with none aborted, or none back within ``VERIFY_IDLE_S``, it runs alone (the
        device idle: nothing runs). No token of that
        prefill reaches a request before the probe's logprob is known, and the reply waits
        for it (``verify_s``: swap to probe result): a non-finite one puts the old version
        back (weights, version, LoRA base), requeues that prefill's requests and fails the
        swap with the probe's message, so the old version serves, whole."""
        with self._update_lock:
            done: Future = Future()
            asked = time.perf_counter()

            def begin() -> None:
                # Taken on the engine thread, so no decode call is dispatched between the
                # staged version leaving the staging (which made calls one step long) and
                # the swap being pending (which keeps them so).
                _, state = self.staging.take(transfer)
                with self._lock:
                    old_base = (self._base_state, self._adapter, self._adapter_load_id)
                    self._base_state = state
                    self._adapter = None
                    self._adapter_load_id = None
                self._pending_update = (state, weight_version, done, 0, None)
                self._pending_abort = abort_all_requests
                self._pending_verify = (_Verify(old_base=old_base, transfer=transfer)
                                        if self.config.check_weights else None)

            try:
                self._call(begin)
            except StagingError as e:
                return {"success": False, "message": str(e), "num_paused_requests": 0}
            except EngineStoppedError as e:
                return {"success": False, "message": f"weights not updated: {e}",
                        "num_paused_requests": 0}
            result = done.result()
            # wait_s: the swap waited for the step boundary (generation went on meanwhile);
            # paused_s: from the old weights' last step to the new ones in place.
            result["wait_s"] = result.pop("_stopped_at", asked) - asked
            result["paused_s"] = result.pop("_swapped_at", time.perf_counter()) - (
                asked + result["wait_s"])
            return result

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        def set_version() -> None:
            if abort_all_requests:
                self._abort_running("aborted by /update_weight_version")
            self.weight_version = new_version

        self._call(set_version)

    def warmup(self) -> int:
        """Compiles every prefill and decode shape now (on the engine thread, between
        steps, once no request runs). Returns the compile count afterwards."""

        def compile_all() -> int:
            if any(s is not None for s in self._slots):
                raise RuntimeError("warmup needs an idle engine")
            self.runner.warmup()
            return self.num_compilations

        return self._call(compile_all)

    def flush_cache(self) -> bool:
        """Zeros the KV cache when nothing runs (no prefix cache to flush). False if busy."""

        def flush() -> bool:
            if any(s is not None for s in self._slots):
                return False
            self.runner.reset()
            return True

        return self._call(flush)

    def info(self) -> JsonDict:
        with self._lock:
            waiting = len(self._waiting)
        running = sum(s is not None for s in self._slots)
        return {
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "max_slots": self.config.max_slots,
            "max_seq_len": self.max_seq_len,
            "max_total_num_tokens": self.config.max_slots * self.max_seq_len,
            "dtype": self.config.dtype,
            "prefill_rows": self.runner.prefill_rows,
            "decode_steps": self.config.decode_steps,
            "layer_loop": "scan" if self.runner.stacked_cache else "unrolled",
            "data_parallel": self.config.data_parallel,
            "prefill_chunks": list(self.runner.chunks),
            "num_compilations": self.num_compilations,
            # compiled ahead of time: seconds and HLO size each; those still to come
            "programs": dict(self.runner.program_stats),
            "startup": dict(self.startup),
            "programs_pending": [program_name(k) for k in self.runner.program_keys()
                                 if not self.runner.ready(k)],
            "compiled_functions": list(self.runner.compiled),
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "paused": self._paused,
            "weights_swapped_at": self.swapped_at,  # time.time(), of the last swap
            "first_token_after_swap_at": self.first_token_at,
            "lora_adapters": self.lora_adapters,
            "eos_token_ids": list(self.eos_token_ids),
            "vocab_size": self.vocab_size,
            "healthy": self.healthy,
            **self.stats,
        }

    def startup_line(self) -> str:
        """The start-up breakdown as one console line."""
        st = self.startup
        programs = ", ".join(f"{name} {p['compile_s']:.1f}s"
                             for name, p in self.runner.program_stats.items())
        pending = [program_name(k) for k in self.runner.program_keys() if not self.runner.ready(k)]
        parts = [f"engine ready {st['ready_s']:.1f}s after process start: imports "
                 f"{st['imports_s']:.1f}s, model load {st['load_s']:.1f}s"]
        if "compile_s" in st:
            parts.append(f"compile {st['compile_s']:.1f}s ({programs or 'none'}; the update "
                         f"probe {st['compile_s'] - st['programs_s']:.1f}s)")
        if pending:
            parts.append(f"{', '.join(pending)} compiling in the background")
        return ", ".join(parts)

    def decode_text(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout)
        self._fail_all("engine shut down")

    # ================================================================== internals
    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs ``fn`` on the engine thread between steps and returns its result."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()
        with self._lock:
            if self._dead or not self._thread.is_alive():
                raise EngineStoppedError(
                    f"engine is not running: {self.fatal_error or 'shut down'}")
            self._commands.append((fn, fut))
            self._lock.notify_all()
        return fut.result(timeout)

    # ---------------------------------------------------------------- step loop
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self._commands and not self._has_work():
                        self._lock.wait(self._idle_timeout())
                    if self._stop:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
                self._maybe_swap_weights()
                if self._verifying is not None and (self.runner.prefill_rows == 1 or not (
                        self._waiting and not self._paused)):
                    self._verify_alone_if_idle()
                self._admit()
                previous, self._in_flight = self._in_flight, None
                if any(s is not None for s in self._slots) and not (
                        self._pending_abort and self._pending_update is not None):
                    self._in_flight = self._dispatch_decode(previous)
                if previous is not None:
                    self._collect(previous)
        except BaseException as e:  # noqa: BLE001 - reported via /health and failed requests
            self.fatal_error = f"{type(e).__name__}: {e}"
            logger.error("engine step loop crashed:\n%s", traceback.format_exc())
        finally:  # nothing may wait for a loop that has ended
            with self._lock:
                self._dead = True
            self._fail_all(f"engine error: {self.fatal_error}" if self.fatal_error
                           else "engine shut down")

    def _idle_timeout(self) -> float | None:
        """How long the idle loop may sleep: until a pending probe is due, else for good."""
        if self._verifying is None:
            return None
        return max(0.001, self._verifying.due - time.perf_counter())

    def _has_work(self) -> bool:
        if self._in_flight is not None or any(s is not None for s in self._slots):
            return True
        if self._verifying is not None and time.perf_counter() >= self._verifying.due:
            return True
        if self._pending_update is not None:
            return True
        return bool(self._waiting) and not self._paused

    def _maybe_swap_weights(self) -> None:
        if self._pending_update is None:
            return
        stopped_at = time.perf_counter()
        aborted_now = 0
        if self._pending_abort and self._in_flight is None:
            aborted_now = self._abort_running("aborted for a weight update")
            self._pending_abort = False
        if any(s is not None for s in self._slots):
            return
        state, version, done, aborted, load_id = self._pending_update
        aborted += aborted_now
        self._pending_update = None
        self._pending_abort = False  # (set when the last slot emptied before the abort ran)
        verify, self._pending_verify = self._pending_verify, None
        if verify is not None:  # what comes back if the probe fails
            verify.old_state, verify.old_version = self.runner.state, self.weight_version
            verify.old_served_load_id = self._served_load_id
        self.runner.swap_params(state)
        self.swapped_at, self.first_token_at = time.time(), None
        self._served_load_id = load_id
        self.runner.reset()  # nothing computed under the old weights is reused
        if version is not None:
            self.weight_version = version
        result = {
            "success": True,
            "message": "Succeeded to update model weights. "
                       f"Weight version is {self.weight_version}.",
            "num_paused_requests": aborted,
            "_stopped_at": stopped_at,
            "_swapped_at": time.perf_counter(),
        }
        if verify is None:
            done.set_result(result)
            return
        verify.done, verify.result, verify.since = done, result, time.perf_counter()
        # Requests aborted for the swap come back within milliseconds: their prefill carries
        # the probe. With none (nothing ran, or the swap waited for them to finish while new
        # runs were held back) the probe runs alone at once, the device idle anyway.
        verify.due = verify.since + (VERIFY_IDLE_S if aborted > 0 else 0.0)
        self._verifying = verify

    def _verify_alone_if_idle(self) -> None:
        """The probe of the version just swapped in, run alone: when no prefill has carried
        it within VERIFY_IDLE_S (nothing to admit), or when a prefill has no row to spare."""
        v = self._verifying
        if v is None:
            return
        if self.runner.prefill_rows > 1 and time.perf_counter() < v.due:
            return
        self._verified(self.runner.probe_logprob(self.runner.state, probe_ids(self.runner)),
                       "alone")

    def _verified(self, probe_logprob: float, where: str) -> bool:
        """Ends the verification of the version just swapped in: with a finite probe
        logprob it is served and the swap's caller hears so; otherwise the old version is
        put back and the swap fails. Returns whether the new version stays."""
        v, self._verifying = self._verifying, None
        assert v is not None and v.done is not None and v.result is not None
        v.result["verify_s"] = time.perf_counter() - v.since
        self.staging.last_probe = {"transfer": v.transfer, "version": self.weight_version,
                                   "ran": where, "finite": math.isfinite(probe_logprob),
                                   "verify_s": v.result["verify_s"]}
        if math.isfinite(probe_logprob):
            v.done.set_result(v.result)
            return True
        failed = self.weight_version
        self.runner.swap_params(v.old_state)
        self.runner.reset()  # the probe's prefill wrote the new version's keys
        self.weight_version = v.old_version
        self._served_load_id = v.old_served_load_id
        with self._lock:
            self._base_state, self._adapter, self._adapter_load_id = v.old_base
        self.first_token_at = None
        message = f"weights not updated: v{failed}: {PROBE_FAILED}"
        self.staging.last_error = message
        logger.error("transfer %s: %s; v%s serves again", v.transfer, message, v.old_version)
        v.done.set_result({"success": False, "message": message,
                           "num_paused_requests": v.result["num_paused_requests"],
                           "verify_s": v.result["verify_s"]})
        return False

    def _admit(self) -> None:
        if self._paused or self._pending_update is not None:
            return
        free = [i for i, s in enumerate(self._slots) if s is None]
        if not free:
            return
        with self._lock:
            batch = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        batch = [req for req in batch if self._adapter_still_served(req)]
        if not batch:
            return
        # Each prompt in chunks of the prefill programs at hand (while the longer chunks
        # compile in the background, a long prompt takes more calls of the shortest), one
        # round per chunk index; a prompt's last chunk samples its first token.
        sizes = self._usable_chunks()
        plans = [(slot, req, chunk_plan(req.prompt_len, sizes, self.runner.prefill_call_tokens))
                 for slot, req in zip(free, batch, strict=False)]
        failed: set[int] = set()
        rows_per_call = self.runner.prefill_rows
        for round_ in range(max(len(plan) for _, _, plan in plans)):
            by_size: dict[int, list[tuple[int, EngineRequest, int, int, bool]]] = {}
            for slot, req, plan in plans:
                if round_ < len(plan) and id(req) not in failed:
                    start, n, size = plan[round_]
                    by_size.setdefault(size, []).append(
                        (slot, req, start, n, round_ == len(plan) - 1))
            for size, group in sorted(by_size.items()):
                first = 0
                while first < len(group):
                    # The first prefill under a version just swapped in carries its probe.
                    probe = (probe_ids(self.runner)
                             if self._verifying is not None and rows_per_call > 1 else None)
                    call = group[first : first + rows_per_call - (probe is not None)]
                    first += len(call)
                    rows = [{"input_ids": r.input_ids[start : start + n], "start": start,
                             "slot": slot, "temperature": r.params.temperature,
                             "top_p": r.params.top_p, "top_k": r.params.top_k, "seed": r.seed}
                            for slot, r, start, n, _ in call]
                    try:
                        tokens, logprobs = self.runner.prefill(
                            size, rows,
                            any_truncation=any(r.params.truncates for _, r, *_ in call),
                            any_random=any(not r.params.greedy for _, r, *_ in call),
                            probe_ids=probe)
                    except Exception as e:
                        if not self.runner.state_intact():
                            raise  # the donated cache is gone: the engine cannot go on
                        # Failed before touching device state: these requests fail alone.
                        logger.exception("prefill failed for requests %s",
                                         [r.rid for _, r, *_ in call])
                        for _, req, *_ in call:
                            failed.add(id(req))
                            self._release(req, {"type": "abort", "message": "internal error"},
                                          error=f"prefill failed: {type(e).__name__}: {e}")
                        continue
                    self.stats["prefill_calls"] += 1
                    if probe is not None and not self._verified(self.runner.last_probe_logprob,
                                                            "in a prefill"):
                        # The old version is back: these requests start again under it (none
                        # holds a slot yet: the probe rode in this round's first call).
                        with self._lock:
                            self._waiting.extendleft(reversed(
                                [r for r in batch if id(r) not in failed]))
                        return
                    now = time.perf_counter()
                    done = [(slot, req, token, logprob) for (slot, req, _, _, last), token, logprob
                            in zip(call, tokens, logprobs, strict=True) if last]
                    if done and "first_token_s" not in self.startup:
                        self.startup["first_token_s"] = time.time() - self._process_start
                    for slot, req, token, logprob in done:
                        self._slots[slot] = req
                        req.first_token_time = now
                        self._append_token(slot, int(token), float(logprob))
                    self._notify_tokens(req for _, req, _, _ in done)

    def _usable_chunks(self) -> list[int]:
        """The prefill chunk lengths a prompt may be split into now: every one without
        warm-up (each compiles on first use, as every program does then); with it, the
        ones compiled so far (the shortest always is)."""
        chunks = self.runner.chunks
        if not self.config.warmup:
            return chunks
        return [c for c in chunks if c == chunks[0] or self.runner.ready(("prefill", c))]

    def _adapter_still_served(self, req: EngineRequest) -> bool:
        """False (and the request failed with a 400 naming the adapter) if it named a LoRA
        adapter that was unloaded or replaced while it waited: it never runs on other weights."""
        if req.lora is None or req.lora[1] == self._served_load_id:
            return True
        with self._lock:
            now = self._adapter[0] if self._adapter is not None else None
        what = f"replaced by {now!r}" if now is not None else "unloaded"
        self._release(req, {"type": "abort", "message": "LoRA adapter gone"}, error_status=400,
                      error=f"lora_path {req.lora[0]!r}: that LoRA adapter was {what} before "
                            "this request started (nothing was generated); resubmit it naming a "
                            f"loaded adapter (loaded: {[now] if now is not None else 'none'})")
        return False

    def _dispatch_decode(self, previous: tuple[Any, Any, list, int] | None
                         ) -> tuple[Any, Any, list[EngineRequest | None], int]:
        """Dispatches a decode call over all slots (asynchronously) and returns its handle.

        ``previous`` is the call still in flight, whose tokens the host has not seen yet:
        a request it carries will sit that call's steps further when this call starts.
        While a weight update that will abort the running requests is on its way
        (``WeightStaging.expecting_swap``: a transfer begun or staged) a call runs one step
        instead of
        ``decode_steps`` (the same program), so the swap waits for one step, not a call
        (0.5B shape, 4 steps on a 2-core host: the wait was 0.1-0.8 s).
        """
        active = [s for s in self._slots if s is not None]
        pending = {id(r) for r in previous[2] if r is not None} if previous is not None else set()
        ahead = previous[3] if previous is not None else 0
        # The token each slot feeds next sits at position prompt_len + n_out - 1.
        max_position = max(
            r.prompt_len + len(r.output_ids) - 1 + (ahead if id(r) in pending else 0)
            for r in active)
        kv_len = self.runner.kv_len(max_position)
        steps = 1 if self.staging.expecting_swap() else self.config.decode_steps
        token_kb, logprob_kb = self.runner.decode(
            kv_len, window=self.runner.decode_window(kv_len, compiled_only=self.config.warmup),
            any_truncation=any(r.params.truncates for r in active),
            any_random=any(not r.params.greedy for r in active), n_steps=steps)
        self.stats["decode_calls"] += 1
        return token_kb, logprob_kb, list(self._slots), steps

    def _collect(self, call: tuple[Any, Any, list[EngineRequest | None], int]) -> None:
        """Appends a finished decode call's tokens to the requests it was dispatched for."""
        token_kb, logprob_kb, owners, steps = call
        token_kb, logprob_kb = jax.device_get((token_kb[:steps], logprob_kb[:steps]))
        for step in range(token_kb.shape[0]):
            for slot, owner in enumerate(owners):
                if owner is not None and self._slots[slot] is owner:
                    self._append_token(slot, int(token_kb[step, slot]),
                                       float(logprob_kb[step, slot]))
        self._notify_tokens(owner for owner in owners if owner is not None)

    @staticmethod
    def _notify_tokens(reqs: Iterable[EngineRequest]) -> None:
        """``on_tokens`` of each request that got tokens and goes on (a finished one is told
        by ``on_finish``)."""
        for req in reqs:
            if req.on_tokens is not None and not req.finished:
                try:
                    req.on_tokens(req)
                except Exception:  # noqa: BLE001 - a caller's callback must not kill the loop
                    logger.exception("on_tokens callback of request %s failed", req.rid)

    def _append_token(self, slot: int, token: int, logprob: float) -> None:
        req = self._slots[slot]
        assert req is not None
        if not math.isfinite(logprob):
            self._slots[slot] = None
            self._release(req, {"type": "abort", "message": "non-finite logprob"},
                          error=f"the model produced a non-finite logprob ({logprob}) for token "
                                f"{len(req.output_ids)}; the served weights or the sampling "
                                f"parameters overflow float32")
            return
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        self.stats["generated_tokens"] += 1
        if self.first_token_at is None:
            self.first_token_at = time.time()
        n = len(req.output_ids)
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self._finish(slot, {"type": "stop", "matched": token})
        elif n >= p.max_new_tokens or req.prompt_len + n >= self.max_seq_len:
            self._finish(slot, {"type": "length", "length": n})

    def _finish(self, slot: int, reason: JsonDict) -> None:
        req = self._slots[slot]
        assert req is not None
        self._slots[slot] = None
        self._release(req, reason)

    def _release(
        self, req: EngineRequest, reason: JsonDict, error: str | None = None,
        error_status: int = 500,
    ) -> None:
        with self._lock:
            self._inflight.pop(req.rid, None)
        self.stats["finished_requests"] += 1
        if reason["type"] == "abort":
            self.stats["aborted_requests"] += 1
        req.error = error
        req.error_status = error_status
        try:
            req.finish(reason, self.weight_version)
        except Exception:  # noqa: BLE001 - a caller's callback must not kill the loop
            logger.exception("on_finish callback of request %s failed", req.rid)

    def _abort_running(self, message: str) -> int:
        count = 0
        for slot, req in enumerate(self._slots):
            if req is not None:
                self._finish(slot, {"type": "abort", "message": message})
                count += 1
        return count

    def _abort_matching(self, match: Callable[[EngineRequest], bool], message: str) -> int:
        count = 0
        with self._lock:
            queued = [r for r in self._waiting if match(r)]
            for r in queued:
                self._waiting.remove(r)
        for r in queued:
            self._release(r, {"type": "abort", "message": message})
            count += 1
        for slot, req in enumerate(self._slots):
            if req is not None and match(req):
                self._finish(slot, {"type": "abort", "message": message})
                count += 1
        return count

    def _fail_all(self, message: str) -> None:
        """Fails every running and queued request and command (the loop has ended)."""
        for slot, req in enumerate(self._slots):
            if req is not None:
                self._slots[slot] = None
                self._release(req, {"type": "abort", "message": message}, error=message)
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
            commands = list(self._commands)
            self._commands.clear()
        for req in queued:
            self._release(req, {"type": "abort", "message": message}, error=message)
        for _, fut in commands:  # waiting callers see the failure instead of hanging
            if not fut.done():
                fut.set_exception(EngineStoppedError(f"engine is not running: {message}"))
        if self._pending_update is not None:
            self._pending_update[2].set_result(
                {"success": False, "message": message, "num_paused_requests": 0})
            self._pending_update = None
        v, self._verifying = self._verifying, None
        if v is not None and v.done is not None and not v.done.done():
            v.done.set_result({"success": False, "message": message, "num_paused_requests": 0})
