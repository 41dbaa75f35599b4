"""The trajectory: what a rollout workflow produces and the learner trains on.

A neutral module: ``rollout/`` builds trajectories, ``data/trajectories.py`` batches them
and ``learner/`` packs them, and none of those rooms needs another to know the type.
Token alignment: every per-token array is aligned with ``input_ids``; ``behav_logp[t]``
is log p(input_ids[t] | input_ids[:t]) under the behaviour policy (0 where ``loss_mask``
is 0); ``versions[t]`` is the weight version that generated token t (-1 for prompt and
tool tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Why a generation ended (SGLang's finish_reason types); "abort" only between resumptions.
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
# An agent's episode ended because its next model call no longer fitted the context.
FINISH_CONTEXT = "context_length"
# Finishes that cut an episode short rather than end it: the answer hit the token limit
# (no EOS), or an agent's episode ran out of turns or context. GAE bootstraps these from
# the critic's value after their last token (docs/losses.md, "Truncated answers").
TRUNCATED_FINISHES = (FINISH_LENGTH, FINISH_CONTEXT)


@dataclass
class Trajectory:
    """One sequence ready for the learner. Per-token arrays have shape [T]."""

    input_ids: np.ndarray  # int32 [T]: prompt + completion (+ env turns)
    loss_mask: np.ndarray  # int32 [T]: 1 on model-generated tokens to train on
    behav_logp: np.ndarray  # float32 [T]: 0 where loss_mask == 0
    versions: np.ndarray  # int32 [T]: -1 on prompt / environment tokens
    reward: float
    group_id: str = ""  # samples of one prompt share it
    prompt_id: str = ""  # stable id of the dataset prompt
    start_version: int = 0  # learner version when the workflow was submitted
    finish_reason: str = FINISH_STOP
    info: dict[str, Any] = field(default_factory=dict)
    # float32 [T] or None: on-policy distillation's teacher logprob of each token (0 where
    # loss_mask is 0), set by the teacher-scored workflow (rollout/distill.py)
    teacher_logp: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.int32)
        self.behav_logp = np.asarray(self.behav_logp, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int32)
        if self.teacher_logp is not None:
            self.teacher_logp = np.asarray(self.teacher_logp, dtype=np.float32)
        n = self.input_ids.shape[0]
        for name in ("loss_mask", "behav_logp", "versions", "teacher_logp"):
            arr = getattr(self, name)
            if arr is not None and arr.shape != (n,):
                raise ValueError(f"Trajectory.{name} has shape {arr.shape}, expected ({n},)")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def truncated(self) -> bool:
        """The episode was cut short (``finish_reason`` in ``TRUNCATED_FINISHES``), not
        finished: its return continues past its last token."""
        return self.finish_reason in TRUNCATED_FINISHES

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("input_ids", "loss_mask", "behav_logp", "versions", "teacher_logp"):
            d[k] = None if getattr(self, k) is None else getattr(self, k).tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(**d)
