"""areal_jax.losses stays a standalone pure-JAX library, and its docs example runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("flax", "optax", "orbax", "grain", "tensorstore", "httpx", "fastapi", "uvicorn",
         "transformers", "torch", "tokenizers", "safetensors", "math_verify", "model_defs")


def _run(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def test_import_pulls_in_only_jax_numpy_and_stdlib():
    code = (
        "import sys, json, areal_jax.losses as L\n"
        "L.decoupled_ppo_loss, L.group_advantages, L.gae\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(heavy))))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('areal_jax'))))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    heavy_lines = result.stdout.strip().splitlines()
    assert json.loads(heavy_lines[0]) == []
    ours = json.loads(heavy_lines[1])
    assert all(m == "areal_jax" or m.startswith("areal_jax.losses") for m in ours), ours


def test_docs_example_runs():
    text = (REPO / "docs" / "losses.md").read_text()
    assert text.startswith("# Using the losses in your own JAX code")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 1
    result = _run(blocks[0])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss " in result.stdout and "accumulated clip_frac" in result.stdout


# ----------------------------------------------------------------------------- transforms

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import areal_jax.losses as L  # noqa: E402
from tests.tolerance import EPS  # noqa: E402

_rng = np.random.default_rng(0)
_MASK = (_rng.random((3, 8)) < 0.8).astype(np.int32)
_SEG = np.repeat([[1, 1, 1, 2, 2, 2, 2, 0]], 3, axis=0)


def _bf16_exact(a):
    """float32 values that bf16 represents exactly, so bf16 and fp32 runs see the same inputs."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))


_LOGP = _bf16_exact(-_rng.uniform(0.1, 2.0, (3, 8)))
_OTHER = {k: _bf16_exact(v) for k, v in {
    "prox": _LOGP + _rng.normal(0, 0.3, (3, 8)),
    "behav": _LOGP + _rng.normal(0, 0.3, (3, 8)),
    "adv": _rng.normal(0, 1, (3, 8)),
    "w": _rng.normal(0, 1, (8, 5)),
}.items()}


def c(name, x):
    """A fixed input in x's dtype."""
    return jnp.asarray(_OTHER[name], x.dtype)


# name -> function of one differentiable float input x [3, 8], returning a scalar.
# decoupled_ppo_loss and logprobs_from_{logits,hidden} have their own jit+grad+bf16 tests
# in test_losses_ppo.py and test_losses_logprobs.py.
TRANSFORM_CASES = {
    "decoupled_ppo_loss_terms": lambda x: L.decoupled_ppo_loss_terms(
        L.PPOInputs(logp=x, prox_logp=c("prox", x), behav_logp=c("behav", x),
                    advantages=c("adv", x), loss_mask=_MASK),
        L.PPOLossConfig(agg_mode="seq-mean-token-sum", seq_token_sum_normalizer=8.0)).loss_sum,
    "group_advantages": lambda x: (
        L.group_advantages(x.reshape(-1), 4) * c("adv", x).reshape(-1)).sum(),
    "gae": lambda x: L.gae(x, c("adv", x), _MASK, 0.99, 0.95)[0].sum(),
    "normalize_advantages": lambda x: (L.normalize_advantages(x, _MASK) * c("adv", x)).sum(),
    "shape_rewards": lambda x: L.shape_rewards(x, scale=2.0, bias=0.5, clip=1.5).sum(),
    "overlong_penalty": lambda x: L.overlong_penalty(
        -x * 8, max_response_length=20, overlong_tokens=5).sum(),
    "token_kl": lambda x: L.token_kl(x, c("prox", x), "k3", mask=_MASK).sum(),
    "ppo_value_loss": lambda x: L.ppo_value_loss(x, c("prox", x), c("adv", x), _MASK)[0],
    "entropy_from_logits": lambda x: L.entropy_from_logits(x, 1.0, 3).sum(),
}


@pytest.mark.parametrize("name", sorted(TRANSFORM_CASES))
def test_every_function_under_jit_and_grad_with_bf16_inputs(name):
    fn = TRANSFORM_CASES[name]
    x16 = jnp.asarray(_LOGP, jnp.bfloat16)
    value16, grad16 = jax.jit(jax.value_and_grad(fn))(x16)
    assert value16.dtype == jnp.float32, "outputs are computed and returned in fp32"
    assert grad16.dtype == jnp.bfloat16 and grad16.shape == x16.shape
    assert np.all(np.isfinite(np.asarray(grad16, np.float32)))
    # fp32 internally: identical (to fp32 rounding) to the fp32 run on the upcast values.
    value32, grad32 = jax.value_and_grad(fn)(x16.astype(jnp.float32))
    np.testing.assert_allclose(float(value16), float(value32), rtol=1e-5, atol=1e-6)
    # The bf16 gradient is the fp32 one rounded to bf16 once: the two roundings of values
    # that agree to fp32 rounding differ by at most one bf16 ulp (eps_bf16 relative).
    np.testing.assert_allclose(np.asarray(grad16, np.float32),
                               np.asarray(grad32.astype(jnp.bfloat16), np.float32),
                               rtol=EPS["bfloat16"], atol=0)
