"""A reward model's score as the reward (``reward.fn: reward_model``): a classifier head.

    rm = RewardModelReward(RewardModelSettings(url="http://127.0.0.1:30003"))
    score, problem = await rm.ascore(completion, reference, question=question)

The text ``template`` (``{question}``, ``{reference}``, ``{answer}``; default the question, a
newline and the answer) goes to SGLang's reward-model route ``POST /classify`` as
``{"text": ...}``; the reward is ``embedding[label]`` of the reply, the head's output for
that label. The server is SGLang started with ``--is-embedding`` on a reward model, or the
embedded server of a Hugging Face ``*ForSequenceClassification`` checkpoint
(``areal_jax.engine.reward_model``; ``reward.reward_model.model_path``). Everything else is
the judge's: concurrency limit, timeouts and retries, the cache of identical calls, and a
failure that is rejected or scored ``fallback_score``, always counted, never a silent 0
(``areal_jax.rewards.judge``). A reply without a finite ``embedding[label]`` within
``[score_min, score_max]`` is unparsable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from areal_jax.rewards.judge import JudgeReward, JudgeSettings, JudgeUnparsable

DEFAULT_RM_TEMPLATE = "{question}\n{answer}"


@dataclass(frozen=True)
class RewardModelSettings(JudgeSettings):
    template: str = DEFAULT_RM_TEMPLATE
    label: int = 0  # which output of the head is the reward
    score_min: float = -1.0e6
    score_max: float = 1.0e6

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label < 0:
            raise ValueError(f"label must be >= 0, got {self.label}")


class RewardModelReward(JudgeReward):
    """A reward model behind ``/classify`` (see the module doc)."""

    kind = "reward_model"

    def __init__(self, settings: RewardModelSettings) -> None:
        super().__init__(settings)
        self.label = settings.label

    def _request(self, question: str, reference: str, answer: str) -> tuple[str, dict[str, Any]]:
        text = self.settings.template.format(question=question, reference=reference,
                                             answer=answer)
        return "/classify", {"text": text}

    def _score(self, reply: Any) -> float:
        item = reply[0] if isinstance(reply, list) and len(reply) == 1 else reply
        try:
            value = item["embedding"][self.label]
        except (KeyError, IndexError, TypeError):
            raise JudgeUnparsable(f"the reward model's reply has no embedding[{self.label}]: "
                                  f"{json.dumps(reply)[:160]}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            raise JudgeUnparsable(f"embedding[{self.label}] is {value!r}, not a finite number")
        s = self.settings
        if not s.score_min <= value <= s.score_max:
            raise JudgeUnparsable(f"score {value:g} is outside [{s.score_min:g}, "
                                  f"{s.score_max:g}]")
        return float(value)
