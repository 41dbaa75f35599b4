"""scripts/plot.py on a synthetic metrics.jsonl: valid PNGs, skipped bad lines, named errors."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest

REPO = Path(__file__).resolve().parent.parent
PLOT = REPO / "scripts" / "plot.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("plot_script", PLOT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(run_dir: Path, n: int = 40) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(n):
        row = {"step": step, "version": step + 1, "reward_mean": 1 - math.exp(-step / 10),
               "tokens": 1000 * (step + 1), "step_time_s": 0.5 + 0.01 * step,
               "tokens_per_s": 2000.0 - step, "staleness_max": step % 3,
               "staleness_mean": (step % 3) / 2, "clip_frac": 0.1, "cap_frac": 0.01,
               "logp_mismatch": 1e-3, "mode": "async", "ok": True}
        if step % 10 == 0:
            row["eval_accuracy"] = step / n
        lines.append(json.dumps(row))
        if step == 5:
            lines.append("[1, 2, 3]")
    lines.append('{"step": 40, "version": 41, "reward_me')  # half-written last line
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_cli_writes_valid_pngs(tmp_path):
    run_dir = _write_run(tmp_path / "run")
    proc = subprocess.run([sys.executable, str(PLOT), str(run_dir)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = [Path(p) for p in proc.stdout.split()]
    names = sorted(p.name for p in printed)
    assert names == ["all_metrics.png", "clip_cap.png", "reward_vs_time.png",
                     "reward_vs_version.png", "staleness.png", "throughput.png"]
    for path in printed:
        assert path.parent == run_dir / "plots"
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = mpimg.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert "metrics.jsonl:7: a JSON list, not an object; skipped" in proc.stderr
    assert "metrics.jsonl:42: not valid JSON" in proc.stderr


def test_headline_selection_and_skips(tmp_path, plot):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": i, "loss": 1.0 / (i + 1), "grad_norm": 0.5} for i in range(5)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    messages: list[str] = []
    paths = plot.plot_run(run_dir, tmp_path / "out", log=messages.append)
    assert [p.name for p in paths] == ["all_metrics.png"]
    assert any("skipped reward_vs_version.png" in m for m in messages)
    assert any("skipped reward_vs_time.png: no time key" in m for m in messages)
    loaded, warnings = plot.load_metrics(run_dir / "metrics.jsonl")
    assert loaded == [{k: float(v) for k, v in r.items()} for r in rows] and warnings == []


def test_named_errors(tmp_path, plot, capsys):
    assert plot.main([str(tmp_path / "nope")]) == 2
    assert f"run dir {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    assert plot.main([str(tmp_path / "run")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "run" / "metrics.jsonl").write_text("not json\n\n")
    assert plot.main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:1: not valid JSON" in err and "has no valid rows" in err
