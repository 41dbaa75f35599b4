"""Reward functions (verifiers) and the process pool that runs them.

- ``areal_jax.rewards.pool.RewardPool``: worker processes, per-call timeout, kill on hang.
- ``areal_jax.rewards.math.math_reward(completion, answer)``: math-verify.
- ``areal_jax.rewards.code.code_reward(completion, tests, timeout_s, memory_mb)``: sandboxed tests.
- ``areal_jax.rewards.builtin.builtin_reward(completion, answer)``: the built-in synthetic task.

Submodules are imported on demand so reward workers stay light.
"""
