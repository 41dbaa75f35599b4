"""Test configuration: 8 fake CPU devices for mesh tests; slow/gpu markers."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("AREAL_RUNSLOW") == "1"
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    skip_gpu = pytest.mark.skip(reason="needs a GPU")
    has_gpu = os.environ.get("JAX_PLATFORMS", "cpu") != "cpu"
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
