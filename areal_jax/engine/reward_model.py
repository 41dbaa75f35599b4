"""A reward model served by the embedded server: a Hugging Face ``*ForSequenceClassification``
checkpoint (Qwen2, Qwen3 or Llama backbone with a ``score`` head), scored over HTTP.

``scripts/serve.py --model-path DIR`` serves one when ``DIR/config.json`` names such an
architecture (``Qwen2ForSequenceClassification``, ...): instead of the generation engine it
answers SGLang's reward-model route,

- ``POST /classify`` ``{"input_ids": [[int]] | [int]}`` or ``{"text": [str] | str}`` ->
  ``[{"embedding": [score per label], "meta_info": {"id", "prompt_tokens"}}]`` (one item per
  input; a single input gets a single item), as SGLang's ``--is-embedding`` servers do;

plus ``/health``, ``/get_model_info`` and ``/get_server_info``. The score is transformers':
the head applied to the last token's final hidden state (``score.weight @ h[len - 1]``; the
inputs are unpadded, so the last token is the last non-padding one). Text is tokenized with
the checkpoint's tokenizer as it is (no chat template; render it on the client).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from flax import nnx
from safetensors import safe_open

from model_defs import JsonDict, fp32_matmuls, load_hf

SUFFIX = "ForSequenceClassification"
MAX_ITEMS = 1024


class RewardModelError(ValueError):
    """A checkpoint that is not a usable sequence classifier, or a bad request."""


def is_sequence_classifier(path: str | os.PathLike) -> bool:
    """Whether ``path/config.json`` names a ``*ForSequenceClassification`` architecture."""
    try:
        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return bool(archs) and isinstance(archs[0], str) and archs[0].endswith(SUFFIX)


def _score_weight(path: Path) -> np.ndarray:
    """``score.weight`` [num_labels, D] from the checkpoint's safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / json.loads(index.read_text())["weight_map"]["score.weight"]]
    else:
        files = sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="numpy") as handle:
            if "score.weight" in handle.keys():  # noqa: SIM118 - safe_open has no __contains__
                return np.asarray(handle.get_tensor("score.weight"), np.float32)
    raise RewardModelError(f"{path}: no score.weight tensor (the classifier head)")


class RewardModel:
    """The backbone (``model_defs``) and the classifier head of a sequence classifier."""

    def __init__(self, path: str | os.PathLike, dtype: str = "float32") -> None:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        arch = config["architectures"][0]
        # The backbone as the causal LM of the same family with a tied head, which needs no
        # lm_head tensor: load_hf reads the "model.*" tensors and ignores score.weight.
        causal = {**config, "architectures": [arch.replace(SUFFIX, "ForCausalLM")],
                  "tie_word_embeddings": True}
        staging = Path(tempfile.mkdtemp(prefix="reward_model_"))
        try:
            (staging / "config.json").write_text(json.dumps(causal))
            for f in path.iterdir():
                if f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json":
                    (staging / f.name).symlink_to(f.resolve())
            model, self.model_config = load_hf(staging, dtype=dtype)
        except (KeyError, ValueError) as e:
            raise RewardModelError(f"{path}: {type(e).__name__}: {e}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.graphdef, self.state = nnx.split(model)
        self.head_ld = jnp.asarray(_score_weight(path))
        if self.head_ld.shape[1] != self.model_config.hidden_size:
            raise RewardModelError(f"{path}: score.weight has shape {list(self.head_ld.shape)}; "
                                   f"expected [num_labels, {self.model_config.hidden_size}]")
        self.num_labels = int(self.head_ld.shape[0])
        self.path = str(path)
        self.max_len = int(config.get("max_position_embeddings", 4096))
        self.tokenizer: Any = None
        if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._lock = threading.Lock()  # one forward at a time

    def scores(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per sequence, the head's output at its last token, fp32 [num_labels]."""
        longest = max(len(s) for s in sequences)
        width = max(16, 1 << (longest - 1).bit_length())
        rows = 1 << max(0, len(sequences) - 1).bit_length()
        ids = np.zeros((rows, width), np.int32)
        valid = np.zeros((rows, width), bool)
        last = np.zeros(rows, np.int32)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = seq
            valid[i, : len(seq)] = True
            last[i] = len(seq) - 1
        with self._lock:
            out = _scores(self.graphdef, self.state, self.head_ld, jnp.asarray(ids),
                          jnp.asarray(valid), jnp.asarray(last))
        return np.asarray(out)[: len(sequences)].astype(float).tolist()


@functools.partial(jax.jit, static_argnums=0)
def _scores(graphdef: nnx.GraphDef, state: nnx.State, head_ld: jax.Array, ids_bt: jax.Array,
            valid_bt: jax.Array, last_b: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    with fp32_matmuls(model.dtype):
        hidden_btd = model.hidden_states(ids_bt, segment_ids=valid_bt.astype(jnp.int32))
    h_bd = jnp.take_along_axis(hidden_btd, last_b[:, None, None], axis=1)[:, 0]
    return jnp.einsum("bd,ld->bl", h_bd.astype(jnp.float32), head_ld,
                      preferred_element_type=jnp.float32)


def parse_classify(body: Any, rm: RewardModel) -> tuple[list[list[int]], bool]:
    """The token lists of a /classify body and whether it was a batch; RewardModelError
    naming the field otherwise."""
    if not isinstance(body, dict):
        raise RewardModelError("the body must be a JSON object with input_ids or text")
    if ("input_ids" in body) == ("text" in body):
        raise RewardModelError("give exactly one of input_ids and text")
    if "text" in body:
        texts = body["text"]
        batched = isinstance(texts, list)
        texts = texts if batched else [texts]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise RewardModelError("text must be a non-empty string or a list of them")
        if rm.tokenizer is None:
            raise RewardModelError(f"{rm.path} has no tokenizer: send input_ids")
        seqs = [list(rm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    else:
        ids = body["input_ids"]
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        seqs = ids if batched else [ids]
    if not seqs or len(seqs) > MAX_ITEMS:
        raise RewardModelError(f"send 1 to {MAX_ITEMS} inputs, got {len(seqs)}")
    vocab = rm.model_config.vocab_size
    for i, seq in enumerate(seqs):
        if not isinstance(seq, list) or not seq or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in seq):
            raise RewardModelError(f"input {i}: a non-empty list of token ids in [0, {vocab})")
        if len(seq) > rm.max_len:
            raise RewardModelError(f"input {i} has {len(seq)} tokens; the model takes at most "
                                   f"{rm.max_len}")
    return seqs, batched


def create_reward_app(rm: RewardModel, api_key: str | None = None) -> Any:
    """The FastAPI app of a reward-model server (see the module doc)."""
    app = FastAPI(title="areal-jax reward model")

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse({"error": "missing or wrong API key"}, status_code=401)
        return await call_next(request)

    @app.post("/classify")
    async def classify(request: Request) -> Any:
        try:
            body = json.loads(await request.body())
            seqs, batched = parse_classify(body, rm)
        except (ValueError, UnicodeDecodeError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        scores = await asyncio.to_thread(rm.scores, seqs)
        items: list[JsonDict] = [
            {"embedding": s, "meta_info": {"id": uuid.uuid4().hex, "prompt_tokens": len(q)}}
            for s, q in zip(scores, seqs, strict=True)]
        return items if batched else items[0]

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> Any:
        return {"model_path": rm.path, "is_generation": False, "num_labels": rm.num_labels}

    @app.get("/get_server_info")
    async def server_info() -> Any:
        return {"model_path": rm.path, "engine": "areal-jax reward model",
                "num_labels": rm.num_labels}

    return app


def serve_reward_model(model_path: str, host: str, port: int, dtype: str,
                       api_key: str | None) -> int:
    """Runs the reward-model server until it is stopped (scripts/serve.py's path for a
    sequence classifier)."""
    import uvicorn

    rm = RewardModel(model_path, dtype=dtype)
    uvicorn.run(create_reward_app(rm, api_key), host=host, port=port, log_level="warning")
    return 0
