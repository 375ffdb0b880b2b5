"""The cuda backend against the fake driver (tests/helpers/fake_cuda.py): set-up, both caps,
metering before any driver call, rollback, copies, kernels vs numpy, cleanup order, failure modes;
and the device budget it meters against."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.device_budget import MAX_SLOTS, DeviceBudget
from shared.errors import BackendUnavailable, CudaError, GpuMemoryExhausted
from shared.exitcodes import STICKY_CUDA_ERRORS
from shared.quota import QuotaBlock
from tests.helpers import fake_cuda
from tests.helpers.fake_cuda import CUresult, FakeDriver
from worker.allocator import MeteredAllocator
from worker.backends import create_backend
from worker.backends.base import DeviceOutOfMemory
from worker.backends.cuda import CudaBackend, round_up

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def backend(fake: FakeDriver | None = None, **kwargs: object) -> tuple[FakeDriver, CudaBackend]:
    f = fake or FakeDriver(memory_bytes=1 << 30)
    return f, CudaBackend(driver=f, nvrtc=f, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def block() -> Iterator[QuotaBlock]:
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=4 * MiB) as b:
        yield b


@pytest.fixture
def budget() -> Iterator[DeviceBudget]:
    with DeviceBudget.create(0, 64 * MiB) as owner:
        worker = DeviceBudget.attach(owner.name)
        try:
            yield worker
        finally:
            worker.close()


def driver_calls(f: FakeDriver) -> list[str]:
    return [c for c in f.calls if c != "cuGetErrorName"]


# ------------------------------------------------------------------ set-up and the pool cap


def test_setup_retains_primary_context_and_makes_a_nonblocking_stream_and_capped_pool() -> None:
    f, b = backend(gpu_cap_bytes=5 * MiB + 3, release_threshold=3 * MiB)
    try:
        order = ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxSetFlags", "cuDevicePrimaryCtxRetain",
                 "cuCtxSetCurrent", "cuStreamCreate", "cuMemGetAllocationGranularity", "cuMemPoolCreate"]
        positions = [f.calls.index(c) for c in order]
        assert positions == sorted(positions)
        assert f.ctx_refs == {0: 1}
        ((_, flags),) = f.streams.values()
        assert flags == fake_cuda.CUstream_flags.CU_STREAM_NON_BLOCKING
        (pool,) = f.pools.values()
        # the release threshold is never set (0): a pool keeping freed memory past a synchronize
        # would hold bytes the device budget has already credited back
        assert "cuMemPoolSetAttribute" not in f.calls
        assert (pool.device, pool.max_size, pool.release_threshold) == (0, 6 * MiB, 0)
        info = b.info()
        assert info["backend"] == "cuda" and info["device_name"] == "Fake CUDA Device"
        assert info["pool_max_size"] == 6 * MiB
        assert info["recorded_cuda_mem_pool_quota"] == 3 * MiB  # reported
        assert info["allocation_granularity"] == 2 * MiB
    finally:
        b.close()


@pytest.mark.parametrize(
    ("cap", "granularity", "expected"),
    [
        (1, 2 * MiB, 2 * MiB),
        (2 * MiB, 2 * MiB, 2 * MiB),
        (2 * MiB + 1, 2 * MiB, 4 * MiB),
        (64 * MiB, 2 * MiB, 64 * MiB),
        (0, 2 * MiB, 2 * MiB),  # a zero cap must not become maxSize 0 ("no limit")
        (None, 2 * MiB, 0),  # no cap: operator trust, the pool is unbounded
        (100_000, 65536, 131072),
    ],
)
def test_pool_max_size_is_the_cap_rounded_up_to_the_granularity(cap: int | None, granularity: int,
                                                                 expected: int) -> None:
    f, b = backend(FakeDriver(granularity=granularity), gpu_cap_bytes=cap)
    try:
        (pool,) = f.pools.values()
        assert pool.max_size == b.pool_max_size == expected
    finally:
        b.close()
    assert round_up(5, 4) == 8 and round_up(8, 4) == 8


def test_second_device_gets_its_own_context_and_pool_location() -> None:
    f, b = backend(FakeDriver(devices=2), device_index=1, gpu_cap_bytes=2 * MiB)
    try:
        assert f.ctx_refs == {1: 1}
        (pool,) = f.pools.values()
        assert pool.device == 1 and b.info()["device"] == 1
    finally:
        b.close()


def test_pool_max_size_is_a_hard_cap_at_the_driver() -> None:
    f, b = backend(gpu_cap_bytes=4 * MiB)
    try:
        with pytest.raises(DeviceOutOfMemory) as exc:
            b.alloc(8 * MiB)
        assert "CUDA_ERROR_OUT_OF_MEMORY" in str(exc.value) and exc.value.limit == 4 * MiB
        got = []
        with pytest.raises(DeviceOutOfMemory):
            for _ in range(100):
                got.append(b.alloc(MiB))
        assert len(got) == 4  # several small allocations stop at the cap
    finally:
        b.close()


def test_release_threshold_alone_does_not_cap() -> None:
    f, b = backend(release_threshold=MiB)
    try:
        buf = b.alloc(64 * MiB)  # far past the threshold: allowed
        b.free(buf)
        b.write(b.alloc(16), 0, memoryview(b"x"))  # a synchronize trims the pool to the threshold
        (pool,) = f.pools.values()
        assert pool.reserved <= 2 * MiB
    finally:
        b.close()


# ------------------------------------------------------------------ metering order


def test_refused_allocation_makes_no_driver_call(block: QuotaBlock, budget: DeviceBudget) -> None:
    f, b = backend(gpu_cap_bytes=4 * MiB)
    alloc = MeteredAllocator("acme", block, b, budget=budget)
    try:
        alloc.alloc(3 * MiB)
        before = list(f.calls)
        with pytest.raises(GpuMemoryExhausted) as exc:
            alloc.alloc(2 * MiB)
        assert f.calls == before  # not one driver call
        assert (exc.value.requested, exc.value.limit, exc.value.current) == (2 * MiB, 4 * MiB, 3 * MiB)
        assert block.gpu_bytes_in_use == 3 * MiB and budget.used_bytes == 3 * MiB
    finally:
        alloc.free_all()
        b.close()


def test_device_budget_refusal_rolls_the_tenant_back_without_a_driver_call() -> None:
    f, b = backend()
    with QuotaBlock.create("acme") as blk, DeviceBudget.create(0, 10 * MiB, reserve_bytes=2 * MiB) as owner:
        shared_budget = DeviceBudget.attach(owner.name)
        alloc = MeteredAllocator("acme", blk, b, instance=0, budget=shared_budget)
        try:
            alloc.alloc(6 * MiB)
            before = list(f.calls)
            with pytest.raises(GpuMemoryExhausted) as exc:
                alloc.alloc(4 * MiB)  # the tenant has no cap, the device budget (8 MiB) refuses
            assert "device 0 budget exhausted" in str(exc.value)
            assert f.calls == before
            assert blk.gpu_bytes_in_use == 6 * MiB and owner.used_bytes == 6 * MiB
            assert owner.snapshot().refusals == 1
        finally:
            alloc.free_all()
            shared_budget.close()
            b.close()
        assert blk.gpu_bytes_in_use == 0 and owner.used_bytes == 0


def test_driver_oom_after_a_successful_consume_rolls_both_counters_back(budget: DeviceBudget) -> None:
    f, b = backend(FakeDriver(memory_bytes=8 * MiB))
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=None) as blk:  # operator trust: only the driver refuses
        attached = QuotaBlock.attach(blk.name, instance=0)
        alloc = MeteredAllocator("acme", attached, b, budget=budget)
        try:
            with pytest.raises(GpuMemoryExhausted) as exc:
                alloc.alloc(16 * MiB)
            # the driver was asked, refused, and asked once more after a drain and a trim
            assert f.count("cuMemAllocFromPoolAsync") == 2 and f.count("cuMemPoolTrimTo") == 1
            assert "CUDA_ERROR_OUT_OF_MEMORY" in str(exc.value)
            assert blk.gpu_bytes_in_use == 0 and budget.used_bytes == 0
            assert blk.instance_share(0) == (0, 0)
        finally:
            attached.close()
            b.close()


def test_other_driver_errors_roll_back_and_carry_the_driver_name(block: QuotaBlock, budget: DeviceBudget) -> None:
    f, b = backend()
    alloc = MeteredAllocator("acme", block, b, budget=budget)
    try:
        f.fail_next("cuMemAllocFromPoolAsync", CUresult.CUDA_ERROR_INVALID_VALUE)
        with pytest.raises(CudaError) as exc:
            alloc.alloc(MiB)
        assert (exc.value.call, exc.value.result_name, exc.value.result_code) == (
            "cuMemAllocFromPoolAsync", "CUDA_ERROR_INVALID_VALUE", 1)
        assert "cuGetErrorName" in f.calls  # the name is the driver's
        assert block.gpu_bytes_in_use == 0 and budget.used_bytes == 0
    finally:
        b.close()


def test_free_returns_bytes_to_both_counters_and_memory_to_the_pool(block: QuotaBlock,
                                                                     budget: DeviceBudget) -> None:
    f, b = backend(gpu_cap_bytes=4 * MiB)
    alloc = MeteredAllocator("acme", block, b, budget=budget)
    try:
        h = alloc.alloc(3 * MiB)
        assert alloc.free(h) == 3 * MiB
        assert block.gpu_bytes_in_use == 0 and budget.used_bytes == 0
        (pool,) = f.pools.values()
        assert pool.used == 0 and b.in_use == 0
        alloc.alloc(4 * MiB)  # the whole cap is usable again
    finally:
        alloc.free_all()
        b.close()


# ------------------------------------------------------------------ copies and kernels


def test_write_read_roundtrip_with_offsets() -> None:
    f, b = backend()
    try:
        buf = b.alloc(1000)
        b.write(buf, 10, memoryview(b"hello"))
        b.write(buf, 995, memoryview(b"tail!"))
        assert b.read(buf, 10, 5) == b"hello" and b.read(buf, 995, 5) == b"tail!"
        dest = bytearray(7)
        b.read_into(buf, 8, memoryview(dest))
        assert bytes(dest) == b"\0\0hello"
        assert b.read(buf, 0, 0) == b""
        assert f.count("cuStreamSynchronize") >= 3  # every copy is complete on return
    finally:
        b.close()


@pytest.mark.parametrize("n", [1, 255, 256, 257, 100_003, 1_000_000])
def test_tensor_ops_match_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    xs = rng.standard_normal(n).astype(np.float32)
    ys = rng.standard_normal(n).astype(np.float32)
    f, b = backend()
    try:
        x, y = b.alloc(4 * n), b.alloc(4 * n)
        b.write(x, 0, memoryview(xs.tobytes()))
        b.fill_f32(y, 0.25, n)
        assert np.array_equal(np.frombuffer(b.read(y, 0, 4 * n), np.float32), np.full(n, 0.25, np.float32))
        b.write(y, 0, memoryview(ys.tobytes()))
        b.axpy_f32(n, 1.5, x, y)
        want = ys + np.float32(1.5) * xs
        got = np.frombuffer(b.read(y, 0, 4 * n), np.float32)
        assert np.array_equal(got, want)
        b.axpy_f32(n, -0.5, y, y)  # x is y
        want = want + np.float32(-0.5) * want
        assert np.array_equal(np.frombuffer(b.read(y, 0, 4 * n), np.float32), want)
        total = b.sum_f32(y, n)
        ref = float(np.add.reduce(want, dtype=np.float32))
        exact = float(np.sum(want, dtype=np.float64))
        assert total == float(np.float32(exact))  # double accumulation, rounded once
        assert total == pytest.approx(ref, rel=1e-5, abs=1e-3 * float(np.abs(want).sum()) / n + 1e-6)
        assert b.sum_f32(y, 0) == 0.0
        assert f.count("nvrtcCompileProgram") == 1  # compiled once per worker
    finally:
        b.close()


def test_kernels_compile_for_the_device_without_fma_contraction() -> None:
    f, b = backend(FakeDriver(compute_capability=(8, 6)))
    try:
        buf = b.alloc(64)
        b.fill_f32(buf, 1.0, 16)
        kernels = b.kernels()
        assert kernels.arch == "sm_86"
        names = [name for name, _, _ in f.launches]
        assert names == [b"twt_fill_f32"]
        (opts,) = f.compile_options
        assert b"--gpu-architecture=sm_86" in opts and b"--fmad=false" in opts
        assert "nvrtcDestroyProgram" in f.calls and not f.programs  # the program is not kept
    finally:
        b.close()


def test_kernels_fall_back_to_ptx_when_nvrtc_does_not_know_the_device() -> None:
    f, b = backend(FakeDriver(nvrtc_archs=("compute_90",)))
    try:
        buf = b.alloc(64)
        b.fill_f32(buf, 3.0, 16)
        assert b.kernels().arch == "compute_90"
        assert np.all(np.frombuffer(b.read(buf, 0, 64), np.float32) == 3.0)
    finally:
        b.close()


@pytest.mark.parametrize("name", STICKY_CUDA_ERRORS)
def test_a_sticky_launch_error_loses_the_context_for_good(name: str) -> None:
    """As on hardware: after a sticky error every later call in the context fails the same way."""
    f, b = backend()
    try:
        buf = b.alloc(64)
        assert b.context_lost is None
        f.fail_next("cuLaunchKernel", CUresult[name])
        with pytest.raises(CudaError) as exc:
            b.fill_f32(buf, 1.0, 16)
        assert exc.value.result_name == name and "sticky" in str(exc.value)
        assert b.context_lost == name
        for op in (lambda: b.fill_f32(buf, 1.0, 16), lambda: b.write(buf, 0, memoryview(b"x" * 8)),
                   lambda: b.read(buf, 0, 8)):
            with pytest.raises(CudaError) as again:
                op()
            assert again.value.result_name == name  # the next launch does NOT work
        with pytest.raises(CudaError):
            b.alloc(64)
        b.free(buf)  # freeing into a lost context is not an error: the process exit frees it
        assert b.in_use == 0
    finally:
        b.close()
    assert "cuMemPoolDestroy" not in f.calls  # nothing torn down through a dead context: the exit frees it


def test_a_kernel_that_faults_reports_illegal_address_at_the_sync_and_after() -> None:
    f, b = backend()
    try:
        with pytest.raises(CudaError) as exc:
            b.inject_kernel_fault()
        assert exc.value.call == "cuStreamSynchronize"
        assert exc.value.result_name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert b.context_lost == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert f.sticky == {0: CUresult.CUDA_ERROR_ILLEGAL_ADDRESS}
        assert f.cuMemGetInfo()[0] == CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    finally:
        b.close()


@pytest.mark.parametrize("name", ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE",
                                  "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"])
def test_non_sticky_errors_keep_the_context(name: str) -> None:
    f, b = backend()
    try:
        buf = b.alloc(64)
        f.fail_next("cuLaunchKernel", CUresult[name])
        with pytest.raises(CudaError) as exc:
            b.fill_f32(buf, 1.0, 16)
        assert exc.value.result_name == name and "sticky" not in str(exc.value)
        assert b.context_lost is None
        b.fill_f32(buf, 2.0, 16)  # the next launch works
        assert np.all(np.frombuffer(b.read(buf, 0, 64), np.float32) == 2.0)
    finally:
        b.close()


def test_missing_nvrtc_is_backend_unavailable_for_tensor_ops_only() -> None:
    f = FakeDriver()
    b = CudaBackend(driver=f, nvrtc=FakeDriver(mode="no-libcuda"))
    try:
        buf = b.alloc(64)  # bytes still move
        b.write(buf, 0, memoryview(b"x" * 64))
        with pytest.raises(BackendUnavailable) as exc:
            b.fill_f32(buf, 1.0, 16)
        assert "NVRTC" in exc.value.reason and "DynamicLibNotFoundError" in exc.value.reason
        assert "tensor-wasm-tenant[cuda]" in exc.value.reason  # which extra brings it
    finally:
        b.close()


# ------------------------------------------------------------------ shutdown


def test_close_frees_everything_in_order_and_a_pop_failure_is_only_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    f, b = backend(gpu_cap_bytes=8 * MiB)
    b.alloc(MiB)
    b.alloc(2 * MiB)
    b.fill_f32(b.alloc(64), 0.0, 16)  # load the kernels (module + scratch)
    f.calls.clear()
    f.fail_next("cuCtxSetCurrent", CUresult.CUDA_ERROR_INVALID_CONTEXT)
    with caplog.at_level(logging.WARNING, logger="twt.worker.cuda"):
        b.close()  # does not raise
    assert driver_calls(f) == [
        "cuMemFreeAsync", "cuMemFreeAsync", "cuMemFreeAsync", "cuStreamSynchronize",
        "cuModuleUnload", "cuMemFree",
        "cuMemPoolDestroy", "cuStreamDestroy", "cuCtxSetCurrent", "cuDevicePrimaryCtxRelease",
    ]
    (rec,) = [r for r in caplog.records if r.getMessage() == "context.pop_failed"]
    assert rec.levelno == logging.WARNING
    fields = rec.twt_fields  # type: ignore[attr-defined]
    assert fields["call"] == "cuCtxSetCurrent" and "CUDA_ERROR_INVALID_CONTEXT" in fields["error"]
    assert f.ctx_refs == {0: 0} and not f.pools and not f.streams and not f.allocs
    f.calls.clear()
    b.close()  # idempotent
    assert f.calls == []
    with pytest.raises(CudaError):
        b.alloc(16)


def test_close_never_raises_when_every_cleanup_call_fails(caplog: pytest.LogCaptureFixture) -> None:
    f, b = backend()
    b.alloc(MiB)
    for name in ("cuMemFreeAsync", "cuStreamSynchronize", "cuMemPoolDestroy", "cuStreamDestroy",
                 "cuCtxSetCurrent", "cuDevicePrimaryCtxRelease"):
        f.fail_next(name, CUresult.CUDA_ERROR_UNKNOWN)
    with caplog.at_level(logging.WARNING, logger="twt.worker.cuda"):
        b.close()
    events = [r.getMessage() for r in caplog.records]
    assert events.count("cuda.cleanup_failed") == 4
    assert "context.pop_failed" in events and "context.release_failed" in events


# ------------------------------------------------------------------ failure modes at start


def test_missing_libcuda_is_backend_unavailable_with_the_reason() -> None:
    with pytest.raises(BackendUnavailable) as exc:
        backend(FakeDriver(mode="no-libcuda"))
    assert exc.value.backend == "cuda"
    assert "DynamicLibNotFoundError" in exc.value.reason and "cuInit" in exc.value.reason
    assert issubclass(fake_cuda.DynamicLibNotFoundError, RuntimeError)


def test_no_device_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        backend(FakeDriver(mode="no-device"))


def test_other_init_failures_are_cuda_errors_named_by_the_driver() -> None:
    with pytest.raises(CudaError) as exc:
        backend(FakeDriver(mode="driver-mismatch"))
    assert (exc.value.call, exc.value.result_name, exc.value.result_code) == (
        "cuInit", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 803)


def test_device_index_that_does_not_exist() -> None:
    with pytest.raises(BackendUnavailable, match=r"device 3 does not exist \(2 CUDA device"):
        backend(FakeDriver(devices=2), device_index=3)


def test_device_without_memory_pools() -> None:
    f = FakeDriver(pools_supported=False)
    with pytest.raises(BackendUnavailable, match="memory pools"):
        backend(f)
    assert f.ctx_refs.get(0, 0) == 0


def test_a_failure_half_way_releases_what_was_made() -> None:
    f = FakeDriver()
    f.fail_next("cuMemPoolCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(CudaError) as exc:
        backend(f, gpu_cap_bytes=MiB)
    assert exc.value.call == "cuMemPoolCreate"
    assert not f.streams and f.ctx_refs == {0: 0}
    assert driver_calls(f)[-3:] == ["cuStreamDestroy", "cuCtxSetCurrent", "cuDevicePrimaryCtxRelease"]


def test_double_free_at_the_driver_is_an_invalid_value() -> None:
    f, b = backend()
    try:
        buf = b.alloc(64)
        f.fail_next("cuMemFreeAsync", CUresult.CUDA_ERROR_INVALID_VALUE)
        with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
            b.free(buf)
        # the fake itself refuses a pointer it does not know
        err, = f.cuMemFreeAsync(fake_cuda.CUdeviceptr(12345), fake_cuda.CUstream(0))
        assert err == CUresult.CUDA_ERROR_INVALID_VALUE
    finally:
        b.close()


# ------------------------------------------------------------------ injected by module name


@pytest.fixture
def fake_by_name(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        monkeypatch.delenv(key, raising=False)  # restored (removed) after the test
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    fake_cuda.reset(None)
    yield
    fake_cuda.reset(None)


def test_create_backend_loads_the_driver_module_named_in_the_options(fake_by_name: None) -> None:
    b = create_backend("cuda", {"driver_module": "tests.helpers.fake_cuda", "nvrtc_module": "tests.helpers.fake_cuda",
                                "device_index": 1, "gpu_memory_bytes_cap": 3 * MiB,
                                "recorded_cuda_mem_pool_quota": MiB})
    try:
        info = b.info()
        assert (info["driver_module"], info["device"], info["pool_max_size"]) == ("tests.helpers.fake_cuda", 1, 4 * MiB)
        assert fake_cuda.instance().ctx_refs == {1: 1}
    finally:
        b.close()


def test_mps_environment_is_in_place_before_cuinit(fake_by_name: None) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/twt-test-mps", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=130M",
           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    b = create_backend("cuda", {"driver_module": "tests.helpers.fake_cuda", "environment": env})
    try:
        assert fake_cuda.instance().init_environment == env
        assert b.info()["environment"] == env
    finally:
        b.close()


def test_unknown_driver_module_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match="not importable"):
        create_backend("cuda", {"driver_module": "tests.helpers.no_such_driver"})


def test_the_fake_has_the_real_bindings_shapes() -> None:
    real = pytest.importorskip("cuda.bindings.driver")
    for enum_name in ("CUresult", "CUmemPool_attribute", "CUstream_flags", "CUmemAllocationType",
                      "CUmemAllocationHandleType", "CUmemLocationType", "CUmemAllocationGranularity_flags",
                      "CUdevice_attribute"):
        for member in getattr(fake_cuda, enum_name):
            assert int(getattr(getattr(real, enum_name), member.name)) == int(member), (enum_name, member.name)
    for struct in ("CUmemPoolProps", "CUmemLocation", "CUmemAllocationProp"):
        fake_fields = set(getattr(fake_cuda, struct)._fields)
        assert fake_fields <= set(dir(getattr(real, struct)())), struct
    used = [n for n in dir(FakeDriver) if n.startswith("cu") and callable(getattr(FakeDriver, n))]
    assert used and all(hasattr(real, n) for n in used), [n for n in used if not hasattr(real, n)]
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    for member in fake_cuda.nvrtcResult:
        assert int(getattr(nvrtc.nvrtcResult, member.name)) == int(member)
    assert all(hasattr(nvrtc, n) for n in dir(FakeDriver) if n.startswith("nvrtc") and n != "nvrtcResult"
               and callable(getattr(FakeDriver, n)))


# ------------------------------------------------------------------ the device budget


def test_device_budget_counts_refuses_and_reports() -> None:
    with DeviceBudget.create(3, 100 * MiB, reserve_bytes=36 * MiB) as owner:
        assert (owner.device_index, owner.capacity_bytes, owner.limit_bytes) == (3, 100 * MiB, 64 * MiB)
        a, b = DeviceBudget.attach(owner.name), DeviceBudget.attach(owner.name)
        reader = DeviceBudget.attach(owner.name, claim_slot=False)
        try:
            assert a.slot != b.slot and reader.slot is None
            a.consume(40 * MiB)
            b.consume(20 * MiB)
            with pytest.raises(GpuMemoryExhausted):
                b.consume(5 * MiB)
            snap = reader.snapshot()
            assert (snap.used_bytes, snap.free_bytes, snap.refusals, snap.high_water) == (
                60 * MiB, 4 * MiB, 1, 60 * MiB)
            assert sorted(h[2] for h in snap.holders) == [20 * MiB, 40 * MiB]
            a.release(40 * MiB)
            assert owner.used_bytes == 20 * MiB
            owner.set_capacity(30 * MiB, 0)
            assert owner.free_bytes == 10 * MiB
            assert owner.reclaim_dead() == []  # every holder is alive (this process)
        finally:
            for x in (a, b, reader):
                x.close()


_CHILD = r"""
import sys, time
from shared.device_budget import DeviceBudget
b = DeviceBudget.attach(sys.argv[1])
b.consume(int(sys.argv[2]))
print(b.slot, flush=True)
time.sleep(60)
"""


def test_device_budget_returns_a_killed_workers_share() -> None:
    with DeviceBudget.create(0, 64 * MiB) as owner:
        mine = DeviceBudget.attach(owner.name)
        mine.consume(MiB)
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, owner.name, str(5 * MiB)], stdout=subprocess.PIPE,
                                cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            assert proc.stdout is not None
            slot = int(proc.stdout.readline())
            assert owner.used_bytes == 6 * MiB
            assert owner.reclaim_dead() == []
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            assert owner.reclaim_dead() == [(slot, proc.pid, 5 * MiB)]
            assert owner.used_bytes == MiB  # ours stays
            assert all(h[0] != slot for h in owner.snapshot().holders)  # the slot is free again
            again = DeviceBudget.attach(owner.name)
            assert again.slot == slot
            again.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
            mine.close()


def test_device_budget_has_a_bounded_number_of_slots() -> None:
    assert MAX_SLOTS >= 256
    t0 = time.perf_counter()
    with DeviceBudget.create(0, MiB) as owner:
        assert owner.reclaim_dead() == []
    assert time.perf_counter() - t0 < 20.0  # a scan of unbounded slots would take minutes: generous


def test_every_error_the_driver_documents_as_sticky_is_classified_sticky() -> None:
    real = pytest.importorskip("cuda.bindings.driver")
    documented = {m.name for m in real.CUresult
                  if "terminated and relaunched" in " ".join((m.__doc__ or "").split())}
    assert documented and documented <= set(STICKY_CUDA_ERRORS)
    assert {"CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE"}.isdisjoint(STICKY_CUDA_ERRORS)
    assert all(hasattr(real.CUresult, n) for n in STICKY_CUDA_ERRORS)


def test_structs_refuse_unknown_fields_and_wrong_types_like_the_real_ones() -> None:
    real = pytest.importorskip("cuda.bindings.driver")
    for mod in (fake_cuda, real):
        props = mod.CUmemPoolProps()
        with pytest.raises(AttributeError):
            props.maxsize = 1  # type: ignore[attr-defined]  (a typo: the field is maxSize)
        with pytest.raises(TypeError):
            props.maxSize = "64"
        with pytest.raises(OverflowError):
            props.maxSize = -1
        with pytest.raises(ValueError):
            props.allocType = "pinned"
        props.allocType = 1  # an int of a member is taken, and becomes the member
        assert props.allocType == mod.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        with pytest.raises(TypeError):
            props.location.id = "0"
        with pytest.raises(TypeError):
            mod.CUdeviceptr("0x10")


def test_handles_compare_as_the_real_ones_do() -> None:
    real = pytest.importorskip("cuda.bindings.driver")
    for mod in (fake_cuda, real):
        # value wrappers: identity
        for t in (mod.CUdeviceptr, mod.CUdevice, mod.cuuint64_t):
            a, b = t(7), t(7)
            assert a != b and int(a) == int(b) == 7 and a != 7
        # object handles: by value, hashable, never equal to an int
        for t in (mod.CUstream, mod.CUcontext, mod.CUmemoryPool):
            a, b = t(7), t(7)
            assert a == b and hash(a) == hash(b) and a != t(8) and a != 7 and int(a) == 7


def test_kernel_sources_compile_with_the_real_nvrtc_and_a_syntax_error_fails() -> None:
    """With NVRTC installed (the 'cuda' extra) the fake really compiles: a broken kernel fails the suite."""
    if fake_cuda.real_nvrtc_module() is None:
        pytest.skip("NVRTC not loadable here (pip install -e '.[cuda]' brings it)")
    from worker.backends import kernels

    f, b = backend()
    try:
        buf = b.alloc(64)
        b.fill_f32(buf, 1.0, 16)
        assert f.real_compiles >= 1  # the kernels went through the real compiler
    finally:
        b.close()
    broken = kernels.KERNEL_SOURCE.replace("p[i] = v;", "p[i] = v +;")
    f2, b2 = backend()
    try:
        original = kernels.KERNEL_SOURCE
        kernels.KERNEL_SOURCE = broken
        try:
            with pytest.raises(CudaError) as exc:
                b2.kernels()
        finally:
            kernels.KERNEL_SOURCE = original
        assert exc.value.result_name == "NVRTC_ERROR_COMPILATION" and "expected an expression" in str(exc.value)
    finally:
        b2.close()


def test_a_runs_processes_share_each_real_nvrtc_result_and_a_changed_source_compiles_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FAKE_CUDA_NVRTC_CACHE set (as the suite sets it), a source compiled by one process is read
    by the next one: the same PTX, or the same error log, with no second real compile and without
    loading NVRTC; a changed source or other options compile for real again."""
    if fake_cuda.real_nvrtc_module() is None:
        pytest.skip("NVRTC not loadable here (pip install -e '.[cuda]' brings it)")
    from worker.backends import kernels

    monkeypatch.setenv(fake_cuda.NVRTC_CACHE_ENV, str(tmp_path / "nvrtc"))
    real = fake_cuda._compile_with
    compiles: list[str] = []

    def counting(mod: Any, src: str, opts: tuple[bytes, ...]) -> tuple[bool, bytes] | None:
        compiles.append(src)
        return real(mod, src, opts)

    monkeypatch.setattr(fake_cuda, "_compile_with", counting)
    monkeypatch.setattr(fake_cuda, "_compiled", {})  # this process has compiled nothing yet
    opts = [b"--gpu-architecture=compute_75"]
    broken = kernels.KERNEL_SOURCE.replace("p[i] = v;", "p[i] = v +;")
    first = fake_cuda.compile_with_real_nvrtc(kernels.KERNEL_SOURCE, opts)
    failed = fake_cuda.compile_with_real_nvrtc(broken, opts)
    assert first is not None and first[0] and b".entry twt_fill_f32" in first[1], first
    assert failed is not None and not failed[0] and b"expected an expression" in failed[1], failed
    assert len(compiles) == 2 and len(list((tmp_path / "nvrtc").iterdir())) == 2
    monkeypatch.setattr(fake_cuda, "_compiled", {})  # another process of the run: NVRTC not loaded yet
    monkeypatch.setattr(fake_cuda, "_real_nvrtc_state", [])
    loads: list[int] = []
    real_module = fake_cuda.real_nvrtc_module
    monkeypatch.setattr(fake_cuda, "real_nvrtc_module", lambda: loads.append(1) or real_module())
    assert fake_cuda.compile_with_real_nvrtc(kernels.KERNEL_SOURCE, opts) == first
    assert fake_cuda.compile_with_real_nvrtc(broken, opts) == failed
    assert len(compiles) == 2, "a second process compiled again"
    assert loads == [], "a second process loaded NVRTC to read what the first compiled"
    monkeypatch.setattr(fake_cuda, "_compiled", {})  # a process where NVRTC does not load: nothing, as before
    monkeypatch.setattr(fake_cuda, "_real_nvrtc_state", [None])
    assert fake_cuda.compile_with_real_nvrtc(kernels.KERNEL_SOURCE, opts) is None
    monkeypatch.setattr(fake_cuda, "_real_nvrtc_state", [])
    changed = kernels.KERNEL_SOURCE + "\n// changed\n"
    assert fake_cuda.compile_with_real_nvrtc(changed, opts) is not None
    assert fake_cuda.compile_with_real_nvrtc(kernels.KERNEL_SOURCE, [b"--gpu-architecture=compute_80"]) is not None
    assert compiles[2:] == [changed, kernels.KERNEL_SOURCE], "a new source or new options were not compiled"
    monkeypatch.delenv(fake_cuda.NVRTC_CACHE_ENV)  # unset: nothing shared, every process compiles
    monkeypatch.setattr(fake_cuda, "_compiled", {})
    assert fake_cuda.compile_with_real_nvrtc(kernels.KERNEL_SOURCE, opts) == first and len(compiles) == 5
