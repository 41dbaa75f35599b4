"""Hostile input against the real engine server over HTTP on 127.0.0.1: out-of-range
numbers in every field, wrong types, bad JSON shapes, huge bodies, non-finite and
wrongly typed weight files, forbidden paths, wrong keys. Every one is a 4xx on a
keep-alive connection that stays open, and afterwards the server still answers a normal
request exactly as before."""

from __future__ import annotations

import http.client
import json
import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from areal_jax.engine.server import resolve_api_key
from tests.hf_fixtures import make_tiny_hf_checkpoint
from tests.server_fixtures import http_client as authed_client
from tests.server_fixtures import start_server

API_KEY = "hostile-test-key"
MAX_SEQ_LEN = 64
VOCAB = 128
WEIGHTS_FILE = "model.safetensors"


def write_variant(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``change(tensors)`` applied."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    return dst


def poison(value: float):
    def change(tensors):
        key = sorted(k for k in tensors if k.endswith("mlp.up_proj.weight"))[0]
        tensors[key] = tensors[key].copy()
        tensors[key][0, 0] = value
    return change


def overflow(tensors):
    """Finite float32 weights near the top of its range (max |w| = 3e38): a forward pass
    overflows, although no value is NaN or Inf."""
    for key, t in tensors.items():
        peak = float(np.abs(t).max())
        if peak > 0:
            tensors[key] = (t.astype(np.float64) * (3e38 / peak)).astype(np.float32)
    assert all(np.isfinite(t).all() for t in tensors.values())


def to_int(tensors):
    key = sorted(k for k in tensors if k.endswith("mlp.up_proj.weight"))[0]
    tensors[key] = tensors[key].astype(np.int32)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    allowed = root / "allowed"
    allowed.mkdir()
    model = make_tiny_hf_checkpoint(allowed, seed=0)
    outside = make_tiny_hf_checkpoint(root / "outside", seed=1)
    return {"root": root, "allowed": allowed, "model": model, "outside": outside}


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    with start_server(dirs["model"], tmp_path_factory, max_slots=4, max_seq_len=MAX_SEQ_LEN,
                      api_key=API_KEY, allowed_weight_dirs=[dirs["allowed"]]) as handle:
        yield handle


@pytest.fixture(scope="module")
def http_client(server):
    with authed_client(server.url, API_KEY) as client:
        yield client


def normal_body(**sampling):
    return {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, **sampling}}


@pytest.fixture(scope="module")
def baseline(http_client):
    r = http_client.post("/generate", json=normal_body())
    assert r.status_code == 200, r.text
    return r.json()


def assert_still_serves(http_client, baseline):
    assert http_client.get("/health").status_code == 200
    r = http_client.post("/generate", json=normal_body())
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == baseline["output_ids"]
    assert r.json()["meta_info"]["weight_version"] == baseline["meta_info"]["weight_version"]


class KeepAlive:
    """Raw requests on one HTTP/1.1 connection; fails if the server closes it."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def post(self, path: str, raw: bytes, headers: dict | None = None) -> tuple[int, dict]:
        hdrs = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json",
                **(headers or {})}
        self.conn.request("POST", path, body=raw, headers=hdrs)
        resp = self.conn.getresponse()
        body = resp.read()
        assert not resp.will_close, f"{path}: the server closed the connection ({resp.status})"
        assert self.conn.sock is self.sock, "the connection was re-opened"
        return resp.status, json.loads(body) if body else {}

    def close(self):
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------- item 1
OUT_OF_RANGE = [
    ("top_k", 2**31), ("top_k", 2**63), ("top_k", -2), ("max_new_tokens", 2**31),
    ("max_new_tokens", 0), ("temperature", 1e-30), ("temperature", 1e39),
    ("temperature", -0.5), ("top_p", 1e-400), ("top_p", 2.0),
    ("sampling_seed", 2**64), ("sampling_seed", -1),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_out_of_range_sampling_field_is_400_naming_it(http_client, field, value):
    r = http_client.post("/generate", json=normal_body(**{field: value}))
    assert r.status_code == 400, r.text
    assert f"sampling_params.{field}" in r.json()["error"]


def test_engine_survives_out_of_range_numbers(http_client, baseline):
    """top_k >= 2**31 used to pass validation and kill the engine thread for good."""
    for body in ({**normal_body(), "logprob_start_len": 2**40},
                 {"input_ids": [2**31], "sampling_params": {}},
                 {"input_ids": [-1], "sampling_params": {}}):
        r = http_client.post("/generate", json=body)
        assert r.status_code == 400, r.text
    assert_still_serves(http_client, baseline)


@pytest.mark.parametrize(("route", "raw", "field"), [
    ("/generate", b'{"input_ids": [5], "rid": "r\\ud800"}', "rid"),
    ("/generate", b'{"input_ids": [5], "sampling_params": {"\\udfff": 1}}',
     "a key of sampling_params"),
    ("/update_weights_from_disk", b'{"model_path": "\\ud800"}', "model_path"),
    ("/update_weight_version", b'{"new_version": "v\\udc00"}', "new_version"),
    ("/load_lora_adapter", b'{"lora_name": "\\ud800", "lora_path": "x"}', "lora_name"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(
        server, http_client, baseline, route, raw, field):
    """Issue 33 item 5: valid JSON, not text. Echoing it back was a 500, and a weight
    version set to one made every later /get_server_info a 500."""
    with KeepAlive(server.url) as conn:
        status, body = conn.post(route, raw)
    assert status == 400, body
    assert f"{route}: {field} holds a lone UTF-16 surrogate" in body["error"], body
    assert http_client.get("/get_server_info").status_code == 200
    assert_still_serves(http_client, baseline)


# ---------------------------------------------------------------------- item 2
def test_a_server_started_on_weights_that_overflow_refuses_to_start(dirs, tmp_path_factory):
    """With --warmup (as the trainer starts its servers) the start weights pass the probe
    forward of a weight update too: a clear exit 2 instead of a 500 on every request."""
    from areal_jax.engine.launch import ServerStartError

    bad = write_variant(dirs["model"], tmp_path_factory.mktemp("start") / "overflow", overflow)
    with pytest.raises(ServerStartError) as info:
        start_server(bad, tmp_path_factory, max_slots=4, max_seq_len=MAX_SEQ_LEN, warmup=True,
                     startup_timeout=300)
    message = str(info.value)
    assert "exited with code 2" in message and "overflow float32 in use" in message, message
    assert f"model_path {bad}" in message and "Traceback" not in message


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "{not json"])
def test_a_config_json_that_is_not_an_object_is_a_400_naming_the_file(
        http_client, dirs, baseline, content):
    """Issue 33 item 7: a JSON list used to answer 400 AttributeError: 'list' object..."""
    bad = dirs["allowed"] / f"config-{abs(hash(content))}"
    if not bad.exists():
        shutil.copytree(dirs["model"], bad)
        (bad / "config.json").write_text(content)
    r = http_client.post("/update_weights_from_disk",
                         json={"model_path": str(bad), "weight_version": "9"})
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert str(bad / "config.json") in message and "JSON object" in message, message
    assert "AttributeError" not in message
    assert_still_serves(http_client, baseline)


@pytest.mark.parametrize(("name", "change", "match"), [
    ("nan", poison(float("nan")), "non-finite"),
    ("inf", poison(float("inf")), "non-finite"),
    ("ints", to_int, "dtype I32"),
    ("overflow", overflow, "overflow float32"),  # issue 33 item 5: every request was a 500
])
def test_bad_weight_files_are_refused_and_old_weights_keep_serving(
        http_client, dirs, baseline, name, change, match):
    bad = write_variant(dirs["model"], dirs["allowed"] / f"bad-{name}", change)
    r = http_client.post("/update_weights_from_disk",
                         json={"model_path": str(bad), "weight_version": "9"})
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and match in r.json()["message"]
    assert_still_serves(http_client, baseline)


# ---------------------------------------------------------------------- item 3
def test_malformed_bodies_are_4xx_on_a_connection_that_stays_open(server, dirs, http_client,
                                                                  baseline):
    listy = dirs["allowed"] / "config-is-a-list"
    shutil.copytree(dirs["model"], listy)
    (listy / "config.json").write_text("[1, 2, 3]")
    conn = KeepAlive(server.url)
    try:
        cases = [
            ("/generate", b"[" * 20_000 + b"]" * 20_000, ""),  # RecursionError in json
            ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
             "temperature"),
            ("/generate", b'{"input_ids": [1], "sampling_params": {"top_p": Infinity}}',
             "top_p"),
            ("/generate", b'{"input_ids": [NaN]}', "input_ids[0]"),
            ("/update_weights_from_disk", json.dumps({"model_path": str(listy)}).encode(),
             "weights not updated"),
        ]
        for path, raw, match in cases:
            status, body = conn.post(path, raw)
            assert 400 <= status < 500, (path, raw[:60], status, body)
            assert match in (body.get("error") or body.get("message")), body
        status, body = conn.post("/generate", json.dumps(normal_body()).encode())
        assert status == 200 and body["output_ids"] == baseline["output_ids"]
    finally:
        conn.close()


# ---------------------------------------------------------------------- item 4
def test_api_key_is_not_on_the_command_line(server, http_client):
    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")
    assert API_KEY not in cmdline
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(f"{server.url}/generate", json=normal_body(), headers=wrong,
                      timeout=30).status_code == 401
    assert http_client.get("/health").status_code == 200


def test_api_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("AREAL_JAX_API_KEY", "from-env")
    assert resolve_api_key(None, str(key_file)) == "from-file"
    assert resolve_api_key("from-flag", None) == "from-flag"
    assert resolve_api_key(None, None) == "from-env"
    monkeypatch.delenv("AREAL_JAX_API_KEY")
    assert resolve_api_key(None, None) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("a", str(key_file))
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(None, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--api-key-file"):
        resolve_api_key(None, str(tmp_path / "missing"))
    for empty in ("", "  "):  # as --api-key '': refused, never an open server by accident
        monkeypatch.setenv("AREAL_JAX_API_KEY", empty)
        with pytest.raises(ValueError, match=r"\$AREAL_JAX_API_KEY is set but empty"):
            resolve_api_key(None, None)


@pytest.mark.parametrize("argv, env_key, words", [
    (["--port", "99999"], None, "--port must be in [1, 65535], got 99999"),
    (["--port", "-1"], None, "--port must be in [1, 65535], got -1"),
    (["--api-key", ""], None, "--api-key is empty"),
    ([], "", "$AREAL_JAX_API_KEY is set but empty"),
    (["--weight-version", "v" * 257], None,
     "--weight-version is 257 characters long; the limit is 256"),
])
def test_serve_refuses_bad_start_arguments_with_exit_2(tmp_path, monkeypatch, capsys, argv,
                                                      env_key, words):
    """Before any model is loaded: one line naming the flag, exit 2 (a port out of range
    was announced and another one listened on; an empty key in the environment served
    with no authentication; a weight version the routes refuse was accepted)."""
    from areal_jax.engine.server import main

    monkeypatch.delenv("AREAL_JAX_API_KEY", raising=False)
    if env_key is not None:
        monkeypatch.setenv("AREAL_JAX_API_KEY", env_key)
    assert main(["--model-path", str(tmp_path / "never-loaded"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {words}"), err


def test_weight_paths_outside_the_allowed_dirs_are_403_and_say_nothing_more(
        http_client, dirs, baseline):
    link = dirs["allowed"] / "link-to-outside"
    if not link.exists():
        os.symlink(dirs["outside"], link)
    forbidden = [
        dirs["outside"],                               # a real checkpoint elsewhere
        dirs["root"] / "no-such-dir",                  # does not exist
        "/etc",                                        # exists, not a checkpoint
        f"{dirs['allowed']}/../outside",               # escapes with ..
        f"{dirs['allowed']}/../../x/evil://w",         # .. before a "://": no URL
        f"gs://b/../{dirs['allowed']}",               # .. in a URL
        link,                                          # escapes with a symlink
        "gs://some-bucket/weights",                    # a URL not allowed
    ]
    replies = []
    for path in forbidden:
        r = http_client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert r.status_code == 403, (path, r.text)
        replies.append(r.json())
    assert all(reply == replies[0] for reply in replies)  # nothing reveals existence
    assert "not in a directory this server may load" in replies[0]["message"]
    assert_still_serves(http_client, baseline)


# ---------------------------------------------------------------------- item 5
def test_body_limit_and_weight_version_length(server, http_client, baseline):
    huge = {"model_path": "x", "weight_version": "v" * 1_000_000}
    r = http_client.post("/update_weights_from_disk", json=huge)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"input_ids": ['
        for _ in range(20_000):
            yield b"1, 1, 1, 1, 1, "
        yield b"1]}"

    r = http_client.post("/generate", content=chunks())
    assert r.status_code == 413, r.text
    r = http_client.post("/update_weight_version", json={"new_version": "v" * 300})
    assert r.status_code == 400 and "new_version is 300 characters" in r.json()["error"]
    r = http_client.post("/update_weights_from_disk",
                         json={"model_path": "x", "weight_version": "v" * 300})
    assert r.status_code == 400 and "weight_version is 300 characters" in r.json()["error"]
    r = http_client.post("/generate", json={**normal_body(), "rid": "r" * 300})
    assert r.status_code == 400 and "rid is 300 characters" in r.json()["error"]
    # The default limit admits the longest prompt max_seq_len allows, written loosely.
    longest = {"input_ids": [VOCAB - 1] * (MAX_SEQ_LEN - 1),
               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    raw = json.dumps(longest, indent=8).encode()
    r = http_client.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert http_client.get("/get_server_info").json()["weight_version"] == "0"
    assert_still_serves(http_client, baseline)


# ---------------------------------------------------------------------- the battery
def hostile_requests(dirs) -> list[tuple[str, str, object, int]]:
    """(method, route, body, expected status). ``bytes`` bodies are sent raw."""
    g = normal_body
    return [
        ("POST", "/generate", b"", 400),
        ("POST", "/generate", b"{", 400),
        ("POST", "/generate", b"\xff\xfe", 400),
        ("POST", "/generate", b"null", 400),
        ("POST", "/generate", b'"text"', 400),
        ("POST", "/generate", b"1e999", 400),
        ("POST", "/generate", {"input_ids": "1 2 3"}, 400),
        ("POST", "/generate", {"input_ids": [[[1, 2]]]}, 400),  # batch form, one level too deep
        ("POST", "/generate", {"input_ids": [[1]] * 4097}, 400),  # over MAX_BATCH_ITEMS
        ("POST", "/generate", {"input_ids": [[1, 2], [10**12]]}, 400),
        ("POST", "/generate", {"input_ids": [[1], [2]], "rid": [1, 2]}, 400),
        ("POST", "/generate", {"input_ids": [1.5]}, 400),
        ("POST", "/generate", {"input_ids": [True]}, 400),
        ("POST", "/generate", {"input_ids": [VOCAB]}, 400),
        ("POST", "/generate", {"input_ids": [1] * MAX_SEQ_LEN}, 400),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": [1]}, 400),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": "hot"}, 400),
        ("POST", "/generate", g(max_new_tokens=10**30), 400),
        ("POST", "/generate", g(max_new_tokens=True), 400),
        ("POST", "/generate", g(temperature=[1]), 400),
        ("POST", "/generate", g(top_k=1.0), 400),
        ("POST", "/generate", g(top_p={"a": 1}), 400),
        ("POST", "/generate", g(stop_token_ids=[VOCAB]), 400),
        ("POST", "/generate", g(stop_token_ids=[2**40]), 400),
        ("POST", "/generate", g(stop_token_ids="3"), 400),
        ("POST", "/generate", g(sampling_seed=1.5), 400),
        ("POST", "/generate", g(n=4), 400),
        ("POST", "/generate", g(ignore_eos=1), 400),
        ("POST", "/generate", {**g(), "rid": ""}, 400),
        ("POST", "/generate", {**g(), "top_logprobs_num": 10**9}, 400),
        ("POST", "/generate", {**g(), "text": "hi"}, 400),
        ("POST", "/generate", {**g(), "stream": True}, 400),
        ("POST", "/pause_generation", {"mode": 7}, 400),
        ("POST", "/pause_generation", b"[]", 400),
        ("POST", "/update_weights_from_disk", {"model_path": 5}, 400),
        ("POST", "/update_weights_from_disk", {"model_path": ""}, 400),
        ("POST", "/update_weights_from_disk", {"model_path": "a\x00b"}, 403),
        ("POST", "/update_weights_from_disk", {"model_path": "/"}, 403),
        ("POST", "/update_weights_from_disk", {"model_path": str(dirs["allowed"])}, 400),
        ("POST", "/update_weights_from_disk",
         {"model_path": str(dirs["model"]), "load_format": "pt"}, 400),
        ("POST", "/update_weights_from_disk",
         {"model_path": str(dirs["model"]), "abort_all_requests": "yes"}, 400),
        ("POST", "/update_weight_version", {"new_version": 3}, 400),
        ("POST", "/abort_request", {"rid": ["x"]}, 400),
        ("POST", "/abort_request", {"abort_all": "true"}, 400),
        ("POST", "/v1/completions", {"model": "m", "prompt": [1, 2], "temperature": 1e-9}, 400),
        ("POST", "/v1/completions", {"model": "m", "prompt": [1, 2], "seed": 2**64}, 400),
        ("POST", "/v1/completions", b"[" * 20_000 + b"]" * 20_000, 400),
        ("GET", "/generate", None, 405),
        ("DELETE", "/flush_cache", None, 405),
        ("GET", "/../../etc/passwd", None, 404),
    ]


def test_hostile_battery_then_a_normal_request(server, dirs, http_client, baseline):
    cases = hostile_requests(dirs)
    for method, route, body, expected in cases:
        if isinstance(body, bytes):
            r = http_client.request(method, route, content=body,
                                    headers={"Content-Type": "application/json"})
        else:
            r = http_client.request(method, route, json=body)
        assert r.status_code == expected, (method, route, str(body)[:80], r.status_code, r.text)
        assert len(r.content) < 4096, (route, len(r.content))  # errors do not echo huge input
    # Wrong keys, and no key.
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": API_KEY},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        r = httpx.post(f"{server.url}/generate", json=normal_body(), headers=headers, timeout=30)
        assert r.status_code == 401
    assert server.alive()
    assert_still_serves(http_client, baseline)
