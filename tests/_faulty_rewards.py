"""Reward functions that misbehave, for fault-injection tests (imported by reward workers)."""

from __future__ import annotations

import numpy as np


def always_raises(completion: str, answer: str) -> float:
    raise ZeroDivisionError(f"cannot score {completion[:10]!r}")


def returns_string(completion: str, answer: str) -> str:
    return "1.0"


def returns_huge(completion: str, answer: str) -> float:
    return 1e39


def returns_nan(completion: str, answer: str) -> float:
    return float("nan")


def returns_numpy_true(completion: str, answer: str) -> np.bool_:
    return np.bool_(True)


def returns_numpy_half(completion: str, answer: str) -> np.float32:
    return np.float32(0.5)


def returns_one(completion: str, answer: str) -> float:
    return 1.0


def fork_echo(completion: str, answer: str) -> float:
    """Forks and returns in both processes (the child's value is off by 100)."""
    import os

    child = os.fork() == 0
    return float(completion) + (100.0 if child else 0.0)


def fork_then_raise_in_child(completion: str, answer: str) -> float:
    """A sandbox that forks and whose child fails before it reaches ``os._exit``."""
    import os

    if os.fork() == 0:
        raise RuntimeError("the sandboxed child failed")
    return float(completion)
