"""The reward pool: results, and exceptions, timeouts, hangs and crashes that never propagate."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from areal_jax.rewards.pool import RewardPool

# Reward functions for the workers: module level, so they pickle by reference.


def square(x: float) -> float:
    return x * x


def raises(x: float) -> float:
    raise ValueError(f"bad sample {x}")


def hangs(x: float) -> float:
    time.sleep(3600)
    return x


def crashes(x: float) -> float:
    os._exit(7)


def not_a_number(x: float) -> str:
    return "n/a"


def worker_pid() -> float:
    return float(os.getpid())


def flaky_reward(completion: str, spec: str) -> float:
    """The built-in verifier, except for prompts marked to make it raise or hang (used by
    test_executor_servers). ``spec`` is ``"<answer>|ok"``, ``"<answer>|raise"`` or
    ``"<answer>|hang"``."""
    from areal_jax.rewards.builtin import builtin_reward

    answer, mode = spec.split("|")
    if mode == "raise":
        raise RuntimeError("flaky reward raised")
    if mode == "hang":
        time.sleep(60)
    return builtin_reward(completion, answer)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); check its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=2.0) as p:
        yield p


def test_scores_many_concurrent_calls_in_order(pool):
    async def main():
        return await asyncio.gather(*(pool.score(square, float(i)) for i in range(40)))

    assert asyncio.run(main()) == [float(i * i) for i in range(40)]
    # usable again from a different event loop
    assert pool.score_sync("test_rewards_pool:square", 3.0) == 9.0


def test_failures_give_none_and_are_counted(pool):
    before = pool.metrics()

    async def main():
        return await asyncio.gather(
            pool.score(raises, 1.0), pool.score(square, 2.0), pool.score(crashes, 1.0),
            pool.score(not_a_number, 1.0), pool.score("no_such_module_xyz:fn", 1.0),
            pool.score(square, 3.0))

    t0 = time.monotonic()
    assert asyncio.run(main()) == [None, 4.0, None, None, None, 9.0]
    assert time.monotonic() - t0 < 60  # nothing waited for a timeout
    after = pool.metrics()
    assert after["errors"] - before["errors"] == 3  # raise, not a number, bad import
    assert after["crashes"] - before["crashes"] == 1
    assert after["ok"] - before["ok"] == 2
    assert any("bad sample 1.0" in e for e in pool.last_errors)


def test_hung_call_times_out_and_its_worker_is_killed_and_replaced():
    with RewardPool(num_workers=1, timeout_s=1.5) as pool:
        async def main():
            pid = int(await pool.score(worker_pid))
            t0 = time.monotonic()
            hung = await pool.score(hangs, 1.0)
            waited = time.monotonic() - t0
            new_pid = int(await pool.score(worker_pid))
            return pid, hung, waited, new_pid

        pid, hung, waited, new_pid = asyncio.run(main())
        assert hung is None
        assert waited >= 1.5
        assert not pid_alive(pid)
        assert new_pid != pid and pid_alive(new_pid)
        m = pool.metrics()
        assert m["timeouts"] == 1 and m["workers_replaced"] == 1
    assert not pid_alive(new_pid)  # close() stops the workers


def test_hangs_do_not_block_other_calls():
    with RewardPool(num_workers=2, timeout_s=2.0) as pool:
        async def main():
            return await asyncio.gather(pool.score(hangs, 1.0), *(pool.score(square, float(i))
                                                                  for i in range(10)))

        results = asyncio.run(main())
        assert results[0] is None and results[1:] == [float(i * i) for i in range(10)]


def test_workers_outlive_the_thread_that_started_them():
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:
        box = {}
        t = threading.Thread(target=lambda: box.update(pid=int(pool.score_sync(worker_pid))))
        t.start()
        t.join()
        time.sleep(1.5)  # the starting thread is gone
        assert pid_alive(box["pid"])
        assert int(pool.score_sync(worker_pid)) == box["pid"]
        assert pool.metrics()["crashes"] == 0


def test_unusable_functions_raise_clear_errors(pool):
    with pytest.raises(TypeError, match="cannot be pickled"):
        pool.score_sync(lambda x: x, 1.0)
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        RewardPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardPool(timeout_s=0)


def test_workers_die_with_their_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from areal_jax.rewards.pool import RewardPool
        pool = RewardPool(num_workers=1, timeout_s=30)
        print(int(pool.score_sync("os:getpid")), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert pid_alive(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(pid)
    finally:
        proc.kill()


def test_importing_the_function_does_not_count_against_the_timeout(tmp_path, monkeypatch):
    (tmp_path / "slow_import_reward.py").write_text(
        "import time\ntime.sleep(2.0)\n\ndef fast(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # workers inherit the parent's sys.path
    with RewardPool(num_workers=1, timeout_s=1.0) as pool:
        assert pool.score_sync("slow_import_reward:fast", 1.0) == 2.0
        assert pool.metrics()["timeouts"] == 0


def returns_value(kind: str):
    """Reward results of every type a user's function might return."""
    import numpy as np

    return {"str": "1.0", "huge": 1e39, "nan": float("nan"), "none": None, "complex": 1 + 0j,
            "list": [1.0], "array2": np.ones(2), "bool": True, "np_bool": np.bool_(False),
            "np_f32": np.float32(0.5), "np_i64": np.int64(3), "array0": np.array(0.25),
            "big_ok": -1e5, "just_over": 2e6}[kind]


def test_rewards_must_be_finite_real_numbers_within_range(pool):
    """A string such as "1.0", 1e39 (inf in float32), NaN, None, complex or an array is a
    failed reward with a message naming it; Python/NumPy numbers and bools pass."""
    kinds = ["str", "huge", "nan", "none", "complex", "list", "array2", "bool", "np_bool",
             "np_f32", "np_i64", "array0", "big_ok", "just_over"]

    async def main():
        return await asyncio.gather(*(pool.score_or_error(returns_value, k) for k in kinds))

    got = dict(zip(kinds, asyncio.run(main()), strict=True))
    for kind in ("str", "huge", "nan", "none", "complex", "list", "array2", "just_over"):
        value, problem = got[kind]
        assert value is None and problem is not None, (kind, got[kind])
        assert "ValueError" in problem, problem
    assert "got str '1.0'" in got["str"][1]
    assert "outside [-1e+06, 1e+06]" in got["huge"][1] and "reward.max_abs" in got["huge"][1]
    assert "not finite" in got["nan"][1]
    assert {k: got[k] for k in ("bool", "np_bool", "np_f32", "np_i64", "array0", "big_ok")} == {
        "bool": (1.0, None), "np_bool": (0.0, None), "np_f32": (0.5, None), "np_i64": (3.0, None),
        "array0": (0.25, None), "big_ok": (-1e5, None)}


def test_reward_range_is_configurable():
    with RewardPool(num_workers=1, timeout_s=5.0, max_abs=10.0) as small:
        assert small.score_sync(square, 3.0) == 9.0
        value, problem = asyncio.run(small.score_or_error(square, 4.0))
        assert value is None and "outside [-10, 10]" in problem
    with pytest.raises(ValueError, match="max_abs"):
        RewardPool(max_abs=0.0)


def test_a_waiter_cancelled_after_its_worker_arrived_gives_it_back_without_hanging():
    """A waiting call cancelled after a worker was handed to it but before it resumed (a
    shutdown cancelling every rollout) returns the worker to the pool. This path took the
    pool's lock twice and hung the shutdown for good (it ended CI runs of the watchdog
    test by the shutdown timeout)."""
    result: dict[str, object] = {}

    async def scenario(p: RewardPool) -> None:
        assert await p.score(square, 3.0) == 9.0  # starts the one worker; now idle
        held = await p._acquire()  # a running call holds it
        waiter = asyncio.ensure_future(p._acquire())  # the next call waits for it
        await asyncio.sleep(0)
        p._release(held)  # hands it to the waiter: delivered on the next loop turn
        await asyncio.sleep(0)  # delivered; the waiter has not resumed yet
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        result["again"] = await p.score(square, 4.0)  # the worker is back

    def run() -> None:
        with RewardPool(num_workers=1, timeout_s=10.0) as p:
            asyncio.run(scenario(p))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the pool hung: its lock was taken twice"
    assert result["again"] == 16.0


@pytest.mark.parametrize("fn", ["fork_echo", "fork_then_raise_in_child"])
def test_a_reward_that_forks_never_answers_for_another_sample(fn):
    """A reward function that forks and comes back in the child too (returning, or raising
    as a sandbox that fails before its os._exit) made the child a second worker on the same
    socket: later rewards reached the wrong samples (echo(5) -> 2.0), all reported "ok"."""
    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        async def main():
            return [await pool.score(f"_faulty_rewards:{fn}", str(x), "") for x in (2, 5, 7, 11)]

        assert asyncio.run(main()) == [2.0, 5.0, 7.0, 11.0]
        m = pool.metrics()
        assert m["ok"] == 4 and m["errors"] == m["crashes"] == 0


def test_an_import_that_hangs_is_reported_as_such_not_as_the_call_timeout(tmp_path, monkeypatch):
    (tmp_path / "hanging_import_reward.py").write_text(
        "import time\ntime.sleep(3600)\n\ndef fast(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardPool(num_workers=1, timeout_s=30.0, startup_timeout_s=2.0) as pool:
        reward, why = asyncio.run(pool.score_or_error("hanging_import_reward:fast", 1.0))
        assert reward is None
        assert "loading hanging_import_reward:fast" in why and "2s" in why
        assert "ran past" not in why
        assert pool.score_sync(square, 3.0) == 9.0  # the hung worker was replaced
