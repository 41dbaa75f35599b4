"""Input-token logprobs: the engine scoring a sequence it is given, with no generation.

SGLang answers ``/generate`` with ``return_logprob: true`` and ``logprob_start_len: k`` with
``meta_info.input_token_logprobs``: one ``[logprob, token_id, text]`` per input token from
position k, the logprob of token t given tokens ``< t`` (``None`` for position 0, which
nothing predicts); with ``max_new_tokens: 0`` it generates nothing and only scores. A
distillation teacher is asked exactly this (``areal_jax.rewards.teacher``). The embedded
engine answers the same fields with :func:`token_logprobs`: one forward of the served
weights over the whole sequence, fp32 log-softmax at temperature 1 (the model's own
distribution, whatever ``sampling_params.temperature`` says, as SGLang's input logprobs),
the vocabulary processed in chunks so that [T, V] logits never exist whole.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.engine.protocol import GenerateCall
from areal_jax.losses import logprobs_from_hidden
from model_defs import JsonDict, fp32_matmuls

if TYPE_CHECKING:
    from areal_jax.engine.engine import GenerationEngine

MIN_SCORE_LEN = 16  # rows are padded to a power of two at least this long
VOCAB_CHUNK = 8192


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs_bt(graphdef: nnx.GraphDef, state: nnx.State, ids_bt: jax.Array,
                       valid_bt: jax.Array) -> jax.Array:
    """[B, T] fp32: log p(ids[t] | ids[<t]) at t >= 1; column 0 and padding are 0."""
    model = nnx.merge(graphdef, state)
    with fp32_matmuls(model.dtype):
        hidden_btd = model.hidden_states(ids_bt, segment_ids=valid_bt.astype(jnp.int32))
        w, vocab_axis = model.unembed_weight()
        next_bt = jnp.pad(ids_bt[:, 1:], ((0, 0), (0, 1)))
        logp_next_bt, _ = logprobs_from_hidden(hidden_btd, w, next_bt, temperature=1.0,
                                               chunk_size=VOCAB_CHUNK, vocab_axis=vocab_axis)
    logp_bt = jnp.pad(logp_next_bt[:, :-1], ((0, 0), (1, 0)))
    return jnp.where(valid_bt, logp_bt, 0.0)


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def token_logprobs(graphdef: nnx.GraphDef, state: nnx.State,
                   sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per sequence, ``logp[t] = log p(seq[t] | seq[:t])`` for t >= 1 (``logp[0]`` is 0).

    Rows are right-padded to a power of two (causal attention: padding after a token never
    changes it) and the batch to a power of two rows, so few shapes are compiled."""
    longest = max(len(s) for s in sequences)
    width, rows = _pow2(longest, MIN_SCORE_LEN), _pow2(len(sequences), 1)
    ids = np.zeros((rows, width), np.int32)
    valid = np.zeros((rows, width), bool)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = seq
        valid[i, : len(seq)] = True
    logp = np.asarray(_token_logprobs_bt(graphdef, state, jnp.asarray(ids), jnp.asarray(valid)))
    return [logp[i, : len(seq)].astype(float).tolist() for i, seq in enumerate(sequences)]


def input_token_logprobs(ids: Sequence[int], logp: Sequence[float], start: int,
                         decode_text: object = None) -> list[list[object]]:
    """SGLang's ``input_token_logprobs`` from position ``start``: ``[logprob, token, text]``,
    ``None`` as position 0's logprob; ``text`` the token's text when ``decode_text`` (a
    ``(ids, skip_special_tokens) -> str``) is given, else None."""
    out: list[list[object]] = []
    for t in range(max(0, start), len(ids)):
        text = decode_text([ids[t]], False) if callable(decode_text) else None
        out.append([None if t == 0 else float(logp[t]), int(ids[t]), text])
    return out


def score_only_reply(call: GenerateCall, logp: Sequence[float], weight_version: str,
                     decode_text: object) -> JsonDict:
    """SGLang's reply to a ``max_new_tokens: 0`` request: no output, the input scored."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": call.rid or uuid.uuid4().hex,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(call.input_ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": weight_version,
            "input_token_logprobs": input_token_logprobs(
                call.input_ids, logp, call.logprob_start_len,
                decode_text if call.return_text_in_logprobs else None),
            "output_token_logprobs": [],
        },
    }


async def score_calls(engine: GenerationEngine, calls: Sequence[GenerateCall]
                      ) -> list[JsonDict]:
    """The replies to a /generate whose every prompt is a scoring request (one forward
    over all of them, on the engine thread)."""
    logps, version = await asyncio.to_thread(engine.score, [c.input_ids for c in calls])
    return [score_only_reply(c, lp, version, engine.decode_text)
            for c, lp in zip(calls, logps, strict=True)]


async def add_input_logprobs(engine: GenerationEngine, calls: Sequence[GenerateCall],
                             replies: Sequence[JsonDict]) -> None:
    """``meta_info.input_token_logprobs`` added to the replies of generating calls that ask
    for them (``return_logprob`` and ``logprob_start_len >= 0``): the prompt scored by the
    weights served once the generation is done."""
    wanted = [i for i, c in enumerate(calls) if c.return_logprob and c.logprob_start_len >= 0]
    if not wanted:
        return
    logps, _ = await asyncio.to_thread(engine.score, [calls[i].input_ids for i in wanted])
    for i, lp in zip(wanted, logps, strict=True):
        c = calls[i]
        replies[i]["meta_info"]["input_token_logprobs"] = input_token_logprobs(
            c.input_ids, lp, c.logprob_start_len,
            engine.decode_text if c.return_text_in_logprobs else None)
