"""The run's metrics files: ``metrics.jsonl`` (one row per version), the consumed-prompt
audit trail, TensorBoard events and the progress bar."""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from areal_jax.losses.step_metrics import MISMATCH_PREFIX

if TYPE_CHECKING:  # annotations only: this room never loads the run config
    from areal_jax.config import TrainConfig

logger = logging.getLogger("areal_jax.trainer")


# The start-up milestones in the order a run reaches them, as the console line names them.
_STARTUP_NAMES = (("imports_s", "imports"), ("servers_launched_s", "servers launched"),
                  ("learner_loaded_s", "learner loaded"),
                  ("learner_compiled_s", "learner compiled"), ("servers_ready_s", "servers ready"),
                  ("setup_s", "set up"), ("first_batch_s", "first batch"),
                  ("first_step_s", "first step"))


def startup_line(row: dict[str, Any]) -> str:
    """A row's ``startup/*`` entries as one console line: seconds from process start to each
    milestone, and the first server's own breakdown (load, compile, ready)."""
    parts = [f"{label} {row[f'startup/{key}']:.1f}s" for key, label in _STARTUP_NAMES
             if f"startup/{key}" in row]
    engine = [f"{label} {row[f'startup/engine_{key}']:.1f}s"
              for key, label in (("load_s", "load"), ("compile_s", "compile"),
                                 ("ready_s", "ready"))
              if f"startup/engine_{key}" in row]
    line = "start-up (s from process start): " + ", ".join(parts)
    return line + (f"; engine: {', '.join(engine)}" if engine else "")


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) as null, so that a metrics line is
    valid JSON (``json.dumps`` writes a bare ``NaN`` otherwise, which strict readers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


class MetricsWriter:
    """metrics.jsonl (one row per version), TensorBoard events and a progress bar."""

    @classmethod
    def from_config(cls, cfg: TrainConfig, run_dir: Path, start_version: int,
                    resumed: bool) -> MetricsWriter:
        """The run's writer in ``run_dir`` (its local working copy), from version
        ``start_version`` of ``train.total_versions``; with ``logging.wandb``, a W&B run
        too (:class:`WandbLogger`)."""
        wandb = None
        if cfg.logging.wandb is not None:
            from areal_jax.config_io import to_dict

            wandb = WandbLogger(cfg.logging.wandb, run_dir, to_dict(cfg))
        return cls(run_dir, cfg.train.total_versions, start_version, cfg.progress_bar,
                   resumed=resumed, wandb=wandb)

    def __init__(self, run_dir: Path, total: int, initial: int, progress_bar: bool,
                 resumed: bool = False, wandb: WandbLogger | None = None) -> None:
        self.run_dir = run_dir
        self.wandb = wandb
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
        self._file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
        self._file.flush()
        step = int(row.get("version", 0))
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k != "time":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self.wandb is not None:
            self.wandb.log(row)
        summary = {k: row[k] for k in ("reward_mean", "loss", "eval_loss", "eval_accuracy")
                   if k in row}
        text = " ".join(f"{k}={v:.3f}" for k, v in summary.items())
        if self._bar is not None:
            if "reward_mean" in row or "loss" in row:  # a trained version's row (RL, SFT)
                self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(text)
            if "eval_accuracy" in row:
                reward = f", reward {row['reward_mean']:.3f}" if "reward_mean" in row else ""
                self._bar.write(f"version {step}: eval accuracy {row['eval_accuracy']:.3f}"
                                + reward)
        elif text:
            print(f"version {step}: {text}", flush=True)
        if "startup/first_step_s" in row:  # the first version's row: the whole breakdown
            line = startup_line(row)
            if self._bar is not None:
                self._bar.write(line)
            else:
                print(line, flush=True)
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
        if self.wandb is not None:
            self.wandb.finish(self.run_dir)


class WandbLogger:
    """``logging.wandb``: a Weights & Biases run holding every metrics.jsonl row (charted
    against ``version``), the run config, and at the end the run's plots (the PNGs of
    scripts/plot.py, drawn from metrics.jsonl where the source tree has that script, and any
    already in RUN_DIR/plots). Its files are in RUN_DIR/wandb; the run's id is kept in
    RUN_DIR/wandb_run_id, so a resumed run logs into the same W&B run."""

    def __init__(self, section: Any, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb  # run_inputs.check_optional_packages has checked it is installed

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        if not run_id:
            run_id = f"{run_dir.name[:40]}-{os.urandom(4).hex()}"
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=section.project, name=section.name or run_dir.name,
                              entity=section.entity, tags=list(section.tags) or None,
                              mode=section.mode, dir=str(run_dir), config=config, id=run_id,
                              resume="allow")
        # Rows are charted against the learner version (a resumed run logs some again).
        self.run.define_metric("version")
        self.run.define_metric("*", step_metric="version")

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(dict(row))

    def finish(self, run_dir: Path) -> None:
        try:
            self.log_plots(run_dir)
        except Exception as e:  # noqa: BLE001 - the metrics are logged; plots are extra
            logger.warning("W&B: the run's plots were not logged (%s: %s)", type(e).__name__, e)
        self.run.finish()

    def log_plots(self, run_dir: Path) -> None:
        """The plots of scripts/plot.py (drawn now, where the source tree has it) and the
        PNGs in RUN_DIR/plots, as W&B images under ``plots/<name>``."""
        import wandb

        script = Path(__file__).resolve().parents[1] / "scripts" / "plot.py"
        if script.is_file():
            import importlib.util

            spec = importlib.util.spec_from_file_location("_areal_jax_plot", script)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.plot_run(run_dir, log=lambda *_: None)
        images = {f"plots/{p.stem}": wandb.Image(str(p))
                  for p in sorted((run_dir / "plots").glob("*.png"))}
        if images:
            self.run.log(images)


def read_wandb_records(path: str | Path) -> list[Any]:
    """The records of a W&B run file (``run-<id>.wandb``, e.g. an offline run's), as
    ``wandb.proto.wandb_internal_pb2.Record`` messages, read with W&B's own protobuf: the
    file is a 7-byte header then LevelDB-log framing (32 KiB blocks of chunks, each a 4-byte
    checksum, 2-byte length and 1-byte type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, last: a whole record
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def read_wandb_history(path: str | Path) -> list[dict[str, Any]]:
    """The rows a W&B run file's history records hold (key -> value)."""
    rows = []
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_summary(rows: list[dict[str, Any]], *, wall_s: float, run_dir: str, version: int,
                weights: str | None, ckpt_dir: str, eval_data: str, serve_model: str) -> str:
    """What a finished run prints last: the final eval accuracy and reward, the wall time,
    and the next three commands (plot, evaluate, serve) with this run's paths. ``rows`` are
    metrics.jsonl's; ``weights`` is the last version's serving weights when eval.py can
    take them as they are (``RUN_DIR/weights/vN``, next to the run's config), else None:
    eval.py then reads the checkpoint. ``serve_model``: what serve.py can serve (those
    weights, ``checkpoint.publish_dir``'s, or with LoRA adapters the base model)."""
    q = shlex.quote
    minutes, seconds = divmod(round(wall_s), 60)
    lines = [f"done: version {version} in {minutes}m {seconds:02d}s; run directory {run_dir}"]
    for key, name in (("eval_accuracy", "eval accuracy"), ("reward_mean", "reward")):
        last = next((r for r in reversed(rows) if key in r), None)
        if last is not None:
            lines.append(f"  {name} {last[key]:.3f} (version {int(last.get('version', 0))})")
    source = f"--model {q(weights)}" if weights else f"--ckpt {q(ckpt_dir)}"
    lines += ["next:",
              f"  python scripts/plot.py {q(run_dir)}",
              f"  python scripts/eval.py {source} --data {q(eval_data)} -n 4",
              f"  python scripts/serve.py --model-path {q(serve_model)} --port 30000"]
    return "\n".join(lines)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL metrics file (unparsable lines skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class MismatchWarner:
    """A warning line when lag-0 rollout-training mismatch (``mismatch/lag0_abs_diff_mean``:
    the mean |logp - behav_logp| over tokens generated by the weights the learner holds)
    passes ``bound``; at most once every ``every`` versions. ``bound=None`` disables it."""

    KEY = MISMATCH_PREFIX + "lag0_abs_diff_mean"  # the step's mismatch, as its row lists it
    MAX_KEY = MISMATCH_PREFIX + "lag0_abs_diff_max"

    def __init__(self, bound: float | None, every: int = 10) -> None:
        self.bound = bound
        self.every = every
        self._last: int | None = None  # the version of the last warning

    def __call__(self, row: dict[str, Any]) -> str | None:
        """Logs and returns the warning for this metrics row, if one is due."""
        value = row.get(self.KEY)
        if self.bound is None or value is None or not value > self.bound:  # NaN: no lag-0
            return None
        version = int(row.get("version", 0))
        if self._last is not None and version - self._last < self.every:
            return None
        self._last = version
        text = (f"version {version}: lag-0 rollout-training mismatch {value:.4g} (mean "
                f"|logp - behav_logp| on tokens of the weights the learner holds; max "
                f"{row.get(self.MAX_KEY, float('nan')):.4g}) is above "
                f"algo.mismatch_warn_abs_diff={self.bound:g}: the engine and the learner "
                f"disagree apart from staleness (precision: model.dtype; kernels: "
                f"model.attention; an external server's own dtype and kernels). A "
                f"correction (algo.behav_correction: tis, icepop) bounds its effect; "
                f"warned again at most every {self.every} versions")
        logger.warning(text)
        return text


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
