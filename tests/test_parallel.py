"""Mesh spec parsing, mesh construction, batch placement, distributed start-up arguments."""

import jax
import numpy as np
import pytest

from areal_jax.parallel import (
    MeshSpecError,
    initialize_distributed,
    local_batch_rows,
    make_mesh,
    n_batch_shards,
    parse_mesh_spec,
    put_batch,
)


def test_parse_mesh_spec_sizes_and_rest():
    assert parse_mesh_spec("data=2,fsdp=4,tensor=1") == {"data": 2, "fsdp": 4, "tensor": 1}
    assert parse_mesh_spec("fsdp=8") == {"data": 1, "fsdp": 8, "tensor": 1}
    assert parse_mesh_spec(" data = 2 , fsdp = -1 ", n_devices=8) == {
        "data": 2, "fsdp": 4, "tensor": 1}
    assert parse_mesh_spec("tensor=2,data=-1", n_devices=8) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert parse_mesh_spec({"fsdp": 4, "tensor": 2}, n_devices=8)["fsdp"] == 4
    assert parse_mesh_spec("data=-1")["data"] == jax.device_count()


@pytest.mark.parametrize("spec, message", [
    ("data=3,fsdp=2", "mesh data=3,fsdp=2 needs 6 devices, found 8"),
    ("data=3,fsdp=-1", r"cannot use 8 devices: 8 is not divisible by the fixed axes' product 3"),
    ("pipeline=2", "unknown axis 'pipeline'; axes are data, fsdp, tensor"),
    ("data2", "entry 'data2' is not axis=size"),
    ("data=2,,fsdp=4", "has an empty entry"),
    ("data=x", "size of 'data' is 'x', not an integer"),
    ("data=0,fsdp=8", "size of 'data' must be >= 1 or -1"),
    ("data=-1,fsdp=-1", "only one axis may be -1"),
    ("data=2,data=4", "axis 'data' is given twice"),
])
def test_parse_mesh_spec_errors(spec, message):
    with pytest.raises(MeshSpecError, match=message):
        parse_mesh_spec(spec, n_devices=8)


@pytest.mark.devices(8)
def test_make_mesh_axes_and_device_fit():
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert n_batch_shards(mesh) == 4
    one = make_mesh("data=1", devices=jax.devices()[:1])
    assert one.size == 1
    with pytest.raises(MeshSpecError, match="needs 8 devices, found 4"):
        make_mesh("fsdp=8", devices=jax.devices()[:4])


@pytest.mark.devices(8)
def test_put_batch_shards_rows_over_data_and_fsdp():
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    x = np.arange(8 * 3).reshape(8, 3).astype(np.int32)
    arr = put_batch(x, mesh)
    np.testing.assert_array_equal(np.asarray(arr), x)
    # 4 batch shards of 2 rows each, replicated over the tensor axis.
    rows = sorted({(s.index[0].start, s.index[0].stop) for s in arr.addressable_shards})
    assert rows == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert local_batch_rows(mesh, 8) == slice(0, 8)  # one process holds every row
    local = put_batch(x, mesh, process_local=True)  # one process: local == global
    np.testing.assert_array_equal(np.asarray(local), x)
    with pytest.raises(ValueError, match="batch of 6 rows cannot be split over data x fsdp = 4"):
        put_batch(x[:6], mesh)


def test_initialize_distributed_single_process_and_errors(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert initialize_distributed() is False  # nothing configured: single process, no-op
    assert initialize_distributed(num_processes=1) is False
    with pytest.raises(ValueError,
                       match=r"missing: coordinator_address \(JAX_COORDINATOR_ADDRESS\)"):
        initialize_distributed(num_processes=2, process_id=0)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        initialize_distributed()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "5")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\), got 5"):
        initialize_distributed()
