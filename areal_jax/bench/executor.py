"""executor: overhead of the rollout executor and the reward pool, and the gate at work.

    python -m areal_jax.bench executor [--runs 2000] [--rewards 400] [--versions 30]

Three measurements, each against a peer in the same run:

1. ``overhead``: no-op workflow runs through the executor (gate, accounting, batches
   handed to another thread) vs the same coroutines under a bare ``asyncio.gather``.
2. ``rewards``: ``math_reward`` over the same completions, in a 2-worker RewardPool
   vs called inline in this process.
3. ``gate``: a simulated learner (fixed train time per version) consuming batches of
   workflows with heavy-tailed generation times, for eta = 0, 1, 2, 4: groups per second
   relative to eta = 0 (synchronous), learner idle fraction, observed staleness.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time


def add_arguments(p) -> None:
    p.add_argument("--runs", type=int, default=2000, help="no-op runs for the overhead test")
    p.add_argument("--rewards", type=int, default=400, help="completions to score")
    p.add_argument("--versions", type=int, default=30, help="learner versions per eta")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--gen-ms", type=float, default=20.0, help="median generation time")
    p.add_argument("--train-ms", type=float, default=40.0, help="learner time per version")


def _noop_group():
    from areal_jax.trajectory import Trajectory

    return [Trajectory(input_ids=[1, 2], loss_mask=[0, 1], behav_logp=[0.0, -1.0],
                       versions=[-1, 0], reward=0.0)]


def bench_overhead(n_runs: int) -> tuple[float, float]:
    from areal_jax.data.prompts import prompt_items_from_list
    from areal_jax.rollout.executor import PromptsExhausted, RolloutExecutor

    async def noop(client, item, ctx):
        await asyncio.sleep(0)
        return _noop_group()

    items = [{"prompt_id": str(i)} for i in range(n_runs)]

    async def bare():
        return await asyncio.gather(*(noop(None, it, None) for it in items))

    t0 = time.perf_counter()
    asyncio.run(bare())
    bare_s = time.perf_counter() - t0

    ex = RolloutExecutor(None, noop, prompt_items_from_list(items), batch_size=50,
                         max_concurrent=256, max_staleness=None)
    t0 = time.perf_counter()
    got = 0
    with ex:
        while True:
            try:
                got += len(ex.prepare_batch(timeout=120, allow_partial=True))
            except PromptsExhausted:
                break
    ex_s = time.perf_counter() - t0
    assert got == n_runs
    return n_runs / ex_s, n_runs / bare_s


def bench_rewards(n: int) -> tuple[float, float]:
    from areal_jax.rewards.math import math_reward
    from areal_jax.rewards.pool import RewardPool

    rng = random.Random(0)
    pairs = [(f"so the answer is \\boxed{{{rng.randint(0, 50)}}}", str(rng.randint(0, 50)))
             for _ in range(n)]
    math_reward(*pairs[0])  # import math-verify here too
    t0 = time.perf_counter()
    inline = [math_reward(c, a) for c, a in pairs]
    inline_s = time.perf_counter() - t0
    with RewardPool(num_workers=2, timeout_s=30, preload=("areal_jax.rewards.math",)) as pool:
        pool.score_sync(math_reward, *pairs[0])  # start-up is not measured

        async def score_all():
            return await asyncio.gather(*(pool.score(math_reward, c, a) for c, a in pairs))

        t0 = time.perf_counter()
        pooled = asyncio.run(score_all())
        pool_s = time.perf_counter() - t0
    assert pooled == inline
    return n / pool_s, n / inline_s


def bench_gate(eta: int, versions: int, batch_size: int, gen_ms: float, train_ms: float
               ) -> dict[str, float]:
    from areal_jax.data.prompts import prompt_items_from_list
    from areal_jax.rollout.executor import RolloutExecutor

    rng = random.Random(eta)
    lock = threading.Lock()

    async def heavy_tailed(client, item, ctx):
        with lock:
            scale = rng.lognormvariate(0.0, 0.8)  # median 1, long tail
        await asyncio.sleep(gen_ms / 1000 * scale)
        return _noop_group()

    items = [{"prompt_id": str(i)} for i in range((versions + eta + 2) * batch_size * 2)]
    ex = RolloutExecutor(None, heavy_tailed, prompt_items_from_list(items), batch_size=batch_size,
                         max_concurrent=4 * batch_size, max_staleness=eta)
    waited = 0.0
    with ex:
        ex.prepare_batch(timeout=60)  # first batch: start-up, not measured
        ex.set_version(1)
        t0 = time.perf_counter()
        for v in range(1, versions + 1):
            t_wait = time.perf_counter()
            ex.prepare_batch(timeout=60)
            waited += time.perf_counter() - t_wait
            time.sleep(train_ms / 1000)  # the learner trains
            ex.set_version(v + 1)
        elapsed = time.perf_counter() - t0
        m = ex.metrics()
    return {"groups_per_s": versions * batch_size / elapsed, "idle_frac": waited / elapsed,
            "staleness_mean": m["staleness_mean"], "staleness_max": m["staleness_max"],
            "stale_requeued": m["stale_requeued"]}


def run(args) -> dict:
    rows = []
    ex_rate, bare_rate = bench_overhead(args.runs)
    rows.append(["overhead", "executor vs asyncio.gather", f"{ex_rate:.0f} runs/s",
                 f"{bare_rate:.0f} runs/s", ex_rate / bare_rate])
    pool_rate, inline_rate = bench_rewards(args.rewards)
    rows.append(["rewards", "RewardPool(2) vs inline math_reward", f"{pool_rate:.0f} /s",
                 f"{inline_rate:.0f} /s", pool_rate / inline_rate])
    gate = {eta: bench_gate(eta, args.versions, args.batch_size, args.gen_ms, args.train_ms)
            for eta in (0, 1, 2, 4)}
    base = gate[0]["groups_per_s"]
    for eta, g in gate.items():
        rows.append([f"gate eta={eta}", f"idle {g['idle_frac']:.0%}, staleness mean "
                     f"{g['staleness_mean']:.2f} max {g['staleness_max']}",
                     f"{g['groups_per_s']:.1f} groups/s", f"{base:.1f} groups/s (eta=0)",
                     g["groups_per_s"] / base])
    summary = {"executor_vs_gather": ex_rate / bare_rate, "pool_vs_inline": pool_rate / inline_rate,
               **{f"gate_eta{eta}_vs_sync": g["groups_per_s"] / base for eta, g in gate.items()},
               "gate_stale_requeued": sum(g["stale_requeued"] for g in gate.values())}
    return {"title": "rollout executor and reward pool",
            "columns": ["what", "compared", "measured", "peer", "ratio"],
            "rows": rows, "summary": summary}
