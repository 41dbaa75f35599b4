"""Start engine servers as subprocesses (tests, the trainer, benchmarks).

    with launch_server("ckpt_dir", max_slots=16) as server:
        client = RolloutClient([server.url])
        ...

Each server runs ``python -m areal_jax.engine.server`` in its own process group, so
``terminate()`` / ``kill()`` reach every process it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from areal_jax.engine.config import CPU_DEVICE_COUNT_FLAG
from areal_jax.interrupt import raise_if_interrupted

API_KEY_ENV = "AREAL_JAX_API_KEY"  # the server reads its key from here (see server.py)


class ServerStartError(RuntimeError):
    """The server process exited or never became healthy; the message has its log tail.
    ``index``: which of the servers started or waited for together it was."""

    index: int | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-n_chars:]


class ServerHandle:
    """A running engine server subprocess."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path,
                 api_key: str | None = None):
        self.process = process
        self.url = url
        self.log_path = log_path
        self.api_key = api_key
        self.started_at = time.monotonic()  # start-up timeouts count from here

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n_chars: int = 4000) -> str:
        return _tail(self.log_path, n_chars)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the server's process group at once (simulates a crashed server)."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def terminate(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds."""
        if not self.alive():
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def __repr__(self) -> str:
        return f"ServerHandle(url={self.url!r}, pid={self.pid}, alive={self.alive()})"


def jax_platform_name(platform: str, backends: Sequence[str] | None = None) -> str:
    """The ``JAX_PLATFORMS`` value that names ``platform`` alone. jax reports a CUDA or ROCm
    device as ``gpu``, but ``JAX_PLATFORMS=gpu`` means *cuda and rocm*, and a process
    without both plugins fails to start ("Unable to initialize backend 'rocm'"). So ``gpu``
    becomes the GPU backend this process runs (``backends``: its backend names, by default
    jax's), else the GPU plugin installed (CUDA unless only ROCm's is), else ``cuda``.
    Other names (and comma lists of them) are returned as they are."""
    names = [p.strip() for p in platform.split(",") if p.strip()]
    if "gpu" not in names:
        return platform
    if backends is None:
        import jax.extend.backend

        try:
            backends = list(jax.extend.backend.backends())
        except RuntimeError:  # no backend could start: fall through to the plugins
            backends = []
    gpu = next((b for b in backends if b in ("cuda", "rocm")), None)
    if gpu is None:
        plugins = _installed_jax_plugins()
        rocm_only = (any(p.startswith("xla_rocm") for p in plugins)
                     and not any(p.startswith("xla_cuda") for p in plugins))
        gpu = "rocm" if rocm_only else "cuda"
    return ",".join(gpu if n == "gpu" else n for n in names)


def _installed_jax_plugins() -> list[str]:
    """The names in jax's plugin namespace package (``xla_cuda13``, ``xla_rocm7``, ...)."""
    try:
        import jax_plugins
    except ImportError:
        return []
    names: list[str] = []
    for folder in getattr(jax_plugins, "__path__", []):
        with contextlib.suppress(OSError):
            names += os.listdir(folder)
    return names


def _child_env(jax_platforms: str | None, xla_cpu_threads: int | None,
               extra_env: dict[str, str] | None, api_key: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)  # the child serves with api_key only, not one inherited
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    # A fake multi-device host (tests set it for mesh tests) would split one server's CPU;
    # a server asks for its own devices with --data-parallel.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(CPU_DEVICE_COUNT_FLAG)]
    if xla_cpu_threads is not None:
        if xla_cpu_threads < 1:
            raise ValueError(f"xla_cpu_threads must be >= 1, got {xla_cpu_threads}")
        if xla_cpu_threads == 1:
            flags.append("--xla_cpu_multi_thread_eigen=false")
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(xla_cpu_threads)
    env["XLA_FLAGS"] = " ".join(flags)
    if jax_platforms is not None:
        env["JAX_PLATFORMS"] = jax_platform_name(jax_platforms)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if extra_env:
        env.update(extra_env)
    return env


def launch_server(
    model_path: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    max_slots: int = 16,
    max_seq_len: int | None = None,
    dtype: str = "float32",
    api_key: str | None = None,
    allowed_weight_dirs: Sequence[str | os.PathLike] | None = None,
    warmup: bool = False,
    extra_args: Sequence[str] = (),
    cpu_affinity: list[int] | None = None,
    xla_cpu_threads: int | None = None,
    jax_platforms: str | None = "cpu",
    env: dict[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    compilation_cache_dir: str | os.PathLike | None = "default",
    startup_timeout: float = 180.0,
    wait: bool = True,
    die_with_parent: bool = True,
) -> ServerHandle:
    """Starts an engine server and waits until ``/health`` answers 200.

    Args:
      port: None picks a free port.
      api_key: passed in the child's environment (``AREAL_JAX_API_KEY``), never on its
        command line, where every user could read it with ``ps``.
      allowed_weight_dirs: directories ``/update_weights_from_disk`` may load from, besides
        ``model_path`` itself (e.g. the run's publish directory).
      extra_args: more ``serve.py`` flags, e.g. ``["--decode-steps", "4"]``.
      cpu_affinity: CPU ids the server may run on (``os.sched_setaffinity`` at its start,
        before JAX starts); XLA sizes its CPU thread pool from this set.
      xla_cpu_threads: 1 turns off XLA's multi-threaded CPU kernels; any value also caps
        OpenMP/MKL threads. Use ``cpu_affinity`` to bound XLA's pool to N cores.
      jax_platforms: JAX_PLATFORMS for the child ("cpu" by default; None inherits).
      log_path: where stdout/stderr go (default: a temp file).
      wait: False returns at once; call ``wait_healthy([handle])`` later.
      compilation_cache_dir: JAX persistent compilation cache shared by servers that
        serve the same shapes (a restart or a second server then skips most compiling);
        ``"default"``: the server's default (``$AREAL_JAX_COMPILATION_CACHE_DIR``, else
        ``~/.cache/areal_jax/jax_compilation_cache``); None: off.
      die_with_parent: the server shuts down when the launching process dies (also by
        SIGKILL; it watches its parent pid), so a killed trainer leaves no orphan
        servers. Launching from a thread that later exits is fine.

    Raises:
      ServerStartError: the process exited during start-up or was not healthy in time
        (the message includes the tail of its log).
    """
    model_path = os.fspath(model_path)  # a local dir or a gs:// URL (the server downloads it)
    chosen_port = port if port is not None else free_port(host)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"areal-engine-{chosen_port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    cmd = [sys.executable, "-m", "areal_jax.engine.server", "--model-path", str(model_path),
           "--host", host, "--port", str(chosen_port), "--max-slots", str(max_slots),
           "--dtype", dtype]
    if max_seq_len is not None:
        cmd += ["--max-seq-len", str(max_seq_len)]
    for d in allowed_weight_dirs or ():
        cmd += ["--allowed-weight-dir", str(d)]
    if warmup:
        cmd.append("--warmup")
    if compilation_cache_dir is None:
        cmd += ["--compilation-cache-dir", "off"]
    elif compilation_cache_dir != "default":
        cmd += ["--compilation-cache-dir", os.fspath(compilation_cache_dir)]
    cmd += list(extra_args)

    # Affinity and the parent watch are set up by the server itself at start-up (no
    # preexec_fn: Python code between fork and exec can deadlock a threaded parent).
    if cpu_affinity:
        cmd += ["--cpu-affinity", ",".join(str(c) for c in cpu_affinity)]
    if die_with_parent:
        cmd += ["--parent-pid", str(os.getpid())]

    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_child_env(jax_platforms, xla_cpu_threads, env, api_key), start_new_session=True,
        )
    handle = ServerHandle(process, f"http://{host}:{chosen_port}", log_path, api_key)
    if wait:
        wait_healthy([handle], startup_timeout)
    return handle


def wait_healthy(handles: Sequence[ServerHandle], timeout: float = 180.0) -> None:
    """Waits until every server answers /health with 200, each within ``timeout`` seconds
    of its launch (not of this call: a caller that compiles its own programs first does
    not give the servers extra time, and a timeout shorter than any start-up fails
    whatever the caller did meanwhile). On failure kills them all and raises
    ServerStartError with the failing server's log tail (``index``: its position in
    ``handles``)."""
    pending = list(handles)
    with httpx.Client(timeout=5.0) as http:
        while pending:
            for handle in list(pending):
                headers = {"Authorization": f"Bearer {handle.api_key}"} if handle.api_key else {}
                problem = None
                if handle.process.poll() is not None:
                    problem = f"exited with code {handle.process.returncode} during start-up"
                else:
                    try:
                        if http.get(f"{handle.url}/health", headers=headers).status_code == 200:
                            pending.remove(handle)
                            continue
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > handle.started_at + timeout:
                        problem = f"was not healthy after {timeout}s"
                if problem:
                    for h in handles:
                        h.kill()
                    error = ServerStartError(
                        f"engine server {handle.url} {problem}; log {handle.log_path}:\n"
                        f"{handle.log_tail()}")
                    error.index = list(handles).index(handle)
                    raise error
            if pending:
                raise_if_interrupted()  # SIGINT/SIGTERM during a training run's start-up
                time.sleep(0.25)


def engine_startup(handle: ServerHandle) -> dict[str, float]:
    """A ready server's start-up breakdown, in seconds from its own process start
    (``/get_server_info``'s ``startup`` and ``programs``): ``engine_imports_s``,
    ``engine_load_s``, ``engine_compile_s`` (the programs before ready and the update
    probe), ``engine_ready_s`` and ``engine_compile_<program>_s`` each. Empty if the
    server does not report it (an older one, SGLang)."""
    headers = {"Authorization": f"Bearer {handle.api_key}"} if handle.api_key else {}
    try:
        info = httpx.get(f"{handle.url}/get_server_info", headers=headers, timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}
    out = {f"engine_{k}": float(v) for k, v in (info.get("startup") or {}).items()
           if k in ("imports_s", "load_s", "compile_s", "ready_s")}
    for name, program in (info.get("programs") or {}).items():
        out[f"engine_compile_{name}_s"] = float(program["compile_s"])
    return out


def launch_servers(model_path: str | os.PathLike, count: int, *, startup_timeout: float = 180.0,
                   wait: bool = True, log_dir: str | os.PathLike | None = None,
                   on_start: Callable[[ServerHandle], object] | None = None,
                   **kwargs: Any) -> list[ServerHandle]:  # Any: launch_server's keywords
    """Starts ``count`` servers in parallel (same arguments as ``launch_server``, each on
    its own free port, logging to ``log_dir/server{i}.log`` when given) and, with ``wait``,
    waits until all are healthy (else call ``wait_healthy`` later, e.g. after compiling
    something else meanwhile). ``on_start(handle)`` runs for each server as soon as its
    process exists (to register it for shutdown). A server that cannot be started raises
    ServerStartError with ``index`` set; the ones already started are terminated."""
    if "port" in kwargs or "log_path" in kwargs:
        raise ValueError("launch_servers picks ports and log files itself")
    handles: list[ServerHandle] = []
    for i in range(count):
        log_path = Path(log_dir) / f"server{i}.log" if log_dir is not None else None
        try:
            handle = launch_server(model_path, wait=False, log_path=log_path, **kwargs)
        except (ServerStartError, OSError) as e:
            for h in handles:
                h.terminate()
            error = ServerStartError(str(e))
            error.index = i
            raise error from e
        if on_start is not None:
            on_start(handle)
        handles.append(handle)
    if wait:
        wait_healthy(handles, startup_timeout)
    return handles
