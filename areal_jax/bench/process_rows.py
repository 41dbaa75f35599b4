"""Seconds to hand each process its rows of one training batch (several JAX processes).

Starts ``--processes`` JAX processes on this machine (CPU, gloo collectives, 127.0.0.1),
one device each, mesh ``data=N``. Process 0 holds ``--batches`` synthetic batches of
``--samples`` rows x ``--seq-len`` tokens (``--tokens`` of them real; the default is a
GSM8K-sized batch, 512 x 1,500), packed ``--rows-per-micro-batch`` rows to a micro-batch,
and the processes pull them through ``ProcessRowsDataset``, as the trainer does. A batch's
time is, after a barrier, the slowest process's ``next()``; the table shows the median over
the batches after the first (which compiles). ``--baseline-repo`` runs the same workers on
another checkout (e.g. one before a change) side by side, for the ratio.

    python -m areal_jax.bench process-rows [--baseline-repo ../areal-jax-old]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Run as a script (a worker), this file's folder is not a package root: drop it from the path
# so that its siblings (train.py, memory.py, ...) shadow nothing.
if __name__ == "__main__":
    sys.path.pop(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--samples", type=int, default=512, help="rows (one sample each) per batch")
    p.add_argument("--tokens", type=int, default=1500, help="real tokens per row")
    p.add_argument("--seq-len", type=int, default=1536)
    p.add_argument("--rows-per-micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--first-delay-s", type=float, default=0.0,
                   help="process 0 waits this long before its first batch (as if generating), "
                        "while the others wait for it")
    p.add_argument("--baseline-repo", default=None,
                   help="another checkout whose areal_jax runs the same workers, for the ratio")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per set of workers")


# ----------------------------------------------------------------------------- the data
def synthetic_batch(index: int, samples: int, tokens: int, seq_len: int,
                    rows_per_micro_batch: int) -> Any:
    """A TrainBatch of ``samples`` rows (``tokens`` real tokens each), deterministic in
    ``index``."""
    import numpy as np

    from areal_jax.data.trajectories import TrainBatch
    from areal_jax.learner.packing import PackedBatch

    if samples % rows_per_micro_batch:
        raise ValueError(f"--samples ({samples}) must be a multiple of --rows-per-micro-batch "
                         f"({rows_per_micro_batch})")
    if not 0 < tokens <= seq_len:
        raise ValueError(f"--tokens ({tokens}) must be in [1, --seq-len ({seq_len})]")
    rng = np.random.default_rng(index)
    shape = (rows_per_micro_batch, seq_len)
    real = np.zeros(shape, np.int32)
    real[:, :tokens] = 1
    mbs = []
    for _ in range(samples // rows_per_micro_batch):
        mbs.append(PackedBatch(
            input_ids=rng.integers(0, 150_000, shape, dtype=np.int32) * real,
            positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape) * real,
            segment_ids=real.copy(), loss_mask=real.copy(),
            behav_logp=(-rng.random(shape, dtype=np.float32) * real).astype(np.float32),
            advantages=(rng.standard_normal(shape, dtype=np.float32) * real).astype(np.float32),
            versions=np.full(shape, index, np.int32) * real,
            minibatch_loss_tokens=samples * tokens, n_shards=1))
    return TrainBatch(mbs, [], index, {"n_trajectories": float(samples)})


def rows_digest(micro_batches: list[Any]) -> str:
    """sha256 of every array of every micro-batch, in order."""
    h = hashlib.sha256()
    for mb in micro_batches:
        for key, value in sorted(mb.arrays().items()):
            h.update(key.encode())
            h.update(value.tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- one process
def worker(argv: list[str]) -> None:
    pid, n, port, out = int(argv[0]), int(argv[1]), argv[2], argv[3]
    samples, tokens, seq_len, rpm, batches = (int(x) for x in argv[4:9])
    first_delay_s = float(argv[9])
    import time

    from areal_jax.parallel import initialize_distributed

    assert initialize_distributed(f"127.0.0.1:{port}", n, pid, initialization_timeout_s=120)
    import jax
    from jax.experimental import multihost_utils

    from areal_jax.data.trajectories import ProcessRowsDataset
    from areal_jax.parallel import make_mesh

    source = ([synthetic_batch(i, samples, tokens, seq_len, rpm) for i in range(batches)]
              if pid == 0 else None)
    it = iter(ProcessRowsDataset(source, make_mesh(f"data={n}")))
    times, digests = [], []
    while True:
        multihost_utils.sync_global_devices("areal_jax bench process-rows")
        if pid == 0 and not times and first_delay_s:
            time.sleep(first_delay_s)
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - t0)
        digests.append(rows_digest(batch.micro_batches))
    Path(out).write_text(json.dumps({"process": pid, "times_s": times, "digests": digests,
                                     "devices": jax.device_count()}))


# ----------------------------------------------------------------------------- the parent
def run_workers(args: argparse.Namespace, repo: Path | None, tmp: Path) -> list[dict[str, Any]]:
    """Starts the workers (``repo``'s areal_jax, else this one); each one's JSON report."""
    import socket

    # Here, not at the top: a worker runs this file with another checkout's areal_jax.
    from areal_jax.bench.common import kill_all

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    if repo is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
    procs, outs = [], []
    for pid in range(args.processes):
        out = tmp / f"{'baseline' if repo else 'this'}.{pid}.json"
        outs.append(out)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(pid),
               str(args.processes), str(port), str(out), str(args.samples), str(args.tokens),
               str(args.seq_len), str(args.rows_per_micro_batch), str(args.batches),
               str(args.first_delay_s)]
        log = (tmp / f"{out.stem}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(args.timeout) for p in procs]
    finally:
        kill_all(procs)
    for pid, code in enumerate(codes):
        if code != 0:
            log = (tmp / f"{outs[pid].stem}.log").read_text()[-3000:]
            raise RuntimeError(f"process-rows worker {pid} ({repo or 'this checkout'}) "
                               f"exited {code}:\n{log}")
    return [json.loads(o.read_text()) for o in outs]


def summarise(reports: list[dict[str, Any]]) -> dict[str, Any]:
    per_batch = [max(r["times_s"][i] for r in reports) for i in range(len(reports[0]["times_s"]))]
    steady = per_batch[1:] or per_batch
    return {"s_per_batch": statistics.median(steady), "first_batch_s": per_batch[0],
            "per_batch_s": per_batch, "digests": [r["digests"] for r in reports]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    mb = args.samples * args.seq_len * 7 * 4 / 1e6  # seven 4-byte arrays per token slot
    systems: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="areal-bench-rows-") as tmp:
        systems["this checkout"] = summarise(run_workers(args, None, Path(tmp)))
        if args.baseline_repo:
            base = Path(args.baseline_repo).resolve()
            if not (base / "areal_jax").is_dir():
                raise SystemExit(f"error: --baseline-repo {args.baseline_repo}: no areal_jax/ "
                                 "there; give a checkout of this project")
            systems["baseline"] = summarise(run_workers(args, base, Path(tmp)))
    rows = [[name, round(s["s_per_batch"], 4), round(s["first_batch_s"], 3),
             round(mb / s["s_per_batch"], 1)] for name, s in systems.items()]
    summary: dict[str, Any] = {"processes": args.processes, "batch_mb": round(mb, 1),
                               "s_per_batch": round(systems["this checkout"]["s_per_batch"], 4)}
    if "baseline" in systems:
        summary["baseline_s_per_batch"] = round(systems["baseline"]["s_per_batch"], 4)
        summary["baseline_over_this"] = round(
            systems["baseline"]["s_per_batch"] / systems["this checkout"]["s_per_batch"], 2)
        summary["same_rows"] = systems["baseline"]["digests"] == systems["this checkout"]["digests"]
    return {"title": f"process rows: {args.samples} x {args.tokens} tokens "
                     f"(seq_len {args.seq_len}) over {args.processes} processes",
            "columns": ["system", "s/batch (median)", "first batch s", "MB/s of batch"],
            "rows": rows, "summary": summary, "systems": systems}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
