"""Model-judged rewards: an LLM judge behind any OpenAI-compatible endpoint.

    judge = JudgeReward(JudgeSettings(url="http://127.0.0.1:30001", template=...))
    score, problem = await judge.ascore(completion, reference, question=question)

Each call fills ``template`` (``{question}``, ``{reference}``, ``{answer}``), sends it to
``/v1/chat/completions`` (or ``/v1/completions``), and reads the score from the reply with
``score_pattern``: the first group of its last match, a number within ``score_range``.
The endpoint may be the run's own embedded server of a checkpoint (``reward.judge.model_path``),
an external SGLang / vLLM server, or a hosted API (``url`` plus ``api_key_env``, the name of the
environment variable holding the key, sent as ``Authorization: Bearer``).

- **Concurrency:** at most ``max_concurrency`` judge requests in flight (per event loop).
- **Timeouts and retries:** each request is limited to ``timeout_s``; a timeout, a lost
  connection, an HTTP 429/5xx or an unparsable reply is retried up to ``retries`` times with
  exponential back-off (``backoff_s``, doubled each try). Other 4xx are not retried.
- **Cache:** identical judgments (same question, reference and answer) are asked once: a
  second call waits for the first, and a finished score is kept (LRU, ``cache_size``).
  Failures are not cached.
- **Failures are never a silent 0.** A judgment still failed after its retries gives
  ``(None, why)`` with ``on_failure: reject`` (the default): the workflow rejects the
  sample's group (group advantages need every sample's reward), counted as
  ``reward_failed_groups``. With ``on_failure: fallback`` it gives ``fallback_score``, counted
  as ``judge_fallbacks``. Every outcome is counted (:meth:`JudgeReward.metrics`, and in a run
  ``rollout/judge_*`` in ``metrics.jsonl``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_jax.rewards.model_client import LoopSessions, ModelServerError, post_json

Counter = Callable[[str, int], None]

DEFAULT_TEMPLATE = (
    "You are grading a student's answer to a problem.\n\n"
    "Problem:\n{question}\n\nReference answer:\n{reference}\n\nStudent's answer:\n{answer}\n\n"
    "Is the student's final answer correct? Reply with one line: \"Score: 1\" if it is "
    "correct, \"Score: 0\" if it is not.")
DEFAULT_SCORE_PATTERN = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
ON_FAILURE = ("reject", "fallback")
ENDPOINTS = ("chat", "completions")
TEMPLATE_FIELDS = ("question", "reference", "answer")


@dataclass(frozen=True)
class JudgeSettings:
    """What :class:`JudgeReward` needs (the run builds it from ``reward.judge``)."""

    url: str  # the server's root, e.g. http://127.0.0.1:30001 (a trailing /v1 is accepted)
    template: str = DEFAULT_TEMPLATE
    model: str = "default"  # the request's "model" field (a hosted API needs its model id)
    endpoint: str = "chat"  # chat: /v1/chat/completions; completions: /v1/completions
    system_prompt: str | None = None  # chat only
    score_pattern: str = DEFAULT_SCORE_PATTERN
    score_min: float = 0.0
    score_max: float = 1.0
    max_tokens: int = 64
    temperature: float = 0.0
    max_concurrency: int = 16
    timeout_s: float = 60.0
    retries: int = 2
    backoff_s: float = 0.5
    cache_size: int = 10000
    on_failure: str = "reject"
    fallback_score: float | None = None
    api_key: str | None = None  # resolved from api_key_env by the caller

    def __post_init__(self) -> None:
        check_template(self.template, "template")
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as e:
            raise ValueError(f"score_pattern {self.score_pattern!r} is not a regex: {e}") from None
        if pattern.groups < 1:
            raise ValueError(f"score_pattern {self.score_pattern!r} needs a group around the "
                             "score, e.g. 'Score: (\\d+)'")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}")
        if self.on_failure == "fallback" and self.fallback_score is None:
            raise ValueError("on_failure: fallback needs fallback_score")
        if not self.score_min < self.score_max:
            raise ValueError(f"score range [{self.score_min}, {self.score_max}] is empty")


def check_template(template: str, key: str) -> None:
    """A str.format template that names only {question}, {reference} and {answer}."""
    import string

    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ValueError(f"{key} is not a valid template ({e}); write literal braces as "
                         "{{ and }}") from None
    unknown = sorted(n for n in names if n not in TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(f"{key} names {unknown}; it may use {{question}}, {{reference}} and "
                         "{answer} (write literal braces as {{ and }})")
    if "answer" not in names:
        raise ValueError(f"{key} must contain {{answer}} (the completion being judged)")


def question_text(prompt: Any) -> str:
    """A prompt item's question as text: a string as is, a chat (list of messages) as its
    messages' contents joined."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


class JudgeUnparsable(ValueError):
    """The judge replied, but without a score in range."""


def parse_score(text: str, pattern: re.Pattern[str], lo: float, hi: float) -> float:
    """The first group of ``pattern``'s last match in ``text``, a finite number in [lo, hi]."""
    matches = list(pattern.finditer(text))
    if not matches:
        raise JudgeUnparsable(f"no score in the judge's reply {text[:120]!r}")
    raw = matches[-1].group(1)
    try:
        score = float(raw)
    except (TypeError, ValueError):
        raise JudgeUnparsable(f"score {raw!r} in the judge's reply is not a number") from None
    if not math.isfinite(score) or not lo <= score <= hi:
        raise JudgeUnparsable(f"score {score:g} is outside [{lo:g}, {hi:g}]")
    return score


class JudgeReward:
    """An LLM judge as a reward (see the module doc). Use from any event loop."""

    kind = "judge"

    def __init__(self, settings: JudgeSettings) -> None:
        self.settings = settings
        self._pattern = re.compile(settings.score_pattern)
        self._sessions = LoopSessions(settings.max_concurrency, settings.api_key)
        self._cache: collections.OrderedDict[tuple[str, str, str], float] = (
            collections.OrderedDict())
        self._inflight: dict[tuple[str, str, str], asyncio.Future[tuple[float | None, str | None]]]
        self._inflight = {}
        self.counts: dict[str, float] = dict.fromkeys(
            ("calls", "cache_hits", "requests", "retries", "timeouts", "http_errors",
             "unparsable", "failed", "fallbacks", "ok"), 0)
        self.counts["latency_s_sum"] = 0.0

    # ------------------------------------------------------------------ public API
    async def ascore(self, completion: str, reference: Any, *, question: Any = "",
                     count: Counter | None = None) -> tuple[float | None, str | None]:
        """``(score, None)``, or ``(None, why)`` when the judgment failed and ``on_failure``
        is reject; with fallback, ``(fallback_score, None)``. ``count(name, n)`` is told of
        every event (the workflow passes the executor's counter)."""
        key = (question_text(question), str(reference), completion)
        self._count("calls", count)
        if key in self._cache:
            self._cache.move_to_end(key)
            self._count("cache_hits", count)
            return self._cache[key], None
        pending = self._inflight.get(key)
        if pending is not None and pending.get_loop() is asyncio.get_running_loop():
            self._count("cache_hits", count)
            return await asyncio.shield(pending)
        fut: asyncio.Future[tuple[float | None, str | None]] = (
            asyncio.get_running_loop().create_future())
        self._inflight[key] = fut
        try:
            result = await self._judge(key, count)
            fut.set_result(result)
            return result
        except asyncio.CancelledError:
            fut.cancel()  # a waiter for the same judgment is cancelled too
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: a waiter may not exist
            raise
        finally:
            self._inflight.pop(key, None)

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def close(self) -> None:
        self._sessions.close()

    # ------------------------------------------------------------------ internals
    def _count(self, name: str, count: Counter | None, n: int = 1) -> None:
        self.counts[name] += n
        if count is not None:
            count(f"judge_{name}", n)

    def _request(self, question: str, reference: str, answer: str) -> tuple[str, dict[str, Any]]:
        s = self.settings
        prompt = s.template.format(question=question, reference=reference, answer=answer)
        body: dict[str, Any] = {"model": s.model, "max_tokens": s.max_tokens,
                                "temperature": s.temperature}
        if s.endpoint == "chat":
            messages = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
            body["messages"] = [*messages, {"role": "user", "content": prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = prompt
        return "/v1/completions", body

    def _score(self, reply: Any) -> float:
        """The score in a reply (JudgeUnparsable when there is none in range)."""
        s = self.settings
        return parse_score(self._reply_text(reply, s.endpoint == "chat"), self._pattern,
                           s.score_min, s.score_max)

    @staticmethod
    def _reply_text(reply: Any, chat: bool) -> str:
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise JudgeUnparsable(f"the judge's reply has no choices[0]."
                                  f"{'message.content' if chat else 'text'}: "
                                  f"{json.dumps(reply)[:160]}") from None
        if not isinstance(text, str):
            raise JudgeUnparsable(f"the judge's reply text is {type(text).__name__}, not text")
        return text

    async def _judge(self, key: tuple[str, str, str], count: Counter | None
                     ) -> tuple[float | None, str | None]:
        s = self.settings
        route, body = self._request(*key)
        why = ""
        for attempt in range(s.retries + 1):
            if attempt:
                self._count("retries", count)
                await asyncio.sleep(s.backoff_s * 2 ** (attempt - 1))
            self._count("requests", count)
            t0 = time.monotonic()
            try:
                reply = await post_json(self._sessions, s.url, route, body, s.timeout_s)
                score = self._score(reply)
            except TimeoutError:
                self._count("timeouts", count)
                why = f"no reply within {s.timeout_s:g}s"
                continue
            except JudgeUnparsable as e:
                self._count("unparsable", count)
                why = f"unparsable: {e}"
                continue
            except ModelServerError as e:
                self._count("http_errors", count)
                why = str(e)
                if not e.retryable:
                    break
                continue
            finally:
                self.counts["latency_s_sum"] += time.monotonic() - t0
            self._count("ok", count)
            self._remember(key, score)
            return score, None
        self._count("failed", count)
        if s.on_failure == "fallback":
            assert s.fallback_score is not None  # checked in JudgeSettings
            self._count("fallbacks", count)
            return s.fallback_score, None
        return None, f"judge {s.url} failed after {s.retries + 1} tries: {why}"

    def _remember(self, key: tuple[str, str, str], score: float) -> None:
        if self.settings.cache_size <= 0:
            return
        self._cache[key] = score
        self._cache.move_to_end(key)
        while len(self._cache) > self.settings.cache_size:
            self._cache.popitem(last=False)


def api_key_from_env(name: str | None) -> str | None:
    """The key held by environment variable ``name`` (None: no key); ValueError naming the
    variable when it is unset or empty."""
    if not name:
        return None
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"environment variable {name} (the endpoint's api_key_env) is not set")
    return value


__all__ = ["DEFAULT_TEMPLATE", "JudgeReward", "JudgeSettings", "JudgeUnparsable",
           "api_key_from_env", "parse_score", "question_text"]
