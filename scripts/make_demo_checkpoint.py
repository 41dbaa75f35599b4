"""Make the demo's starting checkpoint: a tiny Qwen2-style model, briefly SFT'd on the
built-in arithmetic task.

The RL demo needs a policy that already writes the answer format and is sometimes
right, so that rewards are informative from the first batch. This script trains a
~0.4M-parameter model with plain cross-entropy on the solution tokens of the train
split for a fixed number of steps, stopping early, on purpose, while accuracy is still
low: the rest is RL's job.

The SFT data is deliberately noisy: with ``--answer-noise 0.7`` (the default), 70% of the training
solutions end in a random wrong answer (the steps stay right). The warm start therefore
knows the format and the arithmetic but often samples a wrong final answer; RL with
the verifier's reward teaches it to trust its own steps. This is what pretraining on
noisy data looks like in miniature, and it lets the demo show RL's effect within
minutes on a CPU. The result (safetensors + config + tokenizer, ~2 MB) is
shipped in ``areal_jax/data/assets/arith_sft/`` and regenerated with:

    python scripts/make_demo_checkpoint.py --out areal_jax/data/assets/arith_sft

It is deterministic for a given seed on a given JAX version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from areal_jax.data import builtin_task as bt
from areal_jax.rewards.builtin import builtin_reward
from model_defs import CausalLM, ModelConfig, save_hf

SEQ_LEN = 64


def demo_model_config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=32,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=256,
        bos_token_id=bt.BOS_ID,
        eos_token_id=bt.EOS_ID,
    )


def noisy_solution(
    item: dict, rng: np.random.Generator, answer_noise: float, max_value: int
) -> str:
    """The solution, with its final answer replaced by a random wrong one w.p. answer_noise."""
    solution = item["solution"]
    if rng.random() >= answer_noise:
        return solution
    wrong = int(item["answer"])
    while wrong == int(item["answer"]):
        wrong = int(rng.integers(0, max_value + 1))
    return solution[: solution.rindex("A:")] + f"A:{wrong}"


def encode_examples(items: list[dict], answer_noise: float = 0.0, seed: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """[N, SEQ_LEN] ids (right-padded) and loss mask over solution + eos tokens."""
    ids = np.full((len(items), SEQ_LEN), bt.PAD_ID, np.int32)
    mask = np.zeros((len(items), SEQ_LEN), np.float32)
    rng = np.random.default_rng(seed + 7)
    max_value = bt.ArithmeticTaskConfig().max_value
    for i, it in enumerate(items):
        q = bt.encode(it["question"])
        a = bt.encode(noisy_solution(it, rng, answer_noise, max_value)) + [bt.EOS_ID]
        seq = (q + a)[:SEQ_LEN]
        ids[i, : len(seq)] = seq
        mask[i, len(q) : len(seq)] = 1.0
    return ids, mask


def sample_completions(model: CausalLM, prompts: list[str], max_new: int, temperature: float,
                       key: jax.Array) -> list[str]:
    """Decode by full re-forward (tiny model, short sequences): no engine needed here."""
    enc = [bt.encode(p) for p in prompts]
    n = len(enc)
    ids = np.full((n, SEQ_LEN), bt.PAD_ID, np.int32)
    lens = np.array([len(e) for e in enc])
    for i, e in enumerate(enc):
        ids[i, : len(e)] = e
    done = np.zeros(n, bool)
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, ids, pos, key):
        m = nnx.merge(graphdef, state)
        logits = m(ids)  # [N, T, V]
        last = jnp.take_along_axis(logits, pos[:, None, None] - 1, axis=1)[:, 0]
        if temperature == 0:
            return jnp.argmax(last, -1)
        return jax.random.categorical(key, last / temperature)

    for _step in range(max_new):
        key, sub = jax.random.split(key)
        tok = np.asarray(next_token(state, jnp.asarray(ids), jnp.asarray(lens), sub))
        for i in range(n):
            if done[i] or lens[i] >= SEQ_LEN:
                done[i] = True
                continue
            ids[i, lens[i]] = tok[i]
            lens[i] += 1
            if tok[i] == bt.EOS_ID:
                done[i] = True
        if done.all():
            break
    outs = []
    for i, e in enumerate(enc):
        outs.append(bt.decode(ids[i, len(e) : lens[i]].tolist()))
    return outs


def accuracy(model, items, temperature, key, max_new=48) -> float:
    outs = sample_completions(model, [it["question"] for it in items], max_new, temperature, key)
    return float(np.mean([builtin_reward(o, it["answer"])
                          for o, it in zip(outs, items, strict=False)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="areal_jax/data/assets/arith_sft")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--answer-noise", type=float, default=0.7,
                   help="fraction of SFT solutions whose final answer is replaced by a random one")
    args = p.parse_args()

    cfg = demo_model_config()
    model = CausalLM(cfg, rngs=nnx.Rngs(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 50, args.steps, args.lr * 0.1)
    tx = optax.adamw(schedule, weight_decay=0.01)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train = bt.make_split("train")
    evals = bt.make_split("eval")[: args.eval_prompts]
    ids_all, mask_all = encode_examples(train, args.answer_noise, args.seed)
    rng = np.random.default_rng(args.seed)

    @nnx.jit
    def step(model, opt, ids, mask):
        def loss_fn(model):
            logits = model(ids[:, :-1])
            logp = jax.nn.log_softmax(logits, -1)
            tok_logp = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
            m = mask[:, 1:]
            return -(tok_logp * m).sum() / m.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    t0 = time.time()
    key = jax.random.key(args.seed)
    history = []
    for i in range(1, args.steps + 1):
        idx = rng.integers(0, len(train), args.batch_size)
        loss = step(model, opt, jnp.asarray(ids_all[idx]), jnp.asarray(mask_all[idx]))
        if i % args.eval_every == 0 or i == args.steps:
            key, k1 = jax.random.split(key)
            acc_t1 = accuracy(model, evals, 1.0, k1)
            acc_greedy = accuracy(model, evals, 0.0, k1)
            history.append({"step": i, "loss": float(loss), "eval_acc_t1": acc_t1,
                            "eval_acc_greedy": acc_greedy})
            print(f"step {i:5d} loss {float(loss):.3f} eval acc (T=1) {acc_t1:.3f} "
                  f"(greedy) {acc_greedy:.3f}  [{time.time() - t0:.0f}s]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_hf(model, cfg, out)
    bt.save_tokenizer(out)
    (out / "sft_log.json").write_text(
        json.dumps({"args": vars(args), "history": history}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
