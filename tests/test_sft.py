"""Supervised fine-tuning (mode: sft): the loss learns the assistant's tokens only (checked
by its gradient), matches a transformers NLL, lowers a held-out loss, and a run of
scripts/train.py makes weights an RL run starts from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from _learner_data import FAST_COMPILE, make_learner
from hf_fixtures import CHAT_TEMPLATE, logit_tolerance, make_hf_model, make_tiny_hf_checkpoint
from tolerance import logprob_tolerance, unit_roundoff

from areal_jax.data import builtin_task as bt
from areal_jax.data.sft import SFTBatches, chat_example, prompt_completion_example, sft_examples
from areal_jax.learner import AlgoConfig, Learner, OptimConfig, pack_trajectories
from areal_jax.losses import sft_loss
from areal_jax.parallel import make_mesh
from areal_jax.run_inputs import ASSETS_DIR
from areal_jax.tokenizer import ChatTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parent.parent


def one_device():
    return make_mesh("data=1", jax.devices()[:1])


def arith_tokenizer(chat: bool = True) -> ChatTokenizer:
    """The demo's character tokenizer, with a chat template of its own characters (user
    turns verbatim, assistant turns followed by <eos>)."""
    tok = load_tokenizer(ASSETS_DIR / "arith_sft")
    return ChatTokenizer(tok.tokenizer, tok.config, chat_template=CHAT_TEMPLATE if chat else None)


def pack(examples, seq_len=64):
    return pack_trajectories(examples, None, seq_len=seq_len, rows_per_micro_batch=2)


def flat_grads(learner, batches):
    loss, grads = learner.sft_gradients(batches)
    return loss, np.concatenate([np.asarray(g, np.float64).ravel()
                                 for g in jax.tree.leaves(grads)])


def test_sft_loss_ignores_non_assistant_targets_by_gradient():
    """The gradient is the same whatever the tokens that are not the assistant's are, where
    they are only targets (a user turn after the last assistant turn, in a row packed with
    another conversation); changing an assistant token changes it."""
    tok = arith_tokenizer()
    learner = make_learner(one_device(), algo=AlgoConfig())

    def conversation(answer: str, last_user: str):
        return chat_example([{"role": "user", "content": "Q:3+4="},
                             {"role": "assistant", "content": f"3+4={answer};A:{answer}"},
                             {"role": "user", "content": last_user}], tok)

    other = chat_example([{"role": "system", "content": "Q:"},
                          {"role": "user", "content": "Q:8-1="},
                          {"role": "assistant", "content": "8-1=7;A:7"}], tok)
    base = pack([conversation("7", "Q:9-2=5"), other])
    perturbed = pack([conversation("7", "A:1+1;0"), other])
    learned = pack([conversation("8", "Q:9-2=5"), other])
    assert len(base) == 1 and base[0].segment_ids.max() == 2  # one row, two conversations
    loss0, g0 = flat_grads(learner, base)
    loss1, g1 = flat_grads(learner, perturbed)
    loss2, g2 = flat_grads(learner, learned)
    # The same program on inputs that differ only where the loss selects nothing: the
    # gradient terms from those tokens are exact zeros, so it agrees to the last bits.
    tol = 8 * unit_roundoff() * np.max(np.abs(g0))
    assert loss1 == pytest.approx(loss0, abs=8 * unit_roundoff() * loss0)
    assert np.max(np.abs(g1 - g0)) <= tol
    # A changed assistant token is learned: the gradient moves by far more than rounding.
    assert np.max(np.abs(g2 - g0)) > 1e3 * tol
    assert loss2 != pytest.approx(loss0, abs=1e3 * 8 * unit_roundoff() * loss0)


def test_sft_loss_is_transformers_nll_of_the_completion(tmp_path):
    """The learner's held-out loss is the token-mean NLL of the completion and EOS under the
    model, as a transformers forward computes it; the prompt's tokens are not in it."""
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=True, seed=5)
    hf = make_hf_model("qwen2", tie=True, seed=5)
    learner = Learner.from_hf(str(path), OptimConfig(), AlgoConfig(), mesh=one_device(),
                              compiler_options=FAST_COMPILE)
    tok = arith_tokenizer(chat=False)
    items = bt.make_split("eval", n=5)
    examples = [prompt_completion_example(it["question"], it["solution"], tok) for it in items]
    got, count = learner.sft_loss(pack(examples))
    nll, want_count, tol = 0.0, 0, 0.0
    for it, ex in zip(items, examples, strict=True):
        n_prompt = len(bt.encode(it["question"]))
        assert ex.input_ids.tolist() == bt.encode(it["question"] + it["solution"]) + [bt.EOS_ID]
        with torch.no_grad():
            logits = hf(torch.tensor(ex.input_ids[None], dtype=torch.long)).logits[0].double()
        logp = torch.log_softmax(logits, -1)[:-1].gather(
            -1, torch.tensor(ex.input_ids[1:, None], dtype=torch.long))[:, 0].numpy()
        nll -= logp[n_prompt - 1:].sum()  # the completion's tokens and EOS
        want_count += len(logp) - (n_prompt - 1)
        tol = max(tol, logprob_tolerance(hf.config.vocab_size,
                                         logit_tolerance(hf, ex.input_ids[None])))
    assert count == want_count
    assert abs(got - nll / want_count) <= tol  # a mean of per-token errors each within tol


def test_sft_lowers_the_held_out_loss():
    """A tiny model trained on arithmetic solutions: the loss on held-out problems falls."""
    tok = arith_tokenizer(chat=False)
    train_rows = bt.make_split("train", n=512)
    held_out = pack(sft_examples(bt.make_split("eval", n=64), tok, prompt_key="question",
                                 completion_key="solution"))
    examples = sft_examples(train_rows, tok, prompt_key="question", completion_key="solution")
    stream = SFTBatches(examples, batch_size=32, seed=0,
                        pack_kwargs=dict(seq_len=64, rows_per_micro_batch=8))
    learner = make_learner(one_device(), algo=AlgoConfig(),
                           optim=OptimConfig(lr=1e-2, max_grad_norm=1.0))
    before, _ = learner.sft_loss(held_out)
    first = None
    for _, batch in zip(range(30), stream, strict=False):
        metrics = learner.sft_step(batch.micro_batches)
        first = metrics["loss"] if first is None else first
        assert metrics["n_loss_tokens"] == sum(t.num_generated for t in batch.trajectories)
    after, _ = learner.sft_loss(held_out)
    assert learner.version == 30 and learner.step == 30
    # Near-uniform at the start (ln 128 = 4.85 nats for this vocabulary); the task uses 20
    # of its tokens, so learning which ones alone is worth ln(128/20) = 1.86 nats.
    assert before > np.log(128) - 0.5
    assert after < before - 1.86, (before, after)
    assert first == pytest.approx(before, abs=0.5)  # the first batch saw the initial model


def test_sft_data_rows_and_order():
    """Chat rows learn the assistant turns (and their EOS); prompt/completion rows the
    completion + EOS; a bad row names its source and index; batches follow the epochs'
    permutations, so a resumed run takes the same ones."""
    tok = arith_tokenizer()
    ex = chat_example([{"role": "user", "content": "Q:1+1="},
                       {"role": "assistant", "content": "1+1=2;A:2"}], tok)
    learned = ex.input_ids[ex.loss_mask == 1].tolist()
    assert learned == bt.encode("1+1=2;A:2") + [bt.EOS_ID]
    with pytest.raises(ValueError, match=r"data.train row 1 has neither 'messages'"):
        sft_examples([{"prompt": "Q:1=", "completion": "A:1"}, {"question": "x"}], tok,
                     source="data.train")
    with pytest.raises(ValueError, match="row 0 has 8 tokens, more than train.seq_len=7"):
        sft_examples([{"prompt": "Q:1=", "completion": "A:1"}], tok, max_tokens=7)
    examples = sft_examples([{"prompt": f"Q:{i}=", "completion": f"A:{i}"} for i in range(10)],
                            tok)
    stream = SFTBatches(examples, batch_size=4, seed=3, pack_kwargs=dict(seq_len=16,
                                                                      rows_per_micro_batch=2))
    seen = [i for v in range(5) for i in stream.indices(v)]  # 2 epochs of 10
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    resumed = SFTBatches(examples, batch_size=4, seed=3, start_version=3,
                         pack_kwargs=stream.pack_kwargs)
    assert next(iter(resumed)).groups == stream.batch(3).groups


def test_sft_loss_function():
    logp = np.log(np.array([[0.5, 0.25, 0.125, 1e-30]], np.float32))
    mask = np.array([[0, 1, 1, 0]])
    assert float(sft_loss(logp, mask)) == pytest.approx(-(np.log(0.25) + np.log(0.125)) / 2,
                                                        rel=4 * unit_roundoff())
    assert float(sft_loss(logp, np.zeros_like(mask))) == 0.0


# ----------------------------------------------------------------------------- end to end
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


SFT_RUN = [sys.executable, str(REPO / "scripts" / "train.py"),
           "--config", str(REPO / "configs" / "tiny_demo_sft.yaml"),
           "train.batch_size=16", "train.total_versions=6", "eval.every_versions=3",
           "data.max_eval_prompts=16", "checkpoint.every_versions=3", "optim.warmup_steps=0",
           "optim.schedule=constant", "rollout.max_slots=16", "progress_bar=false"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two training runs (~90 s on 2 idle cores)
def test_sft_run_writes_weights_that_rl_starts_from(tmp_path):
    """scripts/train.py mode=sft: every version's row, the held-out loss falling and the
    accuracy measured through the run's server, weights/v6 that load as the learner's
    weights; an RL run (the demo's config) then starts from them."""
    from model_defs import load_hf

    run_dir = tmp_path / "sft"
    r = subprocess.run(SFT_RUN + [f"run_dir={run_dir}"], capture_output=True, text=True,
                       env=_env(), cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(run_dir)
    assert [row["version"] for row in rows] == [1, 2, 3, 4, 5, 6]
    evals = [row for row in rows if "eval_loss" in row]
    assert [row["version"] for row in evals] == [3, 6]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] < np.log(32)
    assert all(0.0 <= row["eval_accuracy"] <= 1.0 and row["eval_n_prompts"] == 16
               for row in evals)
    weights = run_dir / "weights" / "v6"
    assert (weights / "tokenizer.json").is_file()
    model, cfg = load_hf(weights)
    assert cfg.vocab_size == 32 and cfg.num_hidden_layers == 2
    # random_init: the weights are not the shipped checkpoint's, trained or not
    shipped, _ = load_hf(ASSETS_DIR / "arith_sft")
    assert not np.allclose(np.asarray(model.embed_vd[...]), np.asarray(shipped.embed_vd[...]))

    rl_dir = tmp_path / "rl"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"),
         "--config", str(REPO / "configs" / "tiny_demo.yaml"), f"model.path={weights}",
         f"run_dir={rl_dir}", "train.total_versions=1", "train.batch_size=2",
         "rollout.n_samples=2", "eval.every_versions=0", "eval.at_start=false",
         "eval.at_end=false", "progress_bar=false", "rollout.server_cpu_cores=null",
         "rollout.learner_cpu_cores=null"],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["version"] for row in _rows(rl_dir)] == [1]


def test_sft_bad_rows_are_one_line_input_errors(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "Q:1+1=", "solution": "1+1=2;A:2"}) + "\n"
                    + json.dumps({"question": "Q:2+2="}) + "\n")
    r = subprocess.run(SFT_RUN + [f"run_dir={tmp_path / 'run'}", f"data.train={data}"],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data.train") and "row 1 has neither 'messages'" in last
    assert "Traceback" not in r.stderr
