"""SGLang servers started (and stopped) by the trainer: ``rollout.sglang``.

``launch_sglang(...)`` starts ``python -m sglang.launch_server`` with the flags
docs/servers.md lists (``--weight-version``, ``--skip-tokenizer-init``), its GPUs
(``CUDA_VISIBLE_DEVICES``, ``--tp-size``) and memory share (``--mem-fraction-static``)
from the run's placement, under a small watcher (``python -m
areal_jax.engine.sglang_launch --parent-pid P -- CMD``) that ends the server's process
group when the trainer dies, even by SIGKILL: SGLang has no such flag of its own. The
returned ``ServerHandle`` is the engine's, so ``wait_healthy``, ``terminate`` and the
trainer's shutdown treat SGLang and the embedded engine alike. SGLang may live in its
own environment (``python``: that environment's interpreter).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from areal_jax.engine.launch import ServerHandle

PARENT_POLL_S = 1.0


def sglang_command(python: str, model_path: str, *, port: int, weight_version: int,
                   dtype: str, context_length: int, placement_args: Sequence[str] = (),
                   api_key: str | None = None, extra_args: Sequence[str] = (),
                   host: str = "127.0.0.1") -> list[str]:
    """The ``sglang.launch_server`` command line for one server."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--weight-version", str(weight_version),
           "--skip-tokenizer-init", "--dtype", dtype, "--context-length", str(context_length),
           *placement_args]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra_args)


def launch_sglang(cmd: Sequence[str], *, url: str, env: dict[str, str], log_path: Path,
                  api_key: str | None = None) -> ServerHandle:
    """Starts ``cmd`` (``sglang_command``) in its own process group under the parent
    watcher, with ``env`` added to this process's environment; does not wait (use
    ``wait_healthy``)."""
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    watcher = [sys.executable, "-m", "areal_jax.engine.sglang_launch",
               "--parent-pid", str(os.getpid()), "--", *cmd]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(watcher, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=child_env,
                                   start_new_session=True)
    return ServerHandle(process, url, log_path, api_key)


def _watch(parent_pid: int, cmd: list[str]) -> int:
    """Runs ``cmd`` until it exits (its status) or ``parent_pid`` dies (then its process
    group is ended: SIGTERM, SIGKILL after 15 s)."""
    if os.getppid() != parent_pid:
        return 1
    child = subprocess.Popen(cmd)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM reaches the child
    while True:
        code = child.poll()
        if code is not None:
            return code
        if os.getppid() != parent_pid:
            print(f"sglang_launch: parent process {parent_pid} died; stopping SGLang",
                  flush=True)
            os.killpg(0, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.killpg(0, signal.SIGKILL)
        time.sleep(PARENT_POLL_S)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[0] != "--parent-pid" or args[2] != "--":
        print("usage: python -m areal_jax.engine.sglang_launch --parent-pid PID -- CMD ...",
              file=sys.stderr)
        return 2
    return _watch(int(args[1]), args[3:])


if __name__ == "__main__":
    sys.exit(main())
