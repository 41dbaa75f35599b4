"""One process of the two-process learner test (tests/test_learner_multiprocess.py).

    python tests/_multihost_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR_PORT OUT_NPZ

Each process has 4 CPU devices; the two join through jax.distributed (gloo collectives)
into one 8-device mesh data=2,fsdp=4, pack the same trajectories, and run two train steps:
once passing the same global micro-batches everywhere, once passing each process only its
own rows. Every process writes metrics and (gathered) params to OUT_NPZ.PROCESS_ID.npz.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    process_id, num_processes, port, out = sys.argv[1:5]
    from areal_jax.parallel import initialize_distributed

    assert initialize_distributed(f"127.0.0.1:{port}", int(num_processes), int(process_id),
                                  initialization_timeout_s=120)
    import jax
    import numpy as np
    from _learner_data import standard_run

    from areal_jax.parallel import make_mesh

    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    run = standard_run(make_mesh("data=2,fsdp=4"))
    results = {"logp0": run["logp0"]}
    for step, metrics in enumerate(run["metrics"]):
        for k in ("loss", "grad_norm", "clip_frac", "n_loss_tokens"):
            results[f"step{step}_{k}"] = np.float64(metrics[k])
    for i, leaf in enumerate(run["params"]):
        results[f"param{i}"] = leaf
    for i, leaf in enumerate(run["grads0"]):
        results[f"grad{i}"] = leaf
    # Each process feeds only its own rows (e.g. its own rollouts): same training.
    local = standard_run(make_mesh("data=2,fsdp=4"), process_local_batches=True)
    results["local_logp0"] = local["logp0"]  # this process's rows only
    for step, metrics in enumerate(local["metrics"]):
        results[f"local_step{step}_loss"] = np.float64(metrics["loss"])
    for i, leaf in enumerate(local["params"]):
        results[f"local_param{i}"] = leaf
    np.savez(f"{out}.{process_id}.npz", **results)
    print(f"process {process_id}: done", flush=True)


if __name__ == "__main__":
    main()
