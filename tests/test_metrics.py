"""metrics.jsonl: what the MetricsWriter writes is strict JSON."""

from __future__ import annotations

import json
import math

from areal_jax.metrics import MetricsWriter, read_rows


def _strict(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_written_as_null(tmp_path):
    """A NaN loss or an infinite ratio was written as a bare NaN / Infinity, which strict
    JSON readers (jq, pandas' ujson, browsers) refuse: they are null, finite values stay."""
    writer = MetricsWriter(tmp_path, total=2, initial=0, progress_bar=False)
    try:
        writer.log({"version": 1, "loss": float("nan"), "ratio": float("inf"),
                    "neg": -math.inf, "reward_mean": 0.25, "hist": [1.0, float("nan")],
                    "nested": {"x": float("-inf"), "y": 2}})
    finally:
        writer.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    row = _strict(line)
    assert row["loss"] is None and row["ratio"] is None and row["neg"] is None
    assert row["hist"] == [1.0, None] and row["nested"] == {"x": None, "y": 2}
    assert row["reward_mean"] == 0.25 and row["version"] == 1
    assert read_rows(tmp_path / "metrics.jsonl") == [row]


def test_process_start_is_the_interpreter_s_not_its_launching_shell_s(tmp_path):
    """The run summary's "done in" and the start-up timings count from the trainer's own
    start: launched through ``bash -c "sleep 2; exec python ..."`` the process was created
    by the shell 2 s earlier (psutil's create_time), and that is not the trainer's time."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    probe = ("import sys, psutil; sys.path.insert(0, 'scripts'); import train; "
             "from areal_jax.run import process_start_time; "
             "print(psutil.Process().create_time(), process_start_time())")
    res = subprocess.run(["bash", "-c", f'sleep 2; exec "{sys.executable}" -c "{probe}"'],
                         cwd=repo, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in __import__("os").environ.items()
                              if k != "AREAL_JAX_PROCESS_START"})
    assert res.returncode == 0, res.stderr[-2000:]
    created, start = map(float, res.stdout.split())
    # After the shell's 2 s sleep (create_time is rounded to clock ticks: 1.9 s)
    assert start >= created + 1.9
