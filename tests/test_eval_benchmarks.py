"""scripts/eval.py on the named benchmarks (GSM8K test, MATH-500) and pass@k.

The benchmarks' hub datasets (``openai/gsm8k``, ``HuggingFaceH4/MATH-500``) and a tiny model
under a hub id are laid out in a Hugging Face cache as the hub libraries lay them out
(tests/hub_cache.py) and read with ``HF_HUB_OFFLINE=1``. The pass@k estimator is checked
against a direct enumeration of the k-subsets of the samples.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest
from hub_cache import REPO, add_hub_dataset, add_hub_model, offline_env

from areal_jax import hub
from areal_jax.rewards.math import math_reward
from areal_jax.rewards.pool import resolve_reward_fn
from areal_jax.rollout.evaluate import (
    BENCHMARKS,
    BOXED_INSTRUCTION,
    check_pass_at,
    get_benchmark,
    pass_at_k,
)

MODEL_ID = "areal-test/arith-sft"
# Short rows (the tiny model's tokenizer spells a prompt one character per token).
GSM8K_TEST = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 1,200 pens; 2 boxes?", "answer": "2 * 1200 = 2,400\n#### 2,400"},
    {"question": "It is 3 degrees and falls by 10. Now?", "answer": "3 - 10 = -7\n#### -7"},
]
MATH500_TEST = [
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "solution": "$\\boxed{\\frac{3}{4}}$",
     "answer": "\\frac{3}{4}", "subject": "Prealgebra", "level": 1,
     "unique_id": "test/prealgebra/1.json"},
    {"problem": "Compute $2^5$.", "solution": "$2^5 = \\boxed{32}$", "answer": "32",
     "subject": "Algebra", "level": 1, "unique_id": "test/algebra/2.json"},
]


def known_answers(completion: str, answer: str) -> float:
    """A reward that ignores the completion: 1 for the GSM8K rows whose reference ends in
    #### 7 or #### -7 (so pass@k = 2/3 for every k when the answers arrive as the dataset
    writes them)."""
    return 1.0 if answer.rsplit("####", 1)[-1].strip() in ("7", "-7") else 0.0


# ----------------------------------------------------------------------------- pass@k


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> Fraction:
    """The share of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_direct_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = _pass_at_k_by_enumeration(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-15, abs=0), \
                    (n, c, k)
    for n in (1, 5, 16):
        for k in range(1, n + 1):
            assert pass_at_k(n, 0, k) == 0.0  # nothing correct
            assert pass_at_k(n, n, k) == 1.0  # everything correct
        assert pass_at_k(n, 1, n) == 1.0  # k = n: any correct sample is drawn
        assert pass_at_k(n, 1, 1) == pytest.approx(1 / n, rel=1e-15)  # pass@1 = c / n
    # Large n stays exact (integer binomials): C(199, 8) / C(200, 8) = 192 / 200.
    assert pass_at_k(200, 1, 8) == pytest.approx(8 / 200, rel=1e-15)


def test_pass_at_k_rejects_impossible_arguments():
    for n, c, k in ((4, 0, 5), (4, 5, 1), (4, -1, 1), (4, 1, 0)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)
    check_pass_at([1, 4, 8], 8)
    with pytest.raises(ValueError, match=r"pass@8 needs 8 samples per prompt but there are 4"):
        check_pass_at([1, 8], 4)


# ----------------------------------------------------------------------------- the table


def test_benchmark_table():
    gsm8k, math500 = get_benchmark("gsm8k"), get_benchmark("math500")
    assert hub.parse_dataset_uri(gsm8k.data) == {
        "path": "openai/gsm8k", "name": "main", "split": "test", "revision": None}
    assert hub.parse_dataset_uri(math500.data) == {
        "path": "HuggingFaceH4/MATH-500", "name": None, "split": "test", "revision": None}
    assert (gsm8k.prompt_key, gsm8k.answer_key) == ("question", "answer")
    assert (math500.prompt_key, math500.answer_key) == ("problem", "answer")
    for bench in BENCHMARKS.values():
        assert resolve_reward_fn(bench.reward) is math_reward
    row = GSM8K_TEST[0]
    assert gsm8k.prompt(row) == f"{row['question']}\n{BOXED_INSTRUCTION}"
    assert "\\boxed{}" in BOXED_INSTRUCTION
    # The GSM8K reward reads the number after #### of the reference.
    assert math_reward("3 + 4 = 7, so \\boxed{7}", row[gsm8k.answer_key]) == 1.0
    assert math_reward("\\boxed{2400}", GSM8K_TEST[1]["answer"]) == 1.0
    assert math_reward("\\boxed{3}", row[gsm8k.answer_key]) == 0.0
    assert math_reward("so it is \\boxed{0.75}", MATH500_TEST[0][math500.answer_key]) == 1.0
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k': use one of gsm8k, math500"):
        get_benchmark("gsm9k")


# ----------------------------------------------------------------------------- eval.py


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    add_hub_model(home, MODEL_ID)
    add_hub_dataset(home, "openai/gsm8k", "main", {"test": GSM8K_TEST})
    add_hub_dataset(home, "HuggingFaceH4/MATH-500", "default", {"test": MATH500_TEST})
    return home


def _eval(args: list[str], env: dict[str, str], timeout: float = 300):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "eval.py"), *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def _env(hf_home):  # reward workers import known_answers from this module
    return offline_env(hf_home, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))


SMALL = ["--max-new-tokens", "6", "--max-seq-len", "192", "--max-slots", "16"]


@pytest.mark.slow
def test_eval_gsm8k_and_math500_from_the_offline_cache(hf_home, tmp_path):
    """Each benchmark end to end: the hub dataset from the datasets cache, the benchmark's
    columns, prompt and math reward, pass@k for each k of --pass-at, a table and the JSON."""
    env = _env(hf_home)
    for name, rows, n, ks in (("gsm8k", GSM8K_TEST, 4, [1, 2, 4]),
                              ("math500", MATH500_TEST, 2, [1, 2])):
        out = tmp_path / f"{name}.json"
        res = _eval(["--model", MODEL_ID, "--benchmark", name, "-n", str(n), "--pass-at",
                     ",".join(map(str, ks)), *SMALL, "--out", str(out)], env)
        assert res.returncode == 0, res.stderr[-3000:]
        result = json.loads(out.read_text())
        assert result["benchmark"] == name and result["data"] == BENCHMARKS[name].data
        assert result["reward"] == "math" and result["model"] == MODEL_ID
        assert result["n_prompts"] == len(rows) and result["n_samples"] == n
        assert list(result["pass_at"]) == [str(k) for k in ks]
        values = [result["pass_at"][str(k)] for k in ks]
        assert all(0.0 <= v <= 1.0 for v in values)
        assert values == sorted(values)  # pass@k never falls as k grows
        # With a 0/1 reward pass@1 is the mean reward, and pass@n is "any sample correct".
        assert result["pass_at"]["1"] == pytest.approx(result["mean_reward"], abs=1e-12)
        assert result["pass_at"][str(n)] == result["pass_at_k"]
        assert result["mean_reward"] == result["accuracy"]
        table = res.stdout
        assert f"on {name}" in table and f"{len(rows)} x {n} samples" in table
        for k in ks:
            assert f"pass@{k}" in table
        assert "mean reward" in table


def test_eval_benchmark_answers_reach_the_reward(hf_home, tmp_path):
    """With a reward that scores the reference only, pass@k is exactly 2/3 for every k:
    the GSM8K answers reach the reward as the dataset writes them, prompt by prompt."""
    out = tmp_path / "known.json"
    res = _eval(["--model", MODEL_ID, "--benchmark", "gsm8k", "-n", "3", "--pass-at", "1,3",
                 "--reward", "test_eval_benchmarks:known_answers", *SMALL, "--out", str(out)],
                _env(hf_home))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["reward"] == "test_eval_benchmarks:known_answers"
    assert result["pass_at"] == {"1": pytest.approx(2 / 3), "3": pytest.approx(2 / 3)}
    assert result["mean_reward"] == pytest.approx(2 / 3)


def _eval_script():
    spec = importlib.util.spec_from_file_location("eval_script", REPO / "scripts" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_bad_arguments_are_one_line_and_exit_2(capsys):
    """Unknown benchmark, k > n, a malformed --pass-at, no dataset: one line on stderr and
    exit status 2, before any model is loaded."""
    main = _eval_script().main
    cases = [
        (["--benchmark", "gsm9k"],
         "error: unknown benchmark 'gsm9k': use one of gsm8k, math500, or --data"),
        (["--benchmark", "gsm8k", "-n", "4", "--pass-at", "1,8"],
         "error: pass@8 needs 8 samples per prompt but there are 4"),
        (["--benchmark", "gsm8k", "--pass-at", "1,x"], "error: --pass-at '1,x': give"),
        (["--benchmark", "math500", "--pass-at", "0"], "error: pass@0: k must be at least 1"),
        ([], "error: name a --benchmark (gsm8k, math500) or a --data set"),
    ]
    for args, start in cases:
        assert main(["--model", "areal-test/never-loaded", *args]) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(start), (args, lines)


def test_eval_bad_numbers_and_reward_are_one_line_and_exit_2(capsys):
    """issue 39 items 11-12: --temperature -1, --max-new-tokens -5 and an unimportable
    --reward were tracebacks (exit 1); --max-new-tokens 0 silently became 64. Each is one
    line naming the flag and exit 2, before a server starts."""
    main = _eval_script().main
    cases = [
        (["--benchmark", "gsm8k", "--temperature", "-1"], "error: --temperature: temperature "),
        (["--benchmark", "gsm8k", "--temperature", "nan"], "error: --temperature: temperature "),
        (["--benchmark", "gsm8k", "--max-new-tokens", "-5"],
         "error: --max-new-tokens: max_new_tokens must be an int in [1, "),
        (["--data", "builtin:eval", "--max-new-tokens", "0"],
         "error: --max-new-tokens: max_new_tokens must be an int in [1, "),
        (["--data", "builtin:eval", "--max-prompts", "0"], "error: --max-prompts must be >= 1"),
        (["--data", "builtin:eval", "--reward-timeout", "0"],
         "error: --reward-timeout must be > 0"),
    ]
    for args, start in cases:
        assert main(["--model", "areal-test/never-loaded", *args]) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(start), (args, lines)
    # The reward resolves after the model and data (the run's own reward.fn may name it).
    assert main(["--model", "builtin:arith_sft", "--data", "builtin:eval",
                 "--reward", "nomod_xyz:fn"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: reward function 'nomod_xyz:fn': cannot import module "
                               "'nomod_xyz'"), lines


def test_eval_benchmark_not_cached_offline_is_one_line_and_exit_2(tmp_path):
    hf_home = tmp_path / "hf"
    add_hub_model(hf_home, MODEL_ID)  # the model only: no dataset in the cache
    res = _eval(["--model", MODEL_ID, "--benchmark", "math500"], _env(hf_home), timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith("error: --data hf://HuggingFaceH4/MATH-500?split=test is not in "
                               "the datasets cache"), lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0]
