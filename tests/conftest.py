"""Test configuration: 8 fake CPU devices for mesh tests; slow/gpu markers."""

import os

# Must happen before jax is imported anywhere. The device-count flag is added to whatever
# XLA_FLAGS the user has (e.g. --xla_cpu_max_isa=AVX2), so setting XLA_FLAGS for another reason
# never silently drops the suite to one device; a count the user gives explicitly is kept.
HOST_DEVICES = 8
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _count = f"--xla_force_host_platform_device_count={HOST_DEVICES}"
    os.environ["XLA_FLAGS"] = f"{_flags} {_count}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Scripts (scripts/*.py) and `python -m` children import the installed package; this
# checkout goes first so that the tests' subprocesses run the code under test.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("AREAL_RUNSLOW") == "1"
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    skip_gpu = pytest.mark.skip(reason="needs a GPU")
    has_gpu = os.environ.get("JAX_PLATFORMS", "cpu") != "cpu"
    n_devices = None
    for item in items:
        marker = item.get_closest_marker("devices")
        if marker is not None:
            if n_devices is None:
                import jax

                n_devices = jax.device_count()
            if n_devices < marker.args[0]:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {marker.args[0]} JAX devices, found {n_devices} "
                           f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
