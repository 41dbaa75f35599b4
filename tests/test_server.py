"""The engine's HTTP server, as a real subprocess on 127.0.0.1: protocol fields, control
routes, API key, and malformed requests (each a 4xx with a specific message)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from areal_jax.engine.launch import ServerStartError, launch_server
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.server_fixtures import http_client, start_server

API_KEY = "test-key"
MAX_SEQ_LEN = 512
VOCAB = 128


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("server_ckpt"), seed=0)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    # Same shapes as tests/test_client.py: the shared compilation cache skips recompiling.
    with start_server(ckpt, tmp_path_factory, max_slots=16, max_seq_len=MAX_SEQ_LEN,
                      api_key=API_KEY,
                      allowed_weight_dirs=[tmp_path_factory.getbasetemp()]) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(server):
    with http_client(server.url, API_KEY, timeout=120.0) as client:
        yield client


def gen_body(**sampling):
    return {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, **sampling}}


def test_generate_reply_has_sglang_fields(http):
    r = http.post("/generate", json=gen_body())
    assert r.status_code == 200, r.text
    data = r.json()
    meta = data["meta_info"]
    assert len(data["output_ids"]) == 8 and meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["weight_version"] == "0"
    assert [e[1] for e in meta["output_token_logprobs"]] == data["output_ids"]
    assert all(e[0] <= 0.0 and e[2] is None for e in meta["output_token_logprobs"])
    assert isinstance(data["text"], str)
    info = http.get("/get_server_info").json()
    assert info["weight_version"] == "0" and info["num_compilations"] >= 2
    assert http.get("/get_model_info").json()["is_generation"] is True


def test_seeded_sampling_is_reproducible_over_http(http):
    body = gen_body(temperature=1.0, sampling_seed=42, max_new_tokens=16, ignore_eos=True)
    first = http.post("/generate", json=body).json()["output_ids"]
    assert http.post("/generate", json=body).json()["output_ids"] == first
    body["sampling_params"]["sampling_seed"] = 43
    assert http.post("/generate", json=body).json()["output_ids"] != first


def test_control_routes(http):
    r = http.post("/update_weight_version", json={"new_version": "5"})
    assert r.status_code == 200 and r.json()["new_version"] == "5"
    assert http.post("/generate", json=gen_body()).json()["meta_info"]["weight_version"] == "5"
    http.post("/update_weight_version", json={"new_version": "0"})
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/flush_cache").status_code == 200

    # /abort_request on a running request returns its partial output as abort.
    result = {}

    def run():
        body = gen_body(max_new_tokens=500, ignore_eos=True)  # long: the abort lands mid-run
        result["reply"] = http.post("/generate", json={**body, "rid": "to-abort"}).json()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while http.get("/get_server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert http.post("/abort_request", json={"rid": "to-abort"}).json()["num_aborted_requests"] == 1
    t.join(60)
    meta = result["reply"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert len(result["reply"]["output_ids"]) < MAX_SEQ_LEN - 3


def _expect_4xx(http, route, *, json=None, content=None, status=400, match, method="POST"):
    r = http.request(method, route, json=json, content=content)
    assert r.status_code == status, (route, json, content, r.status_code, r.text)
    message = r.json()["error"]
    assert match in message, (match, message)


BAD_GENERATE = [  # (body, substring of the error message)
    ({}, "missing required field 'input_ids'"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": "1 2 3"}, "input_ids must be a list"),
    ({"input_ids": [1, "a"]}, "input_ids[1] must be an integer"),
    ({"input_ids": [1, 2.5]}, "input_ids[1] must be an integer"),
    ({"input_ids": [1, True]}, "input_ids[1] must be an integer"),
    ({"input_ids": [-3]}, "input_ids[0]=-3 is outside the vocabulary"),
    ({"input_ids": [VOCAB]}, f"outside the vocabulary [0, {VOCAB})"),
    ({"input_ids": [[1, 2], 3]}, "input_ids[1] must be a list of integers (batched"),
    ({"input_ids": [[1, 2], []]}, "prompt 1 of the batch: input_ids is empty"),
    ({"input_ids": [[1, 2], [VOCAB]]}, "prompt 1 of the batch: input_ids[0]"),
    ({"input_ids": [[1], [2]], "rid": "one"}, "rid must be a list of strings"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid must hold distinct strings"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params is a list of 1"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_p": 0}]},
     "prompt 1 of the batch: sampling_params.top_p"),
    ({"text": "hello"}, "text prompts are not supported"),
    ({"input_ids": [1] * MAX_SEQ_LEN}, f"context length is {MAX_SEQ_LEN}"),
    ({"input_ids": [1], "sampling_params": "fast"}, "sampling_params must be a JSON object"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens must be"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature must be"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be a number in (0, 1]"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p must be a number in (0, 1]"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disabled)"),
    ({"input_ids": [1], "sampling_params": {"top_k": 2.5}}, "top_k must be -1 (disabled)"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1, "x"]}},
     "stop_token_ids must be a list of integers"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}},
     "stop_token_ids contains 999"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": -1}}, "sampling_seed must be"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos must be true"),
    ({"input_ids": [1], "sampling_params": {"foo": 1}}, "unknown field 'foo'"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "is not supported"),
    ({"input_ids": [1], "sampling_params": {"stop": ["\n"]}}, "use stop_token_ids"),
    ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
    ({"input_ids": [1], "rid": 123}, "rid must be a non-empty string"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be true or false"),
    ({"input_ids": [1], "foo": 1}, "unknown field 'foo'"),
]


def test_malformed_requests_get_4xx_and_server_stays_up(http, server, tmp_path):
    _expect_4xx(http, "/generate", content=b"{bad", match="not valid JSON")
    _expect_4xx(http, "/generate", content=b"", match="body is empty")
    _expect_4xx(http, "/generate", json=[1, 2], match="must be a JSON object, got list")
    for body, match in BAD_GENERATE:
        _expect_4xx(http, "/generate", json=body, match=match)
    _expect_4xx(http, "/pause_generation", json={"mode": "retract"},
                match="mode='retract' is not supported")
    _expect_4xx(http, "/update_weights_from_disk", json={},
                match="missing required field 'model_path'")
    _expect_4xx(http, "/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")},
                match="does not exist")
    _expect_4xx(http, "/update_weights_from_disk", json={"model_path": str(tmp_path)},
                match="has no config.json")
    _expect_4xx(http, "/update_weights_from_disk",
                json={"model_path": str(tmp_path), "weight_version": 3},
                match="weight_version must be a string")
    wide = make_tiny_hf_checkpoint(tmp_path, seed=3, hidden_size=48)
    _expect_4xx(http, "/update_weights_from_disk", json={"model_path": str(wide)},
                match="hidden_size=48")
    _expect_4xx(http, "/update_weight_version", json={},
                match="missing required field 'new_version'")
    _expect_4xx(http, "/abort_request", json={}, match="give a rid")
    _expect_4xx(http, "/generate", method="GET", status=405, match="Method Not Allowed")
    _expect_4xx(http, "/no_such_route", status=404, match="Not Found")
    r = httpx.post(f"{server.url}/generate", json=gen_body(), timeout=30)
    assert r.status_code == 401 and "API key" in r.json()["error"]

    # A rid that is already in flight (queued while paused) is refused.
    assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    replies = {}
    t = threading.Thread(target=lambda: replies.update(
        first=http.post("/generate", json={**gen_body(), "rid": "dup"})))
    t.start()
    deadline = time.monotonic() + 60
    while http.get("/get_server_info").json()["num_waiting_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _expect_4xx(http, "/generate", json={**gen_body(), "rid": "dup"}, match="already in flight")
    assert http.post("/continue_generation").status_code == 200
    t.join(60)
    assert replies["first"].status_code == 200

    assert http.get("/health").status_code == 200
    ok = http.post("/generate", json=gen_body())
    assert ok.status_code == 200 and ok.json()["meta_info"]["weight_version"] == "0"
    assert server.alive()


def test_bad_model_path_fails_startup_with_message(tmp_path):
    with pytest.raises(ServerStartError, match="does not exist"):
        launch_server(tmp_path / "missing", startup_timeout=120)


def test_data_parallel_server_matches_single_device_server(http, ckpt):
    """``--data-parallel 2`` makes its own two CPU devices and splits the slots; a seeded
    sampled request and a greedy one come back identical to the one-device server's."""
    bodies = [gen_body(max_new_tokens=12, ignore_eos=True),
              gen_body(temperature=1.0, sampling_seed=7, max_new_tokens=12, ignore_eos=True)]
    expected = [http.post("/generate", json=b).json()["output_ids"] for b in bodies]
    with launch_server(ckpt, max_slots=16, max_seq_len=MAX_SEQ_LEN,
                       extra_args=["--data-parallel", "2"]) as dp_server:
        with httpx.Client(base_url=dp_server.url, timeout=120.0) as dp_http:
            assert dp_http.get("/get_server_info").json()["data_parallel"] == 2
            got = [dp_http.post("/generate", json=b).json()["output_ids"] for b in bodies]
    assert got == expected
