"""On-policy distillation's rollout side: a workflow whose samples the teacher scores.

    workflow = TeacherScoredWorkflow(RLVRWorkflow(...), TeacherScorer(settings))

The inner workflow runs as usual (the student samples, the reward is computed and only
measured unless ``teacher.reward_weight`` > 0); then one batched scoring request sends the
group's token lists (prompt + completion, env turns included) to the teacher, and each
trajectory gets ``teacher_logp``: the teacher's logprob of every completion token, 0
elsewhere. The advantages come from them (``data.advantages.distill_advantages_for``).

A teacher that still fails after its retries rejects the group (``None``: its capacity is
freed and the next prompt runs), counted as ``teacher_failed_groups``; the cause goes to
the progress watchdog. Eval never asks the teacher.
"""

from __future__ import annotations

import numpy as np

from areal_jax.rewards.teacher import TeacherError, TeacherScorer
from areal_jax.rollout.workflows import (
    GenerateClient,
    PromptItem,
    Workflow,
    WorkflowContext,
    as_workflow_fn,
)
from areal_jax.trajectory import Trajectory


class TeacherScoredWorkflow:
    """``inner``'s groups, each trajectory with the teacher's ``teacher_logp``."""

    def __init__(self, inner: Workflow, teacher: TeacherScorer) -> None:
        self.inner = inner
        self._run = as_workflow_fn(inner)
        self.teacher = teacher

    async def arun(self, client: GenerateClient, item: PromptItem,
                   ctx: WorkflowContext) -> list[Trajectory] | None:
        group = await self._run(client, item, ctx)
        if not group:
            return group
        try:
            logps = await self.teacher.token_logprobs([t.input_ids.tolist() for t in group])
        except TeacherError as e:
            ctx.count("teacher_failed_groups")
            ctx.note_problem(str(e))
            return None
        for traj, logp in zip(group, logps, strict=True):
            traj.teacher_logp = np.where(traj.loss_mask > 0, np.asarray(logp, np.float32),
                                         0.0).astype(np.float32)
        ctx.count("teacher_scored_groups")
        return group

    def close(self) -> None:
        self.teacher.close()
