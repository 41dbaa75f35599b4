"""Placement (areal_jax/parallel/placement.py): which devices each process of a run gets and
the environment that gives them, for the three accelerator configs; the hardware check and
the missing-SGLang check of train.py's start; quiet imports with the aot extra installed.

The configs' placements are computed for a list of devices (no GPU or TPU needed); their
plans (compile-only, tests/test_plan.py) need the aot extra's plugins.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jax.config import RolloutConfig, load_config
from areal_jax.parallel.mesh import parse_mesh_spec
from areal_jax.parallel.placement import (
    SHARED_CARD_LIMIT,
    Host,
    HostDevice,
    PlacementError,
    hardware_problem,
    plan_placement,
    target_host,
)

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
H100 = 80 * GIB


def _gpus(n: int, plugins: tuple[str, ...] = ("cuda",)) -> Host:
    return Host(tuple(HostDevice("cuda", i, H100, "NVIDIA H100 80GB HBM3") for i in range(n)),
                plugins)


def _v5e8() -> Host:
    return Host(tuple(HostDevice("tpu", i) for i in range(8)), ("tpu",), "v5e")


def _cfg(name: str, *overrides: str):
    return load_config(REPO / "configs" / name, list(overrides))


def test_one_gpu_config_shares_the_card_with_explicit_fractions():
    placement = plan_placement(_cfg("gsm8k_1gpu.yaml"), _gpus(1))
    learner, (engine,) = placement.learner, placement.engines
    assert learner.devices == engine.devices == (0,)
    assert learner.env == {"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.55"}
    assert engine.env == {"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
    assert engine.platform == "cuda"
    assert learner.mem_fraction + engine.mem_fraction <= SHARED_CARD_LIMIT
    assert "GPU 0 is shared: learner 0.55 + engine 0 0.3 = 0.85" in placement.describe()
    # The shared card without a fraction, or with fractions that do not fit, is refused.
    with pytest.raises(PlacementError, match=r"GPU 0 is shared by learner and engine 0: set "
                                             r"rollout.engine_mem_fraction"):
        plan_placement(_cfg("gsm8k_1gpu.yaml", "rollout.engine_mem_fraction=null"), _gpus(1))
    with pytest.raises(PlacementError, match=r"sum to learner 0.55 \+ engine 0 0.4 = 0.95 > 0.9"):
        plan_placement(_cfg("gsm8k_1gpu.yaml", "rollout.engine_mem_fraction=0.4"), _gpus(1))
    # On two GPUs the same config needs no sharing: the engine takes the last one.
    two = plan_placement(_cfg("gsm8k_1gpu.yaml"), _gpus(2))
    assert two.learner.devices == (0,) and two.engines[0].devices == (1,)
    assert two.by_device() == {0: [two.learner], 1: [two.engines[0]]}


def test_eight_gpu_config_gives_sglang_and_the_learner_disjoint_gpus():
    cfg = _cfg("gsm8k_8gpu_sglang.yaml")
    placement = plan_placement(cfg, _gpus(8))
    assert placement.learner.devices == (0, 1, 2, 3)
    assert placement.learner.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert parse_mesh_spec(cfg.mesh, len(placement.learner.devices))["fsdp"] == 4
    assert [p.devices for p in placement.sglang] == [(4,), (5,), (6,), (7,)]
    for p in placement.sglang:
        assert p.env == {"CUDA_VISIBLE_DEVICES": str(p.devices[0])}
        assert p.args == ("--tp-size", "1", "--mem-fraction-static", "0.85")
    assert all(len(procs) == 1 for procs in placement.by_device().values())
    # Two GPUs per server (tensor parallel): each server gets its pair.
    tp2 = plan_placement(_cfg("gsm8k_8gpu_sglang.yaml", "rollout.sglang.num_servers=2",
                              "rollout.sglang.tp_size=2"), _gpus(8))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in tp2.sglang] == ["4,5", "6,7"]
    # A server on a learner GPU without fractions is refused, naming both keys.
    with pytest.raises(PlacementError, match="GPU 3 is shared by learner and sglang 0: set "
                                             "placement.learner_mem_fraction"):
        plan_placement(_cfg("gsm8k_8gpu_sglang.yaml", "rollout.sglang.devices=[3,5,6,7]",
                            "placement.learner_devices=[0,1,2,3]"), _gpus(8))
    with pytest.raises(PlacementError, match=r"rollout.sglang.devices \[4, 5, 6, 9\]: no GPU 9"):
        plan_placement(_cfg("gsm8k_8gpu_sglang.yaml", "rollout.sglang.devices=[4,5,6,9]"),
                       _gpus(8))
    with pytest.raises(PlacementError, match="starts SGLang servers on GPUs"):
        plan_placement(cfg, _v5e8())


def test_tpu_config_gives_engines_and_learner_disjoint_chips_with_libtpu_split():
    placement = plan_placement(_cfg("gsm8k_tpu_v5e8.yaml"), _v5e8())
    learner = placement.learner
    assert learner.devices == (0, 1, 2, 3) and learner.platform == "tpu"
    assert learner.env == {
        "TPU_VISIBLE_CHIPS": "0,1,2,3", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": "8476",
        "TPU_PROCESS_ADDRESSES": "localhost:8476", "CLOUD_TPU_TASK_ID": "0",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    ports = {learner.env["TPU_PROCESS_PORT"]}
    for i, engine in enumerate(placement.engines):
        assert engine.devices == (4 + i,) and engine.platform == "tpu"
        assert engine.env["TPU_VISIBLE_CHIPS"] == str(4 + i)
        assert engine.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert engine.env["TPU_PROCESS_ADDRESSES"] == f"localhost:{engine.env['TPU_PROCESS_PORT']}"
        ports.add(engine.env["TPU_PROCESS_PORT"])
    assert len(ports) == 5  # every process its own libtpu port
    assert all(len(procs) == 1 for procs in placement.by_device().values())
    # What plan.py used to do (the learner on every chip, the engine on one of them) and a
    # learner on chips that are no rectangle are refused.
    with pytest.raises(PlacementError, match="TPU chip 4 is given to learner and engine 0: a "
                                             "chip belongs to one process"):
        plan_placement(_cfg("gsm8k_tpu_v5e8.yaml", "placement.learner_devices=null",
                            "rollout.engine_devices=[4]", "rollout.num_servers=1",
                            "placement.learner_devices=[0,1,2,3,4,5,6,7]"), _v5e8())
    with pytest.raises(PlacementError, match="are not a rectangle"):
        plan_placement(_cfg("gsm8k_tpu_v5e8.yaml", "placement.learner_devices=[0,1,2]"), _v5e8())
    with pytest.raises(PlacementError, match="are not a rectangle"):  # the default split
        plan_placement(_cfg("gsm8k_tpu_v5e8.yaml", "placement.learner_devices=null",
                            "rollout.engine_devices=null", "rollout.num_servers=1"), _v5e8())
    # One host of a multi-host job: its chips belong to the job's mesh, never split.
    with pytest.raises(PlacementError, match="one host of a multi-host slice"):
        plan_placement(_cfg("gsm8k_tpu_v5e8.yaml", "distributed.num_processes=2"), _v5e8())
    # The planner's host for the target is the same grid: chips 0-3 are v5e:2x4's 2x2 block.
    assert plan_placement(_cfg("gsm8k_tpu_v5e8.yaml"), target_host("v5e:2x4", 16 * GIB)
                          ).learner.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"


def test_cpu_runs_and_engine_devices_keys():
    cpu = Host()
    tiny = _cfg("tiny_demo.yaml")
    placement = plan_placement(tiny, cpu)
    assert placement.learner.devices == () and placement.engines == []
    assert placement.learner.env == {}
    # An engine on the CPU where the learner has a GPU: the learner keeps every GPU.
    on_gpu = plan_placement(tiny, _gpus(2), learner_platform="cuda")
    assert on_gpu.learner.devices == (0, 1) and on_gpu.engines == []
    with pytest.raises(PlacementError, match="use rollout.server_cpu_cores"):
        plan_placement(_cfg("tiny_demo.yaml", "rollout.engine_devices=[0]"), cpu)
    # One engine per listed device; "gpu" becomes the host's own GPU platform.
    cfg = _cfg("tiny_demo.yaml", "hardware=h100:4", "rollout.engine_platform=gpu",
               "rollout.num_servers=2", "rollout.engine_devices=[2,3]")
    placement = plan_placement(cfg, _gpus(4))
    assert [(e.platform, e.env) for e in placement.engines] == [
        ("cuda", {"CUDA_VISIBLE_DEVICES": "2"}), ("cuda", {"CUDA_VISIBLE_DEVICES": "3"})]
    assert placement.learner.devices == (0, 1)
    rocm = Host(tuple(HostDevice("rocm", i) for i in range(2)), ("rocm",))
    assert plan_placement(_cfg("tiny_demo.yaml", "hardware=null", "rollout.engine_platform=gpu",
                               "rollout.engine_devices=[1]"), rocm).engines[0].env == {
        "HIP_VISIBLE_DEVICES": "1"}
    with pytest.raises(ValueError, match="rollout.engine_mem_fraction must be null or in"):
        RolloutConfig(engine_mem_fraction=1.5)


def test_hardware_check_names_what_was_found_and_the_install_line():
    error, notice = hardware_problem("h100:1", Host((), ("cuda", "tpu")))
    assert notice is None and error.startswith("hardware: h100:1 names NVIDIA GPUs, and JAX "
                                               "can see none here")
    assert "no GPU or TPU (CPU only)" in error and "pip install -e '.[cuda]'" in error
    error, _ = hardware_problem("v5e:2x4", Host())
    assert "names TPU" in error and "pip install -e '.[tpu]'" in error
    error, _ = hardware_problem("h100:8", _gpus(8, plugins=()))  # GPUs, JAX for CPU only
    assert "8 x NVIDIA H100 80GB HBM3" in error and "no NVIDIA GPUs support installed" in error
    error, _ = hardware_problem("h100:8", _gpus(4))
    assert "needs 8 GPUs" in error
    assert hardware_problem("h100:8", _gpus(8)) == (None, None)
    error, notice = hardware_problem("cpu", _gpus(1))
    assert error is None and "keeps JAX on the CPU" in notice
    assert hardware_problem("cpu", Host()) == (None, None)
    assert hardware_problem(None, _gpus(1)) == (None, None)


def _run(args: list[str], env: dict[str, str] | None = None,
         timeout: int = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()  # as a user runs it
            if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO,
                          timeout=timeout)


def _on_a_cpu_host() -> bool:
    from areal_jax.parallel.placement import probe_host

    return not probe_host().devices


@pytest.mark.skipif(not _on_a_cpu_host(), reason="this host has an accelerator")
def test_train_py_with_gpu_hardware_on_this_cpu_exits_2_with_one_line(tmp_path):
    out = _run(["scripts/train.py", "--config", "configs/tiny_demo.yaml", "hardware=h100:1",
                f"run_dir={tmp_path}/run"])
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: hardware: h100:1 names NVIDIA GPUs, and JAX can see "
                               "none here (found no GPU or TPU (CPU only)")
    assert "pip install -e '.[cuda]'" in lines[0]
    assert not (tmp_path / "run").exists()  # stopped before anything was made


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_train_py_with_sglang_settings_and_no_sglang_exits_2_naming_the_extra(tmp_path):
    out = _run(["scripts/train.py", "--config", "configs/gsm8k_8gpu_sglang.yaml",
                f"run_dir={tmp_path}/run"])
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "rollout.sglang needs the sglang package" in lines[0]
    assert "pip install -e '.[sglang]'" in lines[0] and "rollout.sglang.python" in lines[0]
    # Its own environment without sglang in it is named too.
    out = _run(["scripts/train.py", "--config", "configs/gsm8k_8gpu_sglang.yaml",
                f"rollout.sglang.python={sys.executable}", f"run_dir={tmp_path}/run"])
    assert out.returncode == 2 and f"{sys.executable} has no sglang package" in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="needs the CUDA plugin (the aot extra) to have something to print")
@pytest.mark.skipif(not _on_a_cpu_host(), reason="this host has an accelerator")
def test_imports_print_no_plugin_traceback_on_a_cpu_host():
    out = _run(["-c", "import areal_jax, areal_jax.run, jax; print(jax.default_backend())"])
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "cuFFT" not in out.stderr, out.stderr[-2000:]
    # Without the package's guard, jax itself prints the plugin's traceback here.
    raw = _run(["-c", "import jax; jax.default_backend()"])
    assert "Traceback" in raw.stderr, "the CUDA plugin no longer prints: the guard is moot"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="needs the CUDA plugin (the aot extra) to have something to print")
@pytest.mark.skipif(not _on_a_cpu_host(), reason="this host has an accelerator")
def test_eval_ckpt_and_the_small_gpu_check_print_no_plugin_traceback(tmp_path):
    hf = REPO / "areal_jax" / "data" / "assets" / "arith_sft"
    out = _run(["scripts/convert.py", "hf-to-orbax", "--hf", str(hf), "--out",
                str(tmp_path / "ckpt")], timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    out = _run(["scripts/eval.py", "--ckpt", str(tmp_path / "ckpt"), "--tokenizer", str(hf),
                "--data", "builtin:eval", "--reward", "builtin", "--max-prompts", "4", "-n", "1",
                "--max-new-tokens", "8", "--max-seq-len", "96", "--max-slots", "4"],
               timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "cuFFT" not in out.stderr, out.stderr[-3000:]
    out = _run(["scripts/bench.py", "gpu", "--small", "--steps", "attention", "--out-dir",
                str(tmp_path / "g")], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "cuFFT" not in out.stderr, out.stderr[-3000:]
