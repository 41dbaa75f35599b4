"""Verifier of the built-in arithmetic task (see ``areal_jax.data.builtin_task``)."""

from __future__ import annotations

import re

_ANSWER_RE = re.compile(r"A:(-?\d+)")


def extract_builtin_answer(completion: str) -> str | None:
    """The integer after the first ``A:`` in the completion, or None."""
    m = _ANSWER_RE.search(completion)
    return m.group(1) if m else None


def builtin_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals ``answer``, else 0.0.

    Only the ``A:<int>`` field counts; intermediate steps are not graded, so the
    policy is free to learn its own way to the answer.
    """
    got = extract_builtin_answer(completion)
    if got is None:
        return 0.0
    try:
        return 1.0 if int(got) == int(answer) else 0.0
    except ValueError:
        return 0.0
