"""Evaluate a policy on a prompt dataset: pass@1 averaged over k samples.

    python scripts/eval.py --model runs/tiny_demo/weights/v40 --data builtin:eval -k 4
    python scripts/eval.py --ckpt runs/tiny_demo/checkpoints [--step 40] --data builtin:eval
    # with an already-running server:
    python scripts/eval.py --model DIR --server http://127.0.0.1:30000 ...

``--model`` is an HF directory (e.g. a published ``weights/v{N}``) or a Hugging Face hub id
(``Qwen/Qwen2.5-1.5B-Instruct``, fetched into the hub cache); ``--ckpt`` is an
Orbax checkpoint dir written by the trainer (converted to HF in a temp dir first).
For ``--ckpt`` (and ``--model RUN_DIR/weights/vN``) the tokenizer, the reward and the
prompt/answer keys default to the run's own, from its saved config; only the parameters
are read from the checkpoint, never the optimizer state.
Every path (``--model``, ``--ckpt``, ``--tokenizer``, ``--data``, ``--out``) may be local or
``gs://`` (see docs/cloud.md); ``--data hf://openai/gsm8k?config=main&split=test``
reads a hub dataset through ``datasets``.
Without ``--server`` an embedded engine is started on the weights. Prints the result
and writes it as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--data", required=True,
                   help="JSONL/Parquet path, hf://ORG/NAME?config=C&split=S, or builtin:eval")
    p.add_argument("--prompt-key", default=None,
                   help="default: the run's data.prompt_key, else question")
    p.add_argument("--answer-key", default=None,
                   help="default: the run's data.answer_key, else answer")
    p.add_argument("--reward", default=None,
                   help="builtin | math | code | module:function (default: the run's reward.fn, "
                        "else builtin)")
    p.add_argument("-k", "--n-samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--server", action="append", default=[], help="use running server(s) instead")
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward-workers", type=int, default=2, help="reward worker processes")
    p.add_argument("--reward-timeout", type=float, default=10.0,
                   help="seconds per reward call; a call past it scores 0 (reward_failures)")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args(argv)
    if args.n_samples < 1:
        p.error("-k must be >= 1")
    if args.reward_workers < 1 or not args.reward_timeout > 0:
        p.error("--reward-workers must be >= 1 and --reward-timeout > 0")

    from areal_jax import storage
    from areal_jax.data.prompts import read_records
    from areal_jax.data.tokenizer import load_tokenizer
    from areal_jax.rewards import reward_fn_spec
    from areal_jax.rewards.pool import RewardPool
    from areal_jax.rollout.client import RolloutClient
    from areal_jax.rollout.evaluate import evaluate_prompts
    from areal_jax.run_inputs import (
        TrainerError,
        resolve_dataset,
        resolve_model_path,
        saved_run_config,
    )
    from areal_jax.sampling_params import SamplingParams

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
            params_to_hf_dir(params, meta["model_config"], model_dir, tokenizer_dir=tok_src)
        else:
            model_dir = resolve_model_path(args.model, key="--model", revision=args.revision)
            run_cfg = {}
            weights_dir = storage.parent_of(args.model)
            if not args.model.startswith("builtin:") and storage.name_of(weights_dir) == "weights":
                # a run's published weights (RUN_DIR/weights/vN): that run's config.yaml
                run_cfg = saved_run_config(weights_dir, {}) or {}
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
            items.append({**r, "prompt": r[args.prompt_key], "answer": r[args.answer_key]})
        reward = reward_fn_spec(args.reward)
        if args.out:
            storage.check_location(args.out, "--out", write=False)
    except (TrainerError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    handles = []
    servers = list(args.server)
    if not servers:
        from areal_jax.engine.launch import launch_server

        handles.append(launch_server(model_dir, max_slots=args.max_slots,
                                     max_seq_len=args.max_seq_len))
        servers = [handles[0].url]
    try:
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)

        pool = RewardPool(args.reward_workers, args.reward_timeout)

        async def run() -> dict:
            client = RolloutClient(servers)
            try:
                return await evaluate_prompts(client, items, tokenizer=tokenizer, reward_fn=reward,
                                              reward_pool=pool, sampling=sampling,
                                              n_samples=args.n_samples, seed=args.seed)
            finally:
                await client.aclose()
                pool.close()

        result = asyncio.run(run())
    finally:
        for h in handles:
            h.terminate()
        tmp.cleanup()
    result.update({"model": args.model or args.ckpt, "data": args.data, "reward": args.reward,
                   "temperature": args.temperature})
    print(json.dumps(result, indent=2))
    if args.out:
        storage.write_text(args.out, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
