"""The checkpoint's metadata: one typed record, saved as the JSON ``meta`` item.

Every writer (the trainer, the critic's checkpointer, ``scripts/convert.py``) builds a
:class:`CheckpointMeta` and every reader (resume, ``eval.py``, ``convert.py``) gets one back
from ``TrainCheckpointer.restore`` / ``restore_newest`` / ``restore_meta``. On disk it is
the same flat JSON dict as ever (``{"step": 3, "version": 3, "executor": {...}, ...}``):

* ``to_json`` writes ``step`` and ``version`` always, every other field only when it is
  not at its default (a params-only conversion has no executor, a critic no run config),
  then the ``extra`` keys;
* ``from_json`` reads any checkpoint written so far: a missing key takes its default, a
  key this record does not know is kept in ``extra`` (written back as it was).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from model_defs import CheckpointError, JsonDict

__all__ = ["CheckpointMeta"]

_ALWAYS_WRITTEN = ("step", "version")


@dataclass(frozen=True)
class CheckpointMeta:
    """What a training checkpoint says about itself, beside its arrays.

    ``step`` is the learner's optimizer step, ``version`` the policy version (the
    checkpoint's own step number in the trainer's directory). ``has_opt_state`` is set by
    ``TrainCheckpointer.save`` (None in a record that was never saved: unknown).
    """

    step: int = 0
    version: int = 0
    executor: JsonDict = field(default_factory=dict)  # RolloutExecutor.state_dict()
    model_config: JsonDict | None = None  # the HF config.json of the model
    run_config: JsonDict | None = None  # config.to_dict(TrainConfig): eval.py, convert.py
    consumed_tokens: int = 0
    elapsed_s: float = 0.0  # wall time of the run up to this checkpoint, over restarts
    rng: list[int] | None = None  # rng_to_json of the run's PRNG key at this version
    source_hf_dir: str | None = None  # convert.py hf-to-orbax: the HF dir it came from
    source_hub_id: str | None = None  # ... and the hub id that named it
    has_opt_state: bool | None = None
    extra: JsonDict = field(default_factory=dict)  # keys of other writers, kept as they are

    def __post_init__(self) -> None:
        clash = sorted(set(self.extra) & {f.name for f in dataclasses.fields(self)})
        if clash:
            raise ValueError(f"CheckpointMeta extra keys {clash} are fields of the record; "
                             f"set the fields instead")

    def to_json(self) -> JsonDict:
        """The JSON dict saved as the checkpoint's ``meta`` item (a deep copy).

        Raises TypeError naming the key whose value JSON cannot hold.
        """
        out: JsonDict = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if f.name in _ALWAYS_WRITTEN or value != _default_of(f):
                out[f.name] = value
        for key, value in self.extra.items():
            if not isinstance(key, str):
                raise TypeError(f"checkpoint meta key {key!r} is not a string")
            out[key] = value
        for key, value in out.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"checkpoint meta[{key!r}] is not JSON-serialisable: {e}"
                                ) from None
        return json.loads(json.dumps(out))

    @classmethod
    def from_json(cls, data: JsonDict) -> CheckpointMeta:
        """The record of a saved ``meta`` dict, of this or any earlier version: missing
        keys take their defaults, unknown ones go to ``extra``. A known key holding the
        wrong kind of value is a CheckpointError naming it."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"checkpoint meta must be a JSON object, got "
                                  f"{type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        kwargs: JsonDict = {}
        extra: JsonDict = {}
        for key, value in data.items():
            if key in known:
                kwargs[key] = _checked(key, value)
            else:
                extra[key] = value
        return cls(**kwargs, extra=extra)


def _default_of(f: dataclasses.Field) -> object:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


# The JSON kinds each field takes (None where the field is optional).
_KINDS: dict[str, tuple[type, ...]] = {
    "step": (int,), "version": (int,), "consumed_tokens": (int,),
    "elapsed_s": (int, float), "executor": (dict,), "model_config": (dict, type(None)),
    "run_config": (dict, type(None)), "rng": (list, type(None)),
    "source_hf_dir": (str, type(None)), "source_hub_id": (str, type(None)),
    "has_opt_state": (bool, type(None)),
}


def _checked(key: str, value: object) -> object:
    kinds = _KINDS[key]
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a step number
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise CheckpointError(f"checkpoint meta[{key!r}] is {value!r}; expected {names}")
    if key == "elapsed_s":
        return float(value)  # type: ignore[arg-type]
    return value
