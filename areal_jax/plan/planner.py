"""Will a run fit its accelerators, and how fast can it go? Ahead-of-time, on a CPU host.

``plan_run(cfg, target)`` compiles, for compile-only devices of ``target``
(``parallel.targets``), from abstract shapes and no weights:

* the learner's gradient program (one micro-batch of ``train.rows_per_micro_batch`` x
  ``train.seq_len``) and optimizer update: the very ``Program`` objects
  ``Learner._compile`` makes (same functions, static arguments, donation, out_shardings,
  XLA options), on the run's mesh over the target's devices, with ``model.remat`` and
  ``model.dtype`` as ``train.py`` sets them;
* the embedded engine's prefill (``rollout.prefill_rows`` prompts at the largest bucket,
  ``rollout.max_seq_len``) and decode (all ``rollout.max_slots`` slots, ``decode_steps``
  tokens, attending to the whole cache): ``ModelRunner``'s own step functions on one chip.

For each it reads XLA's per-device ``memory_analysis`` and the FLOPs and bytes of its
optimised HLO (``hlo_cost``: XLA's ``cost_analysis`` counts a loop body once, so scanned
layers would be undercounted; its figures are kept as ``xla_cost_*``), and derives
whether it fits, the roofline floor max(FLOPs / peak, bytes / bandwidth) and the best MFU
that floor allows. TPU compilers refuse a program that does not fit (RESOURCE_EXHAUSTED),
reported as ``fits: false``; on GPU the peak is compared with the memory JAX's allocator
takes by default (75% of the card, ``XLA_PYTHON_CLIENT_MEM_FRACTION``).

The learner's gradient program runs while the AdamW moments sit in memory untouched, so
its ``peak_bytes`` adds them to the program's own peak (``program_peak_bytes``).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.plan.hlo_cost import hlo_cost

GPU_MEM_FRACTION = 0.75  # JAX's default share of GPU memory (XLA_PYTHON_CLIENT_MEM_FRACTION)
PROGRAMS = ("learner_grad", "learner_apply", "engine_prefill", "engine_decode")
# Custom-call targets of fused kernels: Mosaic (Pallas TPU), Triton / Mosaic GPU (Pallas
# GPU), cuDNN fused attention.
_KERNEL_TARGETS = {"tpu_custom_call": "mosaic", "__gpu$xla.gpu.triton": "triton",
                   "mosaic_gpu": "mosaic_gpu", "mosaic_gpu_v2": "mosaic_gpu"}
_OOM_REQUIRED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")


class PlanError(ValueError):
    """A config, mesh or model the planner cannot use (the message says which key)."""


# ------------------------------------------------------------------ model shapes
def model_config(cfg: Any, preset: str | None = None) -> tuple[Any, str]:
    """(ModelConfig, where it came from): ``preset`` if given, else ``model.path``'s
    config.json (``builtin:`` assets and local directories), else the preset its name
    matches (``/models/Qwen2.5-1.5B-Instruct`` -> ``qwen2.5-1.5b``): nothing is downloaded."""
    from model_defs import PRESETS, ModelConfig

    if preset:
        if preset not in PRESETS:
            raise PlanError(f"--preset {preset!r} is unknown; choose from {', '.join(PRESETS)}")
        return ModelConfig.preset(preset), f"preset {preset}"
    spec = cfg.model.path
    if spec.startswith("builtin:"):
        from areal_jax.run_inputs import ASSETS_DIR

        path = ASSETS_DIR / spec.split(":", 1)[1]
    else:
        path = Path(os.path.expanduser(spec))
    if (path / "config.json").is_file():
        return ModelConfig.from_pretrained_dir(path), f"{path / 'config.json'}"
    name = Path(spec.rstrip("/")).name.lower()
    matches = [k for k in PRESETS if k in name]
    if not matches:
        raise PlanError(f"model.path {spec!r} has no local config.json and its name matches no "
                        f"preset; pass --preset one of {', '.join(PRESETS)}")
    best = max(matches, key=len)
    return ModelConfig.preset(best), f"preset {best} (matched model.path {spec})"


def _abstract_model(model_cfg: Any, dtype: str, param_dtype: str, remat: Any = False,
                    lora: Any = None, seed: int = 0, attention: str = "auto") -> Any:
    """An abstract CausalLM built as ``load_hf`` builds it (params in ``param_dtype``), with
    the learner's remat policy, attention kernel (``model.attention``), compute dtype and
    LoRA adapters applied the same way."""
    import jax.numpy as jnp
    from flax import nnx

    from areal_jax.learner.trainable import _set_compute_dtype
    from model_defs import CausalLM, add_lora, remat_policy_name

    def build() -> Any:
        model = CausalLM(model_cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(param_dtype),
                         param_dtype=jnp.dtype(param_dtype))
        if lora is not None:
            add_lora(model, lora, rngs=nnx.Rngs(seed))
        return model

    model = nnx.eval_shape(build)
    model.remat = remat_policy_name(remat)
    model.attention_impl = attention
    _set_compute_dtype(model, jnp.dtype(dtype))
    return model


def _on(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (a tree or one sharding)."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    flat_sh = ([shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding)
               else jax.tree.leaves(shardings))
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                        for x, s in zip(leaves, flat_sh, strict=True)])


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its largest shard)."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


# ------------------------------------------------------------------ the learner
def abstract_learner(cfg: Any, model_cfg: Any, mesh: Any) -> Any:
    """A ``Learner`` holding abstract (sharded ShapeDtypeStruct) state instead of arrays,
    with the attributes ``Learner.__init__`` sets for this config, and its programs made by
    ``Learner._compile`` itself. It can lower and compile, never run."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from areal_jax.learner import Learner
    from areal_jax.learner.optimizer import make_optimizer
    from areal_jax.learner.steps import learner_compiler_options
    from areal_jax.parallel.mesh import n_batch_shards, replicated
    from areal_jax.run import learner_configs
    from model_defs import lora_config, param_shardings

    optim, algo, loss_kw = learner_configs(cfg)
    lora = cfg.model.lora.spec() if cfg.model.lora is not None else None
    model = _abstract_model(model_cfg, cfg.model.dtype, "float32", cfg.model.remat, lora,
                            cfg.seed, cfg.model.attention)
    learner = Learner.__new__(Learner)
    learner.mesh, learner.model_cfg, learner.optim, learner.algo = mesh, model_cfg, optim, algo
    learner.n_minibatches = algo.ppo_n_minibatches
    learner.temperature = float(loss_kw["temperature"])
    learner.logp_chunk_size = int(loss_kw["logp_chunk_size"])
    learner.seq_token_sum_normalizer = loss_kw["seq_token_sum_normalizer"]
    learner.compute_dtype = jnp.dtype(model.dtype)
    learner.n_batch_shards = learner.n_fed_shards = n_batch_shards(mesh)
    learner.process_local_batches, learner.trainable = False, True
    options = learner_compiler_options(mesh.devices.flat[0].platform)
    learner._jit_options = {"compiler_options": options} if options else {}
    learner.lora = lora_config(model)
    learner.trainable_filter = nnx.LoRAParam if learner.lora is not None else nnx.Param
    learner._graphdef, params, rest = nnx.split(model, learner.trainable_filter, ...)  # type: ignore[misc]

    def shardings(state: Any) -> Any:
        return jax.tree.unflatten(jax.tree.structure(state),
                                  jax.tree.leaves(param_shardings(state, mesh)))

    learner.param_shardings = shardings(params)
    learner.params = _on(params, learner.param_shardings)
    if learner.lora is not None:  # the frozen base in the compute dtype, as the learner keeps it
        rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, learner.compute_dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, rest)
    learner._rest = _on(rest, shardings(rest))
    learner.tx = make_optimizer(optim)
    abstract_opt = jax.eval_shape(learner.tx.init, learner.params)
    learner.opt_shardings = optax.tree_map_params(
        learner.tx, lambda _, sharding: sharding, abstract_opt, learner.param_shardings,
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    learner.opt_state = _on(abstract_opt, learner.opt_shardings)
    learner._compile()
    return learner


def _learner_batch(learner: Any, rows: int, seq_len: int, keys: list[str]) -> dict[str, Any]:
    import jax

    from areal_jax.learner.packing import OPTIONAL_FIELDS, PACKED_FIELDS
    from areal_jax.parallel.mesh import batch_sharding

    dtypes = {**PACKED_FIELDS, **OPTIONAL_FIELDS}
    sharding = batch_sharding(learner.mesh)
    # As Learner._put places them: integers as int32, the rest as float32.
    return {k: jax.ShapeDtypeStruct(
        (rows, seq_len), np.int32 if np.issubdtype(dtypes[k], np.integer) else np.float32,
        sharding=sharding) for k in keys}


def lower_learner_grad(learner: Any, rows: int, seq_len: int) -> Any:
    """The gradient program ``train_step`` runs per micro-batch, lowered for [rows, seq_len]."""
    import jax

    from areal_jax.learner.steps import zero_sums
    from areal_jax.parallel.mesh import replicated
    from model_defs import use_mesh

    prox_from_logp = learner._skips_prox_recompute()
    batch = _learner_batch(learner, rows, seq_len, learner._train_keys(prox_from_logp))
    rep = replicated(learner.mesh)
    scalar = jax.ShapeDtypeStruct((), np.float32, sharding=rep)
    sums = _on(jax.eval_shape(zero_sums), rep)
    with use_mesh(learner.mesh):
        return learner._grads[prox_from_logp].lower(
            learner.params, learner._rest, learner.params, sums, batch, scalar, scalar, scalar)


def lower_learner_apply(learner: Any) -> Any:
    from model_defs import use_mesh

    with use_mesh(learner.mesh):
        return learner._apply.lower(learner.params, learner.opt_state, learner.params)


# ------------------------------------------------------------------ the engine
def engine_shapes(cfg: Any) -> dict[str, int]:
    """The embedded engine's shapes for this config, as ``run.build_trainer`` launches it."""
    from areal_jax.engine.config import EngineConfig

    ro = cfg.rollout
    slots = ro.max_slots
    prefill_rows = ro.prefill_rows or EngineConfig.prefill_rows
    return {"max_slots": slots, "max_seq_len": ro.max_seq_len,
            "prefill_rows": min(prefill_rows, slots),
            "decode_steps": ro.decode_steps or EngineConfig.decode_steps}


def lower_engine(cfg: Any, model_cfg: Any, device: Any, scan: bool | None = None
                 ) -> tuple[Any, Any, dict[str, int]]:
    """(prefill, decode) of ``ModelRunner`` lowered for one chip: its own step functions and
    jit options, on abstract params, cache and slot state committed to ``device``. ``scan``:
    the layer loop (None: ``rollout.engine_layer_loop``, whose ``auto`` is the engine's
    own choice for the chip)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from areal_jax.engine.forward import init_slot_cache, scan_layers_by_default
    from areal_jax.engine.runner import ModelRunner, prefill_chunks
    from areal_jax.parallel.mesh import make_mesh
    from model_defs import use_mesh

    shapes = engine_shapes(cfg)
    # As run.py launches it: the serving dtype and model.attention.
    dtype_name = cfg.serving_dtype
    model = _abstract_model(model_cfg, dtype_name, dtype_name, attention=cfg.model.attention)
    runner = ModelRunner.__new__(ModelRunner)  # the step functions need only these
    runner.cfg, runner.max_seq_len = model_cfg, shapes["max_seq_len"]
    runner.decode_steps, runner.prefill_rows = shapes["decode_steps"], shapes["prefill_rows"]
    runner.graphdef, state = nnx.split(model)
    on_chip = jax.sharding.SingleDeviceSharding(device)
    state = _on(state, on_chip)
    b, dtype = shapes["max_slots"], jnp.dtype(dtype_name)
    chip_mesh = make_mesh("data=1", [device])
    with use_mesh(chip_mesh):  # the engine's cache layout for the chip's platform
        loop = cfg.rollout.engine_layer_loop
        if scan is None and loop != "auto":
            scan = loop == "scan"
        stacked = scan_layers_by_default() if scan is None else scan
    cache = _on(jax.eval_shape(lambda: init_slot_cache(model_cfg, b, runner.max_seq_len, dtype,
                                                       stacked)), on_chip)
    slots = _on({"token": jax.ShapeDtypeStruct((b,), jnp.int32),
                 "position": jax.ShapeDtypeStruct((b,), jnp.int32),
                 "temperature": jax.ShapeDtypeStruct((b,), jnp.float32),
                 "top_p": jax.ShapeDtypeStruct((b,), jnp.float32),
                 "top_k": jax.ShapeDtypeStruct((b,), jnp.int32),
                 "seed": jax.ShapeDtypeStruct((b,), jnp.uint32)}, on_chip)
    # The longest prefill chunk the engine compiles (it prefills a longer prompt chunk by
    # chunk), and the decode whose window is the whole cache (its largest, at the longest
    # context: the loop beyond a window is a while loop, which XLA's cost analysis counts
    # once).
    p, t = shapes["prefill_rows"], prefill_chunks(shapes["max_seq_len"])[-1]

    def arg(shape: tuple, dt: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, dt, sharding=on_chip)

    flag = arg((), jnp.bool_)
    # ModelRunner.__init__'s jits: cache and slot state donated, kv_len traced. Lowered under
    # a one-chip mesh of the target: the attention kernel (model.attention: auto) is chosen
    # for the active mesh's platform, else for jax's default backend, which here is the host
    # CPU (plain XLA), not the chip the engine runs on (splash on TPU).
    with use_mesh(chip_mesh):
        # The params as the step programs take them: (state, per-layer views); the target
        # chip slices the stack itself (the views are a CPU engine's, ModelRunner.params).
        prefill = jax.jit(runner._prefill_impl, donate_argnums=(1, 2)).lower(
            (state, None), cache, slots, arg((p, t), jnp.int32), arg((p,), jnp.int32),
            arg((p,), jnp.int32), arg((p,), jnp.float32), arg((p,), jnp.float32),
            arg((p,), jnp.int32), arg((p,), jnp.uint32), arg((p,), jnp.int32),
            arg((), jnp.int32), flag, flag)
        decode = jax.jit(runner._decode_impl, donate_argnums=(1, 2), static_argnums=(7,)).lower(
            (state, None), cache, slots, arg((), jnp.int32), arg((), jnp.int32), flag, flag,
            shapes["max_seq_len"])
    shapes["param_bytes"] = device_bytes(state)
    shapes["kv_cache_bytes"] = device_bytes(cache)
    return prefill, decode, shapes


# ------------------------------------------------------------------ compiled facts
def attention_kernel(hlo_text: str) -> str:
    """The fused kernels a compiled program calls (Mosaic/Triton/cuDNN custom calls, by
    name, comma-separated), or "xla" when attention is left to XLA."""
    names = []
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*custom_call_target=\"([^\"]+)\"[^\n]*",
                         hlo_text):
        instr, target = m.group(1), m.group(2)
        family = _KERNEL_TARGETS.get(target) or ("cudnn" if target.startswith("__cudnn$")
                                                  else None)
        if family is None:
            continue
        # A Pallas kernel's name is the scope its pallas_call ran in: op_name=".../NAME/
        # pallas_call" (NAME or jit(NAME)).
        scope = re.search(r'op_name="[^"]*?([\w.\-()]+)/pallas_call"', m.group(0))
        kernel = (target if family == "cudnn" else
                  re.sub(r"^jit\((.*)\)$", r"\1", scope.group(1)) if scope
                  else re.sub(r"\.\d+$", "", instr))
        label = f"{family}:{kernel}"
        if label not in names:
            names.append(label)
    return ",".join(names) or "xla"


def _cost(compiled: Any, platform: str) -> dict[str, float]:
    """Per-device FLOPs and bytes accessed. XLA:GPU compiled for a topology has no
    cost_analysis; its optimised HLO module is then analysed by the CPU client's
    HloCostAnalysis, which counts the same dots and fusion operands."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if not cost and platform == "gpu":
        import jax.extend.backend
        from jaxlib import _jax  # no public wrapper of XLA's HloCostAnalysis (jax 0.10)

        module = compiled.runtime_executable().hlo_modules()[0]
        cost = _jax.hlo_module_cost_analysis(jax.extend.backend.get_backend("cpu"), module)
    cost = cost or {}
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def _oom_bytes(message: str) -> int | None:
    m = _OOM_REQUIRED.search(message)
    if m is None:
        return None
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def measure(lowered: Any, platform: str, chip: Any, usable_bytes: int,
            resident_bytes: int = 0) -> dict[str, Any]:
    """Compiles ``lowered`` and reports its memory, cost and roofline floor per device.
    ``resident_bytes``: state in memory during the program that is not its argument."""
    t0 = time.perf_counter()
    note = None
    try:
        try:
            compiled = lowered.compile()
        except Exception as e:
            if "cudaErrorInvalidDevice" not in str(e):
                raise
            # XLA:GPU sizes a CUB radix sort's scratch space by asking the CUDA runtime,
            # which a GPU-less host cannot answer (the engine's top-p/top-k sort over the
            # vocabulary); XLA's own sort kernel needs no device.
            note = "sorts compiled with xla_gpu_enable_cub_radix_sort=false (no GPU here)"
            compiled = lowered.compile({"xla_gpu_enable_cub_radix_sort": False})
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED: the TPU compiler's "does not fit"
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        required = _oom_bytes(str(e))
        return {"fits": False, "compile_s": round(time.perf_counter() - t0, 1),
                "peak_bytes": None if required is None else required + resident_bytes,
                "error": str(e).splitlines()[0][:300]}
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    program_peak = int(getattr(mem, "peak_memory_in_bytes", 0) or (
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes))
    peak = program_peak + resident_bytes
    text = compiled.as_text()
    cost = hlo_cost(text)  # loops counted per iteration; XLA's own figures alongside
    cost.update({f"xla_cost_{k}": v for k, v in _cost(compiled, platform).items()})
    compute_s = cost["flops"] / chip.peak_bf16_flops
    memory_s = cost["bytes_accessed"] / chip.hbm_bytes_per_s
    floor = max(compute_s, memory_s)
    return {
        "fits": peak <= usable_bytes, "compile_s": round(compile_s, 1),
        "peak_bytes": peak, "program_peak_bytes": program_peak,
        "argument_bytes": int(mem.argument_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes), "resident_bytes": resident_bytes,
        **cost, "step_time_floor_s": floor,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "best_mfu": compute_s / floor if floor > 0 else 0.0,
        "attention_kernel": attention_kernel(text),
        **({"note": note} if note else {}),
    }


# ------------------------------------------------------------------ the plan
def plan_run(cfg: Any, target: str, *, mesh_spec: str | None = None, preset: str | None = None,
             search_rows: int = 2, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The plan for run config ``cfg`` on ``target`` (see the module doc). ``search_rows``:
    how many times to double (or halve) the micro-batch's rows looking for the largest one
    that fits (0: only the config's)."""
    from areal_jax.parallel.mesh import MeshSpecError, make_mesh, n_batch_shards
    from areal_jax.parallel.placement import PlacementError, plan_placement, target_host
    from areal_jax.parallel.targets import compile_only_devices, target_chip, target_platform

    chip, platform = target_chip(target), target_platform(target)
    usable = int(chip.hbm_bytes * (GPU_MEM_FRACTION if platform == "gpu" else 1.0))
    model_cfg, source = model_config(cfg, preset)
    log(f"plan: {target} ({chip.name}), model from {source}")
    host = target_host(target, chip.hbm_bytes)
    try:  # as train.py would place the run's processes on the target's host
        placement = plan_placement(cfg, host, learner_platform=host.platform)
    except PlacementError as e:
        raise PlanError(f"placement on {target}: {e}") from None
    log(placement.describe())
    devices = compile_only_devices(target)
    learner_devices = [devices[i] for i in placement.learner.devices]
    spec = mesh_spec or cfg.mesh
    try:
        mesh = make_mesh(spec, learner_devices)
    except MeshSpecError as e:
        raise PlanError(f"--mesh/mesh {spec!r} on the learner's {len(learner_devices)} of "
                        f"{target}'s devices: {e}") from None
    rows, seq_len = cfg.train.rows_per_micro_batch, cfg.train.seq_len
    shards = n_batch_shards(mesh)
    if rows % shards:
        raise PlanError(f"train.rows_per_micro_batch={rows} is not a multiple of the mesh's "
                        f"data x fsdp = {shards} ({spec} on {target}); use a multiple of {shards}")
    result: dict[str, Any] = {
        "target": target, "chip": chip.name, "devices": len(devices), "platform": platform,
        "learner_devices": list(placement.learner.devices),
        "mesh": {a: int(mesh.shape[a]) for a in mesh.axis_names}, "model": source,
        "hbm_bytes": chip.hbm_bytes, "usable_bytes": usable,
        "peak_bf16_flops": chip.peak_bf16_flops, "hbm_bytes_per_s": chip.hbm_bytes_per_s,
        "dtype": cfg.model.dtype, "remat": cfg.model.remat,
    }
    _check_kernel_libraries(cfg, target, platform)
    learner = abstract_learner(cfg, model_cfg, mesh)
    param_bytes, opt_bytes = device_bytes(learner.params), device_bytes(learner.opt_state)

    def grad_at(r: int) -> dict[str, Any]:
        log(f"  compiling learner_grad [{r} x {seq_len}] for {target} ...")
        out = measure(lower_learner_grad(learner, r, seq_len), platform, chip, usable, opt_bytes)
        log(f"    {_brief(out)}")
        return out

    grad = grad_at(rows)
    grad.update(rows=rows, seq_len=seq_len, param_bytes=param_bytes, optimizer_bytes=opt_bytes,
                tokens_per_s_ceiling=_rate(rows * seq_len, grad))
    tried = {rows: grad["fits"]}
    r = rows
    for _ in range(search_rows):  # double while it fits, or halve until it does
        r = r * 2 if grad["fits"] else r // 2
        if r < shards or r % shards:
            break
        tried[r] = grad_at(r)["fits"]
        if tried[r] != grad["fits"]:
            break
    fitting = [k for k, ok in tried.items() if ok]
    grad["largest_fitting_rows"] = max(fitting) if fitting else None
    grad["rows_tried"] = {str(k): ok for k, ok in sorted(tried.items())}
    result["learner_grad"] = grad

    log(f"  compiling learner_apply for {target} ...")
    apply = measure(lower_learner_apply(learner), platform, chip, usable)
    apply.update(param_bytes=param_bytes, optimizer_bytes=opt_bytes)
    log(f"    {_brief(apply)}")
    result["learner_apply"] = apply

    # The engine on the chip its placement gives it; a rollout that is not on this target's
    # chips (engines on the CPU, SGLang, external servers): on one chip, as an estimate.
    engine_chip = placement.engines[0].devices[0] if placement.engines else 0
    prefill, decode, shapes = lower_engine(cfg, model_cfg, devices[engine_chip])
    result["engine"] = shapes
    for name, lowered, tokens in (
            ("engine_prefill", prefill, shapes["prefill_rows"] * shapes["max_seq_len"]),
            ("engine_decode", decode, shapes["max_slots"] * shapes["decode_steps"])):
        log(f"  compiling {name} for one {chip.name} ...")
        out = measure(lowered, platform, chip, usable)
        out.update(param_bytes=shapes["param_bytes"], kv_cache_bytes=shapes["kv_cache_bytes"],
                   tokens_per_s_ceiling=_rate(tokens, out))
        log(f"    {_brief(out)}")
        result[name] = out
    result["device_memory"] = device_memory(result, placement, platform, chip.hbm_bytes)
    result["fits"] = all(d["fits"] for d in result["device_memory"])
    return result


def device_memory(result: dict[str, Any], placement: Any, platform: str,
                  hbm_bytes: int) -> list[dict[str, Any]]:
    """Every device some process of the run holds, with each process's need against its
    share of the device: the learner's and an engine's compiled peaks, against their
    memory fraction (JAX's 75% by default on a GPU; the whole chip on a TPU); an SGLang
    server takes its ``--mem-fraction-static`` and must hold its share of the serving
    weights within it. A device fits when every process fits its share and, on a shared
    card, the shares sum to at most the placement's limit."""
    from areal_jax.parallel.placement import JAX_DEFAULT_GPU_FRACTION, SHARED_CARD_LIMIT

    def peak(*names: str) -> int | None:
        peaks = [result[n].get("peak_bytes") for n in names]
        return None if any(p is None for p in peaks) else max(peaks)

    learner_peak = peak("learner_grad", "learner_apply")
    engine_peak = peak("engine_prefill", "engine_decode")
    serving_bytes = result["engine"]["param_bytes"]
    rows = []
    for device, procs in placement.by_device().items():
        entries, total = [], 0.0
        for p in procs:
            default = JAX_DEFAULT_GPU_FRACTION if platform == "gpu" else 1.0
            share = p.mem_fraction if p.mem_fraction is not None else default
            limit = int(share * hbm_bytes)
            if p.role == "sglang":
                need: int | None = limit  # SGLang takes its whole share (weights + KV pool)
                ok = serving_bytes // max(len(p.devices), 1) < limit
            else:
                need = learner_peak if p.role == "learner" else engine_peak
                ok = need is not None and need <= limit
            total += share
            entries.append({"process": p.name, "need_bytes": need, "limit_bytes": limit,
                            "fraction": share, "fits": ok})
        shared_ok = len(procs) < 2 or total <= SHARED_CARD_LIMIT + 1e-9
        rows.append({"device": device, "processes": entries, "fraction_sum": round(total, 4),
                     "fits": shared_ok and all(e["fits"] for e in entries)})
    return rows


def attention_flops(model_cfg: Any, segment_lengths: Any, *, training: bool = True) -> float:
    """Self-attention FLOPs of packed rows holding segments of ``segment_lengths`` tokens,
    counted analytically (a fused kernel is one custom call to XLA's cost analysis, so the
    compiled program's count does not see inside it).

    A segment of n tokens has n (n + 1) / 2 visible (query, key) pairs, whatever row it is
    packed into, so the cost is (sum of len^2 + sum of len) / 2 pairs: the skipping paths
    (model_defs.attention) pay this, not row_len^2 per row. Each pair costs 2 matmul FLOPs
    per head dimension for the scores and 2 for the weighted values, per query head; the
    backward pass of flash attention adds 5 such products (the scores again, dV, dP, dQ,
    dK), so ``training`` counts 7 x 2 x head_dim per pair and head, forward only 2 x 2."""
    lengths = np.asarray(segment_lengths, np.float64)
    if lengths.ndim != 1 or (lengths < 0).any():
        raise ValueError("segment_lengths must be a 1-D sequence of token counts >= 0")
    pairs = float(np.sum(lengths * (lengths + 1) / 2))
    head_dim = model_cfg.head_dim or model_cfg.hidden_size // model_cfg.num_attention_heads
    products = 7 if training else 2
    return products * 2.0 * head_dim * model_cfg.num_attention_heads * pairs


def _check_kernel_libraries(cfg: Any, target: str, platform: str) -> None:
    """The kernels resolve for the target exactly as on the chip (never by what this host
    has installed), so a GPU plan whose attention is cuDNN needs cuDNN here to compile it."""
    from model_defs.fused_attention import cudnn_available, resolve_attention_impl

    dtypes = {cfg.model.dtype, cfg.serving_dtype}
    if platform != "gpu" or cudnn_available():
        return
    for dtype in sorted(dtypes):
        if resolve_attention_impl(cfg.model.attention, platform, dtype=dtype) == "cudnn":
            raise PlanError(f"{target} runs model.attention={cfg.model.attention} as cuDNN "
                            f"attention for {dtype}, and this host cannot load cuDNN to compile "
                            "it: pip install nvidia-cudnn-cu13 (in the aot extra), or plan "
                            "with model.attention=pallas_gpu")


def _rate(tokens: int, out: dict[str, Any]) -> float | None:
    floor = out.get("step_time_floor_s")
    return tokens / floor if floor else None


def _gib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _brief(out: dict[str, Any]) -> str:
    if "step_time_floor_s" not in out:
        return f"does not fit (needs {_gib(out.get('peak_bytes'))}), {out['compile_s']} s"
    return (f"peak {_gib(out['peak_bytes'])}, floor {out['step_time_floor_s'] * 1e3:.2f} ms "
            f"({out['bound']}-bound), {out['compile_s']} s to compile")


def format_table(result: dict[str, Any]) -> str:
    """The plan as a text table, one row per program (per device)."""
    head = (f"{result['target']} ({result['devices']} x {result['chip']}, "
            f"HBM {_gib(result['hbm_bytes'])}, usable {_gib(result['usable_bytes'])}), mesh "
            + ",".join(f"{k}={v}" for k, v in result["mesh"].items()))
    cols = ["program", "fits", "peak", "params", "optimizer", "temp", "GFLOP", "GB moved",
            "floor ms", "best MFU", "attention"]
    rows = []
    for name in PROGRAMS:
        o = result[name]
        params = o.get("param_bytes")
        opt = o.get("optimizer_bytes", o.get("kv_cache_bytes"))
        rows.append([
            name, "yes" if o["fits"] else "NO", _gib(o.get("peak_bytes")), _gib(params),
            _gib(opt) if opt is not None else "-", _gib(o.get("temp_bytes")),
            f"{o['flops'] / 1e9:.1f}" if "flops" in o else "?",
            f"{o['bytes_accessed'] / 1e9:.2f}" if "bytes_accessed" in o else "?",
            f"{o['step_time_floor_s'] * 1e3:.2f}" if "step_time_floor_s" in o else "?",
            f"{o['best_mfu']:.0%}" if "best_mfu" in o else "?", o.get("attention_kernel", "?")])
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    g = result["learner_grad"]
    tried = ", ".join(f"{k}: {'fits' if ok else 'no'}" for k, ok in g["rows_tried"].items())
    lines.append(f"learner micro-batch {g['rows']} x {g['seq_len']}; largest that fits: "
                 f"{g['largest_fitting_rows']} rows (rows tried: {tried}); the engine's "
                 "'optimizer' column is its KV cache")
    for d in result.get("device_memory", []):
        parts = ", ".join(f"{e['process']} {_gib(e['need_bytes'])} of {_gib(e['limit_bytes'])}"
                          for e in d["processes"])
        lines.append(f"device {d['device']}: {parts}"
                     + (f" (shares sum to {d['fraction_sum']:g})" if len(d["processes"]) > 1
                        else "") + ("" if d["fits"] else ": DOES NOT FIT"))
    if "fits" in result:
        lines.append("every process fits its devices" if result["fits"] else
                     "DOES NOT FIT: a process needs more than its share of a device (above)")
    return "\n".join(lines)
