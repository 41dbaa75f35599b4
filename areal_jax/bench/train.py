"""Train-step tokens/s (forward + backward + AdamW): our jitted learner step vs transformers
+ torch.optim.AdamW, same model, same batch, same PPO loss, side by side.

    python -m areal_jax.bench train                       # CPU: Qwen2-shaped 512 hidden, 4 layers
    python -m areal_jax.bench train --preset qwen2.5-0.5b --dtype bfloat16 --tokens 4096 \\
        --rows 1 --no-torch                             # GPU: MFU of a 4k-token packed micro-batch
    taskset -c 1 python -m areal_jax.bench train --model-path areal_jax/data/assets/arith_sft \\
        --tokens 384 --rows 4 --threads 1               # the demo's model and micro-batch, 1 core

    python -m areal_jax.bench train --preset qwen2.5-1.5b --dtype bfloat16 --tokens 8192 \
        --rows 2 --torch-compile --independent-init  # GPU: against eager and compiled torch

The peer is what a PyTorch user runs: transformers with fp32 master weights, bf16 autocast
when ``--dtype bfloat16``, SDPA attention, AdamW (``fused=True`` on a GPU), on the GPU when
torch sees one (``--torch-device``); ``--torch-compile`` adds a row with the model under
``torch.compile``. Peak device memory and each system's first call (compilation) are
columns too.

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
    parser.add_argument("--torch-device", default="auto",
                        help="the peer's device: cpu, cuda, or auto (cuda when torch sees a "
                             "GPU)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time the peer under torch.compile (a second row)")
    parser.add_argument("--independent-init", action="store_true",
                        help="each system makes its own random weights on its device (no "
                             "shared checkpoint written and read: fast for 1B+ models); the "
                             "first-step loss check is then skipped")


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
    """Random weights made on device, leaf by leaf (normal(0, 0.02); norm scales 1), each
    shape's small program compiled once: jitting the whole model's init instead compiled
    for over 50 s at 1.5B on an H200."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model_defs import CausalLM, param_shardings

    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    shardings = jax.tree.leaves(param_shardings(abstract_state, mesh))
    makers: dict[tuple, Any] = {}
    leaves = []
    for i, ((path, leaf), sharding) in enumerate(zip(flat, shardings, strict=True)):
        ones = "norm" in jax.tree_util.keystr(path).lower()
        key = (leaf.shape, jnp.dtype(leaf.dtype).name, ones, sharding)
        if key not in makers:
            shape, dtype = leaf.shape, leaf.dtype
            makers[key] = jax.jit(
                (lambda k, s=shape, d=dtype: jnp.ones(s, d)) if ones else
                (lambda k, s=shape, d=dtype: 0.02 * jax.random.normal(k, s, d)),
                out_shardings=sharding)
        leaves.append(makers[key](jax.random.key(i)))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


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


def _torch_device(args: argparse.Namespace) -> str:
    import torch

    if args.torch_device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.torch_device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench train: --torch-device cuda, but torch sees no GPU")
    return args.torch_device


def _torch_model(path: Path | None, cfg: Any, device: str, remat: bool) -> Any:
    """The peer as a GPU user runs it: fp32 master weights (bf16 comes from autocast),
    PyTorch's SDPA attention, on ``device``; from the shared checkpoint ``path``, else
    random weights made on the device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        model = model.to(device)
    else:
        hf_dict = cfg.to_hf_dict()
        hf_config = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    model.train()
    if remat:
        model.gradient_checkpointing_enable()
    return model


def _torch_step_fn(model: Any, batch: dict[str, np.ndarray], eps_clip: float,
                   temperature: float, lr: float, max_grad_norm: float, *, device: str = "cpu",
                   autocast_bf16: bool = False, compile_model: bool = False) -> tuple[Any, Any]:
    """One PPO step of the peer: forward (bf16 autocast if asked), the same decoupled loss,
    backward, global-norm clipping, AdamW (fused on a GPU). Returns (step, optimizer)."""
    import torch

    def put(x: np.ndarray, dtype: Any = None) -> Any:
        return torch.as_tensor(x, dtype=dtype).to(device)

    ids = put(batch["input_ids"], torch.long)
    mask = put(batch["loss_mask"][:, 1:], torch.float32)
    adv = put(batch["advantages"][:, 1:])
    prox = put(batch["prox_logp"][:, 1:])
    behav = put(batch["behav_logp"][:, 1:])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, fused=device == "cuda")
    forward = torch.compile(model) if compile_model else model

    def step() -> float:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = forward(ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        behav_w = torch.exp(prox - behav)
        ratio = torch.exp(logp - prox)
        token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_clip, 1 + eps_clip))
        loss = (behav_w * token_loss * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # waits for the device

    return step, opt


def _peak_memory_gib(system: str) -> float | None:
    """Peak device memory of a system so far (GPU/TPU; None on a CPU)."""
    if system == "ours":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return None if peak is None else peak / 2**30
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**30


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

    torch_models: dict[str, Any] = {}
    device = None if args.no_torch else _torch_device(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if args.no_torch or args.independent_init:
            learner = Learner(_random_model(cfg, mesh), cfg, optim, algo, mesh=mesh,
                              compute_dtype=args.dtype, remat=args.remat,
                              logp_chunk_size=args.chunk)
        else:
            path = save_random_hf(cfg, Path(tmp), "bench-train")
            learner = Learner.from_hf(str(path), optim, algo, mesh=mesh, compute_dtype=args.dtype,
                                      remat=args.remat, logp_chunk_size=args.chunk)
        if not args.no_torch:
            import torch

            if args.threads:
                torch.set_num_threads(args.threads)
            torch_models["transformers"] = _torch_model(path, cfg, device, args.remat)
            if args.torch_compile:
                torch_models["transformers+compile"] = _torch_model(path, cfg, device,
                                                                    args.remat)

    logp = learner.compute_logp([batch])[0]
    batch["prox_logp"] = logp
    rng = np.random.default_rng(1)
    batch["behav_logp"] = (logp + 0.05 * rng.standard_normal(logp.shape)).astype(np.float32) \
        * batch["loss_mask"]

    t0 = time.perf_counter()
    first = learner.train_step([batch])
    compile_s = time.perf_counter() - t0
    systems: dict[str, Any] = {"ours": lambda: learner.train_step([batch])}
    first_call_s = {"ours": compile_s}
    loss_diff = None
    for name, model in torch_models.items():
        step, _ = _torch_step_fn(model, batch, algo.eps_clip, learner.temperature, optim.lr,
                                 optim.max_grad_norm, device=device,
                                 autocast_bf16=args.dtype == "bfloat16",
                                 compile_model=name.endswith("+compile"))
        t0 = time.perf_counter()
        loss = step()  # the first call (torch.compile compiles here)
        first_call_s[name] = time.perf_counter() - t0
        if name == "transformers" and path is not None:
            # Same weights and batch before any update: the losses agree.
            loss_diff = abs(loss - first["loss"])
        systems[name] = step

    times = interleaved_times(systems, args.repeats)

    tokens = args.tokens
    rows, summary = [], {}
    ours_tps = tokens / statistics.median(times["ours"])
    peak = _peak_tflops(args)
    flops = train_flops(cfg, tokens, seq_len)
    for name, ts in times.items():
        tps = tokens / statistics.median(ts)
        tflops = flops / statistics.median(ts) / 1e12
        mfu = tflops / peak if peak else None
        memory = _peak_memory_gib(name)
        rows.append([name, round(tps, 1), round(statistics.median(ts), 4), round(min(ts), 4),
                     round(tflops, 3), "-" if mfu is None else f"{100 * mfu:.1f}%",
                     "-" if memory is None else round(memory, 2),
                     round(first_call_s[name], 2)])
        if memory is not None:
            summary[f"{name}_peak_gib"] = memory
    summary["ours_tokens_per_s"] = ours_tps
    if "transformers" in times:
        summary["ratio"] = ours_tps / (tokens / statistics.median(times["transformers"]))
        summary["first_step_loss_abs_diff"] = loss_diff
        import torch

        summary["torch_threads"] = torch.get_num_threads()
        summary["torch_device"] = device
        summary["torch_version"] = torch.__version__
    if "transformers+compile" in times:
        summary["ratio_vs_compile"] = ours_tps / (
            tokens / statistics.median(times["transformers+compile"]))
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
        "columns": ["system", "tokens/s", "median s", "min s", "TFLOP/s", "MFU", "peak GiB",
                    "first call s"],
        "rows": rows,
        "summary": summary,
    }
