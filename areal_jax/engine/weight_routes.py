"""The server's routes for in-memory weight updates (``engine/staging.py`` receives them,
``areal_jax.weight_wire`` defines the format, ``checkpoint/stream.py`` sends them).

- ``POST /weights/begin[?swap=abort|wait]`` the manifest (JSON) → ``{"success",
  "transfer", "num_buckets", "total_bytes", "held_files"}`` (``held_files``: the
  ``[st_dev, st_ino]`` of each shared-memory file the server still maps, which its sender
  must not write into); 400 if a tensor, shape or dtype does not fit the served model.
  ``swap=abort`` (the default): the swap will abort running requests, so from now to it
  decode calls run one step (the swap then waits for one step); ``wait``: it will wait for
  them to finish, and calls stay whole.
- ``PUT /weights/bucket?transfer=ID&index=I`` the bucket's raw bytes, its checksum (the
  manifest's ``checksum``: xxh3-64 or CRC-32, decimal) in the ``x-areal-checksum`` header
  → ``{"success": true}``; 400 if its length or checksum is wrong (the transfer is then
  dropped). Not bound by ``--max-body-bytes``: the bucket's
  length comes from the manifest.
- ``POST /weights/load_file`` ``{"transfer", "path", "checksums": [per bucket]}``: the same
  host's sender wrote the whole stream to a shared-memory file (``/dev/shm/areal-weights-*``);
  the server maps it read-only and every bucket is checked in a worker thread; the new
  tensors are views of the mapping, which a CPU device aliases (the bytes are neither
  sent over HTTP nor copied; the pages are freed when the sender has removed the file and
  the server no longer serves them) → ``{"success", "load_s"}``.
- ``POST /weights/stage`` ``{"transfer"}`` → ``{"success", "version", "stage_s",
  "place_s"}``: every bucket whole, placed like the served params; generation goes on
  meanwhile.
- ``POST /weights/swap`` ``{"transfer", "weight_version", "abort_all_requests"}`` →
  SGLang's update reply (``success``, ``message``, ``num_paused_requests``) and
  ``wait_s`` (the wait for the step boundary: the decode call in flight is collected, its
  tokens kept, and no other dispatched) and ``paused_s`` (from the old weights' last step
  to the new ones in place): the staged weights are served from that boundary on. With the
  weight checks on (the default) the reply also waits for the new version's probe, which
  rides in a spare row of the first prefill under it (``verify_s``: swap to probe result;
  alone after 0.25 s idle); a probe that fails puts the old version back and the reply is
  a 400 with its message.
- ``POST /weights/abort`` ``{"transfer"}`` (or ``{}``: any) → ``{"success", "dropped"}``.
- ``GET /weights/status`` → what is being received or staged, and the last error.
- ``POST /update_weights_from_delta`` ``{"model_path", "weight_version",
  "abort_all_requests"}``: a delta file (``checkpoint/delta.py``, on a shared path or
  ``gs://``, under ``--allowed-weight-dir``) applied to the served weights, then swapped in
  as ``/update_weights_from_disk`` does; a delta against another version than the served
  one, or a corrupted one, is a 400 (send the full version).

A failure leaves the served weights as they were.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from areal_jax.engine.protocol import ProtocolError, parse_json_body
from areal_jax.engine.staging import StagingError
from areal_jax.weight_wire import CHECKSUM_HEADER

if TYPE_CHECKING:
    from areal_jax.engine.engine import GenerationEngine

BUCKET_ROUTE = "/weights/bucket"


def _refused(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message, "error": message},
                        status_code=status)


def _transfer(body: dict, route: str, required: bool = True) -> str | None:
    transfer = body.get("transfer")
    if transfer is None and not required:
        return None
    if not isinstance(transfer, str) or not transfer:
        raise ProtocolError(f"{route}: 'transfer' must be a non-empty string")
    return transfer


def register_weight_routes(app: FastAPI, engine: GenerationEngine,
                           path_ok: Callable[[str], bool], not_allowed: str) -> None:
    """The routes above; ``path_ok(path)``: may the server read that delta file
    (``not_allowed``: the 403's message otherwise)."""
    staging = engine.staging

    @app.post("/update_weights_from_delta")
    async def update_weights_from_delta(request: Request):
        body = parse_json_body(await request.body(), "/update_weights_from_delta")
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("/update_weights_from_delta: 'model_path' must be the delta "
                                "file's path")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str | int):
            raise ProtocolError("/update_weights_from_delta: 'weight_version' must be a string")
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(abort_all, bool):
            raise ProtocolError("/update_weights_from_delta: 'abort_all_requests' must be "
                                "true or false")
        if not path_ok(path):
            return JSONResponse({"success": False, "message": not_allowed, "error": not_allowed,
                                 "num_paused_requests": 0}, status_code=403)
        result = await asyncio.to_thread(engine.update_weights_from_delta, path,
                                         None if version is None else str(version), abort_all)
        if not result["success"]:
            return _refused(result["message"], 400 if engine.healthy else 503)
        return result

    @app.post("/weights/begin")
    async def begin(request: Request):
        body = parse_json_body(await request.body(), "/weights/begin")
        swap = request.query_params.get("swap", "abort")
        if swap not in ("abort", "wait"):
            raise ProtocolError("/weights/begin: 'swap' must be 'abort' or 'wait'")
        try:
            return staging.begin(body, short_steps=swap == "abort")
        except StagingError as e:
            return _refused(str(e))

    @app.put(BUCKET_ROUTE)
    async def bucket(request: Request):
        transfer = request.query_params.get("transfer") or ""
        try:
            index = int(request.query_params.get("index", ""))
            crc = int(request.headers.get(CHECKSUM_HEADER, ""))
        except ValueError:
            return _refused(f"{BUCKET_ROUTE}: needs ?transfer=ID&index=I and the bucket's "
                            f"checksum in the {CHECKSUM_HEADER} header")
        error: str | None = None
        try:
            async for chunk in request.stream():
                if chunk and error is None:
                    try:
                        staging.write(transfer, index, chunk)
                    except StagingError as e:
                        error = str(e)  # the rest of the body is read and dropped
            if error is None:
                staging.end_bucket(transfer, index, crc)
        except StagingError as e:
            error = str(e)
        except ClientDisconnect:
            staging.abort(transfer, f"the connection dropped during bucket {index}")
            return Response(status_code=499)
        if error is not None:
            return _refused(error)
        return {"success": True}

    @app.post("/weights/load_file")
    async def load_file(request: Request):
        body = parse_json_body(await request.body(), "/weights/load_file")
        transfer = _transfer(body, "/weights/load_file")
        path, crcs = body.get("path"), body.get("checksums")
        if not isinstance(path, str) or not isinstance(crcs, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in crcs):
            raise ProtocolError("/weights/load_file: needs 'path' (a string) and 'checksums' "
                                "(a list of ints, one per bucket)")
        assert transfer is not None
        try:
            seconds = await asyncio.to_thread(staging.load_file, transfer, path, crcs)
        except StagingError as e:
            return _refused(str(e))
        return {"success": True, "load_s": seconds}

    @app.post("/weights/stage")
    async def stage(request: Request):
        body = parse_json_body(await request.body(), "/weights/stage")
        transfer = _transfer(body, "/weights/stage")
        assert transfer is not None
        try:
            return await asyncio.to_thread(staging.stage, transfer)
        except StagingError as e:
            return _refused(str(e))

    @app.post("/weights/swap")
    async def swap(request: Request):
        body = parse_json_body(await request.body(), "/weights/swap")
        transfer = _transfer(body, "/weights/swap")
        assert transfer is not None
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str | int):
            raise ProtocolError("/weights/swap: 'weight_version' must be a string")
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(abort_all, bool):
            raise ProtocolError("/weights/swap: 'abort_all_requests' must be true or false")
        result = await asyncio.to_thread(
            engine.swap_staged, transfer, None if version is None else str(version), abort_all)
        if not result["success"]:
            return _refused(result["message"], 400 if engine.healthy else 503)
        return result

    @app.post("/weights/abort")
    async def abort(request: Request):
        body = parse_json_body(await request.body(), "/weights/abort", allow_empty=True)
        dropped = staging.abort(_transfer(body, "/weights/abort", required=False))
        return {"success": True, "dropped": dropped}

    @app.get("/weights/status")
    async def status():
        return staging.status()
