"""docs/accelerators.md walks a user from install to a running job: its install lines name
extras that exist and are pinned to jax's version, and every command it shows is run here
the way it runs on a CPU (a GPU / TPU command stops at once with the hardware line; the
long ones, as written, under --runslow). A command added to the page without saying how it
runs on a CPU fails the test."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest

from tests.test_docs_commands import _blocks, _commands, _drop_synopsis

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "accelerators.md"

# (script, the command's first arguments) -> (exit status on a CPU host, text in its output);
# None: long (minutes), run as written under --runslow, where it must succeed.
ON_A_CPU: dict[tuple[str, str], tuple[int, str] | None] = {
    ("train.py", "--config configs/gsm8k_1gpu.yaml"):
        (2, "error: hardware: h100:1 names NVIDIA GPUs, and JAX can see none here"),
    ("train.py", "--config configs/gsm8k_tpu_v5e8.yaml"):
        (2, "error: hardware: v5e:2x4 names TPU, and JAX can see none here"),
    ("train.py", "--config configs/tiny_demo.yaml hardware=v5e:2x4"):
        (2, "error: hardware: v5e:2x4 names TPU, and JAX can see none here"),
    # SGLang's environment is checked first: here there is none.
    ("train.py", "--config configs/gsm8k_8gpu_sglang.yaml"):
        (2, "/sglang-env/bin/python: no such executable"),
    ("bench.py", "gpu --out-dir gpu_check"): (1, "bench gpu: no GPU here"),
    ("bench.py", "gpu --out-dir $OUT"): (1, "bench gpu: no GPU here"),
    ("plan.py", "--config configs/gsm8k_1gpu.yaml"): None,
    ("plan.py", "--config configs/gsm8k_8gpu_sglang.yaml"): None,
    ("plan.py", "--config configs/gsm8k_tpu_v5e8.yaml"): None,
    ("plan.py", "--config configs/qwen2.5-1.5b_gsm8k.yaml"): None,
    ("bench.py", "gpu --small"): None,
    ("bench.py", "engine-compile"): None,
}


def _page_commands() -> list[tuple[str, list[str]]]:
    out = []
    for block in _blocks(PAGE):
        for cmd in _commands(block):
            out.append((Path(cmd[0]).name, _drop_synopsis(cmd[1:])))
    return out


def _outcome(script: str, args: list[str]) -> tuple[tuple[str, str], tuple[int, str] | None]:
    line = " ".join(args)
    keys = [k for k in ON_A_CPU if k[0] == script and line.startswith(k[1])]
    assert keys, (f"docs/accelerators.md shows `{script} {line}`: add how it runs on a CPU to "
                  "ON_A_CPU in tests/test_docs_accelerators.py")
    key = max(keys, key=lambda k: len(k[1]))
    return key, ON_A_CPU[key]


def _argv(script: str, args: list[str]) -> list[str]:
    def absolute(a: str) -> str:
        a = os.path.expandvars(a)
        return str(REPO / a) if a.startswith("configs/") else a

    return [sys.executable, str(REPO / "scripts" / script), *map(absolute, args)]


def _env() -> dict[str, str]:  # a user's shell: no test settings
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    return {**env, "PYTHONPATH": str(REPO)}


def _on_a_cpu_host() -> bool:
    from areal_jax.parallel.placement import probe_host

    return not probe_host().devices


def test_every_command_says_how_it_runs_on_a_cpu():
    commands = _page_commands()
    assert len(commands) >= 10
    shown = {_outcome(s, a)[0] for s, a in commands}
    assert shown == set(ON_A_CPU), set(ON_A_CPU) - shown  # no stale entry either


@pytest.mark.skipif(not _on_a_cpu_host(), reason="this host has an accelerator")
def test_the_page_commands_that_stop_on_a_cpu_stop_with_their_line(tmp_path):
    runs = []
    for script, args in _page_commands():
        _, outcome = _outcome(script, args)
        if outcome is None:
            continue
        proc = subprocess.Popen(_argv(script, args), cwd=tmp_path, env=_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        runs.append((script, args, outcome, proc))
    assert len(runs) >= 6
    for script, args, (code, text), proc in runs:  # side by side: each takes seconds
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == code, (script, args, err[-2000:])
        assert text in out + err, (script, args, out[-1000:], err[-2000:])
        assert "Traceback" not in err, (script, args, err[-3000:])
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.slow
def test_the_page_long_commands_run_as_written(tmp_path):
    for script, args in _page_commands():
        _, outcome = _outcome(script, args)
        if outcome is not None:
            continue
        if script == "plan.py" and importlib.util.find_spec("libtpu") is None:
            pytest.skip("plan.py needs the aot extra")
        argv = _argv(script, [a.replace("/tmp/g", str(tmp_path / "g")) for a in args])
        out = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=7200)
        assert out.returncode == 0, (script, args, out.stderr[-3000:])
        if script == "plan.py" and "qwen2.5-1.5b_gsm8k" not in " ".join(args):
            assert "every process fits its devices" in out.stdout, out.stdout[-3000:]


def test_install_lines_name_extras_pinned_to_jax():
    text = PAGE.read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = set(re.findall(r"pip install -e '\.\[(\w+)\]'", text))
    assert {"cuda", "tpu", "sglang"} <= named and named <= set(extras)
    # The accelerator extras are jax's own, which pin the plugin / libtpu to the jax installed.
    assert extras["cuda"] == ["jax[cuda13]"] and extras["tpu"] == ["jax[tpu]"]
    v = jax.__version__
    requires = importlib.metadata.requires("jax") or []

    def pins(extra: str, package: str) -> bool:
        return any(r.startswith(package) and f'extra == "{extra}"' in r
                   and f"<={v}" in r and f">={v}" in r for r in requires)

    assert pins("cuda13", "jax-cuda13-plugin") and pins("cuda13", "jaxlib")
    assert pins("tpu", "jaxlib")
    assert any(r.startswith("libtpu") and 'extra == "tpu"' in r for r in requires)
    # The lines that install jax's packages by hand pin them to the installed jax, too.
    for line in re.findall(r"pip install [^\n]*jax[^\n]*", text):
        if "-e '." in line:
            continue
        assert "==$V" in line or "==$(python -c 'import jax; print(jax.__version__)')" in line, line
    # SGLang in its own environment, at the version the client needs (docs/servers.md).
    assert "pip install 'sglang[all]>=0.5.2'" in text
    assert extras["sglang"] == ["sglang[all]>=0.5.2"]
