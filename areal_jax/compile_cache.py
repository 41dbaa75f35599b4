"""JAX's persistent compilation cache, as the trainer and the embedded servers use it.

    enable_compilation_cache("~/.cache/areal_jax/jax_compilation_cache")

Call it before the process compiles anything it should cache. A second process with the
same shapes, config and JAX version then loads each executable from the directory instead
of compiling it. Several processes may share one directory at once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

# Least-recently-used entries beyond this are evicted. Setting a limit also makes JAX lock
# the directory while it reads or writes an entry, so concurrent processes (a trainer and
# its servers, parallel runs) never read a half-written one.
MAX_BYTES = 4 * 1024**3


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
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    with contextlib.suppress(ImportError, AttributeError):
        # Compilations earlier in this process may have found the cache off; look again.
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    return str(directory)
