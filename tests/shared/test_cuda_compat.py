"""The one version switch between cuda-bindings 12.x and 13.x (shared.cuda_compat), against the fake
driver in both majors and the real binding installed here. That every call the backend makes is
accepted by both real majors is tests/worker/backends/test_replay_bindings.py's part."""

from __future__ import annotations

import types
from typing import Any

import pytest

from shared.cuda_compat import (
    CUBLAS_WORKSPACE_BYTES,
    CUBLAS_WORKSPACE_HOPPER_BYTES,
    DriverApi,
    bindings_version,
    cublas_workspace_bytes,
    default_context_bytes,
    driver_api,
)
from shared.errors import BackendUnavailable
from tests.helpers.fake_cuda import CUresult, FakeDriver

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20


def _ctx(f: FakeDriver) -> Any:
    f.cuInit(0)
    _, dev = f.cuDeviceGet(0)
    _, ctx = f.cuDevicePrimaryCtxRetain(dev)
    f.cuCtxSetCurrent(ctx)
    return dev


@pytest.mark.parametrize("major", [12, 13])
def test_the_fake_in_each_major_is_placed_by_its_version(major: int) -> None:
    f = FakeDriver(bindings_major=major)
    api = driver_api(f)
    assert api.major == major and api.version.startswith(f"{major}.")


@pytest.mark.parametrize("major", [12, 13])
def test_ctx_create_takes_the_shape_of_the_major(major: int) -> None:
    f = FakeDriver(bindings_major=major, context_bytes=8 * MiB)
    dev = _ctx(f)
    err, ctx = driver_api(f).ctx_create(f, 0, dev)
    assert err == CUresult.CUDA_SUCCESS and int(ctx) in f.extra_ctx
    other = DriverApi(25 - major, "x")  # the other major's shape fails as that binding fails it
    with pytest.raises(TypeError, match="positional arguments"):
        other.ctx_create(f, 0, dev)


@pytest.mark.parametrize("major", [12, 13])
def test_pool_props_have_only_the_fields_of_the_major(major: int) -> None:
    f = FakeDriver(bindings_major=major)
    _ctx(f)
    props = driver_api(f).pool_props(f, 0, 4 * MiB)
    assert props.maxSize == 4 * MiB and int(props.location.id) == 0
    assert hasattr(props, "gpuDirectRDMACapable") == (major == 13)
    err, pool = f.cuMemPoolCreate(props)
    assert err == CUresult.CUDA_SUCCESS
    # a struct of the other major is refused by the binding's type check, as the real one does
    other = FakeDriver(bindings_major=25 - major)
    _ctx(other)
    with pytest.raises(TypeError):
        other.cuMemPoolCreate(props)


def test_max_pool_size_is_readable_with_13_only() -> None:
    f13, f12 = FakeDriver(bindings_major=13), FakeDriver(bindings_major=12)
    assert driver_api(f13).max_pool_size_attribute(f13) is not None
    assert driver_api(f12).max_pool_size_attribute(f12) is None
    assert not hasattr(f12.CUmemPool_attribute, "CU_MEMPOOL_ATTR_MAX_POOL_SIZE")
    _ctx(f12)
    _, pool = f12.cuMemPoolCreate(driver_api(f12).pool_props(f12, 0, 4 * MiB))
    # a 12.x driver does not know the attribute's value either: INVALID_VALUE, never a made-up size
    assert f12.cuMemPoolGetAttribute(pool, 13)[0] == CUresult.CUDA_ERROR_INVALID_VALUE


def test_the_real_binding_installed_here_is_placed() -> None:
    real = pytest.importorskip("cuda.bindings.driver")
    import cuda.bindings

    version = bindings_version(real)
    assert version == cuda.bindings.__version__
    api = driver_api(real)
    assert api.major == int(version.split(".")[0])
    props = api.pool_props(real, 0, 2 * MiB)  # builds on the real struct (no GPU needed)
    assert int(props.maxSize) == 2 * MiB


@pytest.mark.parametrize("version, major", [("12.6.0", 12), ("12.9.10", 12), ("13.0.1", 13), ("14.2.0", 13)])
def test_versions_map_to_the_shapes_they_have(version: str, major: int) -> None:
    mod = types.SimpleNamespace(BINDINGS_VERSION=version, __name__="stand_in")
    assert driver_api(mod) == DriverApi(major, version)  # a later major: the newest shapes known


@pytest.mark.parametrize("version", ["11.8.0", "garbage", None])
def test_an_unplaceable_binding_is_backend_unavailable(version: str | None) -> None:
    mod = types.SimpleNamespace(__name__="stand_in", **({} if version is None else {"BINDINGS_VERSION": version}))
    with pytest.raises(BackendUnavailable, match="cuda-bindings"):
        driver_api(mod)


def test_device_class_figures() -> None:
    assert cublas_workspace_bytes(9) == CUBLAS_WORKSPACE_HOPPER_BYTES == 32 * MiB
    assert cublas_workspace_bytes(8) == cublas_workspace_bytes(10) == CUBLAS_WORKSPACE_BYTES == 4 * MiB
    # never 0, and never below what a context is seen to take per process (~300+ MiB)
    assert [default_context_bytes(cc) for cc in (7, 8, 9, 12)] == [384 * MiB, 512 * MiB, 768 * MiB, 768 * MiB]


def test_a_call_the_binding_refuses_is_a_clear_backend_error_not_a_type_error() -> None:
    """Were the switch ever wrong for a binding (a major it does not know), the worker says which
    binding refused which call - a typed BackendUnavailable, not a TypeError out of set-up."""
    from worker.backends._driver import Driver

    f = FakeDriver(bindings_major=12)
    drv = Driver(f)
    drv.call("cuInit", 0)
    dev = drv.call("cuDeviceGet", 0)
    object.__setattr__(drv, "api", DriverApi(13, "12.9.10"))  # the 13.x shape against a 12.x binding
    with pytest.raises(BackendUnavailable, match=r"cuCtxCreate: cuda-bindings 12\.9\.10 refused"):
        drv.create_context(0, dev)
    with pytest.raises(BackendUnavailable, match="refused the call's arguments"):
        drv.call("cuCtxCreate", None, 0, dev)  # the call the backend made before the switch existed
