"""Workflows: how one prompt becomes a group of trajectories.

A workflow is either a plain coroutine function or an object with an ``arun`` method::

    async def my_workflow(client, item, ctx) -> list[Trajectory] | None: ...

    class MyWorkflow:
        async def arun(self, client, item, ctx) -> list[Trajectory] | None: ...

- ``client`` has ``await client.agenerate(GenerateRequest) -> GenerateResponse``; it
  handles interruption (weight updates) and server failover itself.
- ``item`` is one prompt dict from the prompt dataset (``prompt_id``, ``prompt``,
  ``answer``, ...).
- ``ctx`` is a :class:`WorkflowContext`: the start version, a per-run seed, the group id,
  the reward pool, the tokenizer, and ``ctx.count(name)`` for your own metrics.

Return the group (one Trajectory per sample; all samples of a prompt, since group
advantages need a fixed group size), or None to reject the prompt (it frees its
capacity and counts as ``rejected``). An exception counts as a failed attempt; the
executor retries the prompt, then drops it and counts it as ``failed``.

Built-ins: :class:`RLVRWorkflow` (n samples, a verifier reward) and
:class:`MultiTurnWorkflow` (model and environment take turns, token-in/token-out).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from areal_jax.rewards.pool import (
    DEFAULT_MAX_ABS,
    RewardFn,
    RewardPool,
    check_reward_value,
    resolve_reward_fn,
)
from areal_jax.rollout.types import GenerateRequest, GenerateResponse
from areal_jax.sampling_params import SamplingParams
from areal_jax.trajectory import Trajectory

if TYPE_CHECKING:  # annotations only: the run loads the tokenizer and hands it in
    from areal_jax.tokenizer import ChatTokenizer

# One row of the prompt dataset (prompt_id, prompt, answer, and whatever columns the
# user's data has): user JSON, hence Any.
PromptItem = dict[str, Any]
T = TypeVar("T")


class GenerateClient(Protocol):
    """What a workflow generates with: a ``RolloutClient`` or any object with its
    ``agenerate`` (``agenerate_batch`` is used when present)."""

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse: ...

logger = logging.getLogger(__name__)


def sample_request(params: SamplingParams, input_ids: Sequence[int], *, seed: int | None = None,
                   rid: str | None = None, max_new_tokens: int | None = None) -> GenerateRequest:
    """A request for one sample under ``params``, with its own seed and token budget."""
    changes: dict[str, Any] = {}
    if seed is not None:
        changes["seed"] = seed
    if max_new_tokens is not None:
        changes["max_new_tokens"] = max_new_tokens
    return GenerateRequest(list(input_ids), replace(params, **changes) if changes else params,
                           rid)


@dataclass
class WorkflowContext:
    """What the executor hands to each workflow run."""

    start_version: int  # learner version when this run was submitted
    seed: int  # per-run seed; sample i may use seed + i
    group_id: str  # unique per run: "<prompt_id>#<submission seq>"
    attempt: int = 0  # 0 on the first try, 1.. on retries after a failure
    reward_pool: RewardPool | None = None
    tokenizer: ChatTokenizer | None = None
    reward_timeout_s: float = 30.0  # used only without a reward pool
    reward_max_abs: float = DEFAULT_MAX_ABS  # used only without a reward pool
    _count: Callable[[str, int], None] | None = field(default=None, repr=False)
    _note: Callable[[str], None] | None = field(default=None, repr=False)

    def count(self, name: str, n: int = 1) -> None:
        """Adds ``n`` to the executor metric ``name``."""
        if self._count is not None:
            self._count(name, n)

    def note_problem(self, cause: str) -> None:
        """Records why this run may end without a group (e.g. a failed reward); if it is
        then rejected, the executor's progress watchdog reports this cause."""
        if self._note is not None:
            self._note(cause)


GroupFilter = Callable[[list[Trajectory]], bool]


@dataclass(frozen=True)
class DistinctRewards:
    """DAPO's dynamic filter: keeps a group only if its rewards are not all equal (such a
    group's advantages are all 0, so it would train nothing). ``name`` is what the
    progress watchdog calls it when it rejects every group (the run's config key)."""

    name: str = "the dynamic filter"

    def __call__(self, group: list[Trajectory]) -> bool:
        return len({t.reward for t in group}) > 1

    def reason(self, group: list[Trajectory]) -> str:
        return (f"{self.name} dropped the group: all {len(group)} samples got reward "
                f"{group[0].reward if group else None!r}")


def keep_group(group_filter: GroupFilter | None, group: list[Trajectory],
               ctx: WorkflowContext) -> bool:
    """False (counted as ``filtered_groups``, the cause noted for the progress watchdog)
    when ``group_filter`` rejects ``group``; True with no filter."""
    if group_filter is None or group_filter(group):
        return True
    ctx.count("filtered_groups")
    reason = getattr(group_filter, "reason", None)
    ctx.note_problem(reason(group) if callable(reason) else
                     f"group_filter {getattr(group_filter, '__name__', group_filter)!r} "
                     f"dropped the group")
    return False


async def compute_reward(ctx: WorkflowContext, reward_fn: RewardFn, *args: Any,
                         **kwargs: Any) -> float | None:  # Any: the reward fn's own arguments
    """A reward via the context's pool; None (and counted) when it raises or times out.

    Without a pool the function runs in a thread with ``ctx.reward_timeout_s``: the loop
    stays free, but a hung call keeps its thread.
    """
    if ctx.reward_pool is not None:
        value, problem = await ctx.reward_pool.score_or_error(reward_fn, *args, **kwargs)
        if problem is not None:
            ctx.note_problem(problem)
        return value
    fn = resolve_reward_fn(reward_fn)
    try:
        value = await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), ctx.reward_timeout_s)
        return check_reward_value(value, ctx.reward_max_abs)
    except TimeoutError:
        ctx.count("reward_timeouts")
        ctx.note_problem(f"reward timeout: {reward_fn} ran past {ctx.reward_timeout_s}s")
    except Exception as e:  # noqa: BLE001 - a bad sample must not kill the run
        logger.warning("reward %s failed: %s: %s", reward_fn, type(e).__name__, e)
        ctx.count("reward_errors")
        ctx.note_problem(f"reward {reward_fn} failed: {type(e).__name__}: {e}")
    return None


class ModelReward(Protocol):
    """A reward a model gives over HTTP (``areal_jax.rewards.judge.JudgeReward``): awaited on
    the event loop, not run in the reward pool. ``(score, None)`` or ``(None, why)``."""

    async def ascore(self, completion: str, reference: Any, *, question: Any = "",
                     count: Callable[[str, int], None] | None = None
                     ) -> tuple[float | None, str | None]: ...


def is_model_reward(reward_fn: object) -> bool:
    return callable(getattr(reward_fn, "ascore", None))


async def compute_model_reward(ctx: WorkflowContext, reward: ModelReward, completion: str,
                               reference: Any, question: Any) -> float | None:
    """A model-judged reward; None (the cause noted, every event counted as ``judge_*``)
    when the judgment failed and the judge rejects failures."""
    value, problem = await reward.ascore(completion, reference, question=question,
                                         count=ctx.count)
    if problem is not None:
        ctx.note_problem(problem)
    return value


def prompt_token_ids(item: PromptItem, tokenizer: ChatTokenizer | None) -> list[int]:
    """``item["input_ids"]`` if given, else the tokenizer's chat-templated ``item["prompt"]``."""
    if "input_ids" in item:
        return [int(t) for t in item["input_ids"]]
    if "prompt" not in item:
        raise KeyError(f"prompt item {item.get('prompt_id', '?')!r} has neither 'input_ids' nor "
                       f"'prompt'; keys: {sorted(item)}")
    if tokenizer is None:
        raise ValueError("the workflow needs a tokenizer to encode item['prompt'] "
                         "(pass tokenizer=... to the workflow or the executor)")
    return tokenizer.encode_prompt(item["prompt"])


def trajectory_from_response(resp: GenerateResponse, reward: float,
                             **fields: Any) -> Trajectory:  # Any: Trajectory's own fields
    """Prompt tokens (mask 0, version -1) followed by the generated tokens (mask 1)."""
    n_prompt, n_out = len(resp.input_ids), len(resp.output_ids)
    if len(resp.output_logprobs) != n_out or len(resp.output_versions) != n_out:
        raise ValueError(f"response {resp.rid}: {n_out} output ids but "
                         f"{len(resp.output_logprobs)} logprobs, "
                         f"{len(resp.output_versions)} versions")
    info = {"n_interruptions": resp.n_interruptions, "server": resp.server,
            "latency_s": resp.latency_s, **fields.pop("info", {})}
    return Trajectory(
        input_ids=np.asarray(list(resp.input_ids) + list(resp.output_ids), np.int32),
        loss_mask=np.asarray([0] * n_prompt + [1] * n_out, np.int32),
        behav_logp=np.asarray([0.0] * n_prompt + list(resp.output_logprobs), np.float32),
        versions=np.asarray([-1] * n_prompt + list(resp.output_versions), np.int32),
        reward=float(reward), finish_reason=resp.finish_reason, info=info, **fields,
    )


async def generate_all(client: GenerateClient, requests: Sequence[GenerateRequest]
                       ) -> list[GenerateResponse]:
    """One response per request: one batched /generate (``client.agenerate_batch``, one
    HTTP round trip), or concurrent ``agenerate`` calls with a client that has no batch
    method."""
    if hasattr(client, "agenerate_batch"):
        return await client.agenerate_batch(requests)
    return list(await asyncio.gather(*(client.agenerate(r) for r in requests)))


class RLVRWorkflow:
    """Single-turn RL with a verifiable reward: n samples per prompt, one group.

    The n samples go out as one batched /generate request (SGLang's batch form; n
    concurrent requests with a client that has no ``agenerate_batch``), seeds
    ``ctx.seed + i``. Each completion is decoded (special tokens skipped) and scored with
    ``reward_fn(completion_text, item[answer_key], **reward_kwargs)`` in the reward pool.
    If any sample's reward fails or times out the whole group is rejected (counted as
    ``reward_failed_groups``): group advantages need a fixed group size. ``group_filter``
    may reject a finished group too, e.g. :class:`DistinctRewards` drops groups whose
    samples all got the same reward (counted as ``filtered_groups``).
    """

    def __init__(self, reward_fn: RewardFn | ModelReward, *, n_samples: int = 1,
                 gconfig: SamplingParams | None = None, tokenizer: ChatTokenizer | None = None,
                 answer_key: str = "answer", reward_kwargs: PromptItem | None = None,
                 group_filter: GroupFilter | None = None) -> None:
        if n_samples < 1:
            raise ValueError(f"RLVRWorkflow n_samples must be >= 1, got {n_samples}")
        if isinstance(reward_fn, str):
            resolve_reward_fn(reward_fn)  # fail now on a bad "module:function"
        elif not callable(reward_fn) and not is_model_reward(reward_fn):
            raise TypeError(f"reward_fn must be callable or 'module:function', got {reward_fn!r}")
        self.reward_fn = reward_fn
        self.n_samples = n_samples
        self.gconfig = gconfig or SamplingParams()
        self.tokenizer = tokenizer
        self.answer_key = answer_key
        self.reward_kwargs = dict(reward_kwargs or {})
        self.group_filter = group_filter
        if tokenizer is not None and not self.gconfig.stop_token_ids:
            self.gconfig = replace(self.gconfig, stop_token_ids=tuple(tokenizer.stop_token_ids))

    async def arun(self, client: GenerateClient, item: PromptItem,
                   ctx: WorkflowContext) -> list[Trajectory] | None:
        tokenizer = self.tokenizer or ctx.tokenizer
        if tokenizer is None:
            raise ValueError("RLVRWorkflow needs a tokenizer to decode completions for the reward")
        if self.answer_key not in item:
            raise KeyError(f"prompt item {item.get('prompt_id', '?')!r} has no {self.answer_key!r} "
                           f"key for the reward; keys: {sorted(item)}")
        prompt_ids = prompt_token_ids(item, tokenizer)
        requests = [sample_request(self.gconfig, prompt_ids, seed=ctx.seed + i,
                                   rid=f"{ctx.group_id}/{i}")
                    for i in range(self.n_samples)]
        responses = await generate_all(client, requests)
        texts = [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in responses]
        reward_fn = self.reward_fn
        if is_model_reward(reward_fn):  # a judge: awaited here, with the prompt's question
            assert not isinstance(reward_fn, str) and not callable(reward_fn)
            rewards = await asyncio.gather(*(
                compute_model_reward(ctx, reward_fn, text, item[self.answer_key],
                                     item.get("prompt", ""))
                for text in texts))
        else:
            assert isinstance(reward_fn, str) or callable(reward_fn)
            rewards = await asyncio.gather(*(
                compute_reward(ctx, reward_fn, text, item[self.answer_key],
                               **self.reward_kwargs)
                for text in texts))
        scored = [r for r in rewards if r is not None]
        if len(scored) < len(rewards):
            ctx.count("reward_failed_groups")
            return None
        group = [trajectory_from_response(resp, reward, info={"sample_index": i})
                 for i, (resp, reward) in enumerate(zip(responses, scored, strict=True))]
        if not keep_group(self.group_filter, group, ctx):
            return None
        return group


class Environment(Protocol):
    """The environment side of a multi-turn episode (``step`` may be sync or async)."""

    def step(self, action_ids: list[int], action_text: str
             ) -> tuple[list[int], float, bool] | Awaitable[tuple[list[int], float, bool]]:
        """Takes the model's turn; returns (observation token ids, reward, done)."""
        ...


async def _maybe_await(value: T | Awaitable[T]) -> T:
    return await value if inspect.isawaitable(value) else value


class MultiTurnWorkflow:
    """Model and environment take turns on one growing token list (token-in/token-out).

    Each model turn sends the whole token list so far as ``input_ids`` and appends the
    returned ``output_ids`` unchanged (loss_mask 1, their logprobs and versions); the
    environment's observation ids are appended with loss_mask 0, behav_logp 0 and
    version -1. Earlier turns are never decoded and re-encoded. The episode ends when
    the environment says done, after ``max_turns`` model turns, or when the token list
    reaches ``max_total_tokens``. The trajectory's reward is the sum of the step rewards.

    ``env_factory(item)`` makes a fresh environment per sample (it may be async).
    """

    def __init__(self, env_factory: Callable[[PromptItem], Environment | Awaitable[Environment]],
                 *, n_samples: int = 1, gconfig: SamplingParams | None = None,
                 tokenizer: ChatTokenizer | None = None,
                 max_turns: int = 4, max_total_tokens: int = 1024) -> None:
        if n_samples < 1 or max_turns < 1 or max_total_tokens < 1:
            raise ValueError("MultiTurnWorkflow needs n_samples, max_turns, max_total_tokens "
                             f">= 1, got {n_samples}, {max_turns}, {max_total_tokens}")
        self.env_factory = env_factory
        self.n_samples = n_samples
        self.gconfig = gconfig or SamplingParams()
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        if tokenizer is not None and not self.gconfig.stop_token_ids:
            self.gconfig = replace(self.gconfig, stop_token_ids=tuple(tokenizer.stop_token_ids))

    async def _episode(self, client: GenerateClient, item: PromptItem, ctx: WorkflowContext,
                       sample: int) -> Trajectory:
        tokenizer = self.tokenizer or ctx.tokenizer
        ids = prompt_token_ids(item, tokenizer)
        mask, logp, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        env = await _maybe_await(self.env_factory(item))
        total_reward, turns, finish, n_interruptions = 0.0, 0, "length", 0
        while turns < self.max_turns and len(ids) < self.max_total_tokens:
            budget = min(self.gconfig.max_new_tokens, self.max_total_tokens - len(ids))
            resp = await client.agenerate(sample_request(
                self.gconfig, ids, seed=ctx.seed + 1000 * sample + turns,
                rid=f"{ctx.group_id}/{sample}.{turns}", max_new_tokens=budget))
            turns += 1
            n_interruptions += resp.n_interruptions
            finish = resp.finish_reason
            out = list(resp.output_ids)
            ids += out
            mask += [1] * len(out)
            logp += list(resp.output_logprobs)
            versions += list(resp.output_versions)
            text = tokenizer.decode(out, skip_special_tokens=True) if tokenizer is not None else ""
            obs_ids, reward, done = await _maybe_await(env.step(out, text))
            total_reward += float(reward)
            if done:
                break
            obs_ids = [int(t) for t in obs_ids][: self.max_total_tokens - len(ids)]
            ids += obs_ids
            mask += [0] * len(obs_ids)
            logp += [0.0] * len(obs_ids)
            versions += [-1] * len(obs_ids)
        close = getattr(env, "aclose", None) or getattr(env, "close", None)
        if close is not None:
            await _maybe_await(close())
        return Trajectory(input_ids=np.asarray(ids, np.int32),
                          loss_mask=np.asarray(mask, np.int32),
                          behav_logp=np.asarray(logp, np.float32),
                          versions=np.asarray(versions, np.int32), reward=total_reward,
                          finish_reason=finish,
                          info={"turns": turns, "sample_index": sample,
                                "n_interruptions": n_interruptions})

    async def arun(self, client: GenerateClient, item: PromptItem,
                   ctx: WorkflowContext) -> list[Trajectory] | None:
        return list(await asyncio.gather(*(self._episode(client, item, ctx, i)
                                           for i in range(self.n_samples))))


WorkflowFn = Callable[[GenerateClient, PromptItem, WorkflowContext],
                     Awaitable[list[Trajectory] | None]]


class WorkflowObject(Protocol):
    """A workflow as an object: its ``arun`` is the coroutine function."""

    def arun(self, client: GenerateClient, item: PromptItem,
             ctx: WorkflowContext) -> Awaitable[list[Trajectory] | None]: ...


Workflow = WorkflowFn | WorkflowObject


def as_workflow_fn(workflow: Workflow) -> WorkflowFn:
    """The coroutine function behind a workflow object or function (TypeError otherwise)."""
    fn = getattr(workflow, "arun", workflow)
    if not callable(fn):
        raise TypeError(f"workflow {workflow!r} must be an async function (client, item, ctx) or "
                        "an object with an async arun(client, item, ctx) method")
    return fn
