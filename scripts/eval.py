"""Evaluate a policy on a benchmark or a prompt dataset: mean reward and pass@k.

    python scripts/eval.py --model Qwen/Qwen2.5-1.5B-Instruct --benchmark gsm8k -n 8 --pass-at 1,4,8
    python scripts/eval.py --ckpt runs/qwen2.5-1.5b_gsm8k/checkpoints --benchmark math500
    python scripts/eval.py --model runs/tiny_demo/weights/v60 --data builtin:eval -n 4
    python scripts/eval.py --ckpt runs/tiny_demo/checkpoints [--step 60] --data builtin:eval
    # with an already-running server:
    python scripts/eval.py --model DIR --server http://127.0.0.1:30000 ...

``--benchmark gsm8k`` (GSM8K test) and ``--benchmark math500`` (MATH-500) name the hub
dataset, its columns, the reward (``math``) and the prompt (the problem, then "Please reason
step by step, and put your final answer within \\boxed{}.", through the model's chat
template); see ``BENCHMARKS`` in areal_jax/rollout/evaluate.py. With ``--data`` as well,
the benchmark's prompt, columns and reward are used on that file (e.g. a local copy).
``--pass-at 1,4,8`` reports the unbiased pass@k of Chen et al. 2021 for each k (at most
the samples per prompt, ``-n``); the default is pass@1 and pass@n.

``--model`` is an HF directory (e.g. a published ``weights/v{N}``) or a Hugging Face hub id
(``Qwen/Qwen2.5-1.5B-Instruct``, fetched into the hub cache); ``--ckpt`` is an
Orbax checkpoint dir written by the trainer (converted to HF in a temp dir first).
For ``--ckpt`` (and ``--model RUN_DIR/weights/vN``) the tokenizer, the reward and the
prompt/answer keys default to the run's own, from its saved config; only the parameters
are read from the checkpoint, never the optimizer state.
Every path (``--model``, ``--ckpt``, ``--tokenizer``, ``--data``, ``--out``) may be local or
``gs://`` (see docs/cloud.md); ``--data hf://openai/gsm8k?config=main&split=test``
reads a hub dataset through ``datasets``.
Without ``--server`` an embedded engine is started on the weights (``--platform cpu`` by
default; ``--platform auto`` lets JAX pick the accelerator). Prints a table and writes the
result as JSON (``--out``; printed after the table without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line of eval.py (tests/test_docs_commands.py parses the docs with it)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model directory, hub id (org/name) or builtin:NAME")
    src.add_argument("--ckpt", help="Orbax checkpoint directory written by the trainer")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--revision", default=None,
                   help="with a hub id as --model: its branch, tag or commit (default: main)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir (default: the model dir; with --ckpt, the run's tokenizer)")
    p.add_argument("--benchmark", default=None,
                   help="a named benchmark: gsm8k (GSM8K test) or math500 (MATH-500)")
    p.add_argument("--data", default=None,
                   help="JSONL/Parquet path, hf://ORG/NAME?config=C&split=S, or builtin:eval "
                        "(default: the benchmark's dataset)")
    p.add_argument("--prompt-key", default=None,
                   help="default: the run's data.prompt_key, else question")
    p.add_argument("--answer-key", default=None,
                   help="default: the run's data.answer_key, else answer")
    p.add_argument("--reward", default=None,
                   help="builtin | math | code | module:function (default: the run's reward.fn, "
                        "else builtin)")
    p.add_argument("-n", "-k", "--n-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--pass-at", default=None,
                   help="comma-separated k of pass@k, each <= -n (default: 1 and n)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the benchmark's (gsm8k 1024, math500 2048), else 64")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--server", action="append", default=[], help="use running server(s) instead")
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="the embedded engine's weights dtype")
    p.add_argument("--platform", default="cpu",
                   help="JAX_PLATFORMS of the embedded engine (cpu, cuda, tpu); auto: JAX picks")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="the embedded engine's JAX persistent compilation cache (default: "
                        "$AREAL_JAX_COMPILATION_CACHE_DIR, else "
                        "~/.cache/areal_jax/jax_compilation_cache; 'off' turns it off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward-workers", type=int, default=2, help="reward worker processes")
    p.add_argument("--reward-timeout", type=float, default=10.0,
                   help="seconds per reward call; a call past it scores 0 (reward_failures)")
    p.add_argument("--out", default=None, help="JSON output path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from areal_jax import storage
    from areal_jax.data.prompts import read_records
    from areal_jax.rewards import reward_fn_spec
    from areal_jax.rewards.pool import RewardPool, resolve_reward_fn
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.evaluate import check_pass_at, evaluate_prompts, get_benchmark
    from areal_jax.run_inputs import (
        TrainerError,
        resolve_dataset,
        resolve_model_path,
        saved_run_config,
    )
    from areal_jax.sampling_params import SamplingParams
    from areal_jax.tokenizer import load_tokenizer

    try:  # the arguments, before any model is loaded
        _check_numbers(args)
        bench = get_benchmark(args.benchmark) if args.benchmark else None
        if bench is None and args.data is None:
            raise ValueError("name a --benchmark (gsm8k, math500) or a --data set")
        pass_at = _parse_pass_at(args.pass_at, args.n_samples)
        check_pass_at(pass_at, args.n_samples)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.data = args.data or bench.data
    if args.max_new_tokens is None:
        args.max_new_tokens = bench.max_new_tokens if bench else 64

    tmp = tempfile.TemporaryDirectory(prefix="areal-eval-")
    try:
        if args.ckpt:
            from areal_jax.checkpoint import TrainCheckpointer
            from areal_jax.checkpoint.publish import params_to_hf_dir

            storage.check_location(args.ckpt, "--ckpt", must_exist=True)
            ck = TrainCheckpointer(args.ckpt, read_only=True)
            params, _, meta = ck.restore(args.step, params_only=True)
            ck.close()
            run_cfg = saved_run_config(args.ckpt, meta) or {}
            model_dir = Path(tmp.name) / "model"
            tok_src = None
            if args.tokenizer:
                tok_src = resolve_model_path(args.tokenizer, key="--tokenizer")
            elif run_cfg.get("model"):  # the run's own tokenizer
                m = run_cfg["model"]
                tok_src = resolve_model_path(
                    m.get("tokenizer_path") or m["path"], key="the run's model.tokenizer_path",
                    revision=None if m.get("tokenizer_path") else m.get("revision"))
            else:
                raise TrainerError(f"--ckpt {args.ckpt}: no saved run config (checkpoint meta or "
                                   "config.yaml in the run dir) names its tokenizer; "
                                   "pass --tokenizer")
            if meta.model_config is None:
                raise TrainerError(f"--ckpt {args.ckpt}: the checkpoint's meta has no "
                                   "model_config (convert it with scripts/convert.py "
                                   "orbax-to-hf --config-from HF_DIR, then pass --model)")
            params_to_hf_dir(params, meta.model_config, model_dir, tokenizer_dir=tok_src)
        else:
            model_dir = resolve_model_path(args.model, key="--model", revision=args.revision)
            run_cfg = {}
            weights_dir = storage.parent_of(args.model)
            if not args.model.startswith("builtin:") and storage.name_of(weights_dir) == "weights":
                # a run's published weights (RUN_DIR/weights/vN): that run's config.yaml
                run_cfg = saved_run_config(weights_dir, None) or {}
        rollout_cfg = run_cfg.get("rollout") or {}
        if rollout_cfg.get("workflow") == "agent":  # said, not silently done differently
            print(f"note: this run trains an agent (rollout.workflow: agent, rollout.agent "
                  f"{rollout_cfg.get('agent')}); eval.py evaluates single-turn, one reply per "
                  "prompt, without the agent or its tools. The run's own evaluation with its "
                  "agent is eval_accuracy in its metrics.jsonl (eval_single_turn_accuracy is "
                  "this single-turn one)", file=sys.stderr)
        if bench is not None:  # the benchmark's columns and reward, not the run's
            run_cfg = {}
            args.prompt_key = args.prompt_key or bench.prompt_key
            args.answer_key = args.answer_key or bench.answer_key
            args.reward = args.reward or bench.reward
        data_cfg = run_cfg.get("data") or {}
        args.prompt_key = args.prompt_key or data_cfg.get("prompt_key") or "question"
        args.answer_key = args.answer_key or data_cfg.get("answer_key") or "answer"
        args.reward = args.reward or (run_cfg.get("reward") or {}).get("fn") or "builtin"
        tok_dir = resolve_model_path(args.tokenizer, key="--tokenizer") if args.tokenizer \
            else model_dir
        tokenizer = load_tokenizer(tok_dir)
        data_path = resolve_dataset(args.data, Path(tmp.name), "--data")
        rows = read_records(data_path)[: args.max_prompts or None]
        items = []
        for r in rows:
            if args.prompt_key not in r or args.answer_key not in r:
                raise TrainerError(f"{args.data}: rows need keys {args.prompt_key!r} and "
                                   f"{args.answer_key!r}; got {sorted(r)}")
            prompt = (bench.prompt({**r, bench.prompt_key: r[args.prompt_key]}) if bench
                      else r[args.prompt_key])
            items.append({**r, "prompt": prompt, "answer": r[args.answer_key]})
        if not items:
            raise TrainerError(f"{args.data} has no rows")
        reward = reward_fn_spec(args.reward)
        resolve_reward_fn(reward)  # importable here, not a traceback in a reward worker later
        if args.out:
            storage.check_location(args.out, "--out", write=False)
    except (TrainerError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    handles = []
    servers = list(args.server)
    if not servers:
        from areal_jax.engine.launch import launch_server

        handles.append(launch_server(
            model_dir, max_slots=args.max_slots, max_seq_len=args.max_seq_len, dtype=args.dtype,
            jax_platforms=None if args.platform == "auto" else args.platform,
            compilation_cache_dir=(args.compilation_cache_dir
                                   if args.compilation_cache_dir is not None else "default")))
        servers = [handles[0].url]
    try:
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)

        pool = RewardPool(args.reward_workers, args.reward_timeout)

        async def run() -> dict:
            client = RolloutClient(servers)
            try:
                out = await evaluate_prompts(client, items, tokenizer=tokenizer,
                                             reward_fn=reward, reward_pool=pool,
                                             sampling=sampling, n_samples=args.n_samples,
                                             seed=args.seed, pass_at=pass_at)
                if handles:  # the embedded engine's compiles and persistent-cache traffic
                    info = (await client.server_infos())[0]
                    out["engine_compilation_cache"] = info.get("compilation_cache")
                    out["engine_num_compilations"] = info.get("num_compilations")
                return out
            finally:
                await client.aclose()
                pool.close()

        result = asyncio.run(run())
    finally:
        for h in handles:
            h.terminate()
        tmp.cleanup()
    result.update({"model": args.model or args.ckpt, "benchmark": args.benchmark,
                   "data": args.data, "reward": args.reward, "mean_reward": result["accuracy"],
                   "pass_at": {str(k): result[f"pass@{k}"] for k in pass_at},
                   "temperature": args.temperature, "max_new_tokens": args.max_new_tokens})
    print(result_table(result))
    if args.out:
        storage.write_text(args.out, json.dumps(result, indent=2))
    else:
        print(json.dumps(result, indent=2))
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a number outside its range (before anything loads)."""
    from areal_jax.sampling_params import SamplingParams

    for flag, value in (("-n", args.n_samples), ("--max-prompts", args.max_prompts),
                        ("--max-slots", args.max_slots), ("--max-seq-len", args.max_seq_len),
                        ("--reward-workers", args.reward_workers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not args.reward_timeout > 0:
        raise ValueError(f"--reward-timeout must be > 0, got {args.reward_timeout}")
    for flag, field, value in (("--temperature", "temperature", args.temperature),
                               ("--max-new-tokens", "max_new_tokens", args.max_new_tokens)):
        if value is not None:  # the engine's own limits, from the one sampling record
            try:
                SamplingParams(**{field: value})
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None


def _parse_pass_at(spec: str | None, n_samples: int) -> list[int]:
    """``"1,4,8"`` -> [1, 4, 8]; None -> pass@1 and pass@n."""
    if spec is None:
        return sorted({1, n_samples})
    try:
        ks = sorted({int(k) for k in spec.split(",")})
    except ValueError:
        raise ValueError(f"--pass-at {spec!r}: give comma-separated integers, e.g. 1,4,8") \
            from None
    return ks


def result_table(result: dict) -> str:
    """The result as a two-column table: what was evaluated, mean reward, pass@k."""
    name = result["benchmark"] or result["data"]
    rows = [("evaluated", f"{result['model']} on {name}"),
            ("prompts", f"{int(result['n_prompts'])} x {int(result['n_samples'])} samples, "
                        f"temperature {result['temperature']}, "
                        f"at most {result['max_new_tokens']} new tokens"),
            ("mean reward", f"{result['mean_reward']:.4f}"),
            *((f"pass@{k}", f"{v:.4f}") for k, v in result["pass_at"].items()),
            ("mean tokens", f"{result['mean_completion_tokens']:.1f}"),
            ("reward failures", f"{int(result['reward_failures'])}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main())
