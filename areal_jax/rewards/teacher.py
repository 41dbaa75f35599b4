"""The on-policy distillation teacher: per-token logprobs of the student's own samples.

    teacher = TeacherScorer(TeacherSettings(url="http://127.0.0.1:30002"))
    logps = await teacher.token_logprobs([traj.input_ids.tolist() for traj in group])

Each sequence (prompt + sampled completion) is sent to the teacher's SGLang-protocol
``/generate`` as one batched scoring request: ``sampling_params.max_new_tokens: 0``,
``return_logprob: true``, ``logprob_start_len: 0``; the teacher generates nothing and answers
``meta_info.input_token_logprobs``, ``[logprob, token_id, text]`` per input token, ``None``
for the first. ``logps[i][t]`` is the teacher's log p(seq[t] | seq[:t]) (0 at t = 0). Both
SGLang and the embedded engine (``areal_jax.engine.scoring``) answer this, so the teacher may
be an external SGLang server of a larger model on other devices, or the run's own embedded
server of a checkpoint (``teacher.model_path``). The teacher must use the student's
tokenizer (the same token ids); every reply's token ids are checked against those sent.

A failed request (timeout, lost connection, 429/5xx, a malformed reply) is retried
``retries`` times with exponential back-off, then raises :class:`TeacherError`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_jax.rewards.model_client import LoopSessions, ModelServerError, post_json


class TeacherError(RuntimeError):
    """The teacher could not score a group (after its retries)."""


@dataclass(frozen=True)
class TeacherSettings:
    url: str
    max_concurrency: int = 8  # scoring requests (each one group of samples) in flight
    timeout_s: float = 120.0
    retries: int = 2
    backoff_s: float = 0.5
    api_key: str | None = None


def scoring_request(sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """SGLang's batched /generate that scores ``sequences`` without generating."""
    return {"input_ids": [list(map(int, s)) for s in sequences],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0,
                                "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}


def parse_scoring_reply(reply: Any, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per sequence, the teacher's logprob of each token (0.0 for the first); ValueError
    naming what is wrong with a reply of another shape or other token ids."""
    if not isinstance(reply, list) or len(reply) != len(sequences):
        raise ValueError(f"expected a list of {len(sequences)} replies, got "
                         f"{type(reply).__name__}")
    out = []
    for i, (item, seq) in enumerate(zip(reply, sequences, strict=True)):
        try:
            entries = item["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError):
            raise ValueError(f"reply {i} has no meta_info.input_token_logprobs") from None
        if not isinstance(entries, list) or len(entries) != len(seq):
            raise ValueError(f"reply {i}: {len(entries) if isinstance(entries, list) else '?'} "
                             f"input logprobs for {len(seq)} tokens")
        logp = [0.0]
        for t, entry in enumerate(entries):
            if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[1] != seq[t]:
                raise ValueError(f"reply {i}, token {t}: {entry!r:.80} does not score token "
                                 f"{seq[t]} (does the teacher use the student's tokenizer?)")
            if t == 0:
                continue
            value = entry[0]
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value > 1e-3:
                raise ValueError(f"reply {i}, token {t}: logprob {value!r} is not a finite "
                                 "number <= 0")
            logp.append(min(float(value), 0.0))
        out.append(logp)
    return out


class TeacherScorer:
    """Scores groups of sequences with the teacher (see the module doc)."""

    def __init__(self, settings: TeacherSettings) -> None:
        self.settings = settings
        self._sessions = LoopSessions(settings.max_concurrency, settings.api_key)
        self.counts: dict[str, float] = dict.fromkeys(
            ("requests", "retries", "failed", "scored_tokens"), 0)

    async def token_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        s = self.settings
        body = scoring_request(sequences)
        why = ""
        for attempt in range(s.retries + 1):
            if attempt:
                self.counts["retries"] += 1
                await asyncio.sleep(s.backoff_s * 2 ** (attempt - 1))
            self.counts["requests"] += 1
            try:
                reply = await post_json(self._sessions, s.url, "/generate", body, s.timeout_s)
                logps = parse_scoring_reply(reply, sequences)
            except TimeoutError:
                why = f"no reply within {s.timeout_s:g}s"
            except ModelServerError as e:
                why = str(e)
                if not e.retryable:
                    break
            except ValueError as e:
                why = f"malformed reply: {e}"
            else:
                self.counts["scored_tokens"] += sum(len(x) for x in logps)
                return logps
        self.counts["failed"] += 1
        raise TeacherError(f"teacher {s.url} failed after {s.retries + 1} tries: {why}")

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def close(self) -> None:
        self._sessions.close()
