"""Lowers the learner's gradient program and the engine's prefill and decode for a
compile-only target, as scripts/plan.py does, and prints which of them pin their matrix
products to the highest precision, as one JSON line (run in a subprocess by
tests/test_precision_placement.py).

    JAX_PLATFORMS=cpu python tests/_precision_lower.py TARGET DTYPE
"""

from __future__ import annotations

import json
import sys

from areal_jax.config import load_config
from areal_jax.parallel.mesh import make_mesh
from areal_jax.parallel.targets import compile_only_devices
from areal_jax.plan.planner import abstract_learner, lower_engine, lower_learner_grad
from model_defs import ModelConfig


def main(target: str, dtype: str) -> None:
    cfg = load_config(None, [f"model.dtype={dtype}", "model.path=builtin:arith_sft",
                             "rollout.max_slots=2", "rollout.max_seq_len=32",
                             "rollout.max_new_tokens=8", "train.seq_len=32",
                             "train.rows_per_micro_batch=1"])
    model_cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    devices = compile_only_devices(target)[:1] if target != "cpu" else None
    if devices is None:
        import jax

        devices = jax.devices("cpu")[:1]
    mesh = make_mesh("data=1", devices)
    learner = abstract_learner(cfg, model_cfg, mesh)
    texts = {"learner_grad": lower_learner_grad(learner, 1, 32).as_text()}
    prefill, decode, _ = lower_engine(cfg, model_cfg, devices[0])
    texts.update(engine_prefill=prefill.as_text(), engine_decode=decode.as_text())
    result = {}
    for name, text in texts.items():
        dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        result[name] = {"dots": len(dots),
                        "highest": sum("precision = [HIGHEST, HIGHEST]" in d for d in dots)}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
