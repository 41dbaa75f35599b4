"""Evaluation: mean reward and pass@k of a policy served by rollout servers.

Used by the trainer (periodic eval) and ``scripts/eval.py``. Each prompt is sampled
``n_samples`` times with the given sampling params; ``accuracy`` is the mean reward
(a verifier reward in {0, 1}) over all prompts and samples, and ``pass@k`` for each
requested k is the unbiased estimator of Chen et al. 2021 (:func:`pass_at_k`), a sample
being correct when its reward is positive. Rewards are scored by a ``RewardPool``, as in
training: each call runs in a worker process under the pool's timeout, so a hanging
verifier cannot hang an eval. A sample whose reward function fails or times out counts
as 0 and is reported in ``reward_failures``.

:func:`evaluate_workflow` evaluates with a run's own workflow instead (an agent with its
tools): the mean reward of the trajectories it returns, what the run trains on.

:data:`BENCHMARKS` names the standard sets (``gsm8k``, ``math500``): their hub dataset,
columns, reward and prompt.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from areal_jax.rewards.pool import RewardFn, RewardPool, resolve_reward_fn
from areal_jax.rollout.user_code import (
    DeadlineExceeded,
    Escaped,
    describe_error,
    escaped,
    is_own_cancellation,
    wait_abandoning,
)
from areal_jax.rollout.workflows import (
    GenerateClient,
    PromptItem,
    WorkflowContext,
    generate_all,
    prompt_token_ids,
    sample_request,
)
from areal_jax.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: the run loads the tokenizer and hands it in
    from areal_jax.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)
EVAL_BATCH = 16  # samples per batched /generate

# The instruction after each benchmark problem (Qwen2.5-Math's chain-of-thought prompt); the
# math reward reads the last \boxed{...} of the completion, else its last number.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Benchmark:
    """A named evaluation set: its dataset, the columns holding the problem and the reference
    answer, the reward that checks a completion, and the prompt.

    The prompt is the problem, a newline and ``instruction``, sent as one user message
    through the model's chat template (as it is when the tokenizer has none).
    """

    name: str
    data: str  # hf://ORG/NAME?config=C&split=S
    prompt_key: str
    answer_key: str
    reward: str  # a short name of areal_jax.rewards.REWARD_FUNCTIONS or "module:function"
    instruction: str
    max_new_tokens: int  # the default generation budget

    def prompt(self, row: PromptItem) -> str:
        return f"{row[self.prompt_key]}\n{self.instruction}"


BENCHMARKS: dict[str, Benchmark] = {
    # GSM8K test (1319 problems). The reference is a worked solution ending in "#### 72";
    # the math reward compares against the number after ####.
    "gsm8k": Benchmark("gsm8k", "hf://openai/gsm8k?config=main&split=test", "question",
                       "answer", "math", BOXED_INSTRUCTION, max_new_tokens=1024),
    # MATH-500 (Lightman et al. 2023's subset of the MATH test set): the reference is the
    # bare answer ("\frac{14}{3}"), compared with math-verify.
    "math500": Benchmark("math500", "hf://HuggingFaceH4/MATH-500?split=test", "problem",
                         "answer", "math", BOXED_INSTRUCTION, max_new_tokens=2048),
}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}: use one of {', '.join(BENCHMARKS)}, "
                         "or --data for any other dataset")
    return BENCHMARKS[name]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples of which ``c`` are correct:
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without replacement
    hold a correct one (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code"). Exact integer binomials, so large n loses nothing."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def check_pass_at(ks: Sequence[int], n_samples: int) -> None:
    """Each k of pass@k must be in [1, n_samples]."""
    for k in ks:
        if k < 1:
            raise ValueError(f"pass@{k}: k must be at least 1")
        if k > n_samples:
            raise ValueError(f"pass@{k} needs {k} samples per prompt but there are {n_samples}: "
                             f"sample at least {k} (-n {k}) or drop {k} from --pass-at")


async def evaluate_prompts(client: GenerateClient, items: Sequence[PromptItem], *,
                           tokenizer: ChatTokenizer | None, reward_fn: RewardFn,
                           reward_pool: RewardPool, sampling: SamplingParams,
                           n_samples: int = 1, answer_key: str = "answer", seed: int = 0,
                           max_concurrency: int = 256,
                           pass_at: Sequence[int] = ()) -> dict[str, float]:
    """Mean reward over ``items`` (each with a ``prompt`` or ``input_ids`` and an answer), and
    ``pass@k`` for each k in ``pass_at`` (each at most ``n_samples``)."""
    if not items:
        raise ValueError("evaluate_prompts got no prompts")
    if tokenizer is None:
        raise ValueError("evaluate_prompts needs a tokenizer to decode completions for the reward")
    check_pass_at(pass_at, n_samples)
    if not isinstance(reward_pool, RewardPool):
        raise TypeError(f"evaluate_prompts needs a RewardPool (rewards run under its timeout), "
                        f"got {type(reward_pool).__name__}")
    if not sampling.stop_token_ids and tokenizer.stop_token_ids:
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
    n_correct = (per_prompt > 0).sum(1)
    return {
        "accuracy": float(rewards.mean()),
        "accuracy_std_over_samples": float(per_prompt.mean(0).std()) if n_samples > 1 else 0.0,
        "pass_at_k": float((n_correct > 0).mean()),  # any of the n samples correct: pass@n
        **{f"pass@{k}": float(np.mean([pass_at_k(n_samples, int(c), k) for c in n_correct]))
           for k in sorted(set(pass_at))},
        "n_prompts": float(len(items)),
        "n_samples": float(n_samples),
        "mean_completion_tokens": float(lengths.mean()),
        "reward_failures": float(failures),
    }


async def evaluate_workflow(client: GenerateClient, items: Sequence[PromptItem], workflow: Any,
                            *, tokenizer: ChatTokenizer | None, reward_pool: RewardPool | None,
                            seed: int = 0, max_concurrency: int = 256,
                            episode_timeout_s: float = 0.0) -> dict[str, float]:
    """The run's own workflow (e.g. ``AgenticWorkflow.for_eval``: the agent with its tools)
    on ``items``: ``accuracy`` is the mean reward of its trajectories, ``pass_at_k`` the
    share of prompts with a positive reward in any of its ``workflow.n_samples``. A group the
    workflow rejects, that raises (an agent failed, ``sys.exit`` included) or that runs past
    ``episode_timeout_s`` (0: no limit; it is cancelled, not waited for) counts as reward 0
    for each sample and in ``failed_groups`` (``episode_timeouts`` for the latter), and is
    logged with its cause. Tool and turn counts of the episodes, failed ones included, are
    summed in the result."""
    if not items:
        raise ValueError("evaluate_workflow got no prompts")
    n_samples = int(workflow.n_samples)
    counts: Counter[str] = Counter()
    sem = asyncio.Semaphore(max(1, max_concurrency // n_samples))

    async def one(i: int, item: PromptItem) -> list[Any] | None:
        ctx = WorkflowContext(start_version=0, seed=seed + 1000 * i, group_id=f"eval-{seed}-{i}",
                              reward_pool=reward_pool, tokenizer=tokenizer,
                              _count=lambda name, n: counts.update({name: n}))
        async with sem:
            try:
                if not episode_timeout_s:
                    return await guarded(item, ctx)
                return await wait_abandoning(guarded(item, ctx), episode_timeout_s)
            except DeadlineExceeded:
                counts["episode_timeouts"] += 1
                logger.warning("eval: %r on prompt %r did not finish within "
                               "rollout.episode_timeout_s=%gs; counted as failed", workflow,
                               item.get("prompt_id"), episode_timeout_s)
                return None
            except Exception as e:  # noqa: BLE001 - one failed episode is a 0, not a failed eval
                logger.warning("eval: %r on prompt %r failed: %s", workflow,
                               item.get("prompt_id"), describe_error(e))
                return None

    async def guarded(item: PromptItem, ctx: WorkflowContext) -> list[Any] | None:
        try:
            result: list[Any] | None = await workflow.arun(client, item, ctx)
            return result
        except asyncio.CancelledError:
            if is_own_cancellation():
                raise
            raise Escaped(f"{workflow!r} raised CancelledError itself") from None
        except (SystemExit, KeyboardInterrupt) as e:  # would end the loop running the eval
            raise escaped(e, repr(workflow)) from None

    groups = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
    rewards = np.array([[t.reward for t in g] if g else [0.0] * n_samples for g in groups],
                       np.float64)
    generated = [t.num_generated for g in groups if g for t in g]
    return {
        "accuracy": float(rewards.mean()),
        "pass_at_k": float((rewards > 0).any(1).mean()),
        "n_prompts": float(len(items)),
        "n_samples": float(n_samples),
        "mean_completion_tokens": float(np.mean(generated)) if generated else 0.0,
        "failed_groups": float(sum(g is None for g in groups)),
        **{name: float(counts[name]) for name in ("agent_turns", "tool_calls", "tool_errors",
                                                  "agent_context_exceeded",
                                                  "episode_timeouts")},
    }
