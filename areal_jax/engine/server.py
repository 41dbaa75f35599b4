"""HTTP server for the generation engine, speaking the SGLang native protocol subset.

    python -m areal_jax.engine.server --model-path DIR [--host 127.0.0.1 --port 30000]
    python scripts/serve.py --model-path DIR ...            # the same CLI

Routes: /generate, /pause_generation, /continue_generation, /update_weights_from_disk,
/update_weight_version, /abort_request, /flush_cache, /health, /health_generate,
/get_model_info, /get_server_info. Malformed requests get HTTP 400 ``{"error": message}``;
with ``--api-key`` every route needs ``Authorization: Bearer KEY`` (else 401).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import areal_jax
from areal_jax.engine.config import SUPPORTED_DTYPES, EngineConfig, request_cpu_devices
from areal_jax.engine.engine import EngineRequestError, GenerationEngine, ModelPathError
from areal_jax.engine.protocol import (
    ProtocolError,
    generate_reply,
    parse_abort,
    parse_generate,
    parse_json_body,
    parse_pause,
    parse_update_weight_version,
    parse_update_weights_from_disk,
)
from areal_jax.engine.request import EngineRequest

logger = logging.getLogger("areal_jax.engine.server")
DISCONNECT_POLL_S = 1.0
PARENT_POLL_S = 0.5


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class _ApiKeyMiddleware:
    """Plain ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the
    /generate handler, which aborts requests whose client went away)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(
                    "missing or wrong API key (send 'Authorization: Bearer <key>')", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: GenerationEngine, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    app = FastAPI(title="areal-jax generation engine", docs_url=None, redoc_url=None)
    app.state.engine = engine

    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(f"{request.url.path}: invalid request: {exc.errors()}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError):
        return _error(str(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return _error(f"internal server error: {type(exc).__name__}: {exc}", 500)

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = parse_json_body(await request.body(), "/generate")
        call = parse_generate(body, engine.vocab_size, engine.max_seq_len)
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[EngineRequest] = loop.create_future()

        def on_finish(req: EngineRequest) -> None:
            def resolve() -> None:
                if not finished.done():
                    finished.set_result(req)

            loop.call_soon_threadsafe(resolve)

        try:
            req = engine.submit(call.input_ids, call.params, rid=call.rid, on_finish=on_finish)
        except EngineRequestError as e:
            return _error(str(e))
        except RuntimeError as e:
            return _error(str(e), 503)
        while True:
            done, _ = await asyncio.wait({finished}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                await asyncio.to_thread(engine.abort, req.rid)
                return Response(status_code=499)
        if req.error is not None:
            return _error(req.error, 500)
        return generate_reply(req, call, engine.decode_text)

    # ------------------------------------------------------------------ control
    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        parse_pause(parse_json_body(await request.body(), "/pause_generation", allow_empty=True))
        aborted = await asyncio.to_thread(engine.pause)
        return {"success": True, "status": "ok", "num_aborted_requests": aborted,
                "message": f"Generation paused; {aborted} running request(s) aborted."}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        parse_json_body(await request.body(), "/continue_generation", allow_empty=True)
        await asyncio.to_thread(engine.continue_generation)
        return {"success": True, "status": "ok", "message": "Generation continued."}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = parse_json_body(await request.body(), "/update_weights_from_disk")
        model_path, version, abort_all = parse_update_weights_from_disk(body)
        result = await asyncio.to_thread(
            engine.update_weights_from_disk, model_path, version, abort_all)
        if not result["success"]:
            return JSONResponse({**result, "error": result["message"]}, status_code=400)
        return result

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = parse_json_body(await request.body(), "/update_weight_version")
        version, abort_all = parse_update_weight_version(body)
        await asyncio.to_thread(engine.update_weight_version, version, abort_all)
        return {"success": True, "message": f"Weight version updated to {version}",
                "new_version": version}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        rid, abort_all = parse_abort(parse_json_body(await request.body(), "/abort_request"))
        count = await asyncio.to_thread(engine.abort, rid, abort_all)
        return {"success": True, "num_aborted_requests": count}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        flushed = await asyncio.to_thread(engine.flush_cache)
        if not flushed:
            return _error("cache not flushed: requests are running", 400)
        return Response("Cache flushed.\n", status_code=200)

    # ------------------------------------------------------------------ status
    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        if not engine.healthy:
            return _error(f"engine unhealthy: {engine.fatal_error}", 503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
            "is_generation": True,
            "weight_version": engine.weight_version,
            "max_seq_len": engine.max_seq_len,
            "vocab_size": engine.vocab_size,
            "architecture": engine.model_config.architecture,
        }

    @app.get("/get_server_info")
    async def get_server_info():
        return {**engine.info(), "engine": "areal-jax", "version": areal_jax.__version__}

    return app


# ---------------------------------------------------------------------- CLI
def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py", description="Serve an HF checkpoint with the areal-jax engine "
        "(SGLang protocol).")
    p.add_argument("--model-path", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-slots", type=int, default=16, help="requests decoded together")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context length per request (default min(model max, 2048))")
    p.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="float32")
    p.add_argument("--cache-dtype", choices=SUPPORTED_DTYPES, default=None)
    p.add_argument("--prefill-rows", type=int, default=4, help="prompts per prefill call")
    p.add_argument("--decode-steps", type=int, default=8, help="tokens per slot per device call")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="split the slots over this many devices (on CPU: this many XLA CPU "
                        "devices, one core each); max-slots must be a multiple")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--seed", type=int, default=0, help="seeds requests without sampling_seed")
    p.add_argument("--weight-version", default="0", help="initial weight_version (a string)")
    p.add_argument("--warmup", action="store_true", help="compile all shapes at start-up")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache: restarts reuse compiled steps")
    p.add_argument("--cpu-affinity", default=None,
                   help="comma-separated CPU ids to run on (set before JAX starts its threads)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down when this parent process dies, even by SIGKILL")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _apply_process_settings(cpu_affinity: str | None, parent_pid: int | None) -> None:
    if cpu_affinity:
        try:
            cpus = {int(c) for c in cpu_affinity.split(",") if c.strip()}
            os.sched_setaffinity(0, cpus)
        except (ValueError, OSError) as e:
            raise ValueError(f"--cpu-affinity {cpu_affinity!r}: {e}") from None
    if parent_pid is not None:
        if os.getppid() != parent_pid:
            raise SystemExit(f"parent process {parent_pid} is gone; not starting")

        def watch_parent() -> None:  # orphaned: the parent process died (even by SIGKILL)
            while os.getppid() == parent_pid:
                time.sleep(PARENT_POLL_S)
            logger.warning("parent process %d died; shutting down", parent_pid)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _apply_process_settings(args.cpu_affinity, args.parent_pid)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    request_cpu_devices(args.data_parallel)  # CPU devices for the slot shards
    if args.compilation_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        config = EngineConfig(
            model_path=args.model_path, max_slots=args.max_slots, max_seq_len=args.max_seq_len,
            dtype=args.dtype, cache_dtype=args.cache_dtype, prefill_rows=args.prefill_rows,
            decode_steps=args.decode_steps, data_parallel=args.data_parallel, seed=args.seed,
            weight_version=args.weight_version, warmup=args.warmup)
        engine = GenerationEngine(config)
    except (ModelPathError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    app = create_app(engine, api_key=args.api_key)
    logger.info("serving %s on http://%s:%d (weight_version %s, %d compilations so far)",
                args.model_path, args.host, args.port, engine.weight_version,
                engine.num_compilations)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
