"""Verifiers: math answers via math-verify, and code run against tests in a sandbox."""

from __future__ import annotations

import os

import pytest

from areal_jax.rewards import reward_fn_spec
from areal_jax.rewards.code import code_reward, extract_code, run_python, run_tests, sandbox_info
from areal_jax.rewards.math import extract_answer, last_boxed, math_reward


@pytest.mark.parametrize("completion, answer, expected", [
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{41} hmm, no: \\boxed{42}", "42", 1.0),  # the last box counts
    ("we get \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("half: 0.5", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("3 apples and 4 pears, 7 in all", "7", 1.0),  # last number
    ("3 apples and 4 pears, 7 in all", "4", 0.0),
    ("the total is 1,234 dollars", "1234", 1.0),
    ("-3", "-3", 1.0),
    ("\\boxed{12}", "13", 0.0),
    ("no answer here", "1", 0.0),
    ("He sold 48/2 = 24 clips, so 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
    ("\\boxed{x^2+1}", "1 + x^2", 1.0),
])
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_boxed_extraction_handles_nesting_and_cutoff():
    assert last_boxed("a \\boxed{\\frac{a}{b+{c}}} b") == "\\frac{a}{b+{c}}"
    assert last_boxed("\\boxed{12") is None  # cut off inside the box
    assert extract_answer("\\boxed{12") == "12"  # falls back to the last number
    assert last_boxed("\\boxed 5 apples") == "5"


def test_reward_names():
    assert reward_fn_spec("math") == "areal_jax.rewards.math:math_reward"
    assert reward_fn_spec("my.mod:fn") == "my.mod:fn"
    with pytest.raises(ValueError, match="reward fn 'nope' is unknown.*builtin.*code.*math"):
        reward_fn_spec("nope")


ADD_OK = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
ADD_BAD = "```python\ndef add(a, b):\n    return a - b\n```"


def test_extract_code_prefers_the_last_python_block():
    text = "```text\nnot code\n```\n```python\nx = 1\n```\n```python\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("print(1)") == "print(1)"


def test_code_reward_asserts_and_io():
    assert code_reward(ADD_OK, "assert add(1, 2) == 3") == 1.0
    assert code_reward(ADD_BAD, "assert add(1, 2) == 3") == 0.0
    io_prog = "```python\nn = int(input())\nprint(n * 2)\nprint('ok')\n```"
    assert code_reward(io_prog, [{"input": "3", "output": "6\nok"},
                                 {"input": "5\n", "output": "10\nok\n"}]) == 1.0
    assert code_reward(io_prog, [{"input": "3", "output": "6\nok"},
                                 {"input": "5", "output": "11\nok"}]) == 0.0
    assert code_reward(io_prog, [{"input": "3", "output": "6\nok"},
                                 {"input": "5", "output": "11\nok"}], partial_credit=True) == 0.5
    assert run_tests(extract_code(ADD_OK),
                     ["assert add(1, 1) == 2", "assert add(1, 1) == 3"]) == (1, 2)


def test_code_sandbox_limits(tmp_path):
    # time: an endless loop is killed at the timeout
    result = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert result.status == "timeout"
    # a child that sleeps past the timeout is killed with its process group
    result = run_python("import subprocess, sys\n"
                        "subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])\n",
                        timeout_s=1.0)
    assert result.status == "timeout"
    # memory: allocating past memory_mb fails inside the candidate
    result = run_python("x = bytearray(600 * 1024 * 1024)\n", memory_mb=256)
    assert result.status == "error" and "MemoryError" in result.stderr
    # files: the candidate runs in its own temp dir, not ours
    result = run_python("import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())\n")
    assert result.status == "ok"
    assert result.stdout.strip() != os.getcwd()
    assert not os.path.exists(os.path.join(result.stdout.strip(), "out.txt"))  # cleaned up
    assert code_reward("while True: pass", "assert True", timeout_s=1.0) == 0.0


def test_code_sandbox_has_no_network():
    if not sandbox_info()["network_isolated"]:
        pytest.skip("unshare -rn is not available here; the sandbox keeps the host network")
    result = run_python("import socket\n"
                        "s = socket.socket()\n"
                        "s.settimeout(2)\n"
                        "s.connect(('127.0.0.1', 9))\n")
    assert result.status == "error"
    assert "Network is unreachable" in result.stderr or "Connection refused" in result.stderr
    probe = run_python("import socket\nprint(len(socket.if_nameindex()))\n")
    assert probe.status == "ok" and probe.stdout.strip() == "1"  # only loopback, and it is down


def test_code_reward_bad_tests_are_named():
    with pytest.raises(ValueError, match="code test 0 must be a string of asserts or a dict"):
        code_reward(ADD_OK, [{"stdin": "1"}])
    with pytest.raises(ValueError, match="code tests must be a string or a non-empty list"):
        code_reward(ADD_OK, [])
