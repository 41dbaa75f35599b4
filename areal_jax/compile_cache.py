"""JAX's persistent compilation cache, as the trainer, ``serve.py``, ``eval.py`` and the
embedded servers use it: on by default, in ``DEFAULT_DIR``.

    enable_compilation_cache(resolve_cache_dir(flag))  # None: $AREAL_JAX_COMPILATION_CACHE_DIR

Call it before the process compiles anything it should cache. A second process with the
same shapes, config and JAX version then loads each executable from the directory instead
of compiling it. Several processes may share one directory at once. ``cache_stats()``
counts this process's lookups, hits and writes (``/get_server_info`` reports them).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

DEFAULT_DIR = "~/.cache/areal_jax/jax_compilation_cache"
# Overrides DEFAULT_DIR for every process that takes the default (serve.py, eval.py,
# launch_server's servers); "off" (or "", "none", "null") turns the cache off.
ENV_VAR = "AREAL_JAX_COMPILATION_CACHE_DIR"
OFF_VALUES = ("", "off", "none", "null")

# Least-recently-used entries beyond this are evicted. Setting a limit also makes JAX lock
# the directory while it reads or writes an entry, so concurrent processes (a trainer and
# its servers, parallel runs) never read a half-written one.
MAX_BYTES = 4 * 1024**3


def resolve_cache_dir(value: str | os.PathLike | None) -> str | None:
    """The cache directory a command's ``--compilation-cache-dir`` value asks for: None (the
    flag not given) is ``$AREAL_JAX_COMPILATION_CACHE_DIR`` if set, else ``DEFAULT_DIR``;
    an off value (``off``, ``none``, ``null``, ``""``) is None (no cache)."""
    if value is None:
        value = os.environ.get(ENV_VAR, DEFAULT_DIR)
    value = os.fspath(value)
    return None if value.strip().lower() in OFF_VALUES else value


_counts = {"requests": 0, "hits": 0, "writes": 0}
_counts_lock = threading.Lock()
_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
           "/jax/compilation_cache/cache_hits": "hits",
           "/jax/compilation_cache/cache_misses": "writes"}  # JAX records a miss as it writes
_listening = False


def _on_event(event: str, **kwargs: Any) -> None:
    key = _EVENTS.get(event)
    if key is not None:
        with _counts_lock:
            _counts[key] += 1


def _listen() -> None:
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_listener(_on_event)
        _listening = True


def cache_stats() -> dict[str, Any]:
    """This process's persistent-cache traffic since it turned the cache on: ``dir`` (None:
    off), ``requests`` (compiles that looked the cache up), ``hits`` (executables loaded
    from it) and ``writes`` (compiled and stored: the misses)."""
    import jax

    with _counts_lock:
        counts = dict(_counts)
    directory = getattr(jax.config, "jax_compilation_cache_dir")  # noqa: B009 - no stub
    return {"dir": directory or None, **counts}


def enable_compilation_cache(path: str | Path | None) -> str | None:
    """Turns the cache on in this process at ``path`` (``~`` expanded, created if missing);
    None or "" leaves it off. Every compilation is cached, however short. Returns the
    directory used (to hand to child processes). Raises OSError if it cannot be created.
    """
    if not path:
        return None
    import jax

    directory = Path(path).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    _listen()
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    with contextlib.suppress(ImportError, AttributeError):
        # Compilations earlier in this process may have found the cache off; look again.
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    return str(directory)
