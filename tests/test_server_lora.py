"""LoRA adapter serving on the embedded server (SGLang's /load_lora_adapter,
/unload_lora_adapter and ``lora_path`` in /generate), as real subprocesses on 127.0.0.1:
greedy output with an adapter loaded equals that of a server started on the merged
weights; bad adapters and unknown names are 4xx and the server keeps serving; the client's
adapter mode."""

from __future__ import annotations

import asyncio
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from areal_jax.checkpoint.publish import ADAPTER_SUBDIR, WeightPublisher, serving_weights
from areal_jax.rollout.client import RolloutClient, RolloutRequestError
from areal_jax.rollout.types import GenerateRequest
from areal_jax.sampling_params import SamplingParams
from model_defs import LoraConfig, add_lora, load_hf
from model_defs.lora import lora_adapters
from tests.hf_fixtures import make_tiny_hf_checkpoint, token_logprob_tolerance
from tests.server_fixtures import http_client, start_server

MAX_SEQ_LEN = 512  # the shapes of tests/test_server.py: the compilation cache is shared
PROMPTS = [[5, 6, 7], [9, 3, 44, 2, 17], [100, 1]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A base checkpoint, and a version published as the trainer does: ``v1`` merged, and
    ``v1/adapter`` (PEFT) with a non-zero B, so the adapter changes the output."""
    root = tmp_path_factory.mktemp("lora_serving")
    base = make_tiny_hf_checkpoint(root, seed=0)
    model, cfg = load_hf(base)
    add_lora(model, LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    for _, adapter in lora_adapters(model):
        b = adapter.lora_b.get_value()
        adapter.lora_b.set_value(jnp.asarray(0.1 * rng.standard_normal(b.shape), b.dtype))
    publisher = WeightPublisher(root / "weights")
    v1 = publisher.publish(serving_weights(model, with_adapter=True), cfg, 1)
    return base, v1, root


@pytest.fixture(scope="module")
def base_server(published, tmp_path_factory):
    base, _, root = published
    with start_server(base, tmp_path_factory, max_slots=16, max_seq_len=MAX_SEQ_LEN,
                      allowed_weight_dirs=[root]) as handle:
        yield handle


def greedy(http, prompt, **extra):
    r = http.post("/generate", json={
        "input_ids": prompt, "return_logprob": True, **extra,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                            "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return ([e[1] for e in meta["output_token_logprobs"]],
            np.array([e[0] for e in meta["output_token_logprobs"]]), meta["weight_version"])


def test_adapter_output_equals_a_server_started_on_the_merged_weights(
        published, base_server, tmp_path_factory):
    base, v1, _ = published
    adapter = f"{v1}/{ADAPTER_SUBDIR}"
    with start_server(v1, tmp_path_factory, max_slots=16, max_seq_len=MAX_SEQ_LEN) as merged, \
            http_client(merged.url, None) as merged_http:
        want = [greedy(merged_http, p) for p in PROMPTS]
    with http_client(base_server.url, None) as http:
        before = [greedy(http, p) for p in PROMPTS]
        r = http.post("/load_lora_adapter", json={"lora_name": "v1", "lora_path": adapter})
        assert r.status_code == 200, r.text
        assert r.json()["success"] is True and r.json()["error_message"] == ""
        assert r.json()["loaded_adapters"] == {"v1": adapter}
        assert http.get("/get_server_info").json()["lora_adapters"] == {"v1": adapter}
        for prompt, (want_ids, want_lp, _), (base_ids, base_lp, _) in zip(
                PROMPTS, want, before, strict=True):
            ids, lp, version = greedy(http, prompt, lora_path="v1")
            assert version == "0"  # as SGLang: loading an adapter keeps the weight version
            assert ids == want_ids
            tol = token_logprob_tolerance(v1, prompt + ids, temperature=0)
            np.testing.assert_allclose(lp, want_lp, rtol=0, atol=tol)
            # Without lora_path a request runs on what is served: the adapter too.
            assert greedy(http, prompt)[0] == want_ids
            # The adapter does change the model (else the comparison above proves nothing).
            assert ids != base_ids or np.abs(lp - base_lp).max() > tol

        r = http.post("/unload_lora_adapter", json={"lora_name": "v1"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {}, r.text
        assert [greedy(http, p)[0] for p in PROMPTS] == [ids for ids, _, _ in before]
        r = http.post("/generate", json={"input_ids": [5], "lora_path": "v1"})
        assert r.status_code == 400 and "names no loaded LoRA adapter" in r.json()["error"]


def _bad_adapter(src, dst, value):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = np.full_like(tensors[key], value)
    save_file(tensors, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_adapters_and_unknown_names_are_4xx_and_the_server_keeps_serving(
        published, base_server, tmp_path_factory):
    base, v1, root = published
    adapter = root / "weights" / "v1" / ADAPTER_SUBDIR
    nan_dir = _bad_adapter(adapter, root / "nan_adapter", np.nan)
    inf_dir = _bad_adapter(adapter, root / "inf_adapter", np.inf)
    outside = tmp_path_factory.mktemp("not_allowed") / "adapter"
    shutil.copytree(adapter, outside)
    with http_client(base_server.url, None) as http:
        r = http.post("/load_lora_adapter", json={"lora_name": "good", "lora_path": str(adapter)})
        assert r.status_code == 200, r.text
        served = [greedy(http, p)[0] for p in PROMPTS]

        refused = [  # SGLang's reply shape (success, error_message) plus our "error"
            (str(outside), 403, "allowed"),
            (str(root / "missing"), 400, "does not exist"),
            (v1, 400, "has no adapter_config.json"),
            (str(nan_dir), 400, "non-finite"),
            (str(inf_dir), 400, "non-finite"),
        ]
        for path, status, message in refused:
            r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == status, (path, r.text)
            assert r.json()["success"] is False and message in r.json()["error_message"]
            assert r.json()["error"] == r.json()["error_message"]
        malformed = [
            ({"lora_name": "", "lora_path": str(adapter)}, "lora_name is empty"),
            ({"lora_path": str(adapter)}, "missing required field 'lora_name'"),
            ({"lora_name": "x", "lora_path": str(adapter), "scale": 2}, "unknown field"),
        ]
        for body, message in malformed:
            r = http.post("/load_lora_adapter", json=body)
            assert r.status_code == 400 and message in r.json()["error"], (body, r.text)
        r = http.post("/unload_lora_adapter", json={"lora_name": "nope"})
        assert r.status_code == 400 and "'nope' is not loaded" in r.json()["error_message"]
        r = http.post("/generate", json={"input_ids": [5], "lora_path": "nope"})
        assert r.status_code == 400 and "'nope' names no loaded LoRA adapter" in r.json()["error"]
        r = http.post("/generate", json={"input_ids": [5], "lora_path": ["good"]})
        assert r.status_code == 400 and "lora_path must be" in r.json()["error"]

        # Nothing above changed what is served.
        assert http.get("/health").status_code == 200
        assert http.get("/get_server_info").json()["lora_adapters"] == {"good": str(adapter)}
        assert [greedy(http, p, lora_path="good")[0] for p in PROMPTS] == served
        assert http.post("/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200


def test_client_adapter_mode_sets_versions_and_sends_lora_path(published, base_server):
    base, v1, root = published
    adapter = f"{v1}/{ADAPTER_SUBDIR}"
    # A second adapter version: the same files under another directory and name.
    v2_adapter = root / "v2_adapter"
    if not v2_adapter.exists():
        shutil.copytree(adapter, v2_adapter)

    async def scenario():
        async with RolloutClient([base_server.url]) as client:
            req = GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.0))
            await client.load_lora_adapter("v1", adapter, 1)
            first = await client.agenerate(req)
            await client.load_lora_adapter("v2", str(v2_adapter), 2)  # replaces v1
            second = await client.agenerate(req)
            infos = await client.server_infos()
            with pytest.raises(RolloutRequestError, match="names no loaded LoRA adapter"):
                client._latest_adapter = ("v1", adapter, 1)  # a name the server dropped
                await client.agenerate(req)
            return first, second, infos

    first, second, infos = asyncio.run(scenario())
    assert first.output_versions == [1] * 4 and second.output_versions == [2] * 4
    assert first.output_ids == second.output_ids  # the same adapter under two names
    assert infos[0]["weight_version"] == "2"
    assert infos[0]["lora_adapters"] == {"v2": str(v2_adapter)}
    with http_client(base_server.url, None) as http:
        assert http.post("/unload_lora_adapter", json={"lora_name": "v2"}).status_code == 200
        http.post("/update_weight_version", json={"new_version": "0"})


def _wait_for(http, condition, what, deadline_s=120.0):
    """Polls /get_server_info until ``condition(info)`` (a deadline for a state the server
    must reach, not a timing assertion)."""
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        info = http.get("/get_server_info").json()
        if condition(info):
            return info
        time.sleep(0.05)
    pytest.fail(f"the server never reached: {what}")


@pytest.mark.parametrize("change", ["replace", "unload"])
def test_a_queued_request_runs_on_the_adapter_it_named_or_gets_a_400_naming_it(
        published, base_server, change):
    """Issue 33 item 4: a request naming adapter a4 waits (paused); a4 is then replaced by
    b8 (or unloaded). It must not run on b8 or the base: a 400 naming a4. A request naming
    b8, sent after the load, runs on b8."""
    import concurrent.futures

    _, v1, root = published
    adapter = f"{v1}/{ADAPTER_SUBDIR}"
    with http_client(base_server.url, None) as http, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert http.post("/load_lora_adapter",
                         json={"lora_name": "a4", "lora_path": adapter}).status_code == 200
        assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        body = {"input_ids": PROMPTS[0], "lora_path": "a4", "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        queued = pool.submit(http.post, "/generate", json=body)
        _wait_for(http, lambda i: i["num_waiting_reqs"] == 1, "one queued request")
        if change == "replace":
            r = http.post("/load_lora_adapter", json={"lora_name": "b8", "lora_path": adapter})
            assert r.status_code == 200, r.text
            on_b8 = pool.submit(http.post, "/generate", json={**body, "lora_path": "b8"})
            _wait_for(http, lambda i: i["num_waiting_reqs"] == 2, "two queued requests")
        else:
            assert http.post("/unload_lora_adapter", json={"lora_name": "a4"}).status_code == 200
        assert http.post("/continue_generation").status_code == 200
        r = queued.result(timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "lora_path 'a4'" in error and (
            "replaced by 'b8'" if change == "replace" else "unloaded") in error, error
        if change == "replace":
            r = on_b8.result(timeout=120)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
            assert http.post("/unload_lora_adapter", json={"lora_name": "b8"}).status_code == 200
        assert http.get("/health").status_code == 200


def test_client_resubmits_on_the_new_adapter_when_its_adapter_was_replaced(
        published, base_server):
    """The rollout client in adapter mode: a request resubmitted during a pause names the
    old adapter; the version's load replaces it, the server refuses to run it on the new
    one, and the client resubmits it naming the new adapter: tokens of the new version."""
    _, v1, _ = published
    adapter = f"{v1}/{ADAPTER_SUBDIR}"

    async def scenario():
        async with RolloutClient([base_server.url]) as client:
            await client.load_lora_adapter("v1", adapter, 1)
            await client.pause()
            req = GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0.0))
            task = asyncio.create_task(client.agenerate(req))
            while not (await client.server_infos())[0]["num_waiting_reqs"]:
                await asyncio.sleep(0.05)
            await client.load_lora_adapter("v2", adapter, 2)
            await client.continue_()
            return await task

    resp = asyncio.run(scenario())
    assert resp.output_versions == [2] * 4 and resp.n_interruptions == 1
    with http_client(base_server.url, None) as http:
        assert http.post("/unload_lora_adapter", json={"lora_name": "v2"}).status_code == 200
        http.post("/update_weight_version", json={"new_version": "0"})


def test_an_adapter_that_overflows_in_use_is_refused(published, base_server):
    """Issue 33 item 5: finite adapter values whose merge overflows in a forward pass
    (lora_alpha 1e38) are refused with a 400 saying so; the old weights keep serving."""
    import json

    _, v1, root = published
    src = root / "weights" / "v1" / ADAPTER_SUBDIR
    huge = root / "huge_alpha"
    if not huge.exists():
        shutil.copytree(src, huge)
        cfg = json.loads((huge / "adapter_config.json").read_text())
        cfg["lora_alpha"] = 1e38
        (huge / "adapter_config.json").write_text(json.dumps(cfg))
    with http_client(base_server.url, None) as http:
        before = [greedy(http, p)[0] for p in PROMPTS]
        r = http.post("/load_lora_adapter", json={"lora_name": "huge", "lora_path": str(huge)})
        assert r.status_code == 400, r.text
        assert "overflow" in r.json()["error"] and str(huge) in r.json()["error"], r.text
        assert r.json()["loaded_adapters"] == {}
        assert [greedy(http, p)[0] for p in PROMPTS] == before


def test_an_adapter_config_that_is_a_json_list_is_a_400_naming_the_file(published, base_server):
    """Issue 33 item 7: it used to answer AttributeError: 'list' object has no attribute."""
    _, v1, root = published
    bad = root / "list_config"
    if not bad.exists():
        shutil.copytree(root / "weights" / "v1" / ADAPTER_SUBDIR, bad)
        (bad / "adapter_config.json").write_text("[8, 16]")
    with http_client(base_server.url, None) as http:
        r = http.post("/load_lora_adapter", json={"lora_name": "l", "lora_path": str(bad)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert str(bad / "adapter_config.json") in error and "JSON list, not an object" in error
        assert "AttributeError" not in error and r.json()["loaded_adapters"] == {}


@pytest.mark.slow
def test_train_run_in_adapter_mode_serves_each_version_adapter(tmp_path):
    """``model.lora.serving: adapter`` end to end (sync mode: every batch is generated
    entirely under the previous version): the servers start from the base model, load
    ``v{N}/adapter`` every version, and tokens carry the versions in order."""
    from areal_jax.run_inputs import ASSETS_DIR
    from tests.test_trainer import _rows, _run

    run_dir = tmp_path / "run"
    res = _run([f"run_dir={run_dir}", "train.total_versions=3", "mode=sync",
                "model.lora.rank=4", "model.lora.serving=adapter",
                "model.lora.publish_adapter=false", "optim.lr=1e-3"])
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:  # every token of the batch for version v came from the adapter of v - 1
        assert r["token_version_max"] == r["version"] - 1, r
    for v in (2, 3):  # adapter mode publishes the adapter whatever publish_adapter says
        assert (run_dir / "weights" / f"v{v}" / ADAPTER_SUBDIR / "adapter_config.json").is_file()
    # The servers started from the base and loaded each version's adapter by name...
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*") if p.is_file())
    assert "serving LoRA adapter 'v2'" in logs, logs[-3000:]
    # ...which is the policy the learner trains: behaviour logprobs agree with the learner's
    # to the fp32 bound of two evaluations of a sequence (mean over tokens <= the bound).
    tol = token_logprob_tolerance(ASSETS_DIR / "arith_sft", list(range(32)) * 3)
    assert all(r["logp_mismatch"] <= tol for r in rows), [r["logp_mismatch"] for r in rows]


def test_serving_config_key():
    from areal_jax.config import ConfigError, load_config

    cfg = load_config("configs/tiny_demo_lora.yaml", ["model.lora.serving=adapter"])
    assert cfg.model.lora.serving == "adapter" and cfg.model.lora.publish_adapter is True
    cfg = load_config("configs/tiny_demo_lora.yaml")
    assert cfg.model.lora.serving == "merged" and cfg.model.lora.publish_adapter is False
    with pytest.raises(ConfigError, match="model.lora.serving"):
        load_config("configs/tiny_demo_lora.yaml", ["model.lora.serving=both"])
