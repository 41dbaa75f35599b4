"""Make the demo's starting checkpoint: a tiny Qwen2-style model, briefly SFT'd on the
built-in arithmetic task.

``--task arith`` (the default) runs ``configs/tiny_demo_sft.yaml``: supervised fine-tuning in
the learner (``mode: sft``, docs/training.md), this command's flags as its overrides, and
copies the last ``weights/v{N}`` to ``--out``; the same as
``python scripts/train.py --config configs/tiny_demo_sft.yaml``. ``--task longtail`` still
runs the loop below. What follows describes the recipe both follow.

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

``--task longtail`` makes the long-tail task's warm start instead
(``areal_jax/data/assets/longtail_sft``, ``builtin:longtail_sft``): the same model with
512 positions, started from the arithmetic checkpoint (``--init``) and trained further on
the long-tail problems with the same answer noise. A row of 448 tokens (the longest problem
is ~410) costs ~7x one of 64 on a CPU, so each batch is drawn from one length bucket
(rows of 64, 128, 256 or 448 tokens, the bucket picked in proportion to its problems)::

    python scripts/make_demo_checkpoint.py --task longtail --out areal_jax/data/assets/longtail_sft

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
from model_defs import CausalLM, ModelConfig, load_hf, save_hf

SEQ_LEN = 64
# --task -> (train split, eval split, row length, max_position_embeddings, eval max_new)
TASKS = {"arith": ("train", "eval", SEQ_LEN, 256, 48),
         "longtail": ("longtail_train", "longtail_eval", 448, 512, 336)}
# --task longtail: the defaults that differ from the arithmetic demo's
LONGTAIL_DEFAULTS = {"init": "areal_jax/data/assets/arith_sft", "steps": 300, "batch_size": 32,
                     "lr": 2e-3, "eval_every": 300, "eval_prompts": 16}
BUCKET_WIDTHS = (64, 128, 256, 448)  # --task longtail: row lengths of the batches


def demo_model_config(max_position_embeddings: int = 256) -> ModelConfig:
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
        max_position_embeddings=max_position_embeddings,
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


def encode_examples(items: list[dict], answer_noise: float = 0.0, seed: int = 0,
                    seq_len: int = SEQ_LEN) -> tuple[np.ndarray, np.ndarray]:
    """[N, seq_len] ids (right-padded) and loss mask over solution + eos tokens."""
    ids = np.full((len(items), seq_len), bt.PAD_ID, np.int32)
    mask = np.zeros((len(items), seq_len), np.float32)
    rng = np.random.default_rng(seed + 7)
    max_value = bt.ArithmeticTaskConfig().max_value
    for i, it in enumerate(items):
        q = bt.encode(it["question"])
        a = bt.encode(noisy_solution(it, rng, answer_noise, max_value)) + [bt.EOS_ID]
        seq = (q + a)[:seq_len]
        ids[i, : len(seq)] = seq
        mask[i, len(q) : len(seq)] = 1.0
    return ids, mask


def sample_completions(model: CausalLM, prompts: list[str], max_new: int, temperature: float,
                       key: jax.Array, seq_len: int = SEQ_LEN) -> list[str]:
    """Decode by full re-forward (tiny model, short sequences): no engine needed here."""
    enc = [bt.encode(p) for p in prompts]
    n = len(enc)
    ids = np.full((n, seq_len), bt.PAD_ID, np.int32)
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
        width = min(seq_len, -(-(int(lens.max()) + 1) // 64) * 64)  # rows cut to 64k tokens
        tok = np.asarray(next_token(state, jnp.asarray(ids[:, :width]), jnp.asarray(lens), sub))
        for i in range(n):
            if done[i] or lens[i] >= seq_len:
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


def accuracy(model, items, temperature, key, max_new=48, seq_len=SEQ_LEN) -> float:
    outs = sample_completions(model, [it["question"] for it in items], max_new, temperature, key,
                              seq_len)
    return float(np.mean([builtin_reward(o, it["answer"])
                          for o, it in zip(outs, items, strict=False)]))


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="arith",
                   help="arith: the demo's task; longtail: the long-tail task (1-40 steps)")
    p.add_argument("--out", default=None,
                   help="default areal_jax/data/assets/arith_sft (--task longtail: longtail_sft)")
    p.add_argument("--init", default=None,
                   help="HF checkpoint to start from (--task longtail: the arith_sft asset)")
    p.add_argument("--steps", type=int, default=None, help="default 1500 (longtail: 300)")
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (longtail: 32)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-3 (longtail: 2e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=None, help="default 250 (longtail: 300)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="default 128 (longtail: 16; its decode is a full re-forward per token)")
    p.add_argument("--answer-noise", type=float, default=0.7,
                   help="fraction of SFT solutions whose final answer is replaced by a random one")
    return p


def sft_config_run(args: argparse.Namespace) -> int:
    """``--task arith``: the warm start is ``configs/tiny_demo_sft.yaml`` (mode: sft, the
    learner's own SFT) with this command's settings as overrides; its last weights are
    copied to ``--out``."""
    import shutil
    import subprocess
    import tempfile

    if args.answer_noise != 0.7 or args.init:
        print("error: --answer-noise and --init apply to --task longtail; the arithmetic warm "
              "start is configs/tiny_demo_sft.yaml (builtin:train_sft: 70% noisy answers)",
              file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="demo-sft-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, str(repo / "scripts" / "train.py"),
               "--config", str(repo / "configs" / "tiny_demo_sft.yaml"), f"run_dir={run_dir}",
               f"seed={args.seed}", f"train.total_versions={args.steps}",
               f"train.batch_size={args.batch_size}", f"optim.lr={args.lr}",
               f"optim.warmup_steps={min(50, args.steps - 1)}",
               f"eval.every_versions={args.eval_every}",
               f"data.max_eval_prompts={args.eval_prompts}"]
        code = subprocess.call(cmd)
        if code:
            return code
        out = Path(args.out)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(run_dir / "weights" / f"v{args.steps}", out,
                        ignore=shutil.ignore_patterns("COMMIT"))  # the publish marker
        history = [{"step": r["version"], "loss": r["loss"], "eval_loss": r["eval_loss"],
                    "eval_acc_t1": r["eval_accuracy"]}
                   for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                   if "eval_accuracy" in r]
        log_args = {k: v for k, v in vars(args).items() if k not in ("task", "init")}
        (out / "sft_log.json").write_text(json.dumps(
            {"args": log_args, "config": "configs/tiny_demo_sft.yaml", "history": history},
            indent=2))
    print(f"wrote {args.out}")
    return 0


def main() -> int:
    args = build_parser().parse_args()
    defaults = {"steps": 1500, "batch_size": 64, "lr": 3e-3, "eval_every": 250,
                "eval_prompts": 128}
    if args.task != "arith":
        defaults.update(LONGTAIL_DEFAULTS)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    train_split, eval_split, seq_len, max_positions, eval_max_new = TASKS[args.task]
    if args.out is None:
        args.out = ("areal_jax/data/assets/arith_sft" if args.task == "arith"
                    else f"areal_jax/data/assets/{args.task}_sft")
    if args.task == "arith":
        return sft_config_run(args)

    cfg = demo_model_config(max_positions)
    model = CausalLM(cfg, rngs=nnx.Rngs(args.seed))
    if args.init:  # same parameter shapes (positions are RoPE, not weights)
        nnx.update(model, nnx.state(load_hf(args.init, dtype="float32")[0], nnx.Param))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 50, args.steps, args.lr * 0.1)
    tx = optax.adamw(schedule, weight_decay=0.01)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train = bt.make_split(train_split)
    evals = bt.make_split(eval_split)[: args.eval_prompts]
    ids_all, mask_all = encode_examples(train, args.answer_noise, args.seed, seq_len)
    rng = np.random.default_rng(args.seed)
    lengths = (ids_all != bt.PAD_ID).sum(1)
    buckets = ([np.flatnonzero((lengths > lo) & (lengths <= hi)) for lo, hi in
                zip((0, *BUCKET_WIDTHS), BUCKET_WIDTHS, strict=False)]
               if args.task != "arith" else [])
    bucket_of = np.zeros(len(train), np.int64)
    for b, members in enumerate(buckets):
        bucket_of[members] = b

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
        if buckets:  # one length bucket per batch, picked in proportion to its size
            b = bucket_of[rng.integers(0, len(train))]
            idx = buckets[b][rng.integers(0, len(buckets[b]), args.batch_size)]
            width = BUCKET_WIDTHS[b]
        else:
            idx, width = rng.integers(0, len(train), args.batch_size), seq_len
        loss = step(model, opt, jnp.asarray(ids_all[idx, :width]),
                    jnp.asarray(mask_all[idx, :width]))
        if i % args.eval_every == 0 or i == args.steps:
            key, k1 = jax.random.split(key)
            acc_t1 = accuracy(model, evals, 1.0, k1, eval_max_new, seq_len)
            acc_greedy = accuracy(model, evals, 0.0, k1, eval_max_new, seq_len)
            history.append({"step": i, "loss": float(loss), "eval_acc_t1": acc_t1,
                            "eval_acc_greedy": acc_greedy})
            print(f"step {i:5d} loss {float(loss):.3f} eval acc (T=1) {acc_t1:.3f} "
                  f"(greedy) {acc_greedy:.3f}  [{time.time() - t0:.0f}s]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_hf(model, cfg, out)
    bt.save_tokenizer(out, **({} if args.task == "arith" else {"model_max_length": max_positions}))
    new_keys = ("task", "init")  # the arith log keeps the keys it always had
    log_args = {k: v for k, v in vars(args).items()
                if args.task != "arith" or k not in new_keys or (k == "init" and v)}
    (out / "sft_log.json").write_text(
        json.dumps({"args": log_args, "history": history}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
