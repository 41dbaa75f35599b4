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
from areal_jax.rollout.workflows import generate_all, prompt_token_ids, sample_request
from areal_jax.sampling_params import SamplingParams

EVAL_BATCH = 16  # samples per batched /generate


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
    failures = 0
    requests = [sample_request(sampling, prompt_token_ids(item, tokenizer),
                               seed=seed + 1000 * i + k, rid=f"eval-{seed}-{i}-{k}")
                for i, item in enumerate(items) for k in range(n_samples)]
    answers = [item[answer_key] for item in items for _ in range(n_samples)]
    # Batched /generate calls of EVAL_BATCH samples (one request each with a client that
    # has no agenerate_batch); at most max_concurrency samples in flight.
    sem = asyncio.Semaphore(max(1, max_concurrency // EVAL_BATCH))

    async def run(start: int) -> list[tuple[float, int]]:
        nonlocal failures
        part = requests[start:start + EVAL_BATCH]
        async with sem:
            responses = await generate_all(client, part)
        texts = [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in responses]
        scores = await asyncio.gather(*(reward_pool.score(reward_fn, text, answer)
                                        for text, answer in zip(
                                            texts, answers[start:start + EVAL_BATCH],
                                            strict=True)))
        failures += sum(r is None for r in scores)
        return [(0.0 if r is None else float(r), len(resp.output_ids))
                for r, resp in zip(scores, responses, strict=True)]

    chunks = await asyncio.gather(*(run(start)
                                    for start in range(0, len(requests), EVAL_BATCH)))
    results = [r for chunk in chunks for r in chunk]
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
