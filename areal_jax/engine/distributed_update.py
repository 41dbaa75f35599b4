"""SGLang's in-memory weight update on the embedded engine: the trainer broadcasts HF-named
tensors through a torch process group (``areal_jax.weight_group``: gloo on CPU, NCCL on
GPUs), announced one request at a time over HTTP.

- ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size", "group_name": "weight_update_group", "backend": "nccl"}`` (SGLang's
  ``InitWeightsUpdateGroupReqInput``) → ``{"success", "message"}``: the server joins the
  group as rank ``rank_offset`` (the trainer is rank 0 and hosts the rendezvous). One extra
  field of ours, ``timeout_s`` (default 600), bounds every operation on the group.
- ``POST /update_weights_from_distributed`` ``{"names", "dtypes", "shapes", "group_name",
  "flush_cache", "abort_all_requests", "weight_version", "load_format"}`` (SGLang's
  ``UpdateWeightsFromDistributedReqInput``) → ``{"success", "message"}``: the server
  receives one broadcast per name, in order, from rank 0: the HF tensor (e.g.
  ``model.layers.0.self_attn.q_proj.weight``, HF shape, one of bfloat16/float16/float32),
  and writes it, converted by ``model_defs``' HF table (the inverse of ``save_hf``), into
  host arrays of the engine's own stacked layout and dtype. A trainer may send the model in
  several requests (buckets): once every served tensor has arrived, the new weights are
  placed and checked like an in-memory transfer's (``engine/staging.py``) and swapped in at
  a step boundary (``GenerationEngine.swap_staged``; ``abort_all_requests`` aborts the
  running requests, else the swap waits for them), under ``weight_version``. Until then the
  engine generates on the old weights, whole, and the reply says how many tensors arrived.
- ``POST /destroy_weights_update_group`` ``{"group_name"}`` → ``{"success", "message"}``.

Failures leave the old weights serving, whole, and reply 400 with the reason: an unknown
name, a shape or dtype that does not fit (the declared tensors are still received, so the
group stays in step with the trainer), a broadcast that failed or timed out (the trainer
died or stalled: the group is left and must be made again), a failed check. A request that
arrives while another one is in progress is refused. SGLang's ``load_format:
"flattened_bucket"`` is not supported (refused).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_jax.engine.protocol import ProtocolError, parse_json_body
from areal_jax.engine.staging import StagingError, place_named
from areal_jax.engine.weight_check import WeightCheckError
from areal_jax.weight_group import (
    DEFAULT_GROUP_NAME,
    WeightGroupError,
    destroy_group,
    dtype_name,
    init_group,
    to_numpy,
    torch_modules,
)
from areal_jax.weight_wire import aligned_empty, leaf_name
from model_defs.hf_io import Transform, hf_shape, hf_to_ours, param_table

if TYPE_CHECKING:
    from areal_jax.engine.engine import GenerationEngine
    from areal_jax.engine.runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
RECV_WINDOW = 2  # broadcasts posted ahead of the one being converted


@dataclass(frozen=True)
class HfSlot:
    """Where the HF tensor of one name goes in the served params."""

    wire: str  # the served leaf (layers.attn.q_kernel_dhk)
    layer: int | None  # its row of a stacked [L, ...] leaf, None outside the layers
    transform: Transform
    our_shape: tuple[int, ...]  # the row's shape in the engine's layout
    hf_shape: tuple[int, ...]


def hf_slots(runner: ModelRunner) -> dict[str, HfSlot]:
    """HF name -> slot, for every tensor the served model has (``model_defs``' HF table)."""
    served = {leaf_name(path): tuple(x.shape)
              for path, x in jax.tree_util.tree_leaves_with_path(runner.state)}
    slots: dict[str, HfSlot] = {}
    covered = set()
    for hf_key, nnx_path, transform, layer in param_table(runner.cfg):
        wire = ".".join(str(p) for p in nnx_path)
        if wire not in served:
            continue  # a tensor this config does not have (bias, qk-norm, untied head)
        covered.add(wire)
        ours = served[wire] if layer is None else served[wire][1:]
        slots[hf_key] = HfSlot(wire, layer, transform, ours, hf_shape(ours, transform))
    if covered != set(served):
        raise StagingError(f"the served params {sorted(set(served) - covered)[:3]} have no "
                           "HF name; this model cannot take distributed updates")
    return slots


class UpdateRefused(Exception):
    """A request refused (the message says why); the served weights stay."""


class DistributedReceiver:
    """The engine's end of one weight update group, and the update it is assembling."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine
        self._busy = threading.Lock()  # one group operation at a time
        self._group: Any = None
        self._group_name: str | None = None
        self._backend = "gloo"
        self._timeout_s = DEFAULT_TIMEOUT_S
        self._pending: dict[str, np.ndarray] = {}  # wire name -> host array being filled
        self._received: set[str] = set()  # HF names received for the pending update

    def _drop_group(self) -> None:
        destroy_group(self._group)
        self._group, self._group_name = None, None
        self._drop_pending()

    def _drop_pending(self) -> None:
        self._pending, self._received = {}, set()

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """One group operation at a time; another one meanwhile is refused at once."""
        if not self._busy.acquire(blocking=False):
            raise UpdateRefused(f"{what}: another weight update group operation is in "
                                "progress on this server")
        try:
            yield
        finally:
            self._busy.release()

    # ------------------------------------------------------------------ group
    def init_group(self, body: dict[str, Any]) -> str:
        route = "/init_weights_update_group"
        address, port = body.get("master_address"), body.get("master_port")
        offset, world = body.get("rank_offset"), body.get("world_size")
        name = body.get("group_name", DEFAULT_GROUP_NAME)
        backend = body.get("backend", "nccl")
        timeout_s = body.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(address, str) or not address:
            raise ProtocolError(f"{route}: 'master_address' must be a host name or address")
        for key, value, low in (("master_port", port, 1), ("rank_offset", offset, 1),
                                ("world_size", world, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ProtocolError(f"{route}: '{key}' must be an integer >= {low}, got "
                                    f"{value!r}")
        assert isinstance(offset, int) and isinstance(world, int) and isinstance(port, int)
        if offset >= world:
            raise ProtocolError(f"{route}: rank_offset {offset} must be below world_size "
                                f"{world} (the trainer is rank 0)")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"{route}: 'group_name' must be a non-empty string")
        if backend not in ("gloo", "nccl"):
            raise ProtocolError(f"{route}: 'backend' must be 'gloo' or 'nccl', got {backend!r}")
        if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) \
                or not 0 < timeout_s <= 86400:
            raise ProtocolError(f"{route}: 'timeout_s' must be seconds in (0, 86400]")
        with self._exclusive(route):
            try:
                torch, _ = torch_modules()
                if backend == "nccl" and not torch.cuda.is_available():
                    raise WeightGroupError("backend 'nccl' needs a CUDA device for torch on "
                                           "this server; use backend 'gloo'")
                self._drop_group()  # a new group replaces the old one (and its pending update)
                t0 = time.perf_counter()
                self._group = init_group(backend, address, port, offset, world, name,
                                         float(timeout_s))
            except WeightGroupError as e:
                raise UpdateRefused(f"{route}: {e}") from None
            self._group_name, self._backend = name, backend
            self._timeout_s = float(timeout_s)
        return (f"Succeeded to initialize the weight update group {name!r} (rank {offset} of "
                f"{world}, {backend}) in {time.perf_counter() - t0:.2f}s")

    def destroy(self, body: dict[str, Any]) -> str:
        name = body.get("group_name", DEFAULT_GROUP_NAME)
        with self._exclusive("/destroy_weights_update_group"):
            if self._group is None or name != self._group_name:
                raise UpdateRefused(f"no weight update group {name!r} on this server")
            self._drop_group()
        return f"Succeeded to destroy the weight update group {name!r}"

    # ------------------------------------------------------------------ update
    def update(self, body: dict[str, Any]) -> str:
        route = "/update_weights_from_distributed"
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list)
                and isinstance(shapes, list) and len(names) == len(dtypes) == len(shapes)):
            raise ProtocolError(f"{route}: 'names', 'dtypes' and 'shapes' must be lists of "
                                "one length")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str | int):
            raise ProtocolError(f"{route}: 'weight_version' must be a string")
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(abort_all, bool):
            raise ProtocolError(f"{route}: 'abort_all_requests' must be true or false")
        group_name = body.get("group_name", DEFAULT_GROUP_NAME)
        load_format = body.get("load_format")
        with self._exclusive(route):
            if self._group is None or group_name != self._group_name:
                raise UpdateRefused(f"{route}: no weight update group {group_name!r} on "
                                    "this server (call /init_weights_update_group first)")
            specs = self._specs(names, dtypes, shapes)
            if load_format not in (None, "direct", "auto"):
                self._drop_group()  # the sender's broadcasts cannot be told apart
                raise UpdateRefused(f"{route}: load_format {load_format!r} is not "
                                    "supported by this server; the group is left")
            return self._receive_and_apply(specs, None if version is None else str(version),
                                           abort_all)

    def _specs(self, names: list, dtypes: list, shapes: list
               ) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) per declared tensor. Where a declaration cannot even be
        received (an unknown dtype, a shape that is not a list of sizes), the broadcasts
        cannot be followed: the group is left and the update refused."""
        specs = []
        try:
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                if not isinstance(name, str) or not isinstance(shape, list) or not all(
                        isinstance(n, int) and not isinstance(n, bool) and n >= 0
                        for n in shape):
                    raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
                specs.append((name, dtype_name(dtype), tuple(shape)))
        except ValueError as e:
            self._drop_group()
            raise UpdateRefused(f"weights not updated: {e}; the group is left (make it "
                                "again with /init_weights_update_group)") from None
        return specs

    def _problems(self, specs: list[tuple[str, str, tuple[int, ...]]],
                  slots: dict[str, HfSlot]) -> list[str]:
        problems, seen = [], set()
        for name, _, shape in specs:
            slot = slots.get(name)
            if slot is None:
                problems.append(f"unknown tensor {name!r} (the served "
                                f"{self.engine.model_config.architecture} has no such weight)")
            elif shape != slot.hf_shape:
                problems.append(f"tensor {name} has shape {list(shape)}, the served model's "
                                f"is {list(slot.hf_shape)}")
            elif name in seen:
                problems.append(f"tensor {name} is sent twice")
            seen.add(name)
        return problems

    def _receive_and_apply(self, specs: list[tuple[str, str, tuple[int, ...]]],
                           version: str | None, abort_all: bool) -> str:
        runner = self.engine.runner
        slots = hf_slots(runner)
        problems = self._problems(specs, slots)
        largest = max(math.prod(s.hf_shape) for s in slots.values())
        if any(math.prod(shape) > 4 * largest for _, _, shape in specs):
            self._drop_group()  # not received: far larger than any tensor of this model
            raise UpdateRefused(f"weights not updated: {problems[0] if problems else ''} "
                                "(a declared tensor is far larger than any of the served "
                                "model's; the group is left)")
        served = {leaf_name(path): x
                  for path, x in jax.tree_util.tree_leaves_with_path(runner.state)}
        torch, dist = torch_modules()
        device = torch.device("cuda") if self._backend == "nccl" else torch.device("cpu")
        t0 = time.perf_counter()
        posted: collections.deque = collections.deque()

        def finish() -> None:
            name, tensor, work = posted.popleft()
            work.wait()
            if problems:
                return  # received to keep the group in step; dropped
            slot = slots[name]
            dest = self._pending.get(slot.wire)
            if dest is None:
                old = served[slot.wire]
                dest = self._pending[slot.wire] = aligned_empty(old.shape, np.dtype(old.dtype))
            row = hf_to_ours(to_numpy(tensor, torch), slot.our_shape, slot.transform)
            copy_into(dest if slot.layer is None else dest[slot.layer], row)
            self._received.add(name)

        try:
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                posted.append((name, tensor, dist.broadcast(tensor, src=0, group=self._group,
                                                            async_op=True)))
                while len(posted) > RECV_WINDOW:
                    finish()
            while posted:
                finish()
        except Exception as e:  # noqa: BLE001 - a broadcast that failed or timed out
            posted.clear()
            self._drop_group()
            logger.warning("distributed weight update failed: %s", e)
            raise UpdateRefused(
                f"weights not updated: receiving the broadcast failed ({_first_line(e)}); the "
                "old weights stay, and the group is left (make it again with "
                "/init_weights_update_group)") from None
        recv_s = time.perf_counter() - t0
        if problems:
            self._drop_pending()
            raise UpdateRefused(f"weights not updated: {problems[0]}"
                                + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                   else ""))
        missing = len(slots) - len(self._received)
        if missing:
            return (f"Received {len(specs)} tensors in {recv_s:.2f}s; {missing} of "
                    f"{len(slots)} still to come before the new weights are served")
        return self._apply(version, abort_all, recv_s)

    def _apply(self, version: str | None, abort_all: bool, recv_s: float) -> str:
        arrays, self._pending = self._pending, {}
        self._received = set()
        runner = self.engine.runner
        try:
            # probed at the swap (swap_staged: in the first prefill under it), not here
            state = place_named(arrays, runner, False)
        except (StagingError, WeightCheckError) as e:
            raise UpdateRefused(f"weights not updated: {e}") from None
        del arrays
        transfer = f"distributed-{uuid.uuid4().hex[:12]}"
        staging = self.engine.staging
        staging.put(transfer, _int_version(version), state)
        del state
        result = self.engine.swap_staged(transfer, version, abort_all)
        if not result["success"]:
            raise UpdateRefused(result["message"])
        return (f"Succeeded to update model weights (received in {recv_s:.2f}s, "
                f"paused {result.get('paused_s', 0.0):.3f}s, "
                f"{result.get('num_paused_requests', 0)} requests aborted)")


def copy_into(dest: np.ndarray, src: np.ndarray) -> None:
    """``dest[...] = src``, cast to ``dest``'s dtype; between equal dtypes a bit copy
    through unsigned views (a transposed bfloat16 ``src`` copies 4x faster that way than
    through ml_dtypes' own loop)."""
    if src.dtype == dest.dtype and dest.dtype.itemsize in (1, 2, 4, 8):
        bits = np.dtype(f"u{dest.dtype.itemsize}")
        dest.view(bits)[...] = src.view(bits)
    else:
        dest[...] = src


def _int_version(version: str | None) -> int:
    try:
        return int(version) if version is not None else -1
    except ValueError:
        return -1


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _reply(ok: bool, message: str) -> JSONResponse:
    """SGLang's reply: ``{"success", "message"}``, HTTP 200, or 400 when refused."""
    return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)


def register_distributed_routes(app: FastAPI, engine: GenerationEngine) -> None:
    """The routes of the module doc, on ``app``."""
    receiver = DistributedReceiver(engine)
    app.state.distributed_receiver = receiver

    async def run(route: str, request: Request, method: Any) -> JSONResponse:
        body = parse_json_body(await request.body(), route,
                               allow_empty=route == "/destroy_weights_update_group")
        try:
            return _reply(True, await asyncio.to_thread(method, body))
        except UpdateRefused as e:
            return _reply(False, str(e))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        return await run("/init_weights_update_group", request, receiver.init_group)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        return await run("/update_weights_from_distributed", request, receiver.update)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        return await run("/destroy_weights_update_group", request, receiver.destroy)
