"""Process 0 -> every process: each process's own bytes, in one collective.

    own = scatter_from_main("batch/7", {0: b"...", 1: b"..."})   # on process 0
    own = scatter_from_main("batch/7")                           # on every other process

Process 0 posts the payload lengths on the job's board (:mod:`areal_jax.parallel.board`);
the others wait there (as long as it takes, outside any collective), then every process
joins one jitted program over a mesh of one device per process, in which process 0's block
holds every payload (padded to one size) and one ``ppermute`` per process hands it its
own. Each payload crosses the network once, from process 0 straight to its process, and
nothing else does. Public JAX API only (``make_array_from_process_local_data``,
``shard_map``, ``lax.ppermute``).
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np

_PREFIX = "areal_jax/scatter"


def _bucket(n: int) -> int:
    """``n`` rounded up to 1/8 of its power of two (at least 4 KiB): a new size compiles a
    new program, so sizes are few; the padding is at most 12.5%."""
    if n <= 4096:
        return 4096
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


@functools.lru_cache(maxsize=1)
def _process_mesh() -> jax.sharding.Mesh:
    """One device per process (its lowest id), in process order."""
    firsts: dict[int, jax.Device] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        firsts.setdefault(d.process_index, d)
    return jax.sharding.Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))


@functools.cache
def _scatter(mesh: jax.sharding.Mesh):
    """[sender, receiver, L] split over senders -> [1, L] per process: process 0's block for
    it. One ``ppermute`` 0 -> p per other process, so only process 0's bytes travel (an
    ``all_to_all`` would also send every process's zeros to every other)."""
    n = mesh.devices.size

    def body(x):  # x: this process's block [1, n, L]
        me = jax.lax.axis_index("process")
        out = x[:, 0]  # process 0's own payload (zeros elsewhere)
        for p in range(1, n):
            got = jax.lax.ppermute(x[:, p], "process", perm=[(0, p)])
            out = jax.numpy.where(me == p, got, out)
        return out

    spec = jax.sharding.PartitionSpec("process")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


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
    header_key = f"{_PREFIX}/{key}"
    if me == 0:
        lengths = [0] * n if end else [len((payloads or {}).get(p, b"")) for p in range(n)]
        header = {"lengths": lengths, "end": bool(end)}
        board.key_value_set(header_key, json.dumps(header), allow_overwrite=True)
    else:
        header = json.loads(board.wait_key(header_key))
    if header["end"]:
        return None
    lengths = header["lengths"]
    size = _bucket(max(lengths))
    local = np.zeros((1, n, size), np.uint8)
    if me == 0:
        for p, data in (payloads or {}).items():
            local[0, p, :len(data)] = np.frombuffer(data, np.uint8)
    mesh = _process_mesh()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process"))
    blocks = jax.make_array_from_process_local_data(sharding, local, (n, n, size))
    own = np.asarray(_scatter(mesh)(blocks).addressable_shards[0].data)  # [1, size]
    if me == 0:  # every process has read the header: it joined this collective
        board.key_value_delete(header_key)
    return own[0, :lengths[me]].tobytes()
