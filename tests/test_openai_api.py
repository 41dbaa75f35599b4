"""The OpenAI-compatible routes of the engine server, driven by the official ``openai``
client against a real server on 127.0.0.1: completions, chat (the model's chat template),
streaming, logprobs, and bad input as 4xx in OpenAI's error shape. Each reply is checked
against the server's own /generate on the same token ids."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from areal_jax.tokenizer import load_tokenizer
from tests.hf_fixtures import arith_chat_model_dir
from tests.server_fixtures import start_server

API_KEY = "k"
MAX_SEQ_LEN = 256  # the model's own limit: room for long generations
LONG = 230  # tokens a request generates when a test must catch it running
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return arith_chat_model_dir(tmp_path_factory, "openai")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # One token per device call: a LONG request spans hundreds of engine steps, so a pause
    # sent once /get_server_info shows it running lands while it still runs (with 8 tokens
    # per call an 80-token request took ~10 calls and finished first on a fast machine).
    with start_server(model_dir, tmp_path_factory, max_slots=4, max_seq_len=MAX_SEQ_LEN,
                      extra_args=["--decode-steps", "1"], api_key=API_KEY) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120.0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


def native(server, ids, **sampling):
    r = httpx.post(f"{server.url}/generate", timeout=120.0,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"input_ids": ids, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, **sampling}})
    assert r.status_code == 200, r.text
    data = r.json()
    lps = [e[0] for e in data["meta_info"]["output_token_logprobs"]]
    return data["output_ids"], lps, data["meta_info"]["finish_reason"]["type"]


def visible(ids, lps):
    return (ids[:-1], lps[:-1]) if ids and ids[-1] == EOS else (ids, lps)


def test_completion_matches_generate_with_logprobs(server, client, tok):
    prompt = "Q:17+5-8="
    want_ids, want_lps, want_finish = native(server, tok.encode(prompt))
    r = client.completions.create(model="arith", prompt=prompt, max_tokens=24, temperature=0,
                                  logprobs=0)
    ids, lps = visible(want_ids, want_lps)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids, skip_special_tokens=True) and choice.text
    assert choice.finish_reason == want_finish
    assert choice.logprobs.tokens == [tok.decode([t]) for t in ids]
    # Greedy decoding of the same ids by the same engine: the same computation, so equal.
    np.testing.assert_array_equal(choice.logprobs.token_logprobs, lps)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want_ids)
    # Token ids are a prompt too; no logprobs unless asked.
    r2 = client.completions.create(model="arith", prompt=tok.encode(prompt), max_tokens=24,
                                   temperature=0)
    assert r2.choices[0].text == choice.text and r2.choices[0].logprobs is None


def test_chat_uses_the_models_chat_template(server, client, tok):
    messages = [{"role": "user", "content": "Q:3+4="},
                {"role": "assistant", "content": "3+4=7;A:7"},
                {"role": "user", "content": "Q:20-6+1="}]
    ids_in = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert ids_in == tok.encode("Q:3+4=3+4=7;A:7") + [EOS] + tok.encode("Q:20-6+1=")
    want_ids, want_lps, _ = native(server, ids_in)
    r = client.chat.completions.create(model="arith", messages=messages, max_tokens=24,
                                       temperature=0, logprobs=True)
    ids, lps = visible(want_ids, want_lps)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == tok.decode(ids, skip_special_tokens=True)
    np.testing.assert_array_equal([c.logprob for c in r.choices[0].logprobs.content], lps)
    assert r.usage.prompt_tokens == len(ids_in)
    assert client.models.list().data[0].object == "model"


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_gives_the_same_text_and_logprobs(client, chat):
    kwargs = dict(model="arith", max_tokens=24, temperature=1.0, seed=11, stream=True,
                  stream_options={"include_usage": True})
    if chat:
        plain = client.chat.completions.create(
            messages=[{"role": "user", "content": "Q:9+9-3="}], logprobs=True,
            **{**kwargs, "stream": False, "stream_options": None})
        chunks = list(client.chat.completions.create(
            messages=[{"role": "user", "content": "Q:9+9-3="}], logprobs=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
        want_text = plain.choices[0].message.content
        want_lps = [e.logprob for e in plain.choices[0].logprobs.content]
    else:
        plain = client.completions.create(prompt="Q:9+9-3=", logprobs=0,
                                          **{**kwargs, "stream": False, "stream_options": None})
        chunks = list(client.completions.create(prompt="Q:9+9-3=", logprobs=0, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lps = [x for c in chunks if c.choices and c.choices[0].logprobs
               for x in c.choices[0].logprobs.token_logprobs]
        want_text = plain.choices[0].text
        want_lps = plain.choices[0].logprobs.token_logprobs
    # Same seed, same engine: the same tokens, whether streamed or not.
    assert text == want_text and len(text) > 0
    np.testing.assert_array_equal(lps, want_lps)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


@pytest.mark.parametrize("kwargs, param, fragment", [
    (dict(n=2), "n", "n must be 1"),
    (dict(n=True), "n", "n must be 1"),  # true == 1 in Python, not in JSON
    (dict(extra_body={"best_of": True}), "best_of", "best_of must be 1"),
    (dict(stream=False, extra_body={"stream_options": {"include_usage": "yes"}}),
     "stream_options", "stream_options.include_usage must be true or false, got 'yes'"),
    (dict(extra_body={"ignore_eos": 1}), "ignore_eos", "ignore_eos must be true or false"),
    (dict(stop=["A"]), "stop", "stop strings are not supported"),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be a positive integer"),
    (dict(max_tokens=500), "max_tokens", f"exceeds the context length {MAX_SEQ_LEN}"),
    (dict(temperature=5.0), "temperature", "temperature must be a number in [0.0, 2.0]"),
    (dict(prompt="Q:1+1=" * 50), "prompt", f"the context length is {MAX_SEQ_LEN}"),
    (dict(prompt=[5, 99]), "prompt", "token id 99 is outside the vocabulary [0, 32)"),
    (dict(logprobs=3), "logprobs", "logprobs must be 0"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate", "unsupported field 'frobnicate'"),
])
def test_bad_completion_requests_get_openai_400s(client, kwargs, param, fragment):
    args = {"model": "arith", "prompt": "Q:1+1=", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    err = info.value.body
    assert info.value.status_code == 400 and fragment in err["message"], err
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_bad_chat_requests_and_bodies(server, client):
    for messages, fragment in [([], "messages must be a non-empty list"),
                               ([{"role": "robot", "content": "Q:"}], "messages[0].role='robot'"),
                               ([{"role": "user", "content": 3}], "content must be a string")]:
        with pytest.raises(openai.BadRequestError, match=None) as info:
            client.chat.completions.create(model="arith", messages=messages)
        assert fragment in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="arith", messages=[{"role": "user", "content": "Q:"}],
                                       logprobs=True, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # The server is still up and answering.
    assert client.completions.create(model="arith", prompt="Q:1+1=", max_tokens=2).choices


def test_a_weight_update_mid_request_is_invisible_to_the_client(server, client):
    """A completion aborted by /pause_generation resumes under the new weight version with
    its partial output appended: the client gets one reply of the full length, whose
    pieces came from versions 0 and 1."""
    import threading

    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = "Q:40-9-8-7+6-5="
    for _ in range(8):  # until the pause catches the request while it runs
        got: dict = {}

        def complete(out: dict = got) -> None:
            out["r"] = client.completions.create(model="arith", prompt=prompt, max_tokens=LONG,
                                                 temperature=0, extra_body={"ignore_eos": True})

        thread = threading.Thread(target=complete)
        thread.start()
        while thread.is_alive():
            info = httpx.get(f"{server.url}/get_server_info", headers=headers, timeout=60.0).json()
            if info.get("num_running_reqs", 0) > 0:
                break
        httpx.post(f"{server.url}/pause_generation", json={"mode": "abort"},
                   headers=headers, timeout=60.0)
        httpx.post(f"{server.url}/update_weight_version", json={"new_version": "1"},
                   headers=headers, timeout=60.0)
        httpx.post(f"{server.url}/continue_generation", headers=headers, timeout=60.0)
        thread.join()
        httpx.post(f"{server.url}/update_weight_version", json={"new_version": "0"},
                   headers=headers, timeout=60.0)
        reply = got["r"]
        assert reply.usage.completion_tokens == LONG and reply.choices[0].finish_reason == "length"
        if reply.model_extra.get("weight_versions") == ["0", "1"]:
            assert reply.model_extra["weight_version"] == "1"
            return
    pytest.fail("the pause never caught a running request in 8 tries")


def _info(server):
    return httpx.get(f"{server.url}/get_server_info", timeout=60.0,
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()


def _control(server, route, body=None):
    r = httpx.post(f"{server.url}{route}", json=body or {}, timeout=60.0,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text


def test_a_seed_at_the_top_of_its_range_survives_a_resume(server, client):
    """Issue 33 item 5: each resumed piece samples with seed + pieces so far; with a seed
    near 2**64 that left the seed range and every resumed request was a 500. It wraps."""
    import concurrent.futures

    def complete(i: int):
        try:
            return client.completions.create(
                model="arith", prompt=f"Q:40-9-8-{i}+6-5=", max_tokens=LONG, temperature=1.0,
                seed=2**64 - 1, extra_body={"ignore_eos": True})
        except openai.APIError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(40):  # until the pause catches a request while it runs
            futures = [pool.submit(complete, i) for i in range(4)]
            while not all(f.done() for f in futures) and \
                    _info(server).get("num_running_reqs", 0) == 0:
                pass
            _control(server, "/pause_generation", {"mode": "abort"})
            _control(server, "/continue_generation")
            replies = [f.result() for f in futures]
            errors = [r for r in replies if isinstance(r, Exception)]
            assert not errors, errors
            assert all(r.usage.completion_tokens == LONG for r in replies)
            if any(len(r.model_extra.get("weight_versions", [])) == 2 for r in replies):
                return  # one was resumed, with seed 2**64 (wrapped to 0)
    pytest.fail("the pause never caught a running request in 40 tries")


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", b'{"model": "arith", "prompt": "Q:1+\\ud800=", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "arith", "prompt": ["\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions",
     b'{"model": "arith", "messages": [{"role": "user", "content": "Q:\\ud83d"}]}'),
    ("/v1/chat/completions", b'{"model": "arith", "messages": [{"role": "user", "content": '
                             b'[{"type": "text", "text": "\\udc00"}]}]}'),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": [5, 6], "max_tokens": 2}'),
])
def test_a_lone_surrogate_is_an_openai_400(server, client, route, body):
    """Issue 33 item 5: a lone UTF-16 surrogate (valid JSON, not text) was a 500
    (TypeError: TextInputSequence must be str)."""
    r = httpx.post(f"{server.url}{route}", content=body, timeout=60.0,
                   headers={"Authorization": f"Bearer {API_KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "lone UTF-16 surrogate" in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] in ("prompt", "messages", "model")
    assert client.completions.create(model="arith", prompt="Q:1+1=", max_tokens=2).choices


@pytest.mark.parametrize("stream", [False, True])
def test_requests_whose_client_went_away_are_aborted(server, stream):
    """Issue 33 item 6: non-streaming OpenAI requests whose client gave up (here during a
    pause) stayed queued and, after /continue_generation, generated for nobody. Every
    route now aborts them: the queue empties while the server is still paused."""
    import concurrent.futures

    bodies = [("/v1/completions", {"model": "arith", "prompt": "Q:7+8=", "max_tokens": 40,
                                   "stream": stream}),
              ("/v1/chat/completions", {"model": "arith", "max_tokens": 40, "stream": stream,
                                        "messages": [{"role": "user", "content": "Q:2+2="}]})]
    if not stream:  # SGLang's route too (it waits for the client going away, not polls)
        bodies.append(("/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 40}}))
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def give_up(route: str, body: dict) -> str:
        try:
            with httpx.Client(timeout=0.5, headers=headers) as http:
                with http.stream("POST", f"{server.url}{route}", json=body) as r:
                    for _ in r.iter_bytes():
                        pass
        except httpx.TimeoutException:
            return "gave up"
        return "answered"

    _control(server, "/pause_generation", {"mode": "abort"})
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(lambda i: give_up(*bodies[i % len(bodies)]), range(6)))
        assert outcomes == ["gave up"] * 6  # paused: nothing could answer
        import time

        deadline = time.monotonic() + 60.0  # a state to reach, not a timing assertion
        while _info(server)["num_waiting_reqs"] and time.monotonic() < deadline:
            time.sleep(0.1)
        info = _info(server)
        assert info["num_waiting_reqs"] == 0, info
    finally:
        _control(server, "/continue_generation")


def test_a_burst_of_concurrent_requests_all_complete_correctly(server, client):
    """Issue 39 item 15: many requests at once (far more than the server's 4 slots) all
    complete, each with the text it gets alone (greedy)."""
    import asyncio

    import aiohttp

    prompts = [f"Q:{a}+{b}=" for a in range(5) for b in range(4)]
    alone = {p: client.completions.create(model="arith", prompt=p, max_tokens=4,
                                          temperature=0).choices[0].text for p in prompts}

    async def burst(n):
        headers = {"Authorization": f"Bearer {API_KEY}"}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(server.url, connector=connector, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=600)) as s:
            async def one(i):
                body = {"model": "arith", "prompt": prompts[i % len(prompts)], "max_tokens": 4,
                        "temperature": 0}
                async with s.post("/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["choices"][0]["text"]

            return await asyncio.gather(*(one(i) for i in range(n)))

    texts = asyncio.run(burst(300))
    assert texts == [alone[prompts[i % len(prompts)]] for i in range(300)]
