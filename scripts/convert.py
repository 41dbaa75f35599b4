"""Convert between HF model directories and areal-jax Orbax training checkpoints.

    python scripts/convert.py hf-to-orbax --hf HF_DIR --out CKPT_DIR [--dtype float32]
    python scripts/convert.py orbax-to-hf --ckpt CKPT_DIR [--step N] --out HF_DIR \\
        [--tokenizer TOKENIZER_DIR] [--dtype bfloat16] [--config-from HF_DIR] \\
        [--base HF_DIR] [--adapter-out PEFT_DIR]

``hf-to-orbax`` writes checkpoint step 0 holding the params only (no optimizer state:
a run started from it creates a fresh one), with ``meta.model_config`` set to the HF
config. ``orbax-to-hf`` rebuilds the model from ``meta.model_config`` (or from the
config.json in ``--config-from`` for checkpoints that lack it) and writes config.json +
safetensors through the same function the trainer uses to publish serving weights.
A LoRA run's checkpoint holds only the adapters: they are attached to the base model
(the run's ``model.path``, or ``--base``) and written merged; ``--adapter-out`` also
writes them alone in PEFT layout.
Both directions run on the host CPU. Every path (HF_DIR, CKPT_DIR, TOKENIZER_DIR, the
``--out`` of either direction) may be local or gs:// (see docs/cloud.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion is host work

from areal_jax import storage
from areal_jax.checkpoint import CheckpointMeta
from areal_jax.checkpoint.orbax_ckpt import TrainCheckpointer
from areal_jax.checkpoint.publish import PublishError, params_to_hf_dir
from model_defs import (
    CausalLM,
    CheckpointError,
    ConfigError,
    ModelConfig,
    add_lora,
    load_hf,
    save_peft_adapter,
)

USER_ERRORS = (CheckpointError, PublishError, ConfigError, FileNotFoundError, FileExistsError,
               NotADirectoryError, storage.StorageError)


def _require_empty_out(out: str) -> None:
    if storage.is_url(out):
        storage.check_location(out, "--out", write=True)
        if storage.listdir(out):
            raise FileExistsError(f"--out {out} is not empty; choose a new directory")
        return
    if os.path.isfile(out):
        raise FileExistsError(f"--out {out} is a file")
    if os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"--out {out} is not empty; choose a new directory")


def hf_to_orbax(hf_dir: str, out: str, dtype: str = "float32",
                revision: str | None = None) -> int:
    """Saves the HF model in ``hf_dir`` (local, ``gs://`` or a hub id at ``revision``) as
    params-only checkpoint step 0 in ``out``."""
    _require_empty_out(out)
    if storage.is_url(hf_dir):
        storage.check_location(hf_dir, "--hf", must_exist=True)
    from areal_jax.hub import HubError, local_model_dir

    try:  # a hub id (org/name): its snapshot in the Hugging Face cache
        local = local_model_dir(hf_dir, revision, key="--hf")
    except HubError as e:
        raise CheckpointError(str(e)) from None
    model, cfg = load_hf(storage.local_copy(local), dtype=dtype)
    from flax import nnx

    meta = CheckpointMeta(step=0, version=0, model_config=cfg.to_hf_dict(dtype),
                          source_hf_dir=storage.normalize(local),
                          # a hub id: the snapshot above, and what it was named by
                          source_hub_id=hf_dir if local != hf_dir else None)
    with TrainCheckpointer(out, async_save=False) as ckpt:
        ckpt.save(0, nnx.state(model, nnx.Param), None, meta)
    return 0


def _lora_model(meta: CheckpointMeta, params: dict, where: str, base: str | None
                ) -> tuple[CausalLM, str] | None:
    """For a LoRA run's checkpoint (adapters only): (the base model with the checkpoint's
    adapters attached, the base's path); None for a full fine-tuning checkpoint."""
    model_section = (meta.run_config or {}).get("model") or {}
    if not model_section.get("lora"):
        return None
    from flax import nnx

    from areal_jax.config import LoraSection
    from areal_jax.run_inputs import TrainerError, resolve_model_path

    revision = None if base else model_section.get("revision")
    base = base or model_section.get("path")
    try:
        base_dir = resolve_model_path(base, key="--base", revision=revision)
    except TrainerError as e:
        raise CheckpointError(f"{where} is a LoRA checkpoint (adapters only): {e}") from None
    model, _ = load_hf(base_dir)
    add_lora(model, LoraSection(**model_section["lora"]).spec(), rngs=nnx.Rngs(0))
    adapters = nnx.state(model, nnx.LoRAParam)
    try:
        nnx.replace_by_pure_dict(adapters, params)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{where}: the adapters do not fit {base}: {e}") from None
    nnx.update(model, adapters)
    return model, base


def orbax_to_hf(ckpt_dir: str, out: str, step: int | None = None,
                tokenizer_dir: str | None = None, dtype: str | None = None,
                config_from: str | None = None, base: str | None = None,
                adapter_out: str | None = None) -> int:
    """Writes checkpoint ``step`` (default: latest) of ``ckpt_dir`` as an HF dir ``out``."""
    _require_empty_out(out)
    if storage.is_url(ckpt_dir):
        storage.check_location(ckpt_dir, "--ckpt", must_exist=True)
    if tokenizer_dir is not None:
        tokenizer_dir = str(storage.local_copy(tokenizer_dir))
    if config_from is not None:
        config_from = str(storage.local_copy(config_from))
    with TrainCheckpointer(ckpt_dir, read_only=True) as ckpt:
        meta = ckpt.restore_meta(step)
        where = f"{ckpt.directory}/{ckpt.latest_step() if step is None else step}"
        if config_from is not None:
            model_cfg = ModelConfig.from_pretrained_dir(config_from)
        elif meta.model_config:
            model_cfg = ModelConfig.from_hf_dict(meta.model_config,
                                                 source=f"{where} meta.model_config")
        else:
            raise CheckpointError(f"{where}: meta has no model_config; pass --config-from "
                                  f"with an HF dir whose config.json describes this model")
        params, _, _ = ckpt.restore(step, params_only=True)  # never the optimizer state
    lora = _lora_model(meta, params, where, base)
    if lora is not None:
        params = lora[0]  # written merged
        if adapter_out is not None:
            save_peft_adapter(lora[0], adapter_out, base_model_name_or_path=lora[1])
    elif adapter_out is not None:
        raise CheckpointError(f"{where}: --adapter-out, but the run did not train LoRA")
    if not storage.is_url(out):
        params_to_hf_dir(params, model_cfg, out, dtype=dtype, tokenizer_dir=tokenizer_dir)
        return 0
    # Written whole into a temporary directory, then uploaded.
    with tempfile.TemporaryDirectory(prefix="areal-convert-") as tmp:
        params_to_hf_dir(params, model_cfg, tmp, dtype=dtype, tokenizer_dir=tokenizer_dir)
        storage.upload(tmp, out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("hf-to-orbax", help="HF dir -> params-only Orbax checkpoint (step 0)")
    p.add_argument("--hf", required=True,
                   help="HF model dir (config.json + safetensors) or hub id (org/name)")
    p.add_argument("--revision", default=None,
                   help="with a hub id as --hf: its branch, tag or commit (default: main)")
    p.add_argument("--out", required=True, help="new checkpoint directory (local or gs://)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p = sub.add_parser("orbax-to-hf", help="Orbax checkpoint -> HF dir")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (local or gs://)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, help="new HF model directory")
    p.add_argument("--tokenizer", default=None, help="copy tokenizer files from this dir")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast the saved tensors (default: as stored)")
    p.add_argument("--config-from", default=None,
                   help="HF dir whose config.json to use when the checkpoint has no model_config")
    p.add_argument("--base", default=None,
                   help="LoRA checkpoints: the base model (default: the run's model.path)")
    p.add_argument("--adapter-out", default=None,
                   help="LoRA checkpoints: also write the adapter alone (PEFT layout) here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "hf-to-orbax":
            rc = hf_to_orbax(args.hf, args.out, args.dtype, args.revision)
        else:
            rc = orbax_to_hf(args.ckpt, args.out, args.step, args.tokenizer, args.dtype,
                             args.config_from, args.base, args.adapter_out)
    except USER_ERRORS as e:
        print(f"convert.py {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
