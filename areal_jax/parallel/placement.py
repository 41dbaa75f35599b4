"""Which accelerators each process of a run gets, and the environment that gives them to it.

A run on one host is several processes: the learner (this process), the embedded engine
servers or the SGLang servers it starts. ``plan_placement(cfg, host)`` decides, from the
config and the host's devices (``probe_host()`` reads them without starting JAX; the
planner passes a target's), which devices each process gets and the environment it must
start with:

* GPUs: ``CUDA_VISIBLE_DEVICES`` (``HIP_VISIBLE_DEVICES`` on ROCm). A card two processes
  share needs each one's share of its memory set explicitly: JAX's
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (``placement.learner_mem_fraction``,
  ``rollout.engine_mem_fraction``) and SGLang's ``--mem-fraction-static``
  (``rollout.sglang.mem_fraction_static``), summing to at most ``SHARED_CARD_LIMIT``.
* TPU chips: one process owns a chip. A process on part of the host's chips gets libtpu's
  split for independent processes on one TPU VM: ``TPU_VISIBLE_CHIPS``,
  ``TPU_CHIPS_PER_PROCESS_BOUNDS`` (its chips must form a rectangle of the host's grid),
  ``TPU_PROCESS_BOUNDS=1,1,1``, its own ``TPU_PROCESS_PORT`` / ``TPU_PROCESS_ADDRESSES``,
  ``CLOUD_TPU_TASK_ID=0``, and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (libtpu otherwise takes a
  host-wide lock that a second process on the VM would fail on).

Overlaps are refused unless they are a GPU shared with explicit fractions. The plan is
printed when a run starts (``Placement.describe``). Nothing here imports jax.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

# A shared card's fractions sum to at most this: each process also holds a CUDA context
# (about 0.5 GiB) and cuBLAS / cuDNN workspaces outside its pool.
SHARED_CARD_LIMIT = 0.9
JAX_DEFAULT_GPU_FRACTION = 0.75  # what JAX's allocator takes of a GPU unless told otherwise
TPU_PORT_BASE = 8476  # libtpu's default TPU_PROCESS_PORT; each split process gets its own
# Chips per host of a TPU VM, by chip count: chip i sits at (i % X, i // X) (as libtpu and
# jax's topology number them: v5e:2x4 is 2 wide and 4 long).
_TPU_HOST_GRID = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
_TPU_PCI_IDS = {"0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e"}
_GPU_KINDS = ("cuda", "rocm")


class PlacementError(ValueError):
    """A placement the config asks for cannot be made; the message names the key."""


@dataclass(frozen=True)
class HostDevice:
    """One accelerator of the host: its platform and the id the visibility variables use."""

    platform: str  # "cuda", "rocm" or "tpu"
    index: int
    memory_bytes: int | None = None
    name: str = ""


@dataclass(frozen=True)
class Host:
    """The host's accelerators (all of one platform; none: a CPU host) and which JAX
    plugins this environment has installed ("cuda", "rocm", "tpu")."""

    devices: tuple[HostDevice, ...] = ()
    plugins: tuple[str, ...] = ()
    tpu_version: str | None = None

    @property
    def platform(self) -> str:
        return self.devices[0].platform if self.devices else "cpu"

    @property
    def tpu_grid(self) -> tuple[int, int, int] | None:
        return _TPU_HOST_GRID.get(len(self.devices)) if self.platform == "tpu" else None

    def describe(self) -> str:
        if not self.devices:
            return "no GPU or TPU (CPU only)"
        names = sorted({d.name for d in self.devices if d.name})
        kind = {"cuda": "NVIDIA GPU", "rocm": "AMD GPU", "tpu": "TPU chip"}[self.platform]
        what = ", ".join(names) if names else (
            f"TPU {self.tpu_version}" if self.tpu_version else kind)
        return f"{len(self.devices)} x {what} ({kind}s)"


@dataclass(frozen=True)
class ProcessPlacement:
    """One process's devices and the environment (and, for SGLang, flags) that give them."""

    role: str  # "learner", "engine" or "sglang"
    index: int
    platform: str  # "cpu", "cuda", "rocm" or "tpu"
    devices: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    mem_fraction: float | None = None  # of each of its devices' memory (GPUs)
    args: tuple[str, ...] = ()  # SGLang's --tp-size / --mem-fraction-static

    @property
    def name(self) -> str:
        return self.role if self.role == "learner" else f"{self.role} {self.index}"


@dataclass(frozen=True)
class Placement:
    host: Host
    processes: tuple[ProcessPlacement, ...]

    @property
    def learner(self) -> ProcessPlacement:
        return next(p for p in self.processes if p.role == "learner")

    @property
    def engines(self) -> list[ProcessPlacement]:
        return [p for p in self.processes if p.role == "engine"]

    @property
    def sglang(self) -> list[ProcessPlacement]:
        return [p for p in self.processes if p.role == "sglang"]

    def by_device(self) -> dict[int, list[ProcessPlacement]]:
        """Device id -> the processes on it (several: a shared GPU)."""
        out: dict[int, list[ProcessPlacement]] = {}
        for p in self.processes:
            for d in p.devices:
                out.setdefault(d, []).append(p)
        return dict(sorted(out.items()))

    def describe(self) -> str:
        """The plan printed at start: each process, its devices and environment."""
        lines = [f"placement on {self.host.describe()}:"]
        unit = "chip" if self.host.platform == "tpu" else "GPU"
        for p in self.processes:
            where = (f"{unit}{'s' if len(p.devices) > 1 else ''} "
                     f"{','.join(map(str, p.devices))}" if p.devices else p.platform)
            whose = "its" if len(p.devices) == 1 else "each one's"
            share = f", {p.mem_fraction:g} of {whose} memory" if p.mem_fraction else ""
            env = " ".join(f"{k}={v}" for k, v in p.env.items())
            flags = " ".join(p.args)
            lines.append(f"  {p.name:<9} {where}{share}"
                         + (f"  [{env}]" if env else "") + (f"  {flags}" if flags else ""))
        for device, procs in self.by_device().items():
            if len(procs) > 1:
                total = sum(p.mem_fraction or 0.0 for p in procs)
                parts = " + ".join(f"{p.name} {p.mem_fraction:g}" for p in procs)
                lines.append(f"  GPU {device} is shared: {parts} = {total:.2f} of its memory")
        return "\n".join(lines)


# ------------------------------------------------------------------ the host, without JAX
def installed_plugins() -> tuple[str, ...]:
    """The accelerator plugins of jax this environment has: "cuda", "rocm", "tpu"."""
    found = []
    try:
        import jax_plugins

        names = [n for folder in jax_plugins.__path__ for n in os.listdir(folder)]
    except (ImportError, OSError):
        names = []
    if any(n.startswith("xla_cuda") for n in names):
        found.append("cuda")
    if any(n.startswith("xla_rocm") for n in names):
        found.append("rocm")
    if importlib.util.find_spec("libtpu") is not None:
        found.append("tpu")
    return tuple(found)


def _nvidia_gpus() -> list[HostDevice]:
    devices: list[HostDevice] = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
            for line in out.stdout.splitlines() if out.returncode == 0 else []:
                index, name, mib = (s.strip() for s in line.split(",")[:3])
                devices.append(HostDevice("cuda", int(index), int(float(mib)) * 2**20, name))
        except (OSError, subprocess.TimeoutExpired, ValueError):
            devices = []
    if not devices:  # no nvidia-smi: the device nodes
        ids = sorted(int(m.group(1)) for p in glob.glob("/dev/nvidia*")
                     if (m := re.fullmatch(r"/dev/nvidia(\d+)", p)))
        devices = [HostDevice("cuda", i) for i in ids]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and re.fullmatch(r"[\d,\s]*", visible):
        keep = [int(v) for v in visible.split(",") if v.strip()]
        devices = [d for d in devices if d.index in keep]
    return devices


def _amd_gpus() -> list[HostDevice]:
    ids: list[int] = []
    for props in sorted(glob.glob("/sys/class/kfd/kfd/topology/nodes/*/properties")):
        try:
            text = open(props).read()
        except OSError:
            continue
        m = re.search(r"^gfx_target_version\s+(\d+)", text, re.M)
        if m and int(m.group(1)) != 0:
            ids.append(len(ids))
    return [HostDevice("rocm", i) for i in ids]


def _tpu_chips() -> tuple[list[HostDevice], str | None]:
    chips, version = 0, None
    for vendor in sorted(glob.glob("/sys/bus/pci/devices/*/vendor")):
        try:
            if open(vendor).read().strip() != "0x1ae0":  # Google
                continue
            device = open(os.path.join(os.path.dirname(vendor), "device")).read().strip()
        except OSError:
            continue
        if device in _TPU_PCI_IDS:
            chips, version = chips + 1, _TPU_PCI_IDS[device]
    return [HostDevice("tpu", i) for i in range(chips)], version


def probe_host() -> Host:
    """This machine's accelerators, read from the system (nvidia-smi, the device nodes, the
    PCI bus) without starting JAX, so nothing is claimed and no plugin prints."""
    plugins = installed_plugins()
    gpus = _nvidia_gpus() or _amd_gpus()
    if gpus:
        return Host(tuple(gpus), plugins)
    chips, version = _tpu_chips()
    return Host(tuple(chips), plugins, version)


def target_host(target: str, hbm_bytes: int) -> Host:
    """The host of a planner target (``h100:8``, ``v5e:2x4``, ...), as ``probe_host`` would
    read it there."""
    kind, _, shape = target.partition(":")
    if kind in ("h100", "h200"):
        n = int(shape)
        return Host(tuple(HostDevice("cuda", i, hbm_bytes, kind.upper()) for i in range(n)),
                    ("cuda",))
    n = 1
    for s in shape.split("x"):
        n *= int(s)
    return Host(tuple(HostDevice("tpu", i, hbm_bytes) for i in range(n)), ("tpu",), kind)


# ------------------------------------------------------------------ the hardware check
_INSTALL = {"cuda": "pip install -e '.[cuda]'", "rocm": "pip install 'jax[rocm]'",
            "tpu": "pip install -e '.[tpu]'"}


def hardware_problem(hardware: str | None, host: Host) -> tuple[str | None, str | None]:
    """(error, notice) for a config's ``hardware`` on this host: an error when it names an
    accelerator JAX cannot use here (none on the host, or no plugin for it), with what was
    found and the install line; a notice when ``hardware: cpu`` leaves an accelerator idle."""
    if hardware is None:
        return None, None
    plugins = ", ".join(host.plugins) or "none"
    found = f"found {host.describe()}; jax accelerator plugins installed: {plugins}"
    if hardware == "cpu":
        if host.devices:
            return None, (f"hardware: cpu: this machine has {host.describe()}, and this "
                          "config keeps JAX on the CPU (set hardware to the accelerator, e.g. "
                          "hardware=h100:1, to use it; docs/accelerators.md)")
        return None, None
    want = "tpu" if not hardware.startswith(("h100", "h200")) else "cuda"
    label = "TPU" if want == "tpu" else "NVIDIA GPUs"
    if host.platform != want:
        hint = (f"on a machine with {label}, install JAX for it: {_INSTALL[want]}; "
                "or run this config on the CPU with hardware=cpu")
        return (f"hardware: {hardware} names {label}, and JAX can see none here ({found}); "
                f"{hint}"), None
    if want not in host.plugins:
        return (f"hardware: {hardware}: {found}, but JAX has no {label} support installed: "
                f"{_INSTALL[want]}"), None
    if want == "cuda":
        count = int(hardware.split(":")[1])
        if len(host.devices) < count:
            return (f"hardware: {hardware} needs {count} GPUs; {found} (set hardware="
                    f"{hardware.split(':')[0]}:{len(host.devices)} and a placement for it)"), None
    return None, None


# ------------------------------------------------------------------ the placement
def _ids(devices: list[int] | None, key: str, available: list[int], unit: str) -> list[int]:
    if devices is None:
        return []
    bad = [d for d in devices if d not in available]
    if bad:
        have = ",".join(map(str, available)) or "none"
        raise PlacementError(f"{key} {devices}: no {unit} {bad[0]} here ({unit}s: {have})")
    if len(set(devices)) != len(devices):
        raise PlacementError(f"{key} {devices} names a device twice")
    return list(devices)


def _tpu_bounds(chips: tuple[int, ...], grid: tuple[int, int, int] | None, who: str) -> str:
    """libtpu's TPU_CHIPS_PER_PROCESS_BOUNDS for a process on ``chips``: they must form a
    rectangle of the host's chip grid."""
    if grid is None:
        raise PlacementError(f"{who}: splitting this host's chips between processes needs a "
                             "1, 4 or 8-chip TPU VM")
    xs = sorted({c % grid[0] for c in chips})
    ys = sorted({c // grid[0] for c in chips})
    w, h = len(xs), len(ys)
    rect = {x + grid[0] * y for x in range(xs[0], xs[0] + w) for y in range(ys[0], ys[0] + h)}
    if rect != set(chips) or xs != list(range(xs[0], xs[0] + w)):
        raise PlacementError(
            f"{who}: TPU chips {','.join(map(str, chips))} are not a rectangle of this host's "
            f"{grid[0]}x{grid[1]} grid (chip i at ({'i % ' + str(grid[0])}, i // {grid[0]})); "
            "libtpu gives a process a rectangle, e.g. chips 0,1,2,3 or 4,5,6,7 of a v5e-8")
    return f"{w},{h},1"


def plan_placement(cfg: Any, host: Host, learner_platform: str | None = None) -> Placement:
    """Every process of the run on ``host`` and the environment each one starts with (see
    the module doc). ``learner_platform``: "cpu" keeps the learner off the accelerators
    (default: "cpu" for ``hardware: cpu``, else the host's). PlacementError, naming the key,
    for an overlap or a device that is not there."""
    ro, pl = cfg.rollout, cfg.placement
    accel = host.platform
    if learner_platform is None:
        learner_platform = "cpu" if cfg.hardware == "cpu" else accel
    engine_platform = ro.engine_platform or learner_platform
    if engine_platform in ("gpu", "cuda", "rocm") and accel in _GPU_KINDS:
        engine_platform = accel
    available = [d.index for d in host.devices]
    unit = "chip" if accel == "tpu" else "GPU"
    sg = ro.sglang
    rollout: list[tuple[str, int, list[int], float | None, tuple[str, ...]]] = []
    if sg is not None:
        if accel not in _GPU_KINDS:
            raise PlacementError(f"rollout.sglang starts SGLang servers on GPUs; this host has "
                                 f"{host.describe()}")
        width = sg.num_servers * sg.tp_size
        devices = _ids(sg.devices, "rollout.sglang.devices", available, unit)
        if not devices:
            if width > len(available):
                raise PlacementError(f"rollout.sglang: {sg.num_servers} servers x tp_size "
                                     f"{sg.tp_size} need {width} GPUs; this host has "
                                     f"{len(available)}")
            devices = available[len(available) - width:]
        if len(devices) != width:
            raise PlacementError(f"rollout.sglang.devices {sg.devices}: {sg.num_servers} servers "
                                 f"x tp_size {sg.tp_size} need {width} GPUs")
        for i in range(sg.num_servers):
            args: tuple[str, ...] = ("--tp-size", str(sg.tp_size))
            if sg.mem_fraction_static is not None:
                args += ("--mem-fraction-static", f"{sg.mem_fraction_static:g}")
            rollout.append(("sglang", i, devices[i * sg.tp_size:(i + 1) * sg.tp_size],
                            sg.mem_fraction_static, args))
    elif not ro.servers and engine_platform != "cpu":
        if accel == "cpu" or engine_platform != accel:
            raise PlacementError(f"rollout.engine_platform {engine_platform}: this host has "
                                 f"{host.describe()}")
        n = ro.num_servers
        devices = _ids(ro.engine_devices, "rollout.engine_devices", available, unit)
        if devices and len(devices) not in (1, n):
            raise PlacementError(f"rollout.engine_devices {ro.engine_devices}: one device for "
                                 f"every engine, or one list entry per server "
                                 f"(rollout.num_servers={n})")
        if not devices:
            if len(available) > n:
                devices = available[len(available) - n:]  # the last ones; the learner the rest
            elif len(available) == 1:
                devices = available
            else:
                raise PlacementError(
                    f"rollout.num_servers={n} embedded engines and the learner on "
                    f"{len(available)} {unit}s: set rollout.engine_devices (one per server) "
                    "and placement.learner_devices")
        for i in range(n):
            rollout.append(("engine", i, [devices[i % len(devices)]], ro.engine_mem_fraction, ()))
    elif ro.engine_devices is not None and not ro.servers:
        raise PlacementError("rollout.engine_devices selects accelerators; with engine_platform "
                             "cpu use rollout.server_cpu_cores to pick CPU cores")

    learner: list[int] = []
    if learner_platform != "cpu":
        learner = _ids(pl.learner_devices, "placement.learner_devices", available, unit)
        if not learner:
            taken = {d for _, _, ds, _, _ in rollout for d in ds}
            learner = [d for d in available if d not in taken] or list(available)
    elif pl.learner_devices is not None:
        raise PlacementError("placement.learner_devices selects accelerators; with hardware: cpu "
                             "the learner runs on the CPU")

    entries = [("learner", 0, learner, pl.learner_mem_fraction, ()), *rollout]
    _check_sharing(entries, accel)
    processes, port = [], TPU_PORT_BASE
    for role, index, devices, fraction, flags in entries:
        platform = learner_platform if role == "learner" else (
            "cuda" if role == "sglang" and accel == "cuda" else engine_platform)
        env: dict[str, str] = {}
        if devices and accel in _GPU_KINDS:
            var = "CUDA_VISIBLE_DEVICES" if accel == "cuda" else "HIP_VISIBLE_DEVICES"
            env[var] = ",".join(map(str, devices))
            if fraction is not None and role != "sglang":
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"
        elif devices and accel == "tpu" and len(devices) < len(available):
            key = "placement.learner_devices" if role == "learner" else "rollout.engine_devices"
            if _multi_host_tpu(cfg):
                raise PlacementError(
                    f"{key}: this TPU VM is one host of a multi-host slice, whose chips form "
                    "one job's mesh; splitting them between processes here would cut this "
                    "host out of it. Give the learner every chip (rollout.engine_platform: cpu, "
                    "or engines on other machines through rollout.servers)")
            env.update(TPU_VISIBLE_CHIPS=",".join(map(str, devices)),
                       TPU_CHIPS_PER_PROCESS_BOUNDS=_tpu_bounds(tuple(devices), host.tpu_grid,
                                                                key),
                       TPU_PROCESS_BOUNDS="1,1,1", TPU_PROCESS_PORT=str(port),
                       TPU_PROCESS_ADDRESSES=f"localhost:{port}", CLOUD_TPU_TASK_ID="0",
                       ALLOW_MULTIPLE_LIBTPU_LOAD="1")
            port += 1
        processes.append(ProcessPlacement(role, index, platform, tuple(devices), env,
                                          fraction if devices else None, flags))
    return Placement(host, tuple(processes))


def _multi_host_tpu(cfg: Any) -> bool:
    """A process of a multi-host job (several processes configured, or a TPU pod slice's
    worker list in the environment)."""
    n = cfg.distributed.num_processes
    return (n is not None and n > 1) or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


_FRACTION_KEYS = {"learner": "placement.learner_mem_fraction",
                  "engine": "rollout.engine_mem_fraction",
                  "sglang": "rollout.sglang.mem_fraction_static"}


def _check_sharing(entries: list[tuple[str, int, list[int], float | None, tuple[str, ...]]],
                   accel: str) -> None:
    """Refuses a device two processes would share, unless it is a GPU whose every process
    has its memory fraction set, and they sum to at most SHARED_CARD_LIMIT."""
    on: dict[int, list[tuple[str, float | None]]] = {}
    for role, index, devices, fraction, _ in entries:
        name = role if role == "learner" else f"{role} {index}"
        for d in devices:
            on.setdefault(d, []).append((name, fraction))
    for device, procs in sorted(on.items()):
        if len(procs) < 2:
            continue
        names = " and ".join(n for n, _ in procs)
        if accel == "tpu":
            raise PlacementError(
                f"TPU chip {device} is given to {names}: a chip belongs to one process. Give "
                "the engines and the learner disjoint chips (rollout.engine_devices, "
                "placement.learner_devices)")
        unset = sorted({_FRACTION_KEYS[n.split()[0]] for n, f in procs if f is None})
        if unset:
            raise PlacementError(
                f"GPU {device} is shared by {names}: set {' and '.join(unset)} (each process's "
                f"share of the card's memory, summing to at most {SHARED_CARD_LIMIT:g}), or "
                "give them different GPUs")
        total = sum(f or 0.0 for _, f in procs)
        if total > SHARED_CARD_LIMIT + 1e-9:
            parts = " + ".join(f"{n} {f:g}" for n, f in procs)
            raise PlacementError(
                f"GPU {device} is shared by {names}, whose memory fractions sum to {parts} = "
                f"{total:.2f} > {SHARED_CARD_LIMIT:g} (each process also holds a CUDA context "
                "and workspaces outside its share): lower them")


# ------------------------------------------------------------------ at a run's start
def sglang_problem(cfg: Any) -> str | None:
    """Why ``rollout.sglang`` cannot start here (SGLang not installed in the environment it
    names), or None."""
    sg = cfg.rollout.sglang
    if sg is None:
        return None
    if sg.python is None:
        if importlib.util.find_spec("sglang") is None:
            return ("rollout.sglang needs the sglang package, which is not installed here: "
                    "pip install -e '.[sglang]', or install SGLang in its own environment and "
                    "set rollout.sglang.python to its interpreter (docs/accelerators.md)")
        return None
    python = os.path.expanduser(sg.python)
    if not os.access(python, os.X_OK):
        return f"rollout.sglang.python {sg.python}: no such executable"
    try:
        found = subprocess.run([python, "-c", "import importlib.util as u, sys; "
                                "sys.exit(u.find_spec('sglang') is None)"],
                               capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"rollout.sglang.python {sg.python} does not run: {e}"
    if not found:
        return (f"rollout.sglang.python {sg.python} has no sglang package: install it there "
                "with pip install 'sglang[all]>=0.5.2'")
    return None


_started: tuple[Any, Placement] | None = None


def start_placement(cfg: Any, host: Host | None = None, *, announce: bool = True) -> Placement:
    """A run's start (scripts/train.py, before anything starts JAX; run.py again, which
    gets the same placement): SGLang's presence, the ``hardware`` check (PlacementError;
    the ``hardware: cpu`` notice printed once), the placement, this process's (the
    learner's) device environment set, and the plan printed."""
    global _started
    if _started is not None and _started[0] is cfg:
        return _started[1]
    problem = sglang_problem(cfg)
    if problem:
        raise PlacementError(problem)
    host = probe_host() if host is None else host
    error, notice = hardware_problem(cfg.hardware, host)
    forced_cpu = os.environ.get("JAX_PLATFORMS", "").strip() == "cpu"
    if error is None and forced_cpu and cfg.hardware not in (None, "cpu"):
        error = (f"hardware: {cfg.hardware} names an accelerator, and JAX_PLATFORMS=cpu keeps "
                 "JAX on the CPU: unset JAX_PLATFORMS, or run with hardware=cpu")
    if error:
        raise PlacementError(error)
    if notice and not forced_cpu:
        print(notice, file=sys.stderr, flush=True)
    placement = plan_placement(cfg, host, "cpu" if forced_cpu else None)
    os.environ.update(placement.learner.env)  # read once, when JAX starts its backends
    if announce:
        print(placement.describe(), flush=True)
    _started = (cfg, placement)
    return placement


def check_learner_backend(placement: Placement) -> None:
    """After JAX started: the learner runs on the accelerator its placement gave it
    (PlacementError naming what JAX started on, else)."""
    want = placement.learner.platform
    if want == "cpu":
        return
    import jax

    backend = jax.default_backend()
    if backend != ("tpu" if want == "tpu" else "gpu"):
        raise PlacementError(
            f"the learner's placement is {want} devices "
            f"{','.join(map(str, placement.learner.devices))}, and JAX started on {backend} "
            f"(installed plugins: {', '.join(placement.host.plugins) or 'none'}): "
            f"{_INSTALL.get(want, 'install JAX for it')}")
