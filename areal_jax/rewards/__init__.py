"""Reward functions (verifiers) and the process pool that runs them.

- ``areal_jax.rewards.pool.RewardPool``: worker processes, per-call timeout, kill on hang.
- ``areal_jax.rewards.math.math_reward(completion, answer)``: math-verify.
- ``areal_jax.rewards.code.code_reward(completion, tests, timeout_s, memory_mb)``: sandboxed tests.
- ``areal_jax.rewards.builtin.builtin_reward(completion, answer)``: the built-in synthetic task.
- ``areal_jax.rewards.judge.JudgeReward``: an LLM judge behind an OpenAI-compatible endpoint
  (``reward.fn: judge``), awaited on the event loop rather than run in the pool.
- ``areal_jax.rewards.teacher.TeacherScorer``: the distillation teacher's per-token logprobs.

Submodules are imported on demand so reward workers stay light.
"""

# Short names accepted by configs (``reward.fn: math``) and the "module:function" they mean.
REWARD_FUNCTIONS: dict[str, str] = {
    "math": "areal_jax.rewards.math:math_reward",
    "code": "areal_jax.rewards.code:code_reward",
    "builtin": "areal_jax.rewards.builtin:builtin_reward",
}


# reward.fn names that a model server gives (over HTTP, not in the pool): see rewards/judge.py.
MODEL_REWARDS = ("judge", "reward_model")


def reward_fn_spec(name: str) -> str:
    """``"math"`` -> ``"areal_jax.rewards.math:math_reward"``; a "module:function" passes
    through."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if ":" in name:
        return name
    raise ValueError(f"reward fn {name!r} is unknown; use one of {sorted(REWARD_FUNCTIONS)} "
                     "or a 'module:function' string")
