"""The reward-model variant (``reward.fn: reward_model``): the embedded server of a
transformers ``Qwen2ForSequenceClassification`` checkpoint answers ``/classify`` with the
head's scores, checked against transformers' forward, and the reward client on it."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
import torch

from areal_jax.data import builtin_task as bt
from areal_jax.rewards.reward_model import RewardModelReward, RewardModelSettings
from tests.hf_fixtures import make_hf_config
from tests.server_fixtures import http_client, start_server
from tests.tolerance import hf_path_length, logits_term_scale, network_tolerance

VOCAB = len(bt.VOCAB)  # the demo's character tokenizer, saved beside the model


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import Qwen2ForSequenceClassification

    config = make_hf_config("qwen2", vocab_size=VOCAB, num_labels=2, pad_token_id=bt.PAD_ID)
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.2 * torch.randn(p.shape))
    out = tmp_path_factory.mktemp("rm") / "qwen2-rm"
    model.save_pretrained(out, safe_serialization=True)
    bt.save_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def rm_server(rm_dir, tmp_path_factory):
    with start_server(rm_dir, tmp_path_factory) as handle:
        yield handle


def hf_scores(rm_dir, seq):
    """transformers' logits of one unpadded sequence, and their fp32 rounding bound."""
    from transformers import Qwen2ForSequenceClassification

    model = Qwen2ForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_hidden_states=True)
    hidden = out.hidden_states[-1].numpy()
    scale = logits_term_scale(hidden, model.score.weight.detach().numpy()).max()
    tol = float(network_tolerance(scale, hf_path_length(model.config, len(seq))))
    return out.logits[0].numpy(), tol


def test_classify_returns_the_heads_scores_as_transformers(rm_server, rm_dir):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, VOCAB, n).tolist() for n in (4, 19, 40)]
    with http_client(rm_server.url, None, timeout=120.0) as http:
        r = http.post("/classify", json={"input_ids": seqs})
        assert r.status_code == 200, r.text
        items = r.json()
        assert http.get("/get_model_info").json()["num_labels"] == 2
        single = http.post("/classify", json={"input_ids": seqs[0]}).json()
        text = http.post("/classify", json={"text": "Q:17+5-8=A:14"}).json()
        bad = http.post("/classify", json={"input_ids": [[VOCAB]]})
    assert len(items) == 3
    for seq, item in zip(seqs, items, strict=True):
        want, tol = hf_scores(rm_dir, seq)
        assert item["meta_info"]["prompt_tokens"] == len(seq)
        np.testing.assert_allclose(item["embedding"], want, rtol=0, atol=tol)
    want, tol = hf_scores(rm_dir, seqs[0])  # one row instead of four: another program
    np.testing.assert_allclose(single["embedding"], want, rtol=0, atol=tol)
    want, tol = hf_scores(rm_dir, bt.encode("Q:17+5-8=A:14"))
    np.testing.assert_allclose(text["embedding"], want, rtol=0, atol=tol)
    assert bad.status_code == 400 and "input 0" in bad.json()["error"]


def test_reward_model_reward_is_the_labels_score(rm_server, rm_dir):
    reward = RewardModelReward(RewardModelSettings(
        url=rm_server.url, template="{question}{answer}", label=1, timeout_s=120.0))
    counts: Counter = Counter()
    try:
        value, why = asyncio.run(reward.ascore("A:14", "14", question="Q:17+5-8=",
                                               count=lambda k, n: counts.update({k: n})))
    finally:
        reward.close()
    want, tol = hf_scores(rm_dir, bt.encode("Q:17+5-8=A:14"))
    assert why is None and value == pytest.approx(float(want[1]), abs=tol)
    assert counts["judge_ok"] == 1


def test_an_out_of_range_score_is_a_failed_call(rm_server):
    reward = RewardModelReward(RewardModelSettings(
        url=rm_server.url, score_min=1e5, score_max=1e6, retries=0, timeout_s=120.0))
    try:
        value, why = asyncio.run(reward.ascore("A:14", "14", question="Q:17+5-8="))
    finally:
        reward.close()
    assert value is None and "outside" in why
    assert reward.metrics()["unparsable"] == 1
