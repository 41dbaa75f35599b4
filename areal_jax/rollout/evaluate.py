"""Evaluation: pass@1 of a policy served by rollout servers, averaged over k samples.

Used by the trainer (periodic eval) and ``scripts/eval.py``. Each prompt is sampled
``n_samples`` times with the given sampling params; pass@1 is the mean reward
(a verifier reward in {0, 1}) over all prompts and samples. Rewards are scored by a
``RewardPool``, as in training: each call runs in a worker process under the pool's
timeout, so a hanging verifier cannot hang an eval. A sample whose reward function
fails or times out counts as 0 and is reported in ``reward_failures``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from areal_jax.rewards.pool import RewardPool, resolve_reward_fn
from areal_jax.rollout.workflows import prompt_token_ids, sample_request
from areal_jax.sampling_params import SamplingParams


async def evaluate_prompts(client: Any, items: Sequence[dict[str, Any]], *, tokenizer: Any,
                           reward_fn: Any, reward_pool: RewardPool, sampling: SamplingParams,
                           n_samples: int = 1, answer_key: str = "answer", seed: int = 0,
                           max_concurrency: int = 256) -> dict[str, float]:
    """Pass@1 over ``items`` (each with a ``prompt`` or ``input_ids`` and an answer)."""
    if not items:
        raise ValueError("evaluate_prompts got no prompts")
    if not isinstance(reward_pool, RewardPool):
        raise TypeError(f"evaluate_prompts needs a RewardPool (rewards run under its timeout), "
                        f"got {type(reward_pool).__name__}")
    if not sampling.stop_token_ids and getattr(tokenizer, "stop_token_ids", None):
        from dataclasses import replace

        sampling = replace(sampling, stop_token_ids=tuple(tokenizer.stop_token_ids))
    resolve_reward_fn(reward_fn)  # a bad spec fails here, not once per sample
    sem = asyncio.Semaphore(max_concurrency)
    failures = 0

    async def one(i: int, item: dict[str, Any], k: int) -> tuple[float, int]:
        nonlocal failures
        async with sem:
            req = sample_request(sampling, prompt_token_ids(item, tokenizer),
                                 seed=seed + 1000 * i + k, rid=f"eval-{seed}-{i}-{k}")
            resp = await client.agenerate(req)
        text = tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        r = await reward_pool.score(reward_fn, text, item[answer_key])
        if r is None:
            failures += 1
            r = 0.0
        return float(r), len(resp.output_ids)

    results = await asyncio.gather(*(one(i, it, k) for i, it in enumerate(items)
                                     for k in range(n_samples)))
    rewards = np.array([r for r, _ in results], np.float64)
    lengths = np.array([n for _, n in results], np.float64)
    per_prompt = rewards.reshape(len(items), n_samples)
    return {
        "accuracy": float(rewards.mean()),
        "accuracy_std_over_samples": float(per_prompt.mean(0).std()) if n_samples > 1 else 0.0,
        "pass_at_k": float((per_prompt > 0).any(1).mean()),
        "n_prompts": float(len(items)),
        "n_samples": float(n_samples),
        "mean_completion_tokens": float(lengths.mean()),
        "reward_failures": float(failures),
    }
