"""HTTP server for the generation engine, speaking the SGLang native protocol subset.

    python -m areal_jax.engine.server --model-path DIR [--host 127.0.0.1 --port 30000]
    python scripts/serve.py --model-path DIR ...            # the same CLI

Routes: /generate, /pause_generation, /continue_generation, /update_weights_from_disk,
/load_lora_adapter, /unload_lora_adapter, /update_weight_version, /abort_request,
/flush_cache, /health, /health_generate,
/get_model_info, /get_server_info, the in-memory weight updates /weights/* (begin,
bucket, stage, swap, abort, status) and /update_weights_from_delta
(areal_jax.engine.weight_routes), SGLang's /init_weights_update_group,
/update_weights_from_distributed and /destroy_weights_update_group
(areal_jax.engine.distributed_update); OpenAI-compatible
/v1/completions, /v1/chat/completions
and /v1/models (areal_jax.engine.openai_api, errors in OpenAI's shape). Malformed requests
get HTTP 400 ``{"error": message}`` (413 for a body over ``--max-body-bytes``; on the OpenAI
routes every error, these included, is in OpenAI's shape); a 500 means a
bug of ours, and even then the keep-alive connection stays open. With an API key
(``AREAL_JAX_API_KEY``, ``--api-key-file`` or ``--api-key``) every route needs
``Authorization: Bearer KEY`` (else 401). Weights and LoRA adapters load only from
``--allowed-weight-dir`` directories (default: the served model's own directory); any other
path is a 403 that does not say whether it exists.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import logging
import os
import posixpath
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import areal_jax
from areal_jax.compile_cache import (
    DEFAULT_DIR,
    ENV_VAR,
    cache_stats,
    enable_compilation_cache,
    resolve_cache_dir,
)
from areal_jax.cpu_affinity import pin_process_to_cpus
from areal_jax.engine.config import (
    LAYER_LOOPS,
    SUPPORTED_DTYPES,
    EngineConfig,
    request_cpu_devices,
)
from areal_jax.engine.distributed_update import register_distributed_routes
from areal_jax.engine.engine import (
    EngineRequestError,
    EngineStoppedError,
    GenerationEngine,
    ModelPathError,
)
from areal_jax.engine.launch import API_KEY_ENV
from areal_jax.engine.openai_api import first_or_disconnect, register_engine_routes
from areal_jax.engine.protocol import (
    MAX_WEIGHT_VERSION_CHARS,
    ProtocolError,
    generate_reply,
    is_batch,
    parse_abort,
    parse_generate,
    parse_generate_batch,
    parse_json_body,
    parse_load_lora_adapter,
    parse_pause,
    parse_unload_lora_adapter,
    parse_update_weight_version,
    parse_update_weights_from_disk,
)
from areal_jax.engine.request import EngineRequest
from areal_jax.engine.reward_model import is_sequence_classifier, serve_reward_model
from areal_jax.engine.scoring import add_input_logprobs, score_calls
from areal_jax.engine.weight_routes import BUCKET_ROUTE, register_weight_routes
from areal_jax.hub import HubError, local_model_dir

logger = logging.getLogger("areal_jax.engine.server")
PARENT_POLL_S = 0.5
MAX_ERROR_CHARS = 2000  # error messages echo parts of the request; keep replies small
# Default body limit: 16 bytes per token of the longest prompt (an id, a comma, spaces)
# plus 64 KiB for the sampling parameters and the rest.
BODY_BYTES_PER_TOKEN = 16
BODY_BYTES_BASE = 64 * 1024
# A body over the limit is read and dropped up to this many bytes before the 413, so that
# the client sees the reply and the keep-alive connection survives; beyond it, it closes.
MAX_DRAIN_BYTES = 16 * 1024 * 1024
PATH_NOT_ALLOWED = ("model_path is not in a directory this server may load weights from "
                    "(the server's --allowed-weight-dir)")


def default_max_body_bytes(max_seq_len: int) -> int:
    return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_seq_len


_OPENAI_ERROR_KINDS = {401: ("authentication_error", "invalid_api_key"),
                       413: ("invalid_request_error", "request_too_large")}


def _error(message: str, status: int = 400, path: str = "") -> JSONResponse:
    """An error reply: ``{"error": message}``, or on the OpenAI routes (``path`` under
    ``/v1/``) OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "... (truncated)"
    if path.startswith("/v1/"):
        kind, code = _OPENAI_ERROR_KINDS.get(
            status, ("server_error", None) if status >= 500 else ("invalid_request_error", None))
        return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                       "code": code}}, status_code=status)
    return JSONResponse({"error": message}, status_code=status)


class _BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"request body exceeds the server's limit of {limit} bytes "
                         "(--max-body-bytes)")


async def _drain(receive, limit: int) -> None:
    """Reads and drops the rest of a request body (at most ``limit`` bytes)."""
    drained = 0
    while drained <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class _Guard:
    """Plain ASGI middleware in front of every route: the API key, the body-size limit,
    and a last-resort 500 for our own bugs that keeps the keep-alive connection open
    (an ``Exception`` handler in FastAPI re-raises after replying, and uvicorn then drops
    the connection, which a client must take for a dead server). Not BaseHTTPMiddleware,
    which would hide client disconnects from the /generate handler."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.expected is not None and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.expected):
            response = _error("missing or wrong API key (send 'Authorization: Bearer <key>')",
                              401, path)
            await response(scope, receive, send)
            return
        if path == BUCKET_ROUTE:  # a weight bucket: its length is the manifest's, checked there
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > limit:
            await _drain(receive, MAX_DRAIN_BYTES)
            await _error(str(_BodyTooLarge(limit)), 413, path)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if message.get("more_body", False):
                        await _drain(receive, MAX_DRAIN_BYTES)
                    raise _BodyTooLarge(limit)
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as exc:  # noqa: BLE001 - last resort, see the class doc
            logger.exception("internal error on %s", scope.get("path"))
            if not started:
                await _error(f"internal server error: {type(exc).__name__}: {exc}", 500,
                             path)(scope, receive, send)


_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def normalize_allowed_dirs(dirs: list[str]) -> list[str]:
    """Absolute, symlink-free local directories (or normalised ``scheme://`` prefixes)."""
    out = []
    for d in dirs:
        if "://" in d:
            scheme, rest = d.split("://", 1)
            out.append(f"{scheme}://{posixpath.normpath(rest)}")
        else:
            out.append(os.path.realpath(d))
    return out


def path_allowed(path: str, allowed: list[str]) -> bool:
    """True if ``path`` is one of ``allowed`` (normalised) or inside one. No file system
    access beyond resolving symlinks, so the answer never depends on what exists outside."""
    if not isinstance(path, str) or not path or "\x00" in path:
        return False
    if ".." in path.replace("://", "/").split("/"):
        return False  # anywhere in the path, before a "://" too
    if "://" in path:
        scheme, rest = path.split("://", 1)
        if not _URL_SCHEME.fullmatch(scheme):  # "<dir>/x/evil://w" is no URL
            return False
        target = f"{scheme}://{posixpath.normpath(rest)}"
    else:
        target = os.path.realpath(path)
    return any(target == a or target.startswith(a.rstrip("/") + "/") for a in allowed)


def create_app(engine: GenerationEngine, *, api_key: str | None = None,
               allowed_weight_dirs: list[str] | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    ``allowed_weight_dirs`` None allows only the served model's own directory (as given,
    and its local copy if it was downloaded);
    ``max_body_bytes`` None sizes the limit for the longest prompt ``max_seq_len`` allows.
    """
    app = FastAPI(title="areal-jax generation engine", docs_url=None, redoc_url=None)
    app.state.engine = engine
    allowed = normalize_allowed_dirs(
        [engine.config.model_path, engine.model_path] if allowed_weight_dirs is None
        else list(allowed_weight_dirs))
    limit = max_body_bytes or default_max_body_bytes(engine.max_seq_len)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limit)

    @app.exception_handler(_BodyTooLarge)
    async def body_too_large(request: Request, exc: _BodyTooLarge):
        return _error(str(exc), 413, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(f"{request.url.path}: invalid request: {exc.errors()}",
                      path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code,
                      request.url.path)

    @app.exception_handler(EngineStoppedError)
    async def engine_stopped(request: Request, exc: EngineStoppedError):
        return _error(str(exc), 503, request.url.path)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError):
        return _error(str(exc))

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = parse_json_body(await request.body(), "/generate")
        batched = is_batch(body)
        calls = (parse_generate_batch(body, engine.vocab_size, engine.max_seq_len) if batched
                 else [parse_generate(body, engine.vocab_size, engine.max_seq_len)])
        if any(call.score_only for call in calls):  # max_new_tokens 0: score the input
            if not all(call.score_only for call in calls):
                return _error("a batch mixes max_new_tokens 0 (scoring) with generation; "
                              "send them as separate requests")
            scored = await score_calls(engine, calls)
            return scored if batched else scored[0]
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[EngineRequest]] = []

        def resolver(finished: asyncio.Future) -> Callable[[EngineRequest], None]:
            def on_finish(req: EngineRequest) -> None:
                def resolve() -> None:
                    if not finished.done():
                        finished.set_result(req)

                loop.call_soon_threadsafe(resolve)

            return on_finish

        reqs: list[EngineRequest] = []
        try:
            for i, call in enumerate(calls):
                futures.append(loop.create_future())
                try:
                    reqs.append(engine.submit(call.input_ids, call.params, rid=call.rid,
                                              on_finish=resolver(futures[-1]),
                                              lora_name=call.lora_name))
                except EngineRequestError as e:
                    raise EngineRequestError(f"prompt {i} of the batch: {e}" if batched
                                             else str(e)) from None
        except (EngineRequestError, RuntimeError) as e:
            for req in reqs:  # a batch runs whole or not at all
                await asyncio.to_thread(engine.abort, req.rid)
            return _error(str(e), 400 if isinstance(e, EngineRequestError) else 503)
        if await first_or_disconnect(request, set(futures)):
            for req in reqs:
                await asyncio.to_thread(engine.abort, req.rid)
            return Response(status_code=499)
        failed = [req for req in reqs if req.error is not None]
        if failed:  # 4xx: the request could not run as asked; 500: the engine failed
            return _error(failed[0].error or "", failed[0].error_status)
        replies = [generate_reply(req, call, engine.decode_text)
                   for req, call in zip(reqs, calls, strict=True)]
        await add_input_logprobs(engine, calls, replies)  # logprob_start_len >= 0
        return replies if batched else replies[0]

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
        if not path_allowed(model_path, allowed):
            return JSONResponse({"success": False, "message": PATH_NOT_ALLOWED,
                                 "error": PATH_NOT_ALLOWED, "num_paused_requests": 0},
                                status_code=403)
        result = await asyncio.to_thread(
            engine.update_weights_from_disk, model_path, version, abort_all)
        if not result["success"]:
            status = 400 if engine.healthy else 503
            return JSONResponse({**result, "error": result["message"]}, status_code=status)
        return result

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = parse_json_body(await request.body(), "/load_lora_adapter")
        name, path = parse_load_lora_adapter(body)
        if not path_allowed(path, allowed):
            message = PATH_NOT_ALLOWED.replace("model_path", "lora_path")
            return JSONResponse({"success": False, "error_message": message, "error": message,
                                 "loaded_adapters": engine.lora_adapters}, status_code=403)
        return _lora_reply(await asyncio.to_thread(engine.load_lora_adapter, name, path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name = parse_unload_lora_adapter(
            parse_json_body(await request.body(), "/unload_lora_adapter"))
        return _lora_reply(await asyncio.to_thread(engine.unload_lora_adapter, name))

    def _lora_reply(result: dict) -> dict | JSONResponse:
        """SGLang's LoRAUpdateOutput; failures are 400 (503 if the engine died) and carry
        our ``error`` too."""
        if result["success"]:
            return result
        return JSONResponse({**result, "error": result["error_message"]},
                            status_code=400 if engine.healthy else 503)

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
        return {**engine.info(), "compilation_cache": cache_stats(), "engine": "areal-jax",
                "version": areal_jax.__version__}

    register_engine_routes(app, engine)  # /v1/completions, /v1/chat/completions, /v1/models
    # /weights/*: in-memory weight updates; /update_weights_from_delta
    register_weight_routes(app, engine, lambda path: path_allowed(path, allowed),
                           PATH_NOT_ALLOWED)
    # SGLang's /init_weights_update_group + /update_weights_from_distributed (torch group)
    register_distributed_routes(app, engine)
    return app


# ---------------------------------------------------------------------- CLI
def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py", description="Serve an HF checkpoint with the areal-jax engine "
        "(SGLang protocol).")
    p.add_argument("--model-path", required=True,
                   help="HF checkpoint directory, or a Hugging Face hub id (org/name)")
    p.add_argument("--revision", default=None,
                   help="with a hub id: its branch, tag or commit (default: main)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-slots", type=int, default=16, help="requests decoded together")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context length per request (default min(model max, 2048))")
    p.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="float32")
    p.add_argument("--cache-dtype", choices=SUPPORTED_DTYPES, default=None)
    p.add_argument("--prefill-rows", type=int, default=4, help="prompts per prefill call")
    p.add_argument("--decode-steps", type=int, default=8, help="tokens per slot per device call")
    p.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                   help="the engine's loop over the layers: scan (compile time independent "
                        "of depth), unrolled, or auto (scan on TPU, unrolled elsewhere)")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="split the slots over this many devices (on CPU: this many XLA CPU "
                        "devices, one core each); max-slots must be a multiple")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY'; visible in ps, so prefer the "
                        f"{API_KEY_ENV} environment variable or --api-key-file")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (surrounding whitespace stripped)")
    p.add_argument("--allowed-weight-dir", action="append", default=None, metavar="DIR",
                   help="/update_weights_from_disk may load from DIR and below (repeatable; "
                        "default: the --model-path directory only)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body accepted (default: 64 KiB + 16 bytes per token "
                        "of max-seq-len)")
    p.add_argument("--skip-weight-check", action="store_true",
                   help="swap in weight updates without checking dtypes and finiteness "
                        "(faster on huge models)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests without sampling_seed")
    p.add_argument("--weight-version", default="0", help="initial weight_version (a string)")
    p.add_argument("--warmup", action="store_true", help="compile all shapes at start-up")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache: restarts reuse compiled steps "
                        f"(default: ${ENV_VAR}, else {DEFAULT_DIR}; 'off' turns it off)")
    p.add_argument("--cpu-affinity", default=None,
                   help="comma-separated CPU ids to run on (set before JAX starts its threads)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down when this parent process dies, even by SIGKILL")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


# XLA's loop-invariant code motion hoists, out of the decode call's loop over its steps, a
# transposed copy and an fp32 conversion of the tied embedding (0.8 GB of temporaries per
# call at the 0.5B shape, page-faulted in on every call): on a CPU engine that costs more
# than it saves. Measured at the 0.5B shape, 4 slots, 4 steps per call: CPU time per decode
# call 1.33 -> 0.68 s, minor page faults 215k -> 5-13k, the same tokens.
# LLVM at -O1 instead of XLA's default -O2: the step programs' heavy work is matrix
# products in library calls either way, and -O2's extra passes only lengthen the compile.
# Measured on a quiet 2-core host, empty cache, median of 3: the demo engine's two programs
# before ready 3.1 -> 2.5 s (ready 5.3 -> 4.8 s), the long-tail config's 2.9 -> 2.6 s;
# decode call time alike at the demo (9.1 / 8.7 ms) and the 0.5B shape (0.98 / 0.96 s).
# (-O0 compiles a third faster again but decodes 1.6-2.5x slower.)
CPU_ENGINE_XLA_FLAGS = ("--xla_disable_hlo_passes=while-loop-invariant-code-motion",
                        "--xla_backend_optimization_level=1")


def cpu_only_host() -> bool:
    """JAX will run on the CPU here: JAX_PLATFORMS says cpu, or no GPU or TPU device node."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    accelerators = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd", "/dev/accel0",
                    "/dev/vfio/0")
    return not any(os.path.exists(p) for p in accelerators)


def apply_cpu_engine_xla_flags() -> None:
    """Adds CPU_ENGINE_XLA_FLAGS to XLA_FLAGS on a CPU-only host, before JAX starts its
    backend; a flag the user set (the same ``--name``) is kept as it is."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not cpu_only_host():
        return
    user = {f.split("=", 1)[0] for f in flags}
    extra = [f for f in CPU_ENGINE_XLA_FLAGS if f.split("=", 1)[0] not in user]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([*flags, *extra])


def skip_accelerator_plugins() -> bool:
    """Keeps JAX's accelerator plugins (jax-cuda, and any other PJRT plugin package) from
    initialising in a process that ``JAX_PLATFORMS`` limits to the CPU; call it before
    anything starts JAX's backend. Returns whether it applied (``JAX_PLATFORMS=cpu``).

    JAX imports every installed plugin package (the ``jax_plugins`` namespace and the
    ``jax_plugins`` entry points) and calls its ``initialize()`` when its first backend
    starts, whatever ``JAX_PLATFORMS`` says, although only the CPU backend is then used.
    The CUDA plugin's loads the CUDA libraries and its PJRT library: a CPU server on a
    host that has it (the planning host, CI, a GPU node's CPU engine) paid 0.29 GB of
    resident set (0.52 GB for a bare CPU process against 0.23 GB) and 0.08 s, and every
    weight update came on top. Here each plugin package's ``initialize`` is replaced by a
    no-op (the plugin protocol's own hook; no private JAX module is touched). Only for
    ``JAX_PLATFORMS=cpu`` (what ``launch_server`` gives a CPU engine): with no
    ``JAX_PLATFORMS`` a plugin may be the device the user meant."""
    import importlib
    import pkgutil
    from importlib.metadata import entry_points

    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").lower().split(",")]
    if [p for p in platforms if p] != ["cpu"]:
        return False
    names = {entry.value for entry in entry_points(group="jax_plugins")}
    try:
        import jax_plugins  # the namespace package plugins install into, if any
    except ImportError:
        pass
    else:
        names.update(info.name for info in pkgutil.iter_modules(jax_plugins.__path__,
                                                                 "jax_plugins."))
    for name in sorted(names):
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - JAX itself logs a plugin it cannot import
            continue
        if callable(getattr(module, "initialize", None)):
            setattr(module, "initialize", lambda: None)  # noqa: B010 - a module attribute
            logger.debug("JAX_PLATFORMS=cpu: JAX plugin %s not initialised", name)
    return True


def _apply_process_settings(cpu_affinity: str | None, parent_pid: int | None) -> None:
    if cpu_affinity:
        try:
            pin_process_to_cpus(int(c) for c in cpu_affinity.split(",") if c.strip())
        except ValueError as e:
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


def resolve_api_key(flag: str | None, key_file: str | None) -> str | None:
    """The key from --api-key, else --api-key-file, else $AREAL_JAX_API_KEY (None: no key)."""
    if flag is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key = open(key_file, encoding="utf-8").read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {key_file}: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {key_file} is empty")
        return key
    if flag is not None:
        if not flag:
            raise ValueError("--api-key is empty")
        return flag
    env = os.environ.get(API_KEY_ENV)
    if env is not None and not env.strip():  # as --api-key '': never serve open by accident
        raise ValueError(f"${API_KEY_ENV} is set but empty; set a key, or unset it to serve "
                         "without one")
    return env


def main(argv: list[str] | None = None) -> int:
    apply_cpu_engine_xla_flags()  # before anything starts JAX's backend
    skip_accelerator_plugins()
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _apply_process_settings(args.cpu_affinity, args.parent_pid)
        api_key = resolve_api_key(args.api_key, args.api_key_file)
        if not 1 <= args.port <= 65535:
            raise ValueError(f"--port must be in [1, 65535], got {args.port}")
        if len(args.weight_version) > MAX_WEIGHT_VERSION_CHARS:
            raise ValueError(f"--weight-version is {len(args.weight_version)} characters long; "
                             f"the limit is {MAX_WEIGHT_VERSION_CHARS}")
        if args.max_body_bytes is not None and args.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
        for d in args.allowed_weight_dir or []:
            if "://" not in d and not os.path.isdir(d):
                raise ValueError(f"--allowed-weight-dir {d} is not a directory")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.api_key is not None:
        logger.warning("--api-key is visible to every user in ps; prefer %s or --api-key-file",
                       API_KEY_ENV)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach the port can "
                       "generate and pause or update weights (set %s)", args.host, API_KEY_ENV)
    request_cpu_devices(args.data_parallel)  # CPU devices for the slot shards
    cache_dir = resolve_cache_dir(args.compilation_cache_dir)
    try:
        enable_compilation_cache(cache_dir)
    except OSError as e:
        print(f"error: --compilation-cache-dir {cache_dir} cannot be created ({e}); give a "
              "writable directory or 'off'", file=sys.stderr)
        return 2
    try:
        try:  # a Hugging Face hub id (org/name): its snapshot in the hub cache
            args.model_path = local_model_dir(args.model_path, args.revision, "--model-path")
        except HubError as e:
            raise ModelPathError(str(e)) from None
        if is_sequence_classifier(args.model_path):  # a reward model: /classify, no engine
            return serve_reward_model(args.model_path, args.host, args.port, args.dtype, api_key)
        config = EngineConfig(
            model_path=args.model_path, max_slots=args.max_slots, max_seq_len=args.max_seq_len,
            dtype=args.dtype, cache_dtype=args.cache_dtype, prefill_rows=args.prefill_rows,
            decode_steps=args.decode_steps, data_parallel=args.data_parallel, seed=args.seed,
            weight_version=args.weight_version, warmup=args.warmup,
            layer_loop=args.layer_loop,
            check_weights=not args.skip_weight_check)
        engine = GenerationEngine(config)
    except (ModelPathError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The model's own directory as given (a gs:// URL stays one) and its local copy.
    allowed = [args.model_path, engine.model_path, *(args.allowed_weight_dir or [])]
    app = create_app(engine, api_key=api_key, allowed_weight_dirs=allowed,
                     max_body_bytes=args.max_body_bytes)
    # The model, JAX and the libraries are long-lived: moved out of the collector's view,
    # a full collection under load walks only what the requests allocate.
    gc.collect()
    gc.freeze()
    logger.info("serving %s on http://%s:%d (weight_version %s, %d compilations so far)",
                args.model_path, args.host, args.port, engine.weight_version,
                engine.num_compilations)
    logger.info("%s", engine.startup_line())  # the start-up breakdown, one line
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
