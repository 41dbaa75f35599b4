"""Model-judged rewards (``reward.fn: judge``): the judge client against a faulty judge server
of the test's own (500s, garbage, timeouts: each gives the documented outcome, never a
silent 0), and end to end with an embedded engine server on 127.0.0.1 as the judge."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from areal_jax.rewards.judge import (
    JudgeReward,
    JudgeSettings,
    JudgeUnparsable,
    api_key_from_env,
    parse_score,
)

PATTERN = re.compile(r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)")


def test_parse_score_takes_the_last_score_in_range():
    assert parse_score("Score: 0 ... on reflection, Score: 1", PATTERN, 0, 1) == 1.0
    assert parse_score("score=0.25", PATTERN, 0, 1) == 0.25
    for text in ("I think it is right", "Score: 7", "Score: nan"):
        with pytest.raises(JudgeUnparsable):
            parse_score(text, PATTERN, 0, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"template": "{question} {student}"}, "names ['student']"),
    ({"template": "{question} only"}, "must contain {answer}"),
    ({"score_pattern": "Score: \\d"}, "needs a group"),
    ({"score_pattern": "("}, "is not a regex"),
    ({"on_failure": "fallback"}, "needs fallback_score"),
    ({"on_failure": "zero"}, "on_failure must be one of"),
])
def test_bad_settings_name_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        JudgeSettings(url="127.0.0.1:1", **kwargs)


def test_api_key_comes_from_the_named_variable(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-123")
    assert api_key_from_env("MY_JUDGE_KEY") == "sk-123"
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(ValueError, match="MY_JUDGE_KEY"):
        api_key_from_env("MY_JUDGE_KEY")


class JudgeServer:
    """An OpenAI-style /v1/chat/completions of the test's own. ``script`` is the behaviour of
    each request in turn (the last one repeats, or all cycle): "ok" answers "Score: 1" if
    the prompt's answer holds "right", else "Score: 0"; "500", "garbage" (200 with no
    score), "notjson" and "slow" (answers after ``slow_s``)."""

    def __init__(self, script: list[str], slow_s: float = 2.0, cycle: bool = False) -> None:
        self.script, self.slow_s, self.cycle = script, slow_s, cycle
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.bodies.append(body)
                    outer.headers.append(dict(self.headers))
                    n = len(outer.bodies)
                    step = (outer.script[(n - 1) % len(outer.script)] if outer.cycle
                            else outer.script[min(n, len(outer.script)) - 1])
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    self._answer(step, body)
                finally:
                    with lock:
                        outer.in_flight -= 1

            def _answer(self, step, body):
                if step == "500":
                    return self._send(500, b'{"error": "boom"}')
                if step == "notjson":
                    return self._send(200, b"<html>oops</html>")
                if step == "slow":
                    time.sleep(outer.slow_s)
                prompt = body["messages"][-1]["content"]
                text = ("the answer looks fine" if step == "garbage" else
                        "Score: 1" if "right" in prompt.split("Student's answer:")[-1]
                        else "Score: 0")
                if step == "ok":
                    time.sleep(0.05)  # long enough for concurrent calls to overlap
                reply = {"choices": [{"index": 0, "message": {"role": "assistant",
                                                              "content": text}}]}
                self._send(200, json.dumps(reply).encode())

            def _send(self, status, data):
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def judge_server(request):
    server = JudgeServer(request.param)
    yield server
    server.close()


def judge(server, **kwargs):
    return JudgeReward(JudgeSettings(url=server.url, backoff_s=0.01, **kwargs))


def score(reward, answer, question="Q:1+1=", reference="2"):
    counts: Counter = Counter()
    result = asyncio.run(reward.ascore(answer, reference, question=question,
                                       count=lambda name, n: counts.update({name: n})))
    return result, counts


@pytest.mark.parametrize(("judge_server", "counter"), [
    (["500"], "judge_http_errors"), (["garbage"], "judge_unparsable"),
    (["notjson"], "judge_http_errors"), (["slow"], "judge_timeouts")], indirect=["judge_server"])
def test_a_failing_judge_rejects_the_sample_after_its_retries(judge_server, counter):
    reward = judge(judge_server, retries=2, timeout_s=0.5)
    try:
        (value, why), counts = score(reward, "A:2 right")
    finally:
        reward.close()
    assert value is None and "failed after 3 tries" in why
    assert counts[counter] == 3 and counts["judge_requests"] == 3 and counts["judge_retries"] == 2
    assert counts["judge_failed"] == 1 and counts["judge_ok"] == 0
    assert len(judge_server.bodies) == 3


@pytest.mark.parametrize("judge_server", [["500"]], indirect=True)
def test_fallback_scores_a_failed_judgment_and_counts_it(judge_server):
    reward = judge(judge_server, retries=0, on_failure="fallback", fallback_score=0.5)
    try:
        (value, why), counts = score(reward, "A:2 right")
    finally:
        reward.close()
    assert (value, why) == (0.5, None)
    assert counts["judge_fallbacks"] == 1 and counts["judge_failed"] == 1


@pytest.mark.parametrize("judge_server", [["500", "garbage", "ok"]], indirect=True)
def test_retries_reach_a_good_reply_and_the_request_is_the_template(judge_server):
    reward = judge(judge_server, retries=2, model="judge-model", system_prompt="Be strict.",
                   template="Q={question} ref={reference} Student's answer: {answer}")
    try:
        (value, why), counts = score(reward, "it is right", question="Q:1+1=")
    finally:
        reward.close()
    assert (value, why) == (1.0, None) and counts["judge_retries"] == 2
    body = judge_server.bodies[-1]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    assert body["messages"] == [
        {"role": "system", "content": "Be strict."},
        {"role": "user", "content": "Q=Q:1+1= ref=2 Student's answer: it is right"}]


@pytest.mark.parametrize("judge_server", [["ok"]], indirect=True)
def test_identical_judgments_are_asked_once_and_concurrency_is_limited(judge_server):
    reward = judge(judge_server, max_concurrency=2, api_key="sk-test")
    answers = [f"A:{i} {'right' if i % 2 else 'wrong'}" for i in range(8)]

    async def many():
        calls = [reward.ascore(a, "2", question="Q:1+1=") for a in answers + answers]
        return await asyncio.gather(*calls)

    try:
        results = asyncio.run(many())
        again, _ = score(reward, answers[1])  # a finished judgment: from the cache
    finally:
        reward.close()
    assert [v for v, _ in results] == [float(i % 2) for i in range(8)] * 2
    assert again == (1.0, None)
    assert len(judge_server.bodies) == 8  # 17 calls, 8 distinct judgments
    assert reward.metrics()["cache_hits"] == 9
    assert judge_server.max_in_flight == 2
    assert judge_server.headers[0]["Authorization"] == "Bearer sk-test"


# ----------------------------------------------------------------------------------------------
# End to end: an embedded engine server on 127.0.0.1 is the judge (the shipped demo judge).


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    from areal_jax.run_inputs import ASSETS_DIR
    from tests.server_fixtures import start_server

    with start_server(ASSETS_DIR / "arith_judge", tmp_path_factory, max_slots=16,
                      max_seq_len=96) as handle:
        yield handle.url


def demo_judge(url):
    """The settings of configs/tiny_demo_judge.yaml."""
    return JudgeReward(JudgeSettings(
        url=url, endpoint="completions", template="{question}{answer};{reference}=",
        score_pattern=r"^\s*([01])", max_tokens=2, timeout_s=120))


def test_the_embedded_judge_grades_like_the_verifier(judge_url):
    """The demo's judge behind the embedded server's /v1/completions: right and wrong answers
    to held-out problems get the verifier's reward, and each reward is what the server's
    own reply says."""
    from areal_jax.data import builtin_task as bt
    from areal_jax.rewards.builtin import builtin_reward

    items = bt.make_split("eval")[:2]
    cases = [(it, answer) for it in items for answer in (
        it["solution"], it["solution"][: it["solution"].rindex("A:")] + "A:41")]
    reward = demo_judge(judge_url)

    async def all_scores():
        return await asyncio.gather(*(reward.ascore(a, it["answer"], question=it["question"])
                                      for it, a in cases))

    try:
        results = asyncio.run(all_scores())
    finally:
        reward.close()
    assert all(why is None for _, why in results)
    scores = [v for v, _ in results]
    assert scores == [builtin_reward(a, it["answer"]) for it, a in cases]
    it, a = cases[0]
    direct = httpx.post(f"{judge_url}/v1/completions", timeout=120, json={
        "model": "default", "prompt": f"{it['question']}{a};{it['answer']}=", "max_tokens": 2,
        "temperature": 0.0})
    assert direct.json()["choices"][0]["text"].startswith("1")


def test_rlvr_workflow_rewarded_by_the_embedded_judge(judge_url):
    """A group sampled from the demo policy (a server of its own) is rewarded by the judge
    server: rewards in {0, 1}, every sample judged (identical answers asked once)."""
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.workflows import RLVRWorkflow, WorkflowContext
    from areal_jax.run_inputs import ASSETS_DIR
    from areal_jax.sampling_params import SamplingParams
    from areal_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(ASSETS_DIR / "arith_sft")
    reward = demo_judge(judge_url)
    # the judge server is a policy too (the demo model, fine-tuned): it samples the group
    workflow = RLVRWorkflow(reward, n_samples=4, tokenizer=tok,
                            gconfig=SamplingParams(max_new_tokens=24, temperature=1.0))
    counts: Counter = Counter()

    async def go():
        async with RolloutClient([judge_url]) as client:
            ctx = WorkflowContext(start_version=0, seed=3, group_id="g0", tokenizer=tok,
                                  _count=lambda name, n: counts.update({name: n}))
            return await workflow.arun(client, {"prompt_id": "p0", "prompt": "Q:17+5-8=",
                                                "answer": "14"}, ctx)

    try:
        group = asyncio.run(go())
    finally:
        reward.close()
    assert group is not None and len(group) == 4
    assert all(t.reward in (0.0, 1.0) for t in group)
    distinct = len({tok.decode(t.input_ids[t.loss_mask > 0].tolist(), skip_special_tokens=True)
                    for t in group})
    assert counts["judge_calls"] == 4 and counts["judge_requests"] == distinct
    assert counts["judge_ok"] == distinct


@pytest.mark.slow
def test_a_run_goes_on_through_a_faulty_judge(tmp_path):
    """train.py with a judge that answers in turn well, 500, garbage and too late: the failed
    judgments reject their groups (counted), the good ones train, and the run finishes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    server = JudgeServer(["ok"] * 3 + ["500"] + ["ok"] * 3 + ["garbage"] + ["ok"] * 3 + ["slow"],
                         slow_s=3.0, cycle=True)
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, str(repo / "scripts" / "train.py"), "--config",
           str(repo / "configs" / "tiny_demo.yaml"), f"run_dir={run_dir}", "reward.fn=judge",
           "reward.eval_fn=builtin",
           f"reward.judge={{url: '{server.url}', retries: 0, timeout_s: 1.0}}",
           "train.total_versions=2", "train.batch_size=4", "rollout.n_samples=4",
           "rollout.max_new_tokens=40", "rollout.max_slots=16", "eval.every_versions=0",
           "eval.at_start=false", "progress_bar=false", "rollout.server_cpu_cores=null",
           "rollout.learner_cpu_cores=null", "checkpoint.every_versions=0"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env,
                              cwd=repo)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "rollout/judge_calls" in r][-1]
    for key in ("judge_http_errors", "judge_unparsable", "judge_timeouts", "judge_ok",
                "reward_failed_groups"):
        assert last[f"rollout/{key}"] > 0, key
    assert last["rollout/judge_failed"] == (last["rollout/judge_http_errors"]
                                            + last["rollout/judge_unparsable"]
                                            + last["rollout/judge_timeouts"])
