"""Make a judge for the demo task: the demo's tiny model, trained to grade an answer.

The judge reads ``JUDGE_TEMPLATE`` filled with a problem, a student's completion and the
reference answer, and writes ``1`` (the completion's final answer is right) or ``0``,
then ``<eos>``. It is what ``reward.fn: judge`` calls in ``configs/tiny_demo_judge.yaml``:
an embedded server of this checkpoint on 127.0.0.1, asked through
``/v1/completions`` (the demo tokenizer has no chat template), its verdict read by the
score pattern ``^\\s*([01])``.

The training completions are the task's solutions, half of them with a wrong final answer,
some cut off before the answer or with a wrong step, so that the judge has to find and
compare the final answer rather than recognise a format. Training starts from the demo's
warm start (``builtin:arith_sft``), which already reads the task's text::

    python scripts/make_judge_checkpoint.py --out /tmp/arith_judge

It prints the judge's agreement with the built-in verifier on held-out problems.
"""

from __future__ import annotations

import argparse
import json
import random
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
from model_defs import load_hf, save_hf

# The judge's prompt: problem, the student's completion, ";", the reference, "=".
JUDGE_TEMPLATE = "{question}{answer};{reference}="
SEQ_LEN = 96
ONE, ZERO = bt.VOCAB.index("1"), bt.VOCAB.index("0")


def student_answer(item: dict, rng: random.Random) -> str:
    """A completion a student might write: right, wrong at the end, wrong in a step, cut."""
    solution, answer = item["solution"], int(item["answer"])
    kind = rng.random()
    if kind < 0.45:
        return solution
    head = solution[: solution.rindex("A:")]
    if kind < 0.85:  # the steps, then a wrong answer (often the right one +-1)
        wrong = answer
        while wrong == answer:
            wrong = max(0, answer + rng.choice([-2, -1, 1, 2])) if rng.random() < 0.5 \
                else rng.randint(0, 40)
        return head + f"A:{wrong}"
    if kind < 0.95:  # cut off before the answer
        return head[: rng.randint(0, len(head))]
    # the right answer without steps
    return f"A:{answer}"


def judge_examples(items: list[dict], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, SEQ_LEN] ids, loss mask on the verdict and eos, and each example's label."""
    rng = random.Random(seed)
    ids = np.full((len(items), SEQ_LEN), bt.PAD_ID, np.int32)
    mask = np.zeros((len(items), SEQ_LEN), np.float32)
    labels = np.zeros(len(items), np.int32)
    for i, it in enumerate(items):
        answer = student_answer(it, rng)
        label = int(builtin_reward(answer, it["answer"]))
        prompt = bt.encode(JUDGE_TEMPLATE.format(question=it["question"], answer=answer,
                                                 reference=it["answer"]))
        seq = (prompt + [ONE if label else ZERO, bt.EOS_ID])[:SEQ_LEN]
        ids[i, : len(seq)] = seq
        mask[i, len(prompt): len(seq)] = 1.0
        labels[i] = label
    return ids, mask, labels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write the judge checkpoint to")
    p.add_argument("--init", default=str(Path(bt.__file__).parent / "assets" / "arith_sft"),
                   help="HF checkpoint to start from (default: the demo's warm start)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> int:
    args = build_parser().parse_args()
    model, cfg = load_hf(args.init, dtype="float32")
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 50, args.steps, args.lr * 0.1)
    opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
    ids_all, mask_all, _ = judge_examples(bt.make_split("train"), args.seed)
    eval_ids, _, eval_labels = judge_examples(bt.make_split("eval"), args.seed + 1)
    eval_lens = (eval_ids != bt.PAD_ID).sum(1) - 2  # the prompt's length

    @nnx.jit
    def step(model, opt, ids, mask):
        def loss_fn(model):
            logp = jax.nn.log_softmax(model(ids[:, :-1]), -1)
            tok_logp = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
            return -(tok_logp * mask[:, 1:]).sum() / mask[:, 1:].sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    @nnx.jit
    def verdicts(model, ids, lens):
        last = jnp.take_along_axis(model(ids), lens[:, None, None] - 1, axis=1)[:, 0]
        return last[:, ONE] > last[:, ZERO]

    rng = np.random.default_rng(args.seed)
    t0, history = time.time(), []
    for i in range(1, args.steps + 1):
        idx = rng.integers(0, len(ids_all), args.batch_size)
        loss = step(model, opt, jnp.asarray(ids_all[idx]), jnp.asarray(mask_all[idx]))
        if i % 200 == 0 or i == args.steps:
            said = np.asarray(verdicts(model, jnp.asarray(eval_ids), jnp.asarray(eval_lens)))
            agreement = float((said == eval_labels.astype(bool)).mean())
            history.append({"step": i, "loss": float(loss), "eval_agreement": agreement})
            print(f"step {i:5d} loss {float(loss):.4f} agreement with the verifier "
                  f"{agreement:.3f}  [{time.time() - t0:.0f}s]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_hf(model, cfg, out)
    bt.save_tokenizer(out)
    (out / "judge_log.json").write_text(json.dumps(
        {"args": vars(args), "template": JUDGE_TEMPLATE, "history": history}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
