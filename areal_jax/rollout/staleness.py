"""The staleness gate: how many new rollouts may start now (AReaL's capacity formula).

    gate = StalenessGate(batch_size=B, max_staleness=eta, max_concurrent=64)
    gate.capacity(running=3)       # new runs allowed now
    gate.accept()                  # a run returned a group
    gate.set_version(v + 1)        # the learner published a version

A new run may start only while

    capacity = min(max_concurrent - running,
                   (eta + (v - v0) + 1) * B - (accepted + running)) > 0

where ``accepted`` counts every group ever accepted (consumed or not), ``running`` the
runs in flight, ``v`` the current version and ``v0`` the version at which this gate's
accounting began (0 for a fresh run; the version a fresh executor joins a run at
otherwise). With ``eta`` None only ``max_concurrent`` limits. Groups returned to the
prompt queue because they became too stale give their place back (:meth:`release`).

So at most ``(eta + 1) * B`` groups are started per version beyond what the learner has
consumed, and (with the learner taking B groups per version, oldest first) no batch
trained at version v holds a group started before ``v - eta``. The gate holds numbers
only; the executor owns the runs and calls it under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_defs import JsonDict


@dataclass
class StalenessGate:
    batch_size: int  # B: groups (prompts) the learner consumes per version
    max_staleness: int | None  # eta; None: unbounded
    max_concurrent: int
    version: int = 0
    base_version: int = 0  # v0
    accepted: int = 0  # groups accepted ever (consumed or not), minus those released

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None (unbounded), "
                             f"got {self.max_staleness}")

    def capacity(self, running: int) -> int:
        """How many new runs may start now, with ``running`` runs in flight."""
        cap = self.max_concurrent - running
        if self.max_staleness is not None:
            allowed = (self.max_staleness + self.version - self.base_version + 1) * self.batch_size
            cap = min(cap, allowed - (self.accepted + running))
        return cap

    @property
    def oldest_allowed(self) -> int | None:
        """The oldest start version a batch trained now may hold (None: unbounded)."""
        return None if self.max_staleness is None else self.version - self.max_staleness

    def is_stale(self, start_version: int) -> bool:
        oldest = self.oldest_allowed
        return oldest is not None and start_version < oldest

    def accept(self) -> None:
        self.accepted += 1

    def release(self, n: int) -> None:
        """``n`` accepted groups went back to the prompt queue (too stale): their places
        are free again."""
        self.accepted -= n

    def set_version(self, version: int, *, fresh: bool = False) -> None:
        """The learner's version. ``fresh``: nothing was started yet, so the accounting
        begins at this version (an executor joining a run that is at version v0)."""
        if version < self.version:
            raise ValueError(f"set_version({version}) would go back from version {self.version}")
        if fresh:
            self.base_version = version
        self.version = version

    def state_dict(self) -> dict[str, int]:
        return {"version": self.version, "base_version": self.base_version,
                "gate_accepted": self.accepted}

    def load_state_dict(self, state: JsonDict, default_accepted: int) -> None:
        """Restores :meth:`state_dict` (``default_accepted`` for snapshots without it)."""
        self.version = int(state["version"])
        self.base_version = int(state["base_version"])
        self.accepted = int(state.get("gate_accepted", default_accepted))
