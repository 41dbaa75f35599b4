"""The tool-calling demo (configs/arith_tools.yaml): the calculator tool, and the
``builtin:arith_tools`` checkpoint's tokenizer and chat template, which write a calculator
call in the task's vocabulary that the engine's Qwen-form parser reads, and render an
episode to the tokens the SFT traces (scripts/make_tools_checkpoint.py) were made of."""

from __future__ import annotations

import json

import pytest

from areal_jax.config import load_config
from areal_jax.data import builtin_task as bt
from areal_jax.engine.openai_api import chat_prompt_ids
from areal_jax.engine.tool_calls import HERMES, parse_tool_calls, tool_call_format
from areal_jax.rollout.agent_examples import CALCULATOR_TOOL, calculator
from areal_jax.run_inputs import ASSETS_DIR
from areal_jax.tokenizer import load_tokenizer

CALL, CLOSE, R_OPEN, R_CLOSE = 20, 21, 22, 23


def test_calculator():
    assert calculator("17+5-8") == "14" and calculator("3") == "3"
    assert calculator("2-9") == "-7"
    for bad in ["", "17+", "+5", "1+2*3", "2--1", "x", None]:
        assert calculator(bad) == "", bad


def test_checkpoint_writes_calls_the_parser_reads():
    tok = load_tokenizer(ASSETS_DIR / "arith_tools")
    assert tool_call_format(tok.chat_template) == HERMES
    generated = [CALL] + bt.encode("17+5-8") + [CLOSE, bt.EOS_ID]
    text = tok.decode(generated[:-1], skip_special_tokens=True)
    content, (call,) = parse_tool_calls(text, HERMES, {"calculator"})
    assert content is None and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "17+5-8"}
    # The episode as the agent sends it back renders to the SFT trace's tokens.
    messages = [{"role": "user", "content": "Q:17+5-8="},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": call["function"]}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "14"}]
    ids = chat_prompt_ids(tok, messages, [CALCULATOR_TOOL])
    assert ids == bt.encode("Q:17+5-8=") + generated + [R_OPEN] + bt.encode("14") + [R_CLOSE]


def test_config_loads():
    cfg = load_config("configs/arith_tools.yaml", [])
    assert cfg.rollout.workflow == "agent" and cfg.model.path == "builtin:arith_tools"
    assert cfg.rollout.agent.endswith(":arith_calculator_agent")


def test_a_missing_extra_is_named_before_anything_starts(tmp_path):
    """issue 39 item 3: without openai (the agent extra) the demo started its servers, then
    every agent failed with ModuleNotFoundError and the run stopped (exit 3). A package
    that is not installed is simulated by one that cannot be imported, first on the path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    shim = tmp_path / "shim" / "openai"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'openai'\", name='openai')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), str(repo)]))
    env.pop("XLA_FLAGS", None)
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, str(repo / "scripts" / "train.py"), "--config",
                          str(repo / "configs" / "arith_tools.yaml"), f"run_dir={run_dir}",
                          "rollout.server_cpu_cores=null", "rollout.learner_cpu_cores=null"],
                         capture_output=True, text=True, env=env, cwd=repo, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "error: rollout.agent areal_jax.rollout.agent_examples:arith_calculator_agent needs "
        "the openai package, which is not installed: pip install -e '.[agent]' (or pip "
        "install 'areal-jax[agent]')"), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not run_dir.exists()  # nothing was started or written


@pytest.mark.slow
def test_an_agent_run_evaluates_with_its_agent_and_reports_single_turn_apart(tmp_path):
    """Issue 39 item 6b: configs/arith_tools.yaml through scripts/train.py; its eval rows
    hold the agent's figure (eval_accuracy, with tool calls) and the single-turn one
    (eval_single_turn_accuracy), each named."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts" / "train.py"), "--config",
         str(repo / "configs" / "arith_tools.yaml"), f"run_dir={run_dir}",
         "train.total_versions=1", "train.batch_size=4", "rollout.n_samples=4",
         "rollout.max_slots=16", "data.max_eval_prompts=8", "eval.at_start=false",
         "progress_bar=false", "rollout.server_cpu_cores=null",
         "rollout.learner_cpu_cores=null", "checkpoint.every_versions=0"],
        capture_output=True, text=True, timeout=900, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r for r in rows if "eval_accuracy" in r]
    assert 0.0 <= last["eval_accuracy"] <= 1.0 and 0.0 <= last["eval_single_turn_accuracy"] <= 1.0
    assert last["eval_n_prompts"] == 8 and last["eval_single_turn_n_prompts"] == 8
    assert last["eval_tool_calls"] > 0 and last["eval_failed_groups"] == 0
    # issue 50 item 17: a healthy run printed 34 client warnings (reused keep-alive
    # connections the server had closed; connects held up while the learner compiled)
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
