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
