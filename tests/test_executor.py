"""The executor's gate and accounting, driven by user-written workflows that need no server.

These workflows are the kind users write themselves (a workflow may do anything, not only
call the client); they sleep for random, heavy-tailed times, raise, reject or block, so the
gate, the staleness guarantee, retries and checkpoints are exercised quickly and exactly.
The same properties against real servers are in test_executor_servers.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time

import pytest

from areal_jax.data.prompts import prompt_items_from_list
from areal_jax.rollout.executor import PromptsExhausted, RolloutExecutor
from areal_jax.trajectory import Trajectory


def items(n, prefix="p"):
    return [{"prompt_id": f"{prefix}{i}", "prompt": "x"} for i in range(n)]


def make_group(ctx, n=2, reward=1.0):
    return [Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], behav_logp=[0.0, -1.0, -1.0],
                       versions=[-1, ctx.start_version, ctx.start_version], reward=reward)
            for _ in range(n)]


class RandomTimeWorkflow:
    """Sleeps a heavy-tailed random time; records every run's (prompt, start version, time)."""

    def __init__(self, seed=0, fail_p=0.0, reject_p=0.0, slow_p=0.1, base_s=0.004):
        self.rng = random.Random(seed)
        self.fail_p, self.reject_p, self.slow_p, self.base_s = fail_p, reject_p, slow_p, base_s
        self.runs = []  # (prompt_id, start_version, t_submit, outcome)
        self.lock = threading.Lock()

    async def arun(self, client, item, ctx):
        t0 = time.monotonic()
        slow = self.rng.random() < self.slow_p
        await asyncio.sleep(self.base_s * (20 if slow else self.rng.random()))
        u = self.rng.random()
        outcome = ("fail" if u < self.fail_p
                   else "reject" if u < self.fail_p + self.reject_p else "ok")
        with self.lock:
            self.runs.append((item["prompt_id"], ctx.start_version, t0, outcome, ctx.attempt))
        if outcome == "fail":
            raise RuntimeError(f"simulated failure on {item['prompt_id']}")
        if outcome == "reject":
            return None
        return make_group(ctx)


def train_loop(executor, n_versions, batch_size, eta, train_s=0.01, on_batch=None):
    """A slow learner: take a batch, check its staleness, 'train', bump the version."""
    consumed, consume_times = [], []
    for v in range(n_versions):
        groups = executor.prepare_batch(batch_size, timeout=60)
        consume_times.append(time.monotonic())
        assert len(groups) == batch_size
        for g in groups:
            for t in g:
                assert v - t.start_version <= eta, (v, t.start_version)
                assert t.start_version <= v
        consumed += [g[0].prompt_id for g in groups]
        if on_batch:
            on_batch(v, groups)
        time.sleep(train_s)
        executor.pause()
        executor.set_version(v + 1)
        executor.resume()
    return consumed, consume_times


def drain(executor, batch_size, version, eta=None):
    """Takes batches (the last one partial) until the prompts run out, bumping the version
    after each; checks the staleness bound when ``eta`` is given. Returns the prompt ids."""
    consumed = []
    while True:
        try:
            groups = executor.prepare_batch(batch_size, timeout=60, allow_partial=True)
        except PromptsExhausted:
            return consumed
        if eta is not None:
            assert all(version - g[0].start_version <= eta for g in groups)
        consumed += [g[0].prompt_id for g in groups]
        version += 1
        executor.set_version(version)


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_staleness_bound_with_heavy_tailed_runs(eta):
    wf = RandomTimeWorkflow(seed=eta, slow_p=0.15)
    B, n_versions = 4, 25
    ex = RolloutExecutor(None, wf, prompt_items_from_list(items(1000)), batch_size=B,
                         max_concurrent=64, max_staleness=eta)
    with ex:
        consumed, consume_times = train_loop(ex, n_versions, B, eta)
        m = ex.metrics()
    assert len(consumed) == len(set(consumed)) == B * n_versions
    assert m["stale_requeued"] == 0
    assert m["staleness_max"] <= eta
    assert sum(m["staleness_hist"].values()) == B * n_versions
    # the gate: never more than (eta + v + 1) * B groups started by version v
    started_by = {}
    for _, s, _, _, _ in wf.runs:
        started_by[s] = started_by.get(s, 0) + 1
    total = 0
    for v in sorted(started_by):
        total += started_by[v]
        rejected_or_failed = sum(1 for _, s, _, o, _ in wf.runs if s <= v and o != "ok")
        assert total - rejected_or_failed <= (eta + v + 1) * B
    if eta == 0:
        # synchronous: batch v holds only runs started at v, and no run starts while the
        # learner trains on batch v (between taking it and the version bump)
        for _, s, t_submit, _, _ in wf.runs:
            assert t_submit <= consume_times[s]
    if eta >= 1:
        assert max(m["staleness_hist"]) >= 1  # overlap actually happened


def _wait_until(condition, timeout: float = 30.0) -> None:
    """Polls ``condition()`` until it holds (a failure after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def test_gate_capacity_counts_running_and_accepted():
    """Once the gate reports no capacity the executor cannot start another run, so the
    counts read then are final: no fixed wait for the loop to settle."""
    release = threading.Event()

    async def blocking(client, item, ctx):
        while not release.is_set():
            await asyncio.sleep(0.002)
        return make_group(ctx)

    B, eta = 3, 1
    ex = RolloutExecutor(None, blocking, prompt_items_from_list(items(100)), batch_size=B,
                         max_concurrent=100, max_staleness=eta)
    with ex:
        _wait_until(lambda: ex.metrics()["submitted"] > 0 and ex.metrics()["capacity"] == 0)
        m = ex.metrics()
        assert m["running"] == m["submitted"] == (eta + 1) * B  # (eta + v + 1) * B
        release.set()
        ex.prepare_batch(B, timeout=10)
        _wait_until(lambda: ex.metrics()["running"] == 0)
        m = ex.metrics()
        assert m["accepted"] == m["submitted"] == (eta + 1) * B and m["capacity"] == 0
        ex.set_version(1)  # one more batch's worth
        _wait_until(lambda: ex.metrics()["submitted"] > (eta + 1) * B
                    and ex.metrics()["running"] == 0 and ex.metrics()["capacity"] == 0)
        m = ex.metrics()
        assert m["submitted"] == m["accepted"] == (eta + 2) * B

    release.clear()
    ex = RolloutExecutor(None, blocking, prompt_items_from_list(items(100)), batch_size=B,
                         max_concurrent=5, max_staleness=None)
    with ex:
        _wait_until(lambda: ex.metrics()["submitted"] > 0 and ex.metrics()["capacity"] == 0)
        m = ex.metrics()
        assert m["running"] == m["submitted"] == 5
        release.set()


def test_every_prompt_is_accounted_for_once_under_failures_and_rejections():
    wf = RandomTimeWorkflow(seed=3, fail_p=0.25, reject_p=0.15, slow_p=0.05)
    n_prompts, B = 300, 5
    ex = RolloutExecutor(None, wf, prompt_items_from_list(items(n_prompts)), batch_size=B,
                         max_concurrent=32, max_staleness=1, max_retries=1)
    with ex:
        consumed = drain(ex, B, version=0)
        m = ex.metrics()
    rejected = {p for p, _, _, o, _ in wf.runs if o == "reject"}
    failed = {p for p, _, _, o, a in wf.runs if o == "fail" and a == 1}
    assert len(consumed) == len(set(consumed))
    assert set(consumed) | rejected | failed == {f"p{i}" for i in range(n_prompts)}
    assert not (set(consumed) & rejected) and not (set(consumed) & failed)
    assert not (rejected & failed)
    assert m["consumed"] == len(consumed) and m["rejected"] == len(rejected)
    assert m["failed"] == len(failed) and m["prompts_taken"] == n_prompts
    assert m["attempt_errors"] == m["retried"] + m["failed"]
    assert m["running"] == m["pending"] == m["accepted_unconsumed"] == 0


def test_state_round_trip_replays_in_flight_and_keeps_accepted(tmp_path):
    n_prompts, B = 60, 4
    wf = RandomTimeWorkflow(seed=5, slow_p=0.3)
    ex = RolloutExecutor(None, wf, prompt_items_from_list(items(n_prompts), shuffle=True, seed=1),
                         batch_size=B, max_concurrent=16, max_staleness=2)
    ex.start()
    first, _ = train_loop(ex, 4, B, eta=2)
    ex.stop()  # cancels in-flight runs; they stay recorded
    state = json.loads(json.dumps(ex.state_dict()))
    assert state["in_flight"] and state["accepted"]
    (tmp_path / "state.json").write_text(json.dumps(state))

    ex2 = RolloutExecutor(None, RandomTimeWorkflow(seed=6), prompt_items_from_list(
        items(n_prompts), shuffle=True, seed=1), batch_size=B, max_concurrent=16, max_staleness=2)
    ex2.load_state_dict(json.loads((tmp_path / "state.json").read_text()))
    assert ex2.version == 4
    with ex2:
        rest = drain(ex2, B, version=4, eta=2)
    both = first + rest
    assert len(both) == len(set(both)) == n_prompts
    assert ex2.metrics()["replayed"] == len(state["in_flight"])


def test_stop_then_start_replays_cancelled_runs():
    wf = RandomTimeWorkflow(seed=8, slow_p=0.5)
    ex = RolloutExecutor(None, wf, prompt_items_from_list(items(40)), batch_size=4,
                         max_concurrent=8, max_staleness=None)
    ex.start()
    got = [g[0].prompt_id for g in ex.prepare_batch(4, timeout=30)]
    ex.stop()
    ex.start()
    while True:
        try:
            got += [g[0].prompt_id for g in ex.prepare_batch(4, timeout=30, allow_partial=True)]
        except PromptsExhausted:
            break
    ex.stop()
    assert sorted(got) == sorted(f"p{i}" for i in range(40))


def test_retries_rejections_and_failures_are_counted():
    calls = {}

    async def flaky(client, item, ctx):
        calls[item["prompt_id"]] = calls.get(item["prompt_id"], 0) + 1
        await asyncio.sleep(0.001)
        if item["prompt_id"] == "p1" and ctx.attempt == 0:
            raise RuntimeError("first attempt fails")
        if item["prompt_id"] == "p2":
            return None
        if item["prompt_id"] == "p3":
            raise RuntimeError("always fails")
        return make_group(ctx, n=3)

    ex = RolloutExecutor(None, flaky, prompt_items_from_list(items(6)), batch_size=5,
                         max_staleness=0, max_retries=2)
    with ex:
        groups = ex.prepare_batch(timeout=60, allow_partial=True)  # 4 of 6 are accepted
        m = ex.metrics()
    assert sorted(g[0].prompt_id for g in groups) == ["p0", "p1", "p4", "p5"]
    assert all(len(g) == 3 for g in groups)
    assert calls == {"p0": 1, "p1": 2, "p2": 1, "p3": 3, "p4": 1, "p5": 1}
    assert m["rejected"] == 1 and m["failed"] == 1 and m["retried"] == 3
    assert any("always fails" in e for e in ex.last_errors)


def test_prepare_batch_errors_are_clear():
    async def never(client, item, ctx):
        await asyncio.sleep(3600)

    ex = RolloutExecutor(None, never, prompt_items_from_list(items(3)), batch_size=2,
                         max_staleness=0)
    with ex:
        with pytest.raises(TimeoutError, match=r"prepare_batch\(2\) timed out after 0.3s: "
                                               r"0 accepted, 2 running"):
            ex.prepare_batch(timeout=0.3)

    async def ok(client, item, ctx):
        return make_group(ctx)

    ex = RolloutExecutor(None, ok, prompt_items_from_list(items(3)), batch_size=2,
                         max_staleness=None)
    with ex:
        assert len(ex.prepare_batch(2, timeout=10)) == 2
        with pytest.raises(PromptsExhausted, match="1 accepted groups remain, 2 requested"):
            ex.prepare_batch(2, timeout=10)
        assert len(ex.prepare_batch(2, timeout=10, allow_partial=True)) == 1

    async def wrong_type(client, item, ctx):
        return {"not": "a list"}

    ex = RolloutExecutor(None, wrong_type, prompt_items_from_list(items(2)), batch_size=1,
                         max_retries=0)
    with ex:
        with pytest.raises(PromptsExhausted):
            ex.prepare_batch(1, timeout=10)
    assert ex.metrics()["failed"] == 2
    assert "returned dict; expected list[Trajectory] or None" in ex.last_errors[0]

    ex = RolloutExecutor(None, ok, iter([{"prompt": "no id"}]), batch_size=1)
    with ex:
        with pytest.raises(RuntimeError, match="loop died: TypeError: prompt items must be dicts "
                                               "with a 'prompt_id' key"):
            ex.prepare_batch(1, timeout=10)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        RolloutExecutor(None, lambda c, i, x: None, batch_size=0)
    with pytest.raises(ValueError, match="max_staleness must be >= 0 or None"):
        RolloutExecutor(None, lambda c, i, x: None, batch_size=1, max_staleness=-1)
    with pytest.raises(TypeError, match="must be an async function"):
        RolloutExecutor(None, 42, batch_size=1)
    ex = RolloutExecutor(None, lambda c, i, x: None, batch_size=1)
    with pytest.raises(ValueError, match="executor state has format None"):
        ex.load_state_dict({})
    ex.set_version(3)
    with pytest.raises(ValueError, match="would go back from version 3"):
        ex.set_version(2)

    async def nothing():
        return None

    with pytest.raises(RuntimeError, match="not running; call start"):
        ex.run_coroutine(nothing())


class ReleasedWorkflow:
    """Each run waits until the test releases its prompt, so runs finish in a chosen order."""

    def __init__(self):
        self.released: set[str] = set()

    async def arun(self, client, item, ctx):
        while item["prompt_id"] not in self.released:
            await asyncio.sleep(0.002)
        return make_group(ctx)


def _finish(executor, workflow, *prompt_ids):
    workflow.released.update(prompt_ids)
    deadline = time.monotonic() + 60
    while any(item["prompt_id"] in prompt_ids for item in _running_items(executor)):
        assert time.monotonic() < deadline
        time.sleep(0.002)


def _running_items(executor):
    with executor._cond:
        return [r.item for r in executor._running.values()]


def test_a_batch_taken_while_the_servers_update_is_judged_at_the_learners_version():
    """Issue 33: the demo warned "accepted groups became older than max_staleness=2 ...
    regenerated" at its eval versions. The servers' update to version v runs in the
    background while the learner takes its batch for v, so the executor judged that batch
    at v - 1: it skipped a group still in flight that was fine at v - 1, and at the next
    version, which the learner had waited for (an eval), that group was too stale and was
    thrown away. The batch is now judged at the learner's version (announce_version): it
    waits for the group, and nothing is regenerated."""
    eta, b = 2, 2
    workflow = ReleasedWorkflow()
    ex = RolloutExecutor(None, workflow, iter(items(40)), batch_size=b, max_concurrent=64,
                         max_staleness=eta).start()
    try:
        def batch(learner_version):
            groups = ex.prepare_batch(b, timeout=30)
            starts = [g[0].start_version for g in groups]
            assert min(starts) >= learner_version - eta, (learner_version, starts)
            return groups

        _finish(ex, workflow, "p0", "p1")  # (eta + 1) * B = 6 runs started at version 0
        batch(0)
        ex.announce_version(1)  # the update to v1 runs in the background...
        _finish(ex, workflow, "p2", "p3")
        batch(1)
        ex.set_version(1)  # ...and lands: two more runs, p6 and p7, start at version 1
        ex.announce_version(2)  # the update to v2 is under way; p5 (version 0) still runs
        _finish(ex, workflow, "p4", "p6")
        released = threading.Timer(0.2, workflow.released.add, ("p5",))
        released.start()
        batch(2)  # waits for p5 rather than skipping it for p6
        released.join()
        ex.set_version(2)
        ex.set_version(3)  # the learner waited for v3 here (an eval): the gate is current
        ex.announce_version(3)
        workflow.released.update(f"p{i}" for i in range(40))
        batch(3)
        assert ex.metrics()["stale_requeued"] == 0
    finally:
        ex.stop()


def test_a_group_one_version_older_than_eta_is_regenerated_and_one_at_eta_is_trained():
    """The staleness bound at its edge: at version v a batch may hold a group started at
    v - eta, never one started at v - eta - 1; that one goes back to be generated again."""
    eta = 1
    workflow = ReleasedWorkflow()
    ex = RolloutExecutor(None, workflow, iter(items(40)), batch_size=1, max_concurrent=64,
                         max_staleness=eta).start()
    try:
        workflow.released.update({"p0", "p1"})  # (eta + 1) * B = 2 runs start at version 0
        _wait_until(lambda: ex.metrics()["accepted"] == 2)
        assert [g[0].prompt_id for g in ex.prepare_batch(1, timeout=30)] == ["p0"]
        ex.set_version(1)  # p2 starts at version 1
        workflow.released.add("p2")
        _wait_until(lambda: ex.metrics()["accepted"] == 3)
        ex.set_version(2)  # p1 (version 0) is now eta + 1 old, p2 (version 1) eta old
        batch = ex.prepare_batch(1, timeout=30)
        assert [(g[0].prompt_id, g[0].start_version) for g in batch] == [("p2", 1)]
        assert ex.metrics()["stale_requeued"] == 1
        batch = ex.prepare_batch(1, timeout=30)  # p1 again, generated at version 2
        assert [(g[0].prompt_id, g[0].start_version) for g in batch] == [("p1", 2)]
    finally:
        ex.stop()


class Misbehaving:
    """Misbehaves on p0's first attempt (``fault``), then answers like any workflow."""

    def __init__(self, fault):
        self.fault, self.attempts, self.release = fault, [], threading.Event()

    async def arun(self, client, item, ctx):
        self.attempts.append((item["prompt_id"], ctx.attempt))
        if item["prompt_id"] == "p0" and ctx.attempt == 0:
            if self.fault == "exit":
                sys.exit(3)
            if self.fault == "interrupt":
                raise KeyboardInterrupt
            if self.fault == "cancelled":
                raise asyncio.CancelledError()
            if self.fault == "bad_str":
                raise BadStr()
            if self.fault == "hang":  # and ignore the cancellation, until the test ends
                while not self.release.is_set():
                    try:
                        await asyncio.sleep(0.05)
                    except asyncio.CancelledError:
                        pass
        return make_group(ctx)


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


@pytest.mark.parametrize("fault, cause", [
    ("exit", "SystemExit (sys.exit(3))"),
    ("interrupt", "raised KeyboardInterrupt"),
    ("cancelled", "raised CancelledError itself"),
    ("bad_str", "BadStr: <its str() raised>"),
    ("hang", "did not finish within rollout.episode_timeout_s=0.5s"),
])
def test_a_workflow_that_exits_cancels_itself_or_hangs_is_a_failed_attempt(fault, cause):
    """Issue 50 items 6, 7, 9: sys.exit or KeyboardInterrupt in a workflow ended the
    executor's loop silently; a CancelledError it raised itself kept its run "running" for
    good; a hung run blocked every batch; an exception whose __str__ raises escaped the
    accounting. Each is now one failed attempt naming the workflow, then retried."""
    wf = Misbehaving(fault)
    ex = RolloutExecutor(None, wf, prompt_items_from_list(items(4)), batch_size=4,
                         max_staleness=0, max_retries=1, episode_timeout_s=0.5)
    try:
        with ex:
            groups = ex.prepare_batch(timeout=60)
            m = ex.metrics()
            wf.release.set()  # the abandoned run may end now (stop() need not wait for it)
    finally:
        wf.release.set()
    assert sorted(g[0].prompt_id for g in groups) == ["p0", "p1", "p2", "p3"]
    assert ("p0", 1) in wf.attempts
    assert m["attempt_errors"] == 1 and m["retried"] == 1 and m["running"] == 0
    (error,) = ex.last_errors
    assert error.startswith("prompt 'p0' attempt 0: ") and cause in error
    if fault != "bad_str":
        assert "test_executor.Misbehaving" in error  # the culprit is named


def test_the_retry_queue_survives_a_checkpoint():
    """A prompt waiting for its retry (its attempt failed while submission was paused) is in
    the checkpoint and is retried, with its attempt count, after the restore: dropping the
    retry queue from state_dict lost the prompt and passed the whole suite."""
    gate = threading.Event()

    async def first_fails(client, item, ctx):
        while not gate.is_set():
            await asyncio.sleep(0.01)
        if item["prompt_id"] == "p0" and ctx.attempt == 0:
            raise RuntimeError("p0 fails once")
        return make_group(ctx)

    ex = RolloutExecutor(None, first_fails, prompt_items_from_list(items(2)), batch_size=2,
                         max_staleness=0, max_retries=2)
    with ex:
        deadline = time.monotonic() + 30
        while ex.metrics()["running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ex.pause()  # the retry stays queued
        gate.set()
        while ex.metrics()["attempt_errors"] < 1 or ex.metrics()["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        state = json.loads(json.dumps(ex.state_dict()))
    assert ex.metrics()["pending"] == 1

    seen = []

    async def ok(client, item, ctx):
        seen.append((item["prompt_id"], ctx.attempt))
        return make_group(ctx)

    ex2 = RolloutExecutor(None, ok, prompt_items_from_list(items(2)), batch_size=2,
                          max_staleness=0, max_retries=2)
    ex2.load_state_dict(state)
    with ex2:
        groups = ex2.prepare_batch(timeout=30)
    assert sorted(g[0].prompt_id for g in groups) == ["p0", "p1"]
    assert seen == [("p0", 1)]  # only the queued retry ran again, as attempt 1
