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


def _realistic_rows(n: int = 30) -> list[dict]:
    """A run's rows as the trainer writes them: an eval-at-start row without wall_time_s,
    throughput on very different scales, fractions that stay 0, mismatch keys that appear
    in scattered rows only, eval every 10 versions, an epoch ``time`` and 30+ keys (two
    all_metrics pages)."""
    rows = [{"version": 0, "step": 0, "eval_accuracy": 0.2, "time": 1.7e9}]
    for v in range(1, n + 1):
        row = {"version": v, "step": v, "reward_mean": 0.2 + 0.02 * v, "time": 1.7e9 + 3 * v,
               "wall_time_s": 3.0 * v - 1.5, "step_time_s": 0.9 + 0.01 * (v % 3),
               "tokens_per_s": 8000.0 + 10 * v, "clip_frac": 0.0, "cap_frac": 0.0,
               "behav_cap_frac": 0.0, "dual_clip_frac": 0.0, "logp_mismatch": 0.02 + 1e-3 * v,
               "staleness_mean": 0.5, "staleness_max": 1.0}
        if v % 7 == 0:  # a lag seen in a few versions only
            row["mismatch/lag2_abs_diff_mean"] = 0.01 * v
        row["mismatch/lag0_abs_diff_mean"] = 0.001 * v
        if v % 10 == 0:
            row["eval_accuracy"] = 0.2 + 0.02 * v
        row.update({f"train/extra_{i}": float(i * v) for i in range(20)})
        rows.append(row)
    return rows


def test_every_plot_shows_each_series_on_a_readable_scale(plot):
    """issue 50 item 18: each axis holds its data; series on one axis are of one scale
    (each reaches at least 1/25 of the axis' span: tokens/s ~8,000 and step time ~1 are
    on separate axes); no series that is 0 throughout lies flat under another; no line
    joins points of rows that are not neighbours; reward_vs_time's x is wall_time_s
    (the eval-at-start row placed by its time); all_metrics pages stay small."""
    rows = [{k: float(v) for k, v in r.items()} for r in _realistic_rows()]
    figs = plot.figures(rows, log=lambda m: None)
    assert {"throughput.png", "clip_cap.png", "mismatch.png", "reward_vs_time.png",
            "all_metrics.png", "all_metrics_2.png"} <= set(figs)
    row_x = [r["version"] for r in rows]
    for name, fig in figs.items():
        for ax in fig.axes:
            lines = list(ax.get_lines())
            if not lines:
                continue
            (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
            span = y1 - y0
            for ln in lines:
                xs = [float(a) for a in ln.get_xdata()]
                ys = [float(b) for b in ln.get_ydata()]
                pts = [(a, b) for a, b in zip(xs, ys, strict=True)
                       if math.isfinite(a) and math.isfinite(b)]
                assert pts, (name, ln.get_label())
                assert all(x0 <= a <= x1 and y0 <= b <= y1 for a, b in pts), (name,
                                                                               ln.get_label())
                if len(lines) > 1:
                    assert max(abs(b) for _, b in pts) >= span / 25, (name, ln.get_label())
                if ln.get_linestyle() not in ("None", "") and name != "reward_vs_time.png":
                    # consecutive drawn points are neighbouring rows (x = version here)
                    drawn = list(zip(xs, ys, strict=True))
                    for (a, b), (c, d) in zip(drawn, drawn[1:], strict=False):
                        if all(math.isfinite(v) for v in (a, b, c, d)):
                            assert row_x.index(c) - row_x.index(a) == 1, (name, a, c)
        w, h = fig.get_size_inches() * (80 if name.startswith("all_metrics") else 100)
        assert w <= 1400 and h <= 1400, (name, w, h)
    throughput = figs["throughput.png"]
    assert len([ax for ax in throughput.axes if ax.get_lines()]) == 2
    clip = figs["clip_cap.png"]
    assert [ln.get_label() for ax in clip.axes for ln in ax.get_lines()] == ["logp_mismatch"]
    assert "0 throughout: behav_cap_frac, cap_frac, clip_frac, dual_clip_frac" in " ".join(
        t.get_text() for t in clip.texts)
    (ax,) = [a for a in figs["reward_vs_time.png"].axes if a.get_lines()]
    evals = [ln for ln in ax.get_lines() if ln.get_label() == "eval_accuracy"][0]
    got = [(float(a), float(b)) for a, b in zip(evals.get_xdata(), evals.get_ydata(),
                                                strict=True) if math.isfinite(b)]
    # version 0 (no wall_time_s) at time - (time - wall_time_s) = -1.5; version 10 at 28.5
    assert got[:2] == [(-1.5, 0.2), (28.5, 0.4)]
    assert ax.get_xlabel() == "wall_time_s (s)"
    for fig in figs.values():
        plot.plt.close(fig)
