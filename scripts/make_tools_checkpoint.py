"""Make the tool-calling demo's starting checkpoint: the arithmetic demo model
(``builtin:arith_sft``) briefly SFT'd to call a calculator in Qwen's ``<tool_call>`` form.

The task's 20-character vocabulary cannot spell JSON, so the tokenizer gains four added
tokens in the model's unused vocabulary rows (20-23):

    <tool_call>{"name": "calculator", "arguments": {"expression": "     (one token)
    "}}</tool_call>                                                      (one token)
    <tool_response>   </tool_response>

A call is then ``[20] 17+5-8 [21] <eos>`` and decodes to the text the engine's Qwen parser
reads. The chat template (written beside the weights) renders user turns verbatim,
assistant turns with their calls and ``<eos>``, and tool results in ``<tool_response>``.
A traced episode is::

    Q:17+5-8=  [20]17+5-8[21]<eos>  [22]14[23]  A:14<eos>

The SFT data is noisy on purpose, so RL has something to do: ``--no-call`` of the traces
solve the problem by hand without calling, and ``--expression-noise`` of the calls send a
mangled expression (an operand dropped or changed), whose result the trace then copies as
the answer. Regenerate with:

    python scripts/make_tools_checkpoint.py --out areal_jax/data/assets/arith_tools
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
from areal_jax.run_inputs import ASSETS_DIR
from model_defs import load_hf, save_hf

CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ADDED = [CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE]
FIRST_ID = len(bt.VOCAB)  # 20: the first unused row
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ m['content'] or '' }}"
    "{%- for c in (m['tool_calls'] or []) -%}"
    "{%- set f = c['function'] if c['function'] is defined else c -%}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson)"
    " + '}</tool_call>' }}"
    "{%- endfor -%}<eos>"
    "{%- elif m['role'] == 'tool' -%}<tool_response>{{ m['content'] }}</tool_response>"
    "{%- else -%}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}")
SEQ_LEN = 64
CALL, CLOSE, R_OPEN, R_CLOSE = range(FIRST_ID, FIRST_ID + 4)


def mangle(expression: str, rng: np.random.Generator) -> str:
    """The expression with its last operand dropped, or one digit changed."""
    parts = expression.replace("-", "+-").split("+")
    if len(parts) > 2 and rng.random() < 0.5:
        return expression[:expression.rindex(parts[-1].lstrip("-")) - 1]
    digits = [i for i, c in enumerate(expression) if c.isdigit()]
    i = int(rng.choice(digits))
    new = str((int(expression[i]) + int(rng.integers(1, 9))) % 10)
    return expression[:i] + new + expression[i + 1:]


def trace(item: dict, rng: np.random.Generator, no_call: float, noise: float
          ) -> tuple[list[int], list[int]]:
    """One episode's ids and loss mask (the model's tokens)."""
    q = bt.encode(item["question"])
    if rng.random() < no_call:
        a = bt.encode(item["solution"]) + [bt.EOS_ID]
        return q + a, [0] * len(q) + [1] * len(a)
    expression = item["question"][2:-1]  # "Q:17+5-8=" -> "17+5-8"
    if rng.random() < noise:
        expression = mangle(expression, rng)
    value = str(sum(int(t) for t in expression.replace("-", "+-").split("+") if t))
    call = [CALL] + bt.encode(expression) + [CLOSE, bt.EOS_ID]
    result = [R_OPEN] + bt.encode(value) + [R_CLOSE]
    answer = bt.encode(f"A:{value}") + [bt.EOS_ID]
    ids = q + call + result + answer
    mask = [0] * len(q) + [1] * len(call) + [0] * len(result) + [1] * len(answer)
    return ids, mask


def write_tokenizer(out: Path) -> None:
    bt.save_tokenizer(out)
    tok = json.loads((out / "tokenizer.json").read_text())
    for i, content in enumerate(ADDED):
        tok["added_tokens"].append({"id": FIRST_ID + i, "content": content,
                                    "single_word": False, "lstrip": False, "rstrip": False,
                                    "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tok, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="areal_jax/data/assets/arith_tools")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-call", type=float, default=0.3,
                   help="fraction of traces that solve by hand without calling the tool")
    p.add_argument("--expression-noise", type=float, default=0.5,
                   help="fraction of calls that send a mangled expression")
    return p


def main() -> int:
    args = build_parser().parse_args()

    model, cfg = load_hf(ASSETS_DIR / "arith_sft", dtype="float32")
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 20, args.steps,
                                                        args.lr * 0.1), weight_decay=0.01)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(args.seed)
    train = bt.make_split("train")
    ids_all = np.full((len(train), SEQ_LEN), bt.PAD_ID, np.int32)
    mask_all = np.zeros((len(train), SEQ_LEN), np.float32)
    for i, item in enumerate(train):
        ids, mask = trace(item, rng, args.no_call, args.expression_noise)
        ids_all[i, :len(ids)], mask_all[i, :len(mask)] = ids[:SEQ_LEN], mask[:SEQ_LEN]

    @nnx.jit
    def step(model, opt, ids, mask):
        def loss_fn(model):
            logp = jax.nn.log_softmax(model(ids[:, :-1]), -1)
            tok_logp = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
            return -(tok_logp * mask[:, 1:]).sum() / mask[:, 1:].sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    t0 = time.time()
    history = []
    for i in range(1, args.steps + 1):
        idx = rng.integers(0, len(train), args.batch_size)
        loss = step(model, opt, jnp.asarray(ids_all[idx]), jnp.asarray(mask_all[idx]))
        if i % 50 == 0 or i == args.steps:
            history.append({"step": i, "loss": float(loss)})
            print(f"step {i:4d} loss {float(loss):.3f} [{time.time() - t0:.0f}s]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_hf(model, cfg, out)
    write_tokenizer(out)
    (out / "sft_log.json").write_text(json.dumps({"args": vars(args), "history": history},
                                                 indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
