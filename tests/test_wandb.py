"""logging.wandb: an offline W&B run holds every metrics.jsonl key of every row, read back
from its run file with W&B's own protobuf records; without the package, one line."""

from __future__ import annotations

import json
import math
import sys
import time

import pytest

from areal_jax.config import load_config
from areal_jax.metrics import MetricsWriter, read_rows, read_wandb_history, read_wandb_records

pytest.importorskip("wandb")

WANDB = "logging.wandb={project: areal-jax-test, name: offline-check, mode: offline}"


def _rows() -> list[dict]:
    """Rows like a run's: the eval at start, trained versions with sections, an eval."""
    rows: list[dict] = [{"version": 0, "step": 0, "eval_accuracy": 0.25, "eval_s": 1.5}]
    for v in range(1, 5):
        row = {"version": v, "step": v, "reward_mean": 0.1 * v, "train/loss": 1.0 / v,
               "train/grad_norm": 2.0 + v, "mismatch/lag0_abs_diff_mean": 0.001 * v,
               "rollout/accepted": 8 * v, "logp_mismatch": float("nan") if v == 2 else 0.5,
               "n_trajectories": 16}
        if v == 4:
            row.update({"eval_accuracy": 0.75, "eval_n_prompts": 16.0})
        rows.append(row)
    return rows


def test_offline_wandb_run_holds_every_metric_of_every_version(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["model.path=builtin:arith_sft", WANDB])
    writer = MetricsWriter.from_config(cfg, tmp_path, 0, resumed=False)
    for row in _rows():
        writer.log(row)
    writer.close()

    written = read_rows(tmp_path / "metrics.jsonl")
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # W&B's service process writes the file; on a loaded machine its last records can land
    # after finish() returns (seen once in a CI run: none yet), so read until they are in.
    deadline = time.monotonic() + 60
    while len(history := read_wandb_history(run_file)) < len(written) and (
            time.monotonic() < deadline):
        time.sleep(0.5)
    assert len(history) >= len(written)
    by_version = {}
    for entry in history:
        if "version" in entry:
            by_version.setdefault(int(entry["version"]), {}).update(entry)
    assert sorted(by_version) == [0, 1, 2, 3, 4]
    for row in written:  # every key of every metrics.jsonl row, with its value
        logged = by_version[row["version"]]
        for key, value in row.items():
            assert key in logged, (row["version"], key)
            if value is None:  # NaN in metrics.jsonl (null there)
                assert logged[key] is None or math.isnan(logged[key])
            else:
                assert logged[key] == pytest.approx(value, rel=1e-12), key
    # the run's config, and the run's name and project
    records = read_wandb_records(run_file)
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else (
            r.config.update if kind == "config" else [])
        config.update({i.key: json.loads(i.value_json) for i in items})
    model = config["model"]
    assert model.get("value", model)["path"] == "builtin:arith_sft"
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "offline-check" and run.project == "areal-jax-test"
    # the plots of scripts/plot.py, logged as images at the end
    assert any(key.startswith("plots/") for entry in history for key in entry)
    assert (tmp_path / "wandb_run_id").read_text().strip() == run.run_id


def test_missing_wandb_is_one_line(monkeypatch):
    from areal_jax.run_inputs import TrainerError, check_optional_packages

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = load_config(None, ["model.path=builtin:arith_sft", WANDB])
    with pytest.raises(TrainerError, match=r"logging.wandb needs the wandb package, which is "
                                           r"not installed: pip install -e '.\[wandb\]'"):
        check_optional_packages(cfg)
    check_optional_packages(load_config(None, ["model.path=builtin:arith_sft"]))
