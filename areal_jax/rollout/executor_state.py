"""Saving and restoring a RolloutExecutor's accounting (see "Checkpoints" in executor.py).

The snapshot holds: the counters and the version, the prompt iterator's state, every
accepted-but-unconsumed group as data, and the prompt item of every run in flight or
queued for retry. Restoring puts the accepted groups back as they were and queues the
in-flight prompts to be replayed from scratch, before any new prompt.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_jax.rollout.types import Trajectory

if TYPE_CHECKING:
    from areal_jax.rollout.executor import RolloutExecutor

STATE_FORMAT = 1


@dataclass
class AcceptedGroup:
    """A group waiting for the learner, with where it came from."""

    seq: int  # submission order of its run
    start_version: int
    item: dict[str, Any]
    group: list[Trajectory]

    @property
    def order(self) -> tuple[int, int]:
        """Oldest first: by start version, then submission order."""
        return (self.start_version, self.seq)


def executor_state_dict(ex: RolloutExecutor) -> dict[str, Any]:
    """The executor's JSON-serialisable snapshot (``RolloutExecutor.state_dict``)."""
    with ex._cond:
        iterator_state = None
        if ex._prompts is not None:
            get_state = getattr(ex._prompts, "get_state", None)
            if get_state is None:
                raise TypeError("the prompt iterator has no get_state(); use a grain "
                                "DatasetIterator (iter(load_prompt_dataset(...)))")
            iterator_state = get_state()
        in_flight = [{"item": r.item, "attempt": r.attempt}
                     for r in sorted(ex._running.values(), key=lambda r: r.seq)]
        in_flight += [{"item": item, "attempt": attempt} for item, attempt in ex._pending]
        state = {
            "format": STATE_FORMAT,
            "version": ex._version,
            "base_version": ex._base_version,
            "next_seq": ex._next_seq,
            "gate_accepted": ex._gate_accepted,
            "counts": dict(ex._counts),
            "staleness_hist": {str(k): v for k, v in ex._staleness_hist.items()},
            "prompt_iterator": iterator_state,
            "prompts_exhausted": ex._exhausted,
            "accepted": [{"seq": a.seq, "start_version": a.start_version, "item": a.item,
                          "group": [t.to_dict() for t in a.group]}
                         for a in sorted(ex._accepted, key=lambda a: a.order)],
            "in_flight": in_flight,
        }
    try:
        json.dumps(state)
    except TypeError as e:
        raise TypeError(f"executor state is not JSON-serialisable ({e}); prompt items and "
                        "Trajectory.info must hold only JSON types") from e
    return state


def load_executor_state(ex: RolloutExecutor, state: dict[str, Any]) -> None:
    """Restores a snapshot into a not yet started executor (``load_state_dict``)."""
    if ex._thread is not None:
        raise RuntimeError("load_state_dict must be called before start()")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"executor state has format {state.get('format')!r}, "
                         f"this version reads {STATE_FORMAT}")
    missing = {"version", "base_version", "next_seq", "counts", "prompt_iterator",
               "accepted", "in_flight"} - set(state)
    if missing:
        raise KeyError(f"executor state lacks keys {sorted(missing)}")
    if state["prompt_iterator"] is not None:
        set_state = getattr(ex._prompts, "set_state", None)
        if set_state is None:
            raise TypeError("the executor state holds a prompt-iterator state, but this "
                            "executor's prompt iterator has no set_state()")
        set_state(state["prompt_iterator"])
    with ex._cond:
        ex._version = int(state["version"])
        ex._base_version = int(state["base_version"])
        ex._next_seq = int(state["next_seq"])
        ex._counts = Counter(state["counts"])
        ex._staleness_hist = Counter({int(k): v
                                      for k, v in state.get("staleness_hist", {}).items()})
        ex._exhausted = bool(state.get("prompts_exhausted", False))
        ex._accepted = [AcceptedGroup(a["seq"], a["start_version"], a["item"],
                                      [Trajectory.from_dict(t) for t in a["group"]])
                        for a in state["accepted"]]
        ex._pending = deque((f["item"], int(f["attempt"])) for f in state["in_flight"])
        ex._running = {}
        default_gate = ex._counts.get("consumed", 0) + len(ex._accepted)
        ex._gate_accepted = int(state.get("gate_accepted", default_gate))
        ex._counts["replayed"] += len(ex._pending)
