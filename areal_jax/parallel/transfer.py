"""Process 0 -> every process: each process's own bytes, through the job's board.

    own = scatter_from_main("batch/7", {0: b"...", 1: b"..."})   # on process 0
    own = scatter_from_main("batch/7")                           # on every other process

Process 0 posts each other process's payload on the job's board
(:mod:`areal_jax.parallel.board`, a small TCP store process 0 serves); each process waits
there for its own key (as long as it takes, outside any collective), takes it and deletes
it. Each payload crosses the network once, from process 0 to its process, and nothing
else does. No JAX collective is involved: an earlier form moved the rows with one
``ppermute`` per batch over a mesh of one device per process, but every new payload size
compiled a program on every process on the batch's critical path, and a process that
reached the learner's first collective more than 30 s after another (gloo's context
set-up limit) under a loaded host failed the job; the rows are a few MB per process per
batch, which a loopback or datacenter TCP connection moves in well under the step time.
"""

from __future__ import annotations

import base64

import jax

_PREFIX = "areal_jax/scatter"


def _board():
    from areal_jax.parallel.distributed import board_client

    return board_client()


def scatter_from_main(key: str, payloads: dict[int, bytes] | None = None, *,
                      end: bool = False) -> bytes | None:
    """Process 0's ``payloads[p]`` on process ``p`` (b"" for a process not in it).

    Every process calls it with the same ``key`` (a fresh one per call), process 0 with
    ``payloads`` (or ``end=True``: every process gets None, e.g. the stream ended).
    """
    me, n = jax.process_index(), jax.process_count()
    board = _board()
    if me == 0:
        for p in range(1, n):
            value = "E" if end else "D" + base64.b64encode(
                (payloads or {}).get(p, b"")).decode("ascii")
            board.key_value_set(f"{_PREFIX}/{key}/{p}", value, allow_overwrite=True)
        return None if end else (payloads or {}).get(0, b"")
    own_key = f"{_PREFIX}/{key}/{me}"
    value = board.wait_key(own_key)
    board.key_value_delete(own_key)
    if value.startswith("E"):
        return None
    return base64.b64decode(value[1:])
