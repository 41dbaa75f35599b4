"""Plot the training curves of a run directory as PNG files.

    python scripts/plot.py RUN_DIR [--out DIR]      # RUN_DIR and DIR: local or gs://

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per learner step) and writes into
``DIR`` (default ``RUN_DIR/plots``):

* ``reward_vs_version.png``  reward_mean / eval_accuracy against the weight version;
* ``reward_vs_time.png``     the same against wall-clock time;
* ``staleness.png``          staleness_* keys (versions behind) against the version;
* ``clip_cap.png``           clip / cap / correction fractions and logp_mismatch;
* ``mismatch.png``           rollout-training mismatch per lag: mismatch/lag*_abs_diff_mean
                             and _max (lag 0 is mismatch apart from staleness);
* ``mismatch_kl.png``        its k3 KL estimates, mismatch/lag*_kl;
* ``throughput.png``         *_per_s keys and step_time_s;
* ``all_metrics.png``        every numeric key, one small panel each, 24 panels a page
                             (``all_metrics_2.png``, ... for more).

Each series is drawn on a readable scale: the series of a plot share an axis only when
their magnitudes are within a factor of 10 (step time and tokens/s get a panel each);
series that are 0 throughout are named under the plot instead of drawn as flat lines; a
line is broken where rows lack its key, so scattered points are never joined across
the gap (sparse series, e.g. eval every N versions, are drawn as points).

A headline plot is skipped (and said so) when none of its keys is in the file. Lines
that are not JSON objects (e.g. a half-written last line) are skipped with a warning.
Wall time is the first present of ``wall_time_s``, ``elapsed_s``, ``time_s``,
``timestamp``/``time`` (made relative to the first row); rows without ``wall_time_s`` but
with ``time`` (the eval at start's) are placed on it by the two keys' offset. Failing
those, the running sum of ``step_time_s`` (learner time only, labelled so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

METRICS_FILE = "metrics.jsonl"
X_KEYS = ("version", "step")
TIME_KEYS = ("wall_time_s", "elapsed_s", "time_s", "timestamp", "time")
REWARD_KEYS = ("reward_mean", "eval_accuracy", "reward", "accuracy")


class PlotError(RuntimeError):
    """A run dir or metrics file that cannot be plotted."""


def load_metrics(path: Path) -> tuple[list[dict[str, float]], list[str]]:
    """Numeric fields of each valid row, and one warning per skipped line."""
    rows: list[dict[str, float]] = []
    warnings: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                warnings.append(f"{path}:{lineno}: not valid JSON ({e.msg}); skipped")
                continue
            if not isinstance(obj, dict):
                warnings.append(f"{path}:{lineno}: a JSON {type(obj).__name__}, not an object; "
                                f"skipped")
                continue
            rows.append({k: float(v) for k, v in obj.items()
                         if isinstance(v, int | float) and not isinstance(v, bool)})
    return rows, warnings


SCALE_RATIO = 10.0  # series whose magnitudes differ by more do not share an axis
PANELS_PER_PAGE = 24  # all_metrics: 4 x 6 panels a page (about 1000 x 860 pixels)
ABSOLUTE_TIME_KEYS = ("time", "timestamp")  # seconds since the epoch: not plotted as metrics


def _series(rows: list[dict[str, float]], x: list[float], key: str) -> tuple[list, list]:
    """(x, y) over every row, NaN where the row has no finite value or no x: the line breaks
    there, so points of rows far apart are never joined by one long segment."""
    xs, ys = [], []
    for xv, row in zip(x, rows, strict=True):
        y = row.get(key)
        ok = y is not None and math.isfinite(y) and math.isfinite(xv)
        xs.append(xv if math.isfinite(xv) else math.nan)
        ys.append(y if ok else math.nan)
    return xs, ys


def _magnitude(rows: list[dict[str, float]], key: str) -> float | None:
    """The largest |value| of ``key`` (None: no finite value)."""
    ys = [abs(r[key]) for r in rows if key in r and math.isfinite(r[key])]
    return max(ys) if ys else None


def scale_groups(rows: list[dict[str, float]], keys: list[str]
                 ) -> tuple[list[list[str]], list[str]]:
    """Series grouped onto axes of one scale each, and the series that are 0 throughout.

    Sorted by magnitude (largest |value|), a series joins the current group while its
    magnitude is at least 1/SCALE_RATIO of the group's largest, else it starts the next
    group: step time (~1 s) and tokens/s (~8,000) get an axis each, and neither is a flat
    line at 0. Series that are 0 everywhere are left out (named under the plot) unless
    every series is."""
    mags = {k: m for k in keys if (m := _magnitude(rows, k)) is not None}
    zeros = [k for k in keys if mags.get(k) == 0.0]
    groups: list[list[str]] = []
    for k in sorted((k for k in mags if mags[k] > 0), key=lambda k: -mags[k]):
        if groups and mags[k] * SCALE_RATIO >= mags[groups[-1][0]]:
            groups[-1].append(k)
        else:
            groups.append([k])
    if not groups and zeros:
        return [zeros], []
    return groups, zeros


def _draw(ax: Any, rows: list[dict[str, float]], x: list[float], key: str,
          label: str | None = None, markersize: float = 3) -> None:
    xs, ys = _series(rows, x, key)
    present = sum(1 for y in ys if not math.isnan(y))
    sparse = present < 0.5 * len(rows)  # e.g. eval every N versions: show the points
    ax.plot(xs, ys, marker="o" if sparse else None, markersize=markersize, label=label)
    try:
        ax.ticklabel_format(axis="both", useOffset=False)  # values as they are, no offset
    except AttributeError:  # a formatter that is not a ScalarFormatter
        pass


def line_figure(title: str, xlabel: str, x: list[float], rows: list[dict[str, float]],
                keys: list[str]) -> Any:
    """One panel per scale group (``scale_groups``), sharing the x axis."""
    groups, zeros = scale_groups(rows, keys)
    n = max(1, len(groups))
    fig, axes = plt.subplots(n, 1, sharex=True, figsize=(7, 1.2 + 2.4 * n), squeeze=False)
    for ax, group in zip(axes[:, 0], groups, strict=False):
        for key in group:
            _draw(ax, rows, x, key, label=key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0, 0].set_title(title)
    axes[-1, 0].set_xlabel(xlabel)
    if zeros:
        fig.text(0.01, 0.005, "0 throughout: " + ", ".join(zeros), fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.03 if zeros else 0, 1, 1))
    return fig


def grid_figures(xlabel: str, x: list[float], rows: list[dict[str, float]],
                 keys: list[str]) -> list[Any]:
    """Every key in its own small panel, PANELS_PER_PAGE panels a figure."""
    figures = []
    for start in range(0, len(keys), PANELS_PER_PAGE):
        page = keys[start:start + PANELS_PER_PAGE]
        ncols = min(4, len(page))
        nrows = math.ceil(len(page) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.4 * nrows),
                                 squeeze=False)
        for ax, key in zip(axes.flat, page, strict=False):
            _draw(ax, rows, x, key, markersize=2)
            ax.set_title(key, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(page):]:
            ax.axis("off")
        fig.supxlabel(xlabel, fontsize=9)
        fig.tight_layout()
        figures.append(fig)
    return figures


def _x_axis(rows: list[dict[str, float]]) -> tuple[str, list[float]]:
    for key in X_KEYS:
        if all(key in r for r in rows):
            return key, [r[key] for r in rows]
    return "row", [float(i) for i in range(len(rows))]


def time_axis(rows: list[dict[str, float]]) -> tuple[str, list[float]] | None:
    """The wall-time axis: the first of TIME_KEYS that any row has (NaN for rows without
    it; ``time``/``timestamp`` relative to the first row). A row without ``wall_time_s``
    (the eval at start's) but with ``time`` is placed by the offset between the two in the
    rows that have both, so its point lands on the wall_time_s axis too. Failing those,
    the running sum of ``step_time_s`` (learner time only, labelled so)."""
    for key in TIME_KEYS:
        if not any(key in r for r in rows):
            continue
        if key in ABSOLUTE_TIME_KEYS:
            t0 = next(r[key] for r in rows if key in r)
            return f"{key} (s)", [r[key] - t0 if key in r else math.nan for r in rows]
        offsets = sorted(r["time"] - r[key] for r in rows if key in r and "time" in r)
        offset = offsets[len(offsets) // 2] if offsets else None
        return f"{key} (s)", [r[key] if key in r else
                              (r["time"] - offset if offset is not None and "time" in r
                               else math.nan) for r in rows]
    if all("step_time_s" in r for r in rows):
        total, out = 0.0, []
        for r in rows:
            total += r["step_time_s"]
            out.append(total)
        return "cumulative step_time_s (learner only, s)", out
    return None


def figures(rows: list[dict[str, float]], log: Any = print,
            source: str = METRICS_FILE) -> dict[str, Any]:
    """Every plot of ``rows`` as a matplotlib figure, by file name (headline plots whose
    keys are absent are skipped, and said so through ``log``)."""
    present = sorted({k for r in rows for k in r})
    xlabel, x = _x_axis(rows)
    out: dict[str, Any] = {}

    def headline(name: str, title: str, keys: list[str],
                 axis: tuple[str, list[float]] | None = None) -> None:
        label, xs = axis or (xlabel, x)
        if keys:
            out[name] = line_figure(title, label, xs, rows, keys)
        else:
            log(f"skipped {name}: no matching keys in {source}")

    reward_keys = [k for k in REWARD_KEYS if k in present]
    headline("reward_vs_version.png", "Reward / accuracy", reward_keys)
    t_axis = time_axis(rows)
    if t_axis is None:
        log(f"skipped reward_vs_time.png: no time key ({', '.join(TIME_KEYS)}, step_time_s)")
    else:
        headline("reward_vs_time.png", "Reward / accuracy vs wall time", reward_keys, t_axis)
    headline("staleness.png", "Staleness (versions behind)",
             [k for k in present if k.startswith("staleness")])
    headline("clip_cap.png", "Clip / cap fractions, logp mismatch",
             [k for k in present if (("clip" in k or "cap" in k or "behav_" in k)
                                     and k.endswith("frac")) or k.startswith("logp_mismatch")])
    headline("mismatch.png", "Rollout-training mismatch |logp - behav_logp| by lag",
             [k for k in present if k.startswith("mismatch/") and "_abs_diff_" in k])
    headline("mismatch_kl.png", "Rollout-training mismatch, k3 KL(behav || pi) by lag",
             [k for k in present if k.startswith("mismatch/") and k.endswith("_kl")])
    headline("throughput.png", "Throughput",
             [k for k in present if k.endswith("_per_s") or k == "step_time_s"])
    grid_keys = [k for k in present if k not in X_KEYS and k not in ABSOLUTE_TIME_KEYS]
    for i, fig in enumerate(grid_figures(xlabel, x, rows, grid_keys)):
        out["all_metrics.png" if i == 0 else f"all_metrics_{i + 1}.png"] = fig
    return out


def _save(fig: Any, path: Path, dpi: int = 100) -> Path:
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None,
             log: Any = print) -> list[Path] | list[str]:
    """Writes the PNGs for ``run_dir`` and returns their paths.

    A ``gs://`` run dir (or ``out_dir``) is read (written) through ``areal_jax.storage``:
    metrics.jsonl is downloaded to a temp dir, the PNGs are drawn locally and uploaded.
    """
    from areal_jax import storage

    run_text = os.fspath(run_dir)
    try:
        if not storage.is_url(run_text) and (out_dir is None or not storage.is_url(out_dir)):
            return _plot_local(Path(run_text), Path(out_dir) if out_dir else None, log)
        metrics_url = storage.join(run_text, METRICS_FILE)
        if not storage.isdir(run_text):
            raise PlotError(f"run dir {run_text} does not exist")
        if not storage.isfile(metrics_url):
            raise PlotError(f"run dir {run_text} has no {METRICS_FILE}")
        out_text = os.fspath(out_dir) if out_dir is not None else storage.join(run_text, "plots")
        with tempfile.TemporaryDirectory(prefix="areal-plot-") as tmp:
            local_run = Path(tmp) / "run"
            storage.download(metrics_url, local_run / METRICS_FILE)
            written = _plot_local(local_run, Path(tmp) / "plots", log)
            if not storage.is_url(out_text):
                storage.upload(Path(tmp) / "plots", out_text)
                return [Path(storage.normalize(out_text)) / p.name for p in written]
            for p in written:
                storage.upload(p, storage.join(out_text, p.name))
            return [storage.join(out_text, p.name) for p in written]
    except storage.StorageError as e:
        raise PlotError(str(e)) from None


def _plot_local(run_dir: Path, out_dir: Path | None, log: Any) -> list[Path]:
    if not run_dir.is_dir():
        raise PlotError(f"run dir {run_dir} does not exist")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise PlotError(f"run dir {run_dir} has no {METRICS_FILE}")
    rows, warnings = load_metrics(metrics_path)
    for w in warnings:
        log(f"warning: {w}")
    if not rows:
        raise PlotError(f"{metrics_path} has no valid rows")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)

    written = []
    for name, fig in figures(rows, log, str(metrics_path)).items():
        written.append(_save(fig, out / name, dpi=80 if name.startswith("all_metrics") else 100))
    return written


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (local or gs://)")
    parser.add_argument("--out", default=None,
                        help="output directory, local or gs:// (default RUN_DIR/plots)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out, log=lambda m: print(m, file=sys.stderr))
    except (PlotError, OSError) as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
