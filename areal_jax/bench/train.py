"""Train-step tokens/s (forward + backward + AdamW): our jitted learner step vs transformers
+ torch.optim.AdamW, same model, same batch, same PPO loss, side by side.

    python -m areal_jax.bench train                       # CPU: Qwen2-shaped 512 hidden, 4 layers
    python -m areal_jax.bench train --preset qwen2.5-0.5b --dtype bfloat16 --tokens 4096 \\
        --rows 1 --no-torch                             # GPU: MFU of a 4k-token packed micro-batch
    taskset -c 1 python -m areal_jax.bench train --model-path areal_jax/data/assets/arith_sft \\
        --tokens 384 --rows 4 --threads 1               # the demo's model and micro-batch, 1 core

Default model: Qwen2-shaped (hidden 512, 8/2 heads, mlp 2048, vocab 32000, tied), 4 layers;
batch 4 x 512 tokens, fp32. Both systems start from the same random weights (ours loads the
transformers checkpoint) and compute the same decoupled-PPO loss over every token that has a
logprob; the first-step losses are compared as a sanity check. Ours runs
``Learner.train_step`` (1 minibatch = 1 micro-batch, prox_logp given): logprobs chunked over
the vocabulary, global-norm clipping, AdamW. Theirs: ``model(ids).logits`` -> log_softmax ->
the same loss -> backward -> ``clip_grad_norm_`` -> ``AdamW.step``. Timed steps alternate
between the two so that noise from other processes hits both alike; figure: median tokens/s.

MFU (ours only): (6 * N_matmul + 12 * layers * heads * head_dim * seq_len) * tokens / time /
peak, N_matmul = parameters used in matmuls (layers + lm head), PaLM's convention. Peak is
taken from the device kind (H100/H200: 989 TFLOP/s bf16 dense, half that for fp32 via TF32 is
not assumed) or ``--peak-tflops``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.bench.common import interleaved_times, save_random_hf

PEAK_TFLOPS_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "TPU v5e": 197.0,
                    "TPU v4": 275.0, "TPU v5p": 459.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None,
                        help="ModelConfig preset (e.g. qwen2.5-0.5b); default: the small "
                             "Qwen2 shape")
    parser.add_argument("--model-path", default=None,
                        help="take the model shape from this HF directory's config.json "
                             "(e.g. areal_jax/data/assets/arith_sft, the demo's model); "
                             "weights stay random")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="tokens per micro-batch (rows x seq)")
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype (master weights stay fp32)")
    parser.add_argument("--remat", action="store_true", help="gradient checkpointing per layer")
    parser.add_argument("--mesh", default="data=-1", help="mesh spec for our learner")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per system (median)")
    parser.add_argument("--chunk", type=int, default=8192, help="vocabulary chunk for logprobs")
    parser.add_argument("--no-torch", action="store_true", help="skip the transformers peer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")


def _model_config(args: argparse.Namespace) -> Any:
    from model_defs import ModelConfig

    if args.preset and args.model_path:
        raise SystemExit("bench train: give --preset or --model-path, not both")
    if args.model_path:
        cfg = ModelConfig.from_pretrained_dir(args.model_path)
    elif args.preset:
        cfg = ModelConfig.preset(args.preset)
    else:
        cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=32000, hidden_size=512,
                          intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True,
                          rope_theta=1000000.0, max_position_embeddings=32768)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    return cfg


def _random_model(cfg: Any, mesh: Any) -> Any:
    """Random init on device (for --no-torch): no checkpoint round trip for big models."""
    import jax
    from flax import nnx

    from model_defs import CausalLM, param_shardings

    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = jax.tree.unflatten(jax.tree.structure(abstract_state),
                                   jax.tree.leaves(param_shardings(abstract_state, mesh)))
    state = jax.jit(lambda: nnx.state(CausalLM(cfg, rngs=nnx.Rngs(0))),
                    out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def matmul_params(cfg: Any) -> int:
    d, f, h, k, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.head_dim)
    per_layer = d * h * dh * 2 + d * k * dh * 2 + 3 * d * f
    return cfg.num_hidden_layers * per_layer + d * cfg.vocab_size


def train_flops(cfg: Any, tokens: int, seq_len: int) -> float:
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return float((6 * matmul_params(cfg) + attention) * tokens)


def _peak_tflops(args: argparse.Namespace) -> float | None:
    import jax

    if args.peak_tflops:
        return args.peak_tflops
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_TFLOPS_BF16.items():
        if name.lower() in kind.lower():
            return peak if args.dtype == "bfloat16" else None
    return None


def _batch(cfg: Any, rows: int, seq_len: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (rows, seq_len)).astype(np.int32)
    mask = np.ones((rows, seq_len), np.int32)
    mask[:, 0] = 0  # the first token has no logprob
    return {
        "input_ids": ids,
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy(),
        "segment_ids": np.ones((rows, seq_len), np.int32),
        "loss_mask": mask,
        "advantages": (rng.standard_normal((rows, seq_len)) * mask).astype(np.float32),
        "versions": np.zeros((rows, seq_len), np.int32),
    }


def _torch_step_fn(model: Any, batch: dict[str, np.ndarray], eps_clip: float,
                   temperature: float, lr: float, max_grad_norm: float) -> tuple[Any, Any]:
    import torch

    ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    mask = torch.as_tensor(batch["loss_mask"][:, 1:], dtype=torch.float32)
    adv = torch.as_tensor(batch["advantages"][:, 1:])
    prox = torch.as_tensor(batch["prox_logp"][:, 1:])
    behav = torch.as_tensor(batch["behav_logp"][:, 1:])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)

    def step() -> float:
        logits = model(ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        behav_w = torch.exp(prox - behav)
        ratio = torch.exp(logp - prox)
        token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_clip, 1 + eps_clip))
        loss = (behav_w * token_loss * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, opt


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from areal_jax.learner import AlgoConfig, Learner, OptimConfig
    from areal_jax.parallel import make_mesh

    if args.tokens % args.rows:
        raise SystemExit(f"--tokens {args.tokens} is not a multiple of --rows {args.rows}")
    seq_len = args.tokens // args.rows
    cfg = _model_config(args)
    mesh = make_mesh(args.mesh)
    optim = OptimConfig(lr=1e-5, max_grad_norm=1.0)
    algo = AlgoConfig(ppo_n_minibatches=1, eps_clip=0.2)
    batch = _batch(cfg, args.rows, seq_len)

    with tempfile.TemporaryDirectory() as tmp:
        theirs = None
        if args.no_torch:
            learner = Learner(_random_model(cfg, mesh), cfg, optim, algo, mesh=mesh,
                              compute_dtype=args.dtype, remat=args.remat,
                              logp_chunk_size=args.chunk)
        else:
            import torch
            from transformers import AutoModelForCausalLM

            if args.threads:
                torch.set_num_threads(args.threads)
            path = save_random_hf(cfg, Path(tmp), "bench-train")
            learner = Learner.from_hf(str(path), optim, algo, mesh=mesh, compute_dtype=args.dtype,
                                      remat=args.remat, logp_chunk_size=args.chunk)
            torch_dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
            theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).train()
            if args.remat:
                theirs.gradient_checkpointing_enable()

    logp = learner.compute_logp([batch])[0]
    batch["prox_logp"] = logp
    rng = np.random.default_rng(1)
    batch["behav_logp"] = (logp + 0.05 * rng.standard_normal(logp.shape)).astype(np.float32) \
        * batch["loss_mask"]

    t0 = time.perf_counter()
    first = learner.train_step([batch])
    compile_s = time.perf_counter() - t0
    systems: dict[str, Any] = {"ours": lambda: learner.train_step([batch])}
    loss_diff = None
    if theirs is not None:
        torch_step, _ = _torch_step_fn(theirs, batch, algo.eps_clip, learner.temperature, optim.lr,
                                       optim.max_grad_norm)
        # Same weights and batch before any update: the losses agree.
        loss_diff = abs(torch_step() - first["loss"])
        systems["transformers"] = torch_step

    times = interleaved_times(systems, args.repeats)

    tokens = args.tokens
    rows, summary = [], {}
    ours_tps = tokens / statistics.median(times["ours"])
    peak = _peak_tflops(args)
    flops = train_flops(cfg, tokens, seq_len)
    for name, ts in times.items():
        tps = tokens / statistics.median(ts)
        tflops = flops / statistics.median(ts) / 1e12
        mfu = tflops / peak if (peak and name == "ours") else None
        rows.append([name, round(tps, 1), round(statistics.median(ts), 4), round(min(ts), 4),
                     round(tflops, 3), "-" if mfu is None else f"{100 * mfu:.1f}%"])
    summary["ours_tokens_per_s"] = ours_tps
    if "transformers" in times:
        summary["ratio"] = ours_tps / (tokens / statistics.median(times["transformers"]))
        summary["first_step_loss_abs_diff"] = loss_diff
        import torch

        summary["torch_threads"] = torch.get_num_threads()
    if peak:
        summary["mfu"] = flops / statistics.median(times["ours"]) / (peak * 1e12)
        summary["peak_tflops"] = peak
    summary.update(first_call_s=round(compile_s, 2), jax_backend=jax.default_backend(),
                   device=jax.devices()[0].device_kind, params_matmul=matmul_params(cfg),
                   mesh=args.mesh, dtype=args.dtype, remat=args.remat)
    shape = args.model_path or args.preset or "qwen2-shaped h512"
    return {
        "title": f"train step (fwd+bwd+AdamW) tokens/s: ours vs transformers+torch AdamW, "
                 f"{shape}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, "
                 f"{args.rows}x{seq_len} tokens, {args.dtype}",
        "columns": ["system", "tokens/s", "median s", "min s", "TFLOP/s", "MFU"],
        "rows": rows,
        "summary": summary,
    }
