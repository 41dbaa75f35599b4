"""Code answers: the candidate program runs against tests in a sandboxed subprocess.

    code_reward(completion, tests, timeout_s=5.0, memory_mb=512) -> 1.0 | 0.0

The code is the last fenced block of the completion (```python ... ``` or ``` ... ```), or
the whole completion when it has no fence. ``tests`` is one of:

- a string of Python test code (asserts), run after the candidate in the same file;
- a list of such strings, each run separately;
- a list of ``{"input": str, "output": str}`` cases: the candidate reads stdin, and its
  stdout must equal ``output`` up to trailing whitespace on each line.

Each run happens in a fresh temporary directory, in its own session (the whole process
group is killed on timeout), with ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``
and no core dumps, a minimal environment, ``python -I``, and the parent-death signal set so
it never outlives its reward worker. Network: when ``unshare -rn`` works (Linux with user
namespaces) the run is in an empty network namespace; otherwise it has the host network
(``sandbox_info()["network_isolated"]`` says which). This is a resource sandbox for
RL rewards, not a security boundary against hostile code.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_MAX_OUTPUT_BYTES = 1 << 20


def extract_code(completion: str) -> str:
    """The last fenced code block (python-tagged blocks preferred), else the whole text."""
    blocks = _FENCE_RE.findall(completion)
    if not blocks:
        return completion
    python_blocks = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python_blocks or [body for _, body in blocks])[-1]


@functools.lru_cache(maxsize=1)
def _unshare_works() -> bool:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def sandbox_info() -> dict[str, Any]:
    """What the sandbox can enforce on this machine."""
    return {"network_isolated": _unshare_works(), "rlimits": sys.platform != "win32"}


def _limits(memory_mb: int, cpu_s: int):  # noqa: ANN202 - preexec callable
    def apply() -> None:
        import resource

        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (_MAX_OUTPUT_BYTES, _MAX_OUTPUT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sys.platform == "linux":
            try:
                import ctypes

                pr_set_pdeathsig = 1
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
            except OSError:
                pass

    return apply


@dataclass
class RunResult:
    status: str  # "ok" | "error" | "timeout"
    returncode: int | None
    stdout: str
    stderr: str


def run_python(source: str, *, stdin: str = "", timeout_s: float = 5.0,
               memory_mb: int = 512) -> RunResult:
    """Runs ``source`` as ``main.py`` in the sandbox described in the module docstring."""
    with tempfile.TemporaryDirectory(prefix="areal_code_") as tmp:
        script = os.path.join(tmp, "main.py")
        with open(script, "w") as f:
            f.write(source)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        cmd = [sys.executable, "-I", script]
        if _unshare_works():
            cmd = ["unshare", "-rn", *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
               # one BLAS thread: thread pools reserve address space that RLIMIT_AS counts
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                start_new_session=True,
                preexec_fn=_limits(memory_mb, max(1, int(timeout_s + 0.999)) + 1),
            )
            try:
                proc.communicate(stdin.encode(), timeout=timeout_s)
                if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
                    status = "timeout"  # the CPU-time limit fired before the wall clock
                else:
                    status = "ok" if proc.returncode == 0 else "error"
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        with open(out_path, "rb") as f:
            stdout = f.read(_MAX_OUTPUT_BYTES).decode(errors="replace")
        with open(err_path, "rb") as f:
            stderr = f.read(_MAX_OUTPUT_BYTES).decode(errors="replace")
    return RunResult(status, proc.returncode, stdout, stderr)


def _same_output(actual: str, expected: str) -> bool:
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip().splitlines()]

    return norm(actual) == norm(expected)


def run_tests(code: str, tests: str | list, *, timeout_s: float = 5.0,
              memory_mb: int = 512) -> tuple[int, int]:
    """(passed, total) for the test formats in the module docstring."""
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code tests must be a string or a non-empty list, got {tests!r:.80}")
    passed = 0
    for i, case in enumerate(tests):
        if isinstance(case, str):
            result = run_python(f"{code}\n\n{case}\n", timeout_s=timeout_s, memory_mb=memory_mb)
            passed += result.status == "ok"
        elif isinstance(case, dict) and "input" in case and "output" in case:
            result = run_python(code, stdin=str(case["input"]), timeout_s=timeout_s,
                                memory_mb=memory_mb)
            passed += result.status == "ok" and _same_output(result.stdout, str(case["output"]))
        else:
            raise ValueError(f"code test {i} must be a string of asserts or a dict with 'input' "
                             f"and 'output' keys, got {case!r:.80}")
    return passed, len(tests)


def code_reward(completion: str, tests: str | list, timeout_s: float = 5.0,
                memory_mb: int = 512, partial_credit: bool = False) -> float:
    """1.0 if the extracted code passes every test (the fraction passed with partial_credit)."""
    passed, total = run_tests(extract_code(completion), tests, timeout_s=timeout_s,
                              memory_mb=memory_mb)
    if partial_credit:
        return passed / total
    return 1.0 if passed == total else 0.0
