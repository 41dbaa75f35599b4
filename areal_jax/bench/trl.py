"""trl: areal-jax against Hugging Face TRL's ``GRPOTrainer``, side by side on the demo.

    pip install -e '.[trl]'
    python scripts/bench.py trl [--versions 40] [--repeats 1] [--peer-repo DIR] \
        [--docs docs/trl_vs_areal] [--out docs/trl_vs_areal.json]

Both start from the demo's SFT checkpoint (``areal_jax/data/assets/arith_sft``), train on
the built-in arithmetic prompts with the built-in verifier's reward, and evaluate the same
128 held-out prompts (pass@1 at temperature 1, 48 new tokens) every ``--eval-every``
steps. Each run is its own process, started from this script; runs are interleaved
(areal-jax, [peer,] TRL, then again for ``--repeats``). Measured from process start:

- **training tokens/s**: prompt + completion tokens trained on, divided by the wall time
  to the end of the last step minus the time spent in evals (compilation and model
  loading included);
- **time to accuracy**: wall time until an eval first reaches ``--target`` (0.8);
- **eval time**: seconds each run spent in its evals (areal-jax: each metrics row's
  ``eval_s``, the trainer's whole ``evaluate`` call; TRL: the callback's batched
  ``generate`` and scoring), and per eval;
- the accuracy curve against wall time, drawn into ``<docs>.png``; the table goes to
  ``<docs>.md`` with the command that made it.

``--peer-repo DIR`` adds a third system: another checkout of areal-jax (e.g. the commit
before a change), timed the same way.

How each knob of ``configs/tiny_demo.yaml`` maps onto ``GRPOConfig``:

| areal-jax (tiny_demo.yaml) | value | TRL GRPOConfig |
|---|---|---|
| model.path builtin:arith_sft | HF dir | ``AutoModelForCausalLM.from_pretrained`` (fp32) |
| data.train / data.eval | builtin | the same problems (``builtin_task.make_split``) |
| reward.fn builtin | A:<int> matches | the same function (``builtin_reward``) |
| train.batch_size x rollout.n_samples | 16 x 8 | per_device_train_batch_size=128, |
| | | num_generations=8 |
| rollout.max_new_tokens | 48 | max_completion_length=48 |
| rollout.temperature / top_p / top_k | 1.0 / 1.0 / off | temperature=1.0, top_p=1.0, top_k=0 |
| algo.name grpo (std-normalised group advantages) | | scale_rewards="group" |
| algo.agg_mode token-mean (global token mean) | | loss_type="dapo" |
| algo.eps_clip | 0.2 | epsilon=0.2 |
| algo.ppo_n_minibatches | 1 | num_iterations=1, steps_per_generation=1 |
| algo.kl_coef | 0 | beta=0.0 |
| algo.behav_imp_weight_cap | 5.0 | none (TRL is on-policy: the weight is 1) |
| rollout.max_staleness (async) | 2 | none (TRL is synchronous) |
| optim.lr / warmup_steps | 1e-4 / 2 | learning_rate=1e-4, warmup_steps=2, |
| | | lr_scheduler_type="constant_with_warmup" |
| optim.max_grad_norm, AdamW b1 b2 eps, weight_decay | 1.0, 0.9 0.999 1e-8, 0 | the same |
| | | (HF defaults) |
| train.total_versions | --versions | max_steps |
| seed | 0 | seed=0 |
| CPU: server core 0, learner core 1 | 2 cores | torch on the same 2 cores (its default threads) |
| model.remat false | | gradient_checkpointing=False (TRL's default is True) |
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from areal_jax.bench.common import REPO, format_summary, format_table, run_train, script_env

MISSING = ("the trl benchmark needs TRL: pip install -e '.[trl]' "
           "(or: pip install 'trl>=0.20' datasets)")


def add_arguments(p) -> None:
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_demo.yaml"))
    p.add_argument("--versions", type=int, default=40, help="training steps of each system")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--target", type=float, default=0.8, help="accuracy for time-to-accuracy")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--peer-repo", default=None, help="another areal-jax checkout, timed alike")
    p.add_argument("--docs", default=None,
                   help="write <docs>.md and <docs>.png (e.g. docs/trl_vs_areal)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t-launch", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--trl-task", default="arith", choices=sorted(TRL_TASKS),
                   help=argparse.SUPPRESS)


# The task a TRL worker trains: the model, the built-in splits, eval prompts and the
# completion length, as the areal-jax config of that task has them (tiny_demo.yaml,
# longtail_demo.yaml).
TRL_TASKS = {
    "arith": {"model": "builtin:arith_sft", "train": "train", "eval": "eval",
              "eval_prompts": 128, "max_new_tokens": 48},
    "longtail": {"model": "builtin:longtail_sft", "train": "longtail_train",
                 "eval": "longtail_eval", "eval_prompts": 64, "max_new_tokens": 352},
}


# ----------------------------------------------------------------------------- TRL worker
def trl_worker(out_path: Path, versions: int, eval_every: int, t_launch: float,
               task: str = "arith") -> None:
    """Runs TRL GRPOTrainer in this process; writes evals and tokens/s to ``out_path``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_jax.data.builtin_task import make_split
    from areal_jax.rewards.builtin import builtin_reward
    from areal_jax.run import resolve_model_path

    spec = TRL_TASKS[task]
    asset = resolve_model_path(spec["model"])  # the config's model.path
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(asset)
    model = AutoModelForCausalLM.from_pretrained(asset, dtype=torch.float32)
    train = Dataset.from_list([{"prompt": r["question"], "answer": r["answer"]}
                               for r in make_split(spec["train"])])
    evals = make_split(spec["eval"])[:spec["eval_prompts"]]
    max_new = spec["max_new_tokens"]

    def reward(completions, answer, **_):
        return [builtin_reward(c, a) for c, a in zip(completions, answer, strict=True)]

    record: dict = {"evals": [], "eval_s": 0.0}

    class Evaluate(TrainerCallback):
        def run(self, step: int, model) -> None:
            t0 = time.time()
            enc = tokenizer([r["question"] for r in evals], return_tensors="pt", padding=True,
                            padding_side="left", add_special_tokens=False)
            was_training = model.training
            model.eval()
            with torch.no_grad():
                out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, use_cache=True)
            model.train(was_training)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                           skip_special_tokens=True)
            acc = float(np.mean([builtin_reward(t, r["answer"])
                                 for t, r in zip(texts, evals, strict=True)]))
            record["eval_s"] += time.time() - t0
            record["evals"].append({"step": step, "accuracy": acc,
                                    "time_s": time.time() - t_launch})

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.run(0, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            record["last_step_s"] = time.time() - t_launch
            if state.global_step % eval_every == 0:
                self.run(state.global_step, model)

    cfg = GRPOConfig(
        output_dir=str(out_path.parent / "trl_out"), max_steps=versions, seed=0,
        per_device_train_batch_size=128, num_generations=8, steps_per_generation=1,
        num_iterations=1, max_completion_length=max_new, temperature=1.0, top_p=1.0, top_k=0,
        scale_rewards="group", loss_type="dapo", epsilon=0.2, beta=0.0,
        learning_rate=1e-4, warmup_steps=2, lr_scheduler_type="constant_with_warmup",
        max_grad_norm=1.0, weight_decay=0.0, use_cpu=True, bf16=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_dropout=True,
        gradient_checkpointing=False)  # TRL turns it on by default; the demo model is tiny
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward],
                          args=cfg, train_dataset=train, callbacks=[Evaluate()])
    timed = {"generation_s": 0.0, "step_s": 0.0}

    def timing(name, fn):  # seconds in generation (+ scoring) and in whole training steps
        def wrapped(*a, **kw):
            t0 = time.time()
            try:
                return fn(*a, **kw)
            finally:
                timed[name] += time.time() - t0
        return wrapped

    trainer._generate_and_score_completions = timing(
        "generation_s", trainer._generate_and_score_completions)
    trainer.training_step = timing("step_s", trainer.training_step)
    trainer.train()
    record["time_shares"] = {"generation_s": timed["generation_s"],
                             "training_s": timed["step_s"] - timed["generation_s"]}
    tokens = max((h.get("num_tokens", 0) for h in trainer.state.log_history), default=0)
    record["tokens"] = float(tokens)
    out_path.write_text(json.dumps(record))


# ----------------------------------------------------------------------------- runs
def run_trl(work: Path, versions: int, eval_every: int, task: str = "arith") -> dict:
    out = work / "trl.json"
    t_launch = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_jax.bench", "trl",
                          "--trl-worker", str(out), "--versions", str(versions),
                          "--eval-every", str(eval_every), "--t-launch", str(t_launch),
                          "--trl-task", task],
                         capture_output=True, text=True, cwd=REPO,
                         env=script_env(REPO, TOKENIZERS_PARALLELISM="false"))
    if res.returncode != 0:
        raise RuntimeError(f"TRL run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    rec = json.loads(out.read_text())
    rec["total_s"] = time.time() - t_launch
    # eval_s counts an eval after the last step, so the training time ends after it too
    rec["last_step_s"] = max(rec["last_step_s"], rec["evals"][-1]["time_s"])
    return _summarise(rec["evals"], rec["tokens"], rec["last_step_s"], rec["eval_s"],
                      rec["total_s"]) | {"time_shares": rec.get("time_shares", {})}


def run_areal(repo: Path, config: str, work: Path, versions: int, eval_every: int) -> dict:
    args = [f"train.total_versions={versions}", f"eval.every_versions={eval_every}",
            "progress_bar=false", "checkpoint.every_versions=0"]
    done = run_train(config, args, work / "run", repo=repo, JAX_PLATFORMS="cpu")
    rows, t_launch = done.rows, done.t_launch
    evals = [{"step": r["version"], "accuracy": r["eval_accuracy"], "time_s": r["time"] - t_launch}
             for r in rows if "eval_accuracy" in r]
    trained = [r for r in rows if "tokens_consumed" in r]
    return _summarise(evals, float(trained[-1]["tokens_consumed"]), trained[-1]["time"] - t_launch,
                      areal_eval_seconds(rows), done.total_s)


def areal_eval_seconds(rows: list[dict]) -> float:
    """Seconds a run spent in evals: each row's ``eval_s``; for a trainer that does not log
    it, a version's row time minus the previous row's minus its ``step_time_s`` (the start
    eval then counts as the median of the others)."""
    if all("eval_s" in r for r in rows if "eval_accuracy" in r):
        return float(sum(r.get("eval_s", 0.0) for r in rows))
    spans = [r["time"] - prev["time"] - r["step_time_s"]
             for prev, r in zip(rows, rows[1:], strict=False)
             if "eval_accuracy" in r and "step_time_s" in r]
    n_start = sum(1 for r in rows if "eval_accuracy" in r and r.get("version") == 0)
    return float(sum(spans) + n_start * (np.median(spans) if spans else 0.0))


def _summarise(evals: list[dict], tokens: float, train_end_s: float, eval_s: float,
               total_s: float) -> dict:
    return {"evals": evals, "tokens": tokens, "train_end_s": train_end_s, "eval_s": eval_s,
            "total_s": total_s, "tokens_per_s": tokens / max(train_end_s - eval_s, 1e-9)}


def time_to(evals: list[dict], target: float) -> float | None:
    return next((e["time_s"] for e in evals if e["accuracy"] >= target), None)


def _check_trl() -> None:
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{MISSING} ({e})") from None


def run(args) -> dict:
    _check_trl()
    if args.trl_worker:  # the child process of run_trl
        trl_worker(Path(args.trl_worker), args.versions, args.eval_every, args.t_launch,
                   args.trl_task)
        raise SystemExit(0)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-trl-"))
    systems = {"areal-jax": REPO}
    if args.peer_repo:
        systems["areal-jax (peer)"] = Path(args.peer_repo).resolve()
    systems["TRL GRPOTrainer"] = None
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for rep in range(args.repeats):
        for k, (name, repo) in enumerate(systems.items()):
            d = work / f"system{k}-run{rep}"  # a fresh run dir each (a reused one would resume)
            d.mkdir(parents=True, exist_ok=True)
            m = (run_trl(d, args.versions, args.eval_every) if repo is None else
                 run_areal(repo, args.config, d, args.versions, args.eval_every))
            runs[name].append(m)
            print(f"{name} #{rep}: tokens/s {m['tokens_per_s']:.0f}, time to {args.target}: "
                  f"{time_to(m['evals'], args.target)}, evals "
                  + " ".join(f"{e['step']}:{e['accuracy']:.3f}@{e['time_s']:.1f}s"
                             for e in m["evals"]),
                  flush=True)
    columns = ["system", "training tokens/s (best)", f"time to acc {args.target} s (best)",
               "whole command s (best)", "eval s per run (each run)", "s per eval (best)",
               "final accuracy (last run)", "runs"]
    rows, summary = [], {}
    for name, ms in runs.items():
        tps = max(m["tokens_per_s"] for m in ms)
        tta = [t for t in (time_to(m["evals"], args.target) for m in ms) if t is not None]
        best_tta = min(tta) if tta else float("nan")
        per_eval = min(m["eval_s"] / len(m["evals"]) for m in ms)
        rows.append([name, tps, best_tta, min(m["total_s"] for m in ms),
                     " ".join(f"{m['eval_s']:.2f}" for m in ms), per_eval,
                     ms[-1]["evals"][-1]["accuracy"], len(ms)])
        summary[f"{name} tokens/s"] = tps
        summary[f"{name} time to {args.target} s"] = best_tta
        summary[f"{name} eval s per run"] = [round(m["eval_s"], 3) for m in ms]
        summary[f"{name} s per eval"] = per_eval
    trl = runs["TRL GRPOTrainer"]
    summary["tokens/s ratio areal-jax / TRL"] = (summary["areal-jax tokens/s"]
                                                 / summary["TRL GRPOTrainer tokens/s"])
    summary["s per eval ratio areal-jax / TRL"] = (summary["areal-jax s per eval"]
                                                  / summary["TRL GRPOTrainer s per eval"])
    summary[f"time-to-{args.target} ratio areal-jax / TRL"] = (
        summary[f"areal-jax time to {args.target} s"]
        / summary[f"TRL GRPOTrainer time to {args.target} s"])
    result = {"title": f"areal-jax vs TRL GRPOTrainer on the demo ({args.versions} steps)",
              "columns": columns, "rows": rows, "summary": summary, "runs": runs,
              "trl_runs": len(trl)}
    if args.docs:
        write_docs(Path(args.docs), result, args)
    return result


def plot_accuracy_curves(runs: dict[str, list[dict]], target: float, path: Path,
                         colors: dict[str, str], ylabel: str, title: str) -> None:
    """A PNG of eval accuracy against wall time: one line per run, the first run of each
    system opaque and labelled, the target accuracy dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ms in runs.items():
        for i, m in enumerate(ms):
            ax.plot([e["time_s"] for e in m["evals"]], [e["accuracy"] for e in m["evals"]],
                    marker="o", color=colors.get(name), alpha=1.0 if i == 0 else 0.5,
                    label=name if i == 0 else None)
    ax.axhline(target, color="k", lw=0.8, ls="--")
    ax.set_xlabel("wall time since process start (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(stem: Path, result: dict, args) -> None:
    """``<stem>.png``: accuracy against wall time for every run; ``<stem>.md``: the table."""
    plot_accuracy_curves(result["runs"], args.target, stem.with_suffix(".png"),
                         {"areal-jax": "tab:blue", "areal-jax (peer)": "tab:gray",
                          "TRL GRPOTrainer": "tab:orange"},
                         "eval accuracy (pass@1, T=1, 128 prompts)",
                         "areal-jax vs TRL GRPOTrainer, tiny demo")
    cmd = "python scripts/bench.py " + " ".join(sys.argv[1:])
    lines = [f"# {result['title']}", "", f"Made by `{cmd}`.", "", "```",
             format_table(result["columns"], result["rows"]), "```", ""]
    lines += format_summary(result["summary"], prefix="- ")
    lines += ["", "Accuracy at each eval (step: accuracy @ seconds since process start):", ""]
    for name, ms in result["runs"].items():
        for i, m in enumerate(ms):
            lines.append(f"- {name} run {i}: " + ", ".join(
                f"{e['step']}: {e['accuracy']:.3f} @ {e['time_s']:.1f}s" for e in m["evals"]))
    lines += ["", f"![accuracy vs wall time]({stem.with_suffix('.png').name})", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
