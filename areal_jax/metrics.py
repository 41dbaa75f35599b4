"""The run's metrics files: ``metrics.jsonl`` (one row per version), the consumed-prompt
audit trail, TensorBoard events and the progress bar."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("areal_jax.trainer")


class MetricsWriter:
    """metrics.jsonl (one row per version), TensorBoard events and a progress bar."""

    def __init__(self, run_dir: Path, total: int, initial: int, progress_bar: bool,
                 resumed: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        prompts_path = run_dir / "consumed_prompts.jsonl"
        if resumed:  # versions after the checkpoint are trained again: drop their old rows
            for path in (self.path, prompts_path):
                _drop_rows_after(path, initial)
        self._file = self.path.open("a")
        self._prompts_file = prompts_path.open("a")
        self._tb = None
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception as e:  # noqa: BLE001 - TensorBoard is optional output
            logger.warning("TensorBoard events disabled: %s", e)
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="versions", unit="v",
                             dynamic_ncols=True, file=sys.stderr)

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        row = {k: (float(v) if isinstance(v, np.floating | np.integer) else v)
               for k, v in row.items()}
        row["time"] = time.time()
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        step = int(row.get("version", 0))
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k != "time":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        summary = {k: row[k] for k in ("reward_mean", "eval_accuracy") if k in row}
        text = " ".join(f"{k}={v:.3f}" for k, v in summary.items())
        if self._bar is not None:
            if "reward_mean" in row:
                self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(text)
            if "eval_accuracy" in row:
                reward = f", reward {row['reward_mean']:.3f}" if "reward_mean" in row else ""
                self._bar.write(f"version {step}: eval accuracy {row['eval_accuracy']:.3f}"
                                + reward)
        elif text:
            print(f"version {step}: {text}", flush=True)
        return row

    def log_consumed(self, version: int, prompt_ids: list[str]) -> None:
        """Which prompts trained version ``version`` (an audit trail for resume)."""
        self._prompts_file.write(json.dumps({"version": version, "prompt_ids": prompt_ids}) + "\n")
        self._prompts_file.flush()

    def close(self) -> None:
        self._prompts_file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def _drop_rows_after(path: Path, version: int) -> None:
    """Rewrites a JSONL of per-version rows without those of versions > ``version``
    (atomically: a kill mid-way leaves the old file). Unparsable lines are kept."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            row_version = int(json.loads(line).get("version", -1))
        except (ValueError, AttributeError, TypeError):
            row_version = -1
        if row_version > version:
            dropped += 1
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        logger.info("%s: dropped %d rows of versions after %d (they are trained again)",
                    path.name, dropped, version)
