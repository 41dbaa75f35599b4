"""The staleness gate alone: AReaL's capacity formula, step by step."""

from __future__ import annotations

import pytest

from areal_jax.rollout.staleness import StalenessGate


def test_capacity_follows_the_formula_over_versions():
    gate = StalenessGate(batch_size=4, max_staleness=1, max_concurrent=100)
    # (eta + v - v0 + 1) * B - (accepted + running): 8 at version 0 with nothing started
    assert gate.capacity(running=0) == 8
    assert gate.capacity(running=3) == 5
    for _ in range(8):
        gate.accept()
    assert gate.capacity(running=0) == 0  # 2 * B accepted: wait for the next version
    gate.set_version(1)
    assert gate.capacity(running=0) == 4  # one more batch's worth per version
    assert gate.capacity(running=4) == 0
    gate.release(2)  # two accepted groups went back to the queue (too stale)
    assert gate.capacity(running=4) == 2


def test_max_concurrent_and_unbounded_staleness():
    gate = StalenessGate(batch_size=4, max_staleness=None, max_concurrent=6)
    for _ in range(100):
        gate.accept()
    assert gate.capacity(running=2) == 4  # only max_concurrent limits
    assert gate.oldest_allowed is None and not gate.is_stale(-10)
    bounded = StalenessGate(batch_size=100, max_staleness=2, max_concurrent=6)
    assert bounded.capacity(running=0) == 6


def test_staleness_window_and_fresh_start_at_a_later_version():
    gate = StalenessGate(batch_size=2, max_staleness=2, max_concurrent=64)
    gate.set_version(5, fresh=True)  # an executor joining a run at version 5
    assert gate.capacity(running=0) == 6  # as a fresh run at version 0: (2 + 0 + 1) * 2
    assert gate.oldest_allowed == 3
    assert gate.is_stale(2) and not gate.is_stale(3)
    with pytest.raises(ValueError, match="go back"):
        gate.set_version(4)


def test_state_round_trip_and_validation():
    gate = StalenessGate(batch_size=3, max_staleness=0, max_concurrent=8)
    gate.set_version(2, fresh=True)
    gate.set_version(4)
    gate.accept()
    other = StalenessGate(batch_size=3, max_staleness=0, max_concurrent=8)
    other.load_state_dict(gate.state_dict(), default_accepted=0)
    assert other.state_dict() == gate.state_dict() == {
        "version": 4, "base_version": 2, "gate_accepted": 1}
    assert other.capacity(running=1) == gate.capacity(running=1) == (0 + 2 + 1) * 3 - 2
    old = {"version": 1, "base_version": 0}  # a snapshot from before the gate was saved
    other.load_state_dict(old, default_accepted=5)
    assert other.accepted == 5
    for kwargs, match in (({"batch_size": 0}, "batch_size"), ({"max_concurrent": 0}, "max_conc"),
                          ({"max_staleness": -1}, "max_staleness")):
        args = {"batch_size": 1, "max_staleness": 0, "max_concurrent": 1, **kwargs}
        with pytest.raises(ValueError, match=match):
            StalenessGate(**args)
