"""Scoring without generating (SGLang's ``max_new_tokens: 0`` + ``logprob_start_len``) on a
real embedded server, checked against a transformers forward of the same tokens, and the
distillation teacher's client on it (and on a faulty server of the test's own)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from areal_jax.rewards.teacher import TeacherError, TeacherScorer, TeacherSettings
from tests.hf_fixtures import make_tiny_hf_checkpoint, token_logprob_tolerance
from tests.server_fixtures import http_client, start_server

MAX_SEQ_LEN = 64
VOCAB = 128


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("teacher_ckpt"), tie=False, seed=3)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with start_server(ckpt, tmp_path_factory, max_slots=8, max_seq_len=MAX_SEQ_LEN) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(server):
    with http_client(server.url, None, timeout=120.0) as client:
        yield client


def hf_token_logprobs(ckpt, seq):
    """log p(seq[t] | seq[:t]) for t >= 1 by transformers, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[t - 1, seq[t]]) for t in range(1, len(seq))]


def sequences():
    rng = np.random.default_rng(0)
    # lengths: short, crossing a padding width, and the whole context (only scoring may)
    return [rng.integers(0, VOCAB, n).tolist() for n in (5, 23, MAX_SEQ_LEN)]


def test_score_only_request_matches_transformers(http, ckpt):
    seqs = sequences()
    r = http.post("/generate", json={
        "input_ids": seqs, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}})
    assert r.status_code == 200, r.text
    replies = r.json()
    assert len(replies) == len(seqs)
    for seq, reply in zip(seqs, replies, strict=True):
        meta = reply["meta_info"]
        assert reply["output_ids"] == [] and meta["completion_tokens"] == 0
        assert meta["prompt_tokens"] == len(seq)
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == seq and entries[0][0] is None
        got = np.array([e[0] for e in entries[1:]])
        want = np.array(hf_token_logprobs(ckpt, seq))  # temperature 1 whatever was sent
        tol = token_logprob_tolerance(ckpt, seq)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_logprob_start_len_on_a_generating_request(http, ckpt):
    prompt = [5, 6, 7, 8, 9]
    r = http.post("/generate", json={
        "input_ids": prompt, "return_logprob": True, "logprob_start_len": 2,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert len(r.json()["output_ids"]) == 4
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[2:]
    want = hf_token_logprobs(ckpt, prompt)[1:]  # positions 2.. of the prompt
    np.testing.assert_allclose([e[0] for e in entries], want, rtol=0,
                               atol=token_logprob_tolerance(ckpt, prompt))
    # without logprob_start_len the reply has no input logprobs (as before)
    r = http.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 2}})
    assert "input_token_logprobs" not in r.json()["meta_info"]


@pytest.mark.parametrize(("body", "message"), [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}},
     "0 only scores the input"),
    ({"input_ids": [1, 2], "return_logprob": True, "sampling_params": {"max_new_tokens": 0}},
     "0 only scores the input"),
    ({"input_ids": [[1, 2], [3]], "return_logprob": True, "logprob_start_len": 0,
      "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 2}]},
     "mixes max_new_tokens 0"),
    ({"input_ids": [1] * (MAX_SEQ_LEN + 1), "return_logprob": True, "logprob_start_len": 0,
      "sampling_params": {"max_new_tokens": 0}}, f"context length is {MAX_SEQ_LEN}"),
])
def test_bad_scoring_requests_are_400(http, body, message):
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


def test_teacher_scorer_on_the_embedded_server(server, ckpt):
    seqs = sequences()
    teacher = TeacherScorer(TeacherSettings(url=server.url, timeout_s=120.0))
    try:
        logps = asyncio.run(teacher.token_logprobs(seqs))
    finally:
        teacher.close()
    for seq, lp in zip(seqs, logps, strict=True):
        assert len(lp) == len(seq) and lp[0] == 0.0
        np.testing.assert_allclose(lp[1:], hf_token_logprobs(ckpt, seq), rtol=0,
                                   atol=token_logprob_tolerance(ckpt, seq))
    assert teacher.metrics()["requests"] == 1 and teacher.metrics()["failed"] == 0


class _Faulty(BaseHTTPRequestHandler):
    mode = "500"
    calls = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        # "wrong_ids": a teacher with another tokenizer scores other token ids
        reply = [{"meta_info": {"input_token_logprobs": [[-1.0, t + 1, None] for t in ids]}}
                 for ids in body["input_ids"]]
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("mode", "message", "calls"), [
    ("500", "answered HTTP 500", 3), ("wrong_ids", "the student's tokenizer", 3)])
def test_teacher_failures_raise_after_retries(mode, message, calls):
    handler = type("Handler", (_Faulty,), {"mode": mode, "calls": 0})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    teacher = TeacherScorer(TeacherSettings(url=f"127.0.0.1:{httpd.server_port}", retries=2,
                                            backoff_s=0.01))
    try:
        with pytest.raises(TeacherError, match=message):
            asyncio.run(teacher.token_logprobs([[1, 2, 3]]))
    finally:
        teacher.close()
        httpd.shutdown()
    assert handler.calls == calls and teacher.metrics()["failed"] == 1
