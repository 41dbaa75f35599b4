"""Run scripts/train.py on a Ray cluster: N trainer processes (one JAX job) + rollout servers.

    python scripts/launch_ray.py --address HEAD_IP:6379 --config configs/X.yaml \\
        --trainers 2 --servers 1 [--mesh fsdp=2] [--env XLA_FLAGS=...] [key=value ...]

* One trainer per ``--trainer-resource`` unit (default ``trainer``: start each learner host's
  Ray node with ``--resources='{"trainer": 1}'``). Trainer 0's node hosts the JAX coordinator;
  every trainer gets ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``.
* ``--servers M`` rollout servers, one per ``--server-resource`` unit (default ``rollout``):
  the embedded engine (``scripts/serve.py`` on the run's ``model.path``), or any command
  given as ``--server-cmd`` with ``{model}``, ``{host}`` and ``{port}`` filled in (e.g. an
  SGLang launch line). Their URLs go to the trainers as ``rollout.servers``.
* Every process's output is printed here, each line prefixed with its role and host.
* When any trainer or server exits non-zero (or its node dies), every other process is
  stopped (SIGTERM to its process group, SIGKILL after ``--grace-s``) and this command exits
  with that status; when all trainers finish, the servers are stopped and it exits 0.

Every node needs this checkout at the same path (or the same container image) and
``pip install 'areal-jax[ray]'``; ``run_dir`` (checkpoints) and ``checkpoint.publish_dir``
must be on storage that every node can reach (a shared filesystem or gs://).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

SERVE = str(REPO / "scripts" / "serve.py")
TRAIN = str(REPO / "scripts" / "train.py")
# Sets PR_SET_PDEATHSIG, then execs the command: a process whose Ray actor dies dies too.
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


class ProcessRunner:
    """A Ray actor that runs one command on its node and keeps its output lines."""

    def __init__(self, name: str) -> None:
        import socket

        self.name, self.host = name, socket.gethostname()
        self.proc: Any = None
        self.lines: list[str] = []

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def resolve_model(self, spec: str) -> str:
        from areal_jax.run_inputs import resolve_model_path

        return str(resolve_model_path(spec))

    def start(self, cmd: list[str], env: dict[str, str], make_dirs: tuple[str, ...] = ()
              ) -> tuple[str, int]:
        import subprocess
        import threading

        for d in make_dirs:  # e.g. the publish dir a server is allowed to load from
            os.makedirs(d, exist_ok=True)
        full_env = {**os.environ, **env}
        if full_env.get("CUDA_VISIBLE_DEVICES") == "":  # Ray's for a GPU-less actor: not ours
            del full_env["CUDA_VISIBLE_DEVICES"]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, *cmd], env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True)  # its own process group: stop() ends its children too

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()
        return self.host, self.proc.pid

    def drain(self) -> tuple[list[str], int | None]:
        """New output lines, and the exit status (None while running)."""
        lines, self.lines = self.lines, []
        return lines, None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float) -> int | None:
        import subprocess

        if self.proc is None:
            return None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                continue
        try:  # the group's other members (e.g. reward workers) too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.poll()


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS or auto)")
    p.add_argument("--config", required=True, help="YAML run config (the same path on every node)")
    p.add_argument("--mesh", default=None, help="learner mesh over all trainers' devices")
    p.add_argument("--trainers", type=int, default=1, help="trainer processes (one per host)")
    p.add_argument("--trainer-resource", default="trainer",
                   help="Ray resource each trainer takes one unit of")
    p.add_argument("--servers", type=int, default=1, help="rollout servers to start (0: use "
                   "rollout.servers from the config)")
    p.add_argument("--server-resource", default="rollout",
                   help="Ray resource each server takes one unit of")
    p.add_argument("--server-cmd", default=None,
                   help="server command line with {model} {host} {port} "
                        "(default: the embedded engine)")
    p.add_argument("--server-args", default="", help="extra arguments for the embedded engine")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for trainers and servers (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for servers only (repeatable)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="servers' start-up limit")
    p.add_argument("--grace-s", type=float, default=10.0,
                   help="SIGTERM -> SIGKILL delay at teardown")
    p.add_argument("--pid-file", default=None,
                   help="write the started processes as JSON [{role, host, pid}] here")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, passed to train.py")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.trainers < 1 or args.servers < 0:
        p.error("--trainers must be >= 1 and --servers >= 0")
    for item in args.env + args.server_env:
        if "=" not in item:
            p.error(f"--env {item!r} is not KEY=VALUE")
    return args


def _env(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


class Job:
    """The started actors; ``teardown`` stops every process and kills every actor."""

    def __init__(self, ray: Any, grace_s: float, startup_timeout_s: float) -> None:
        self.ray, self.grace_s, self.startup_timeout_s = ray, grace_s, startup_timeout_s
        self.actors: dict[str, Any] = {}  # role -> actor
        self.hosts: dict[str, str] = {}
        self.started: list[dict[str, Any]] = []

    def actor(self, role: str, resource: str) -> Any:
        remote = self.ray.remote(num_cpus=0, resources={resource: 1}, max_restarts=0)(ProcessRunner)
        actor = remote.options(name=None).remote(role)
        self.actors[role] = actor
        return actor

    def start(self, role: str, cmd: list[str], env: dict[str, str],
              make_dirs: tuple[str, ...] = ()) -> None:
        # Waits for the actor to be placed: a timeout when the resource stays taken.
        host, pid = self.ray.get(self.actors[role].start.remote(cmd, env, make_dirs),
                                 timeout=self.startup_timeout_s)
        self.hosts[role] = host
        self.started.append({"role": role, "host": host, "pid": pid})
        print(f"[launch] {role} started on {host} (pid {pid}): {shlex.join(cmd)}", flush=True)

    def pump(self) -> dict[str, int | None | str]:
        """Prints new output; returns each started role's exit status (None: running,
        "lost": its actor or node died)."""
        out: dict[str, int | None | str] = {}
        for role in [s["role"] for s in self.started]:
            try:
                lines, code = self.ray.get(self.actors[role].drain.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - the actor or its node is gone
                print(f"[launch] lost {role}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                out[role] = "lost"
                continue
            for line in lines:
                print(f"[{role} @ {self.hosts[role]}] {line}", flush=True)
            out[role] = code
        return out

    def teardown(self, roles: list[str] | None = None) -> None:
        roles = list(self.actors) if roles is None else roles
        refs = [self.actors[r].stop.remote(self.grace_s) for r in roles
                if r in {s["role"] for s in self.started}]
        for ref in refs:
            try:
                self.ray.get(ref, timeout=3 * self.grace_s + 30)
            except Exception:  # noqa: BLE001 - killed with the actor below (PDEATHSIG)
                pass
        if roles:
            self.pump()  # their last output
        for r in roles:
            self.ray.kill(self.actors.pop(r), no_restart=True)


def _wait_healthy(url: str, job: Job, role: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = job.pump().get(role)
        if code is not None:
            raise RuntimeError(f"{role} exited with status {code} during start-up")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{role} at {url} not healthy after {timeout_s:.0f} s")


def run(args: argparse.Namespace) -> int:
    import ray

    from areal_jax.config import ConfigError, load_config

    if "://" not in args.config:  # every process resolves paths the same way
        args.config = os.path.abspath(args.config)
    try:
        mesh_override = [f"mesh={args.mesh}"] if args.mesh else []
        cfg = load_config(args.config, list(args.overrides) + mesh_override)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if "://" not in cfg.run_dir and not os.path.isabs(cfg.run_dir):
        args.overrides = [*args.overrides, f"run_dir={os.path.abspath(cfg.run_dir)}"]
    run_dir = cfg.run_dir if "://" in cfg.run_dir else os.path.abspath(cfg.run_dir)
    publish_dir = cfg.checkpoint.publish_dir or f"{run_dir.rstrip('/')}/weights"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address=args.address, log_to_driver=False, logging_level="warning")
    needed = {args.trainer_resource: args.trainers, args.server_resource: args.servers}
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0)) for k, v in needed.items() if v and have.get(k, 0) < v}
    if short:
        print("error: the Ray cluster lacks resources (needed, available): "
              + ", ".join(f"{k}: {v}" for k, v in short.items())
              + "; start nodes with e.g. ray start --resources='{\"trainer\": 1}'", file=sys.stderr)
        return 2
    job = Job(ray, args.grace_s, args.startup_timeout_s)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    common_env = {"PYTHONUNBUFFERED": "1", **_env(args.env)}
    try:
        urls = []
        for i in range(args.servers):
            role = f"server{i}"
            actor = job.actor(role, args.server_resource)
            ip, port, model = ray.get([actor.node_ip.remote(), actor.free_port.remote(),
                                       actor.resolve_model.remote(cfg.model.path)],
                                      timeout=args.startup_timeout_s)
            if args.server_cmd:
                cmd = shlex.split(args.server_cmd.format(model=model, host=ip, port=port))
            else:
                cmd = [sys.executable, SERVE, "--model-path", model,
                       "--host", ip, "--port", str(port),
                       "--max-slots", str(cfg.rollout.max_slots),
                       "--max-seq-len", str(cfg.rollout.max_seq_len),
                       "--allowed-weight-dir", publish_dir,  # the run's serving weights
                       *shlex.split(args.server_args)]
            job.start(role, cmd, {**common_env, **_env(args.server_env)},
                      make_dirs=() if "://" in publish_dir else (publish_dir,))
            urls.append(f"http://{ip}:{port}")
        for i, url in enumerate(urls):
            _wait_healthy(url, job, f"server{i}", args.startup_timeout_s)
        servers = [f"rollout.servers=[{','.join(urls)}]"] if urls else []

        trainers = [job.actor(f"trainer{i}", args.trainer_resource) for i in range(args.trainers)]
        ip, port = ray.get([trainers[0].node_ip.remote(), trainers[0].free_port.remote()],
                           timeout=args.startup_timeout_s)
        cmd = [sys.executable, TRAIN, "--config", args.config,
               *(["--mesh", args.mesh] if args.mesh else []), *args.overrides, *servers]
        for i in range(args.trainers):
            job.start(f"trainer{i}", cmd, {**common_env, "JAX_COORDINATOR_ADDRESS": f"{ip}:{port}",
                                           "JAX_NUM_PROCESSES": str(args.trainers),
                                           "JAX_PROCESS_ID": str(i)})
        if args.pid_file:
            Path(args.pid_file).write_text(json.dumps(job.started))

        status = 0
        while True:
            codes = job.pump()
            failed = [(r, c) for r, c in codes.items() if c not in (None, 0)
                      or (c == 0 and r.startswith("server"))]
            if failed:
                # One failure takes the others down within moments (a killed trainer resets
                # its peers' collectives); collect them briefly and name each, the processes
                # ended by a signal (the likely root cause) first.
                grace = time.monotonic() + 2.0
                while time.monotonic() < grace:
                    time.sleep(0.25)
                    codes = {**codes, **{r: c for r, c in job.pump().items() if c is not None}}
                failed = sorted(((r, c) for r, c in codes.items() if c not in (None, 0)
                                 or (c == 0 and r.startswith("server"))),
                                key=lambda rc: not (isinstance(rc[1], int) and rc[1] < 0))
                for role, code in failed:
                    print(f"[launch] {role} ended with status {code}", file=sys.stderr,
                          flush=True)
                print("[launch] stopping every process", file=sys.stderr, flush=True)
                code = failed[0][1]
                status = code if isinstance(code, int) and code > 0 else 1
                break
            if all(codes[f"trainer{i}"] == 0 for i in range(args.trainers)):
                print("[launch] every trainer finished", flush=True)
                break
            if stopping:
                print("[launch] interrupted; stopping every process", file=sys.stderr, flush=True)
                status = stopping[0]
                break
            time.sleep(0.5)
    except Exception as e:  # noqa: BLE001 - any start-up failure: report, tear down, fail
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        status = 1
    finally:
        job.teardown()
        if args.pid_file:
            Path(args.pid_file).write_text(json.dumps(job.started))
        ray.shutdown()
    return status


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
