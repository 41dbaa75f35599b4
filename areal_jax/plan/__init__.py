"""The planner: will a run fit its accelerators, and how fast can it go? On a CPU host.

A product feature users run before renting hardware (``scripts/plan.py``,
docs/accelerators.md): it compiles the learner's and the engine's real programs for
compile-only TPU or GPU devices, from abstract shapes and no weights, and reads their
memory, FLOPs and bytes.

* ``planner``: ``plan_run(cfg, target)`` and its table, ``measure`` of one lowered program;
* ``hlo_cost``: FLOPs and bytes of an optimised HLO module, loop bodies counted per
  iteration (XLA's ``cost_analysis`` counts them once);
* ``memory``: the learner's memory per parameter and the engine's KV cache, compiled and
  by the formula of docs/models.md (``python -m areal_jax.bench memory`` prints them).

It sits above ``run`` (it builds the learner's configs as a run does, ``run.learner_configs``)
and below ``bench``, whose benchmarks may use it. Importing this package imports no JAX.
"""

from areal_jax.plan.planner import PlanError, format_table, plan_run

__all__ = ["PlanError", "format_table", "plan_run"]
