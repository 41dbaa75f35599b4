"""The benchmark package (areal_jax.bench): one entry point for every benchmark, light to
import, a real tiny run end to end, and named errors from its train.py runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jax.bench import benchmarks, build_parser, main
from areal_jax.bench.common import REPO, format_table, repo_file, run_train, script_env

NAMES = ["forward", "train", "generate", "async-vs-sync", "staleness", "losses", "executor",
         "memory", "memory-run", "startup", "trl", "longtail", "process-rows", "attention",
         "engine-compile", "gpu", "serve-load", "weight-sync"]


def test_importing_the_package_or_its_benchmarks_pulls_in_no_torch_trl_or_transformers():
    code = ("import sys, areal_jax; assert 'areal_jax.bench' not in sys.modules; "
            "from areal_jax.bench import benchmarks; benchmarks(); "
            "print(sorted(m for m in ('torch', 'transformers', 'trl', 'datasets') "
            "if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_every_benchmark_is_a_subcommand_with_the_contract():
    assert list(benchmarks()) == NAMES
    for mod in benchmarks().values():
        assert callable(mod.add_arguments) and callable(mod.run)
    parser, _ = build_parser()
    for name in NAMES:  # each one's own options parse (--help exits 0 after printing them)
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["no-such-benchmark"])
    assert e.value.code == 2


@pytest.mark.parametrize("cmd", [["scripts/bench.py"], ["-m", "areal_jax.bench"]])
def test_the_script_and_the_module_are_the_same_entry_point(cmd):
    res = subprocess.run([sys.executable, *cmd, "--help"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in NAMES:
        assert name in res.stdout


def test_format_table_aligns_columns_and_rounds_floats():
    text = format_table(["name", "value"], [["a", 1.234567], ["longer", 10]])
    lines = text.splitlines()
    assert lines[0] == "name   | value"
    assert lines[1] == "-------+------"
    assert lines[2] == "a      | 1.235"
    assert lines[3] == "longer | 10   "


def test_a_tiny_losses_run_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "losses.json"
    assert main(["losses", "--tokens", "64", "--dim", "32", "--vocab", "256", "--chunk", "64",
                 "--repeats", "1", "--dtype", "float32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r[2] for r in result["rows"]] == ["naive", "chunked(64)"]
    assert all(len(r) == len(result["columns"]) for r in result["rows"])
    assert set(result["summary"]) == {"V256_speed_vs_naive", "V256_temp_memory_reduction"}
    assert result["argv"][0] == "losses" and "machine" in result
    printed = capsys.readouterr().out
    assert result["title"] in printed and f"wrote {out}" in printed


def test_run_train_names_the_failing_script_and_shows_its_output(tmp_path):
    with pytest.raises(RuntimeError, match=r"scripts/train\.py failed \(exit 2\)") as e:
        run_train(str(REPO / "configs" / "tiny_demo.yaml"), ["no_such_key=1"],
                  tmp_path / "run", JAX_PLATFORMS="cpu")
    assert "no_such_key" in str(e.value)


def test_a_checkout_without_scripts_is_a_named_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="source checkout"):
        repo_file("scripts/train.py", tmp_path)
    assert repo_file("scripts/train.py") == REPO / "scripts" / "train.py"


def test_script_env_puts_the_checkout_first_and_drops_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = script_env(Path("/some/checkout"), JAX_PLATFORMS="cpu")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/some/checkout", "/elsewhere"]
    assert "XLA_FLAGS" not in env and env["JAX_PLATFORMS"] == "cpu"


def test_memory_run_model_dir_keeps_the_preset_vocab_with_the_demo_tokenizer(tmp_path):
    from areal_jax.bench.memory_run import write_model_dir
    from areal_jax.tokenizer import load_tokenizer
    from model_defs import ModelConfig

    write_model_dir("tiny", 1, "bfloat16", str(tmp_path / "m"))
    cfg = ModelConfig.from_pretrained_dir(tmp_path / "m")
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.eos_token_id) == (256, 1, 2)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_tokenizer(str(tmp_path / "m")).vocab_size < cfg.vocab_size  # 20 tokens


def test_weight_sync_rss_parts_count_a_mapped_shared_memory_file_as_shmem(tmp_path):
    """The weight-sync bench splits a server's RSS into its heap and the shared memory it
    maps (the weight versions): a child that maps and reads a 64 MiB /dev/shm file shows
    it under shmem, not anon, and the parts add up to VmRSS."""
    from areal_jax.bench.weight_sync import _rss_parts

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    size = 64 << 20
    path = f"/dev/shm/areal-test-rss-{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(size)
    child = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys\n"
         f"f = open({path!r}, 'r+b'); m = mmap.mmap(f.fileno(), {size})\n"
         f"sum(m[i] for i in range(0, {size}, 4096)); print('mapped', flush=True)\n"
         "sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "mapped"
        parts = _rss_parts(child.pid)
        # the kernel's per-thread counters may lag by a few pages (as above)
        assert parts["shmem"] >= size - 64 * 4096
        assert parts["anon"] < size  # a bare interpreter's heap, the file not in it
        assert abs(parts["anon"] + parts["shmem"] + parts["file"] - parts["rss"]) <= 4096
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=30)
        os.unlink(path)


def test_peak_rss_is_the_high_water_mark_and_none_once_gone():
    import psutil

    from areal_jax.bench.memory_run import peak_rss_bytes

    # RSS first: the high-water mark read afterwards covers it (read the other way round,
    # RSS had grown one page past the mark in a CI run). The kernel's per-thread RSS
    # counters may lag by a few pages: 64 pages of slack on a ~1 GiB process.
    rss = psutil.Process().memory_info().rss
    assert peak_rss_bytes(os.getpid()) >= rss - 64 * 4096
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert peak_rss_bytes(int(done.stdout)) is None


@pytest.mark.slow
def test_a_tiny_memory_run_completes_versions_with_fsdp1_and_two_processes(tmp_path):
    out = tmp_path / "memory_run.json"
    assert main(["memory-run", "--preset", "tiny", "--seq-len", "96", "--versions", "2",
                 "--work-dir", str(tmp_path / "work"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["run"] for r in result["runs"]] == ["fsdp=1", "fsdp=2"]
    for run in result["runs"]:
        assert run["versions_completed"] == [1, 2]
        assert len(run["trainers"]) == run["processes"]
        for t in run["trainers"]:
            assert 0 < t["peak_rss_training_bytes"] <= t["peak_rss_at_exit_bytes"]
        assert run["server_peak_rss_bytes"] > 0
        assert run["compiled"]["held"] == 16.0 / run["processes"]
    assert len(result["rows"]) == 3 and all(len(r) == len(result["columns"])
                                            for r in result["rows"])
    assert result["n_params"] > 0


def test_a_train_run_on_the_demo_models_shape_writes_both_systems(tmp_path):
    """``bench train --model-path``: the shape comes from the HF directory's config (here
    the demo's model), ours and transformers + torch AdamW side by side."""
    out = tmp_path / "train.json"
    assert main(["train", "--model-path", str(REPO / "areal_jax" / "data" / "assets" /
                                              "arith_sft"),
                 "--tokens", "768", "--rows", "8", "--repeats", "1", "--threads", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "arith_sft" in result["title"]
    assert len(result["rows"]) == 2  # ours and the peer


def test_train_refuses_a_preset_and_a_model_path_together():
    with pytest.raises(SystemExit, match="--preset or --model-path"):
        main(["train", "--preset", "tiny", "--model-path", "x", "--no-torch"])
