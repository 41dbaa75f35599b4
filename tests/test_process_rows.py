"""Process 0 -> each process's rows: the job's board (TCP, process 0), on public JAX API
only. The two-process tests run real JAX processes (gloo, 127.0.0.1)
through ``python -m areal_jax.bench process-rows``'s workers."""

from __future__ import annotations

import argparse
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from areal_jax.parallel.board import BoardClient, BoardError, BoardServer

ROOT = Path(__file__).resolve().parent.parent


def test_no_private_jax_api_in_the_package():
    # jax._src moves between JAX releases; areal_jax and model_defs use only public (jax,
    # jax.experimental, jax.extend) modules.
    private = re.compile(r"jax\._src|from\s+jax\s+import\s+[^\n]*\b_src\b")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for package in ("areal_jax", "model_defs")
             for path in sorted((ROOT / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert not found, "private JAX API in the package:\n" + "\n".join(found)


@pytest.fixture
def board():
    server = BoardServer("127.0.0.1")
    yield server, BoardClient("127.0.0.1", server.port, timeout_s=20)
    server.close()


def test_board_set_get_dir_delete(board):
    _, client = board
    client.key_value_set("a/x/1", "one")
    client.key_value_set("a/x/2", "two")
    client.key_value_set("a/y", "why")
    with pytest.raises(BoardError, match="already set"):
        client.key_value_set("a/x/1", "again")
    client.key_value_set("a/x/1", "uno", allow_overwrite=True)
    assert client.key_value_try_get("a/x/1") == "uno"
    assert client.key_value_try_get("missing") is None
    assert client.key_value_dir_get("a/x/") == [("a/x/1", "uno"), ("a/x/2", "two")]
    client.key_value_delete("a/x/")
    assert client.key_value_dir_get("a/") == [("a/y", "why")]
    assert client.wait_key("never", timeout_s=0.2) is None


def test_board_wait_does_not_hold_up_other_threads(board):
    # The JobGuard beats from its own thread while the main thread waits for a batch: the
    # wait must not delay the beat (each thread has its own connection).
    server, client = board
    got: list[str | None] = []
    waiter = threading.Thread(target=lambda: got.append(client.wait_key("batch/0")))
    waiter.start()
    for i in range(20):  # answered while the waiter is parked on the server
        client.key_value_set("guard/alive/0", str(i), allow_overwrite=True)
        assert client.key_value_dir_get("guard/") == [("guard/alive/0", str(i))]
    assert waiter.is_alive() and not got
    BoardClient("127.0.0.1", server.port).key_value_set("batch/0", "ready")
    waiter.join(timeout=20)
    assert got == ["ready"]


def test_board_gone_is_an_error_not_a_hang():
    server = BoardServer("127.0.0.1")
    port = server.port
    server.close()
    with pytest.raises(OSError):
        BoardClient("127.0.0.1", port, timeout_s=5).key_value_dir_get("guard/")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_board_serves_ipv4_and_ipv6_hosts(host):
    import errno
    import socket

    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    if host == "127.0.0.1":  # every test machine has it: a bind error here is a failure
        server = BoardServer(host)
    else:
        try:
            server = BoardServer(host)
        except OSError as e:  # IPv6 built in but ::1 not configured (some containers)
            if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise
            pytest.skip(f"cannot listen on {host}: {e}")
    try:
        client = BoardClient(host, server.port, timeout_s=5)
        client.key_value_set("k", "v")
        assert client.key_value_try_get("k") == "v"
    finally:
        server.close()


def test_synthetic_batch_has_the_learner_dtypes():
    from areal_jax.bench.process_rows import synthetic_batch
    from areal_jax.learner.packing import PACKED_FIELDS

    batch = synthetic_batch(3, samples=8, tokens=5, seq_len=8, rows_per_micro_batch=4)
    assert len(batch.micro_batches) == 2
    for mb in batch.micro_batches:
        assert {k: v.dtype for k, v in mb.arrays().items()} == {
            k: np.dtype(t) for k, t in PACKED_FIELDS.items()}
        assert mb.shape == (4, 8) and int(mb.loss_mask.sum()) == 4 * 5


def _bench_args(**kw) -> argparse.Namespace:
    args = dict(processes=2, samples=16, tokens=40, seq_len=48, rows_per_micro_batch=4,
                batches=3, baseline_repo=None, timeout=300.0, first_delay_s=0.0)
    return argparse.Namespace(**{**args, **kw})


def _expected_digests(args: argparse.Namespace) -> list[list[str]]:
    """What each process must receive: its block of every micro-batch's rows (mesh data=N)."""
    from areal_jax.bench.process_rows import rows_digest, synthetic_batch
    from areal_jax.learner.packing import PackedBatch

    n = args.processes
    block = args.rows_per_micro_batch // n
    out: list[list[str]] = [[] for _ in range(n)]
    for i in range(args.batches):
        batch = synthetic_batch(i, args.samples, args.tokens, args.seq_len,
                                args.rows_per_micro_batch)
        for pid in range(n):
            rows = slice(pid * block, (pid + 1) * block)
            out[pid].append(rows_digest([
                PackedBatch(**{k: v[rows] for k, v in mb.arrays().items()},
                            minibatch_id=mb.minibatch_id, n_shards=mb.n_shards,
                            minibatch_loss_tokens=mb.minibatch_loss_tokens)
                for mb in batch.micro_batches]))
    return out


@pytest.mark.parametrize("processes", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_processes_each_get_their_own_rows(tmp_path, processes):
    from areal_jax.bench.process_rows import run_workers

    args = _bench_args(processes=processes, samples=6 * processes,
                       rows_per_micro_batch=2 * processes)
    reports = run_workers(args, None, tmp_path)
    # Every batch arrives, and the stream's end reaches every process (its loop stopped).
    assert [len(r["times_s"]) for r in reports] == [args.batches] * processes
    assert [r["digests"] for r in reports] == _expected_digests(args)


@pytest.mark.slow
def test_a_process_waits_longer_than_a_collective_would_for_the_first_batch(tmp_path):
    # Process 0 takes 40 s for its first batch (generation): process 1 waits on the board,
    # not inside a collective (a first gloo collective gives up after 30 s).
    from areal_jax.bench.process_rows import run_workers

    args = _bench_args(first_delay_s=40.0, batches=2)
    t0 = time.monotonic()
    reports = run_workers(args, None, tmp_path)
    assert time.monotonic() - t0 >= 40.0
    assert [r["digests"] for r in reports] == _expected_digests(args)
