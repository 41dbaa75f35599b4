"""Supervised fine-tuning data: rows -> token sequences with a loss mask -> packed batches.

    examples = sft_examples(read_records("train.jsonl"), tokenizer, completion_key="completion")
    stream = SFTBatches(examples, batch_size=64, seed=0, pack_kwargs=dict(seq_len=256, ...))
    batch = stream.batch(version)   # a TrainBatch: examples [v*B, (v+1)*B) of the epochs

A row is either

- **chat messages** (``messages_key``, default ``messages``): a list of ``{"role", "content"}``
  rendered with the tokenizer's chat template; the loss is on the assistant turns only. Each
  assistant turn's tokens are the text the template adds for it: the rendering of the
  messages up to it (``add_generation_prompt=True``) must be a prefix of the rendering that
  includes it, as it is for the usual templates (the plain fallback of a folder without a
  template too; its assistant turns end with the EOS token);
- **a prompt and a completion** (``prompt_key`` and ``completion_key``): the prompt encoded as
  the RL workflow encodes it (``ChatTokenizer.encode_prompt``: the chat template with its
  generation prompt when the tokenizer has one), the completion's tokens then the EOS token;
  the loss is on the completion and EOS.

Each example is a :class:`~areal_jax.trajectory.Trajectory` (loss_mask = the tokens to
learn; no logprobs, version -1), so SFT packs exactly like RL
(:func:`~areal_jax.learner.packing.pack_trajectories`).

Order: epoch e visits the examples in a permutation drawn from (seed, e); the batch of
version v is positions [v*B, (v+1)*B) of the concatenated epochs, so a resumed run takes the
same batches knowing its version alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from areal_jax.data.trajectories import TrainBatch
from areal_jax.learner.packing import pack_trajectories
from areal_jax.tokenizer import ChatTokenizer
from areal_jax.trajectory import Trajectory

__all__ = ["SFTBatches", "chat_example", "prompt_completion_example", "sft_examples"]


def _example(pieces: list[tuple[list[int], bool]], prompt_id: str) -> Trajectory:
    """A trajectory from (token ids, learn them?) pieces in order."""
    ids = [t for piece, _ in pieces for t in piece]
    mask = [int(learn) for piece, learn in pieces for _ in piece]
    n = len(ids)
    return Trajectory(input_ids=np.asarray(ids, np.int32), loss_mask=np.asarray(mask, np.int32),
                      behav_logp=np.zeros(n, np.float32), versions=np.full(n, -1, np.int32),
                      reward=0.0, prompt_id=prompt_id, group_id=prompt_id)


def _eos(tokenizer: ChatTokenizer) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.source} has no eos_token: an SFT completion "
                         "must end with one (set eos_token in tokenizer_config.json)")
    return [tokenizer.eos_token_id]


def prompt_completion_example(prompt: str | list[dict[str, Any]], completion: str,
                              tokenizer: ChatTokenizer, prompt_id: str = "") -> Trajectory:
    """The prompt as the RL workflow encodes it (not learned), then the completion and EOS
    (learned)."""
    if not isinstance(completion, str):
        raise ValueError(f"the completion must be a string, got {type(completion).__name__}")
    prompt_ids = tokenizer.encode_prompt(prompt)
    completion_ids = tokenizer.encode(completion) + _eos(tokenizer)
    return _example([(prompt_ids, False), (completion_ids, True)], prompt_id)


def chat_example(messages: list[dict[str, Any]], tokenizer: ChatTokenizer,
                 prompt_id: str = "") -> Trajectory:
    """Chat messages rendered with the tokenizer's chat template; only the assistant turns
    are learned (see the module doc)."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the messages have no assistant turn: nothing to learn")
    plain = tokenizer.chat_template is None  # the fallback's turns carry no EOS of their own
    pieces: list[tuple[list[int], bool]] = []
    done = ""  # the text rendered so far
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
        with_turn = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not before.startswith(done) or not with_turn.startswith(before):
            raise ValueError(
                f"the chat template does not render message {i} (assistant) as a suffix of "
                "the messages before it, so its tokens cannot be told apart; use prompt/"
                "completion rows instead")
        pieces.append((tokenizer.encode(before[len(done):]), False))
        turn = tokenizer.encode(with_turn[len(before):]) + (_eos(tokenizer) if plain else [])
        pieces.append((turn, True))
        done = with_turn
    return _example(pieces, prompt_id)


def sft_examples(rows: Sequence[dict[str, Any]], tokenizer: ChatTokenizer, *,
                 prompt_key: str = "prompt", completion_key: str = "completion",
                 messages_key: str = "messages", max_tokens: int | None = None,
                 source: str = "data") -> list[Trajectory]:
    """One example per row: chat messages when the row has ``messages_key``, else
    ``prompt_key`` + ``completion_key``. A row that is neither, renders no learned token or
    has more than ``max_tokens`` tokens is a ValueError naming ``source`` and the row."""
    out = []
    for i, row in enumerate(rows):
        prompt_id = str(row.get("prompt_id", i))
        try:
            if messages_key in row:
                example = chat_example(row[messages_key], tokenizer, prompt_id)
            elif prompt_key in row and completion_key in row:
                example = prompt_completion_example(row[prompt_key], row[completion_key],
                                                    tokenizer, prompt_id)
            else:
                raise ValueError(f"has neither {messages_key!r} (sft.messages_key) nor "
                                 f"{prompt_key!r} and {completion_key!r} (data.prompt_key, "
                                 f"sft.completion_key); keys: {sorted(row)}")
            if example.loss_mask[0]:
                raise ValueError("its first token would be learned, but nothing precedes it "
                                 "to predict it from: give it a prompt")
            if example.num_generated == 0:
                raise ValueError("it has no token to learn")
        except ValueError as e:
            raise ValueError(f"{source} row {i} {e}") from None
        if max_tokens is not None and example.num_tokens > max_tokens:
            raise ValueError(f"{source} row {i} has {example.num_tokens} tokens, more than "
                             f"train.seq_len={max_tokens}: raise train.seq_len or drop the row")
        out.append(example)
    if not out:
        raise ValueError(f"{source} holds no rows")
    return out


class SFTBatches:
    """The SFT batch of each version (see the module doc): ``batch_size`` examples, packed
    with ``pack_kwargs`` (``pack_trajectories``' seq_len, rows_per_micro_batch, n_shards,
    n_minibatches, row_lengths)."""

    def __init__(self, examples: Sequence[Trajectory], *, batch_size: int, seed: int,
                 pack_kwargs: dict[str, Any], start_version: int = 0) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.examples = list(examples)
        self.batch_size, self.seed = batch_size, seed
        self.pack_kwargs = dict(pack_kwargs)
        self.start_version = start_version
        self._perms: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(
                len(self.examples))}
        return self._perms[epoch]

    def indices(self, version: int) -> list[int]:
        """The examples of version ``version``'s batch."""
        n = len(self.examples)
        out = []
        for pos in range(version * self.batch_size, (version + 1) * self.batch_size):
            out.append(int(self._order(pos // n)[pos % n]))
        return out

    def batch(self, version: int) -> TrainBatch:
        """Version ``version``'s batch: its examples packed into micro-batches."""
        trajs = [self.examples[i] for i in self.indices(version)]
        micro_batches = pack_trajectories(trajs, None, **self.pack_kwargs)
        n_loss = float(sum(t.num_generated for t in trajs))
        return TrainBatch(micro_batches, [[t] for t in trajs], version,
                          {"n_examples": float(len(trajs)), "n_loss_tokens": n_loss})

    def __iter__(self) -> Iterator[TrainBatch]:
        version = self.start_version
        while True:
            yield self.batch(version)
            version += 1
