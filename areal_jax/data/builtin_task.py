"""The built-in synthetic reasoning task: multi-step integer arithmetic.

It exists so that the whole system (SFT warm start, async RL, evaluation) runs on a
CPU in minutes with no download. A problem is a left-to-right chain of additions and
subtractions; the solution writes every intermediate step, so answers have varied
length (2 to ``max_operands`` operands give 1 to ``max_operands - 1`` steps) and the
long tail of long answers exists::

    prompt:      Q:17+5-8=
    completion:  17+5=22;22-8=14;A:14<eos>

The first number is 0..40, later operands are 1..9, and running values stay in
[0, 40] by default, so a tiny model learns the format in a short SFT and RL has room to
improve accuracy. The first number spans the whole value range on purpose: with
single-digit starts there are only ~150 one-step questions, the eval split takes about
half of them, and a model trained on the rest memorises them instead of learning to add
(its held-out one-step accuracy was 0.36 against 1.0 on training questions).

Every intermediate result stays in ``[0, max_value]``. The tokenizer is character
level, saved in HF ``tokenizer.json`` form, so the generic tokenizer loader, the
engine and the learner treat it like any other model's tokenizer.

Splits are generated deterministically from a seed: ``train`` and ``eval`` never
share a question.

**The long-tail variant** (``longtail_train`` / ``longtail_eval``, :data:`LONGTAIL_TASK`)
is the same chain with 1 to 40 steps, the count drawn with P(k) proportional to
``k ** -1.3``: most answers are short (median ~28 tokens), a few are long (up to ~325),
so solution lengths spread over 30x, as reasoning traces do. It is the task on which a
synchronous step waits for its longest sample (docs/benchmarks.md, "Long-tail task").
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
CHARS = list("0123456789+-=;:QA")
VOCAB = SPECIAL_TOKENS + CHARS
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    min_operands: int = 2
    max_operands: int = 4
    max_value: int = 40
    max_operand: int = 9
    # None: the operand count is uniform in [min_operands, max_operands]. A number x: the
    # step count k = operands - 1 is drawn with P(k) proportional to k ** -x (a long tail).
    steps_exponent: float | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                "need 2 <= min_operands <= max_operands, "
                f"got {self.min_operands}, {self.max_operands}"
            )
        if self.max_operand < 1 or self.max_value < self.max_operand:
            raise ValueError("need 1 <= max_operand <= max_value")
        if self.steps_exponent is not None and self.steps_exponent <= 0:
            raise ValueError(f"need steps_exponent > 0 or None, got {self.steps_exponent}")


# The long-tail task: 1 to 40 steps, P(k steps) ~ k^-1.3 (see the module docstring).
LONGTAIL_TASK = ArithmeticTaskConfig(min_operands=2, max_operands=41, steps_exponent=1.3)
# A split name's task prefix -> its task; "train" is the arithmetic demo's, "longtail_train"
# the long-tail one's.
TASKS = {"": ArithmeticTaskConfig(), "longtail": LONGTAIL_TASK}
SPLITS = tuple(f"{t}_{s}" if t else s for t in TASKS for s in ("train", "eval"))


def parse_split(name: str) -> tuple[str, ArithmeticTaskConfig]:
    """``"train"`` -> ("train", the arithmetic task); ``"longtail_eval"`` -> ("eval",
    :data:`LONGTAIL_TASK`)."""
    if name not in SPLITS:
        raise ValueError(f"builtin task split must be one of {list(SPLITS)}, got {name!r}")
    task, _, split = name.rpartition("_")
    return split, TASKS[task]


def _num_operands(rng: random.Random, cfg: ArithmeticTaskConfig) -> int:
    if cfg.steps_exponent is None:
        return rng.randint(cfg.min_operands, cfg.max_operands)
    steps = range(cfg.min_operands - 1, cfg.max_operands)
    weights = [k ** -cfg.steps_exponent for k in steps]
    return 1 + rng.choices(steps, weights)[0]


def make_problem(rng: random.Random, cfg: ArithmeticTaskConfig) -> dict:
    """One problem: question, step-by-step solution and integer answer."""
    n = _num_operands(rng, cfg)
    value = rng.randint(0, cfg.max_value)
    question = str(value)
    steps = []
    for _ in range(n - 1):
        ops = []
        if value + 1 <= cfg.max_value:
            ops.append("+")
        if value >= 1:
            ops.append("-")
        op = rng.choice(ops)
        if op == "+":
            operand = rng.randint(1, min(cfg.max_operand, cfg.max_value - value))
            new = value + operand
        else:
            operand = rng.randint(1, min(cfg.max_operand, value))
            new = value - operand
        steps.append(f"{value}{op}{operand}={new}")
        question += f"{op}{operand}"
        value = new
    return {
        "question": f"Q:{question}=",
        "solution": ";".join(steps) + f";A:{value}",
        "answer": str(value),
        "num_steps": n - 1,
    }


def make_split(
    split: str, n: int | None = None, cfg: ArithmeticTaskConfig | None = None
) -> list[dict]:
    """Deterministic ``train`` (default 20000) or ``eval`` (default 256) problems.

    ``split`` may name a task too (``longtail_train``, see :data:`SPLITS`); ``cfg``, if
    given, replaces the task. Eval questions are drawn first from their own seed; train
    questions skip any question that appears in eval.
    """
    name = split
    split, task = parse_split(name)
    cfg = cfg or task
    eval_rng = random.Random(1234)
    n_eval = 256 if split != "eval" or n is None else n
    eval_items: list[dict] = []
    seen: set[str] = set()
    while len(eval_items) < n_eval:
        p = make_problem(eval_rng, cfg)
        if p["question"] not in seen:
            seen.add(p["question"])
            eval_items.append(p)
    if split == "eval":
        items = eval_items
    else:
        n_train = 20000 if n is None else n
        rng = random.Random(42)
        items, train_seen = [], set()
        while len(items) < n_train:
            p = make_problem(rng, cfg)
            if p["question"] in seen:
                continue
            items.append(p)
            train_seen.add(p["question"])
    return [{"prompt_id": f"{name}-{i}", **p} for i, p in enumerate(items)]


# The SFT splits (``train_sft``, ``longtail_train_sft``): the train split with
# SFT_ANSWER_NOISE of its solutions ending in a random wrong answer (the steps stay right),
# the data of the demos' warm starts (configs/tiny_demo_sft.yaml; docs/training.md).
SFT_SUFFIX = "_sft"
SFT_SPLITS = tuple(f"{t}_train{SFT_SUFFIX}" if t else f"train{SFT_SUFFIX}" for t in TASKS)
SFT_ANSWER_NOISE = 0.7


def noisy_solution(item: dict, rng: np.random.Generator, answer_noise: float,
                   max_value: int) -> str:
    """The solution, with its final answer replaced by a random wrong one w.p. answer_noise."""
    solution = item["solution"]
    if rng.random() >= answer_noise:
        return solution
    wrong = int(item["answer"])
    while wrong == int(item["answer"]):
        wrong = int(rng.integers(0, max_value + 1))
    return solution[: solution.rindex("A:")] + f"A:{wrong}"


def make_sft_split(split: str, answer_noise: float = SFT_ANSWER_NOISE, seed: int = 0
                   ) -> list[dict]:
    """An SFT split (:data:`SFT_SPLITS`): the train split's rows with each ``solution`` noisy
    (:func:`noisy_solution`, drawn from ``seed`` in row order); ``answer`` stays the right one."""
    if split not in SFT_SPLITS:
        raise ValueError(f"builtin SFT split must be one of {list(SFT_SPLITS)}, got {split!r}")
    base = split[: -len(SFT_SUFFIX)]
    rng = np.random.default_rng(seed + 7)
    max_value = parse_split(base)[1].max_value
    return [{**item, "prompt_id": f"{split}-{i}",
             "solution": noisy_solution(item, rng, answer_noise, max_value)}
            for i, item in enumerate(make_split(base))]


def write_split(path: str | Path, split: str, n: int | None = None,
                cfg: ArithmeticTaskConfig | None = None) -> Path:
    """Write a split as JSONL (keys: prompt_id, question, solution, answer, num_steps); an
    SFT split (:data:`SFT_SPLITS`) with its noisy solutions."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    items = make_sft_split(split) if split in SFT_SPLITS else make_split(split, n, cfg)
    with tmp.open("w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    tmp.replace(path)
    return path


def build_tokenizer():
    """The character-level tokenizer as a ``tokenizers.Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def save_tokenizer(out_dir: str | Path, model_max_length: int = 128) -> Path:
    """Save ``tokenizer.json`` and ``tokenizer_config.json`` (HF layout) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": PAD},
                   indent=2)
    )
    return out_dir


def encode(text: str) -> list[int]:
    """Encode task text without the tokenizer object (it is a fixed char vocabulary)."""
    index = {c: i for i, c in enumerate(VOCAB)}
    try:
        return [index[c] for c in text]
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the builtin task vocabulary") from None


def decode(ids: list[int]) -> str:
    """Decode ids, dropping special tokens."""
    return "".join(VOCAB[i] for i in ids if i >= len(SPECIAL_TOKENS) and i < len(VOCAB))
