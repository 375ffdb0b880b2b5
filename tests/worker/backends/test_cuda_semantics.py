"""The cuda backend against the driver's *semantics*, not only its types.

The fake driver queues work on a stream and runs it later (at a synchronize,
an event or stream query), surfaces a kernel's fault only there, keeps a
free's bytes outstanding until it has run, lets a release threshold keep
freed memory until a synchronize, has primary-context flags and charges
contexts, modules and cuBLAS's default pool against the device. Each test
here is for one behaviour the backend must get right on hardware.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shared.cuda_compat import default_context_bytes
from shared.device_budget import DeviceBudget
from shared.errors import CudaError, GpuMemoryExhausted, InvalidArgument, KernelTimeout
from shared.exitcodes import WORKER_GPU_QUEUE_OVERRUN, exit_cause, exit_reason
from shared.quota import QuotaBlock
from tests.helpers.fake_cublas import FakeCublas, Status
from tests.helpers.fake_cuda import CUmemPool_attribute, CUresult, FakeDriver
from tests.helpers.wasm_env import probe as wasm_probe
from tests.helpers.wasm_env import tenant_env
from worker.allocator import MeteredAllocator
from worker.backends.cuda import (
    QUEUE_EVENT_EVERY,
    QUEUE_MAX_EVENTS,
    CudaBackend,
    QueueOverrun,
)
from worker.backends.cuda_scratch import FIXED_SCRATCH_BYTES

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
#: the most async ops one backend may have queued (an event every EVERY ops, wait past MAX events)
QUEUE_BOUND = QUEUE_EVENT_EVERY * (QUEUE_MAX_EVENTS + 1)


def make(fake: FakeDriver | None = None, **kwargs: Any) -> tuple[FakeDriver, CudaBackend]:
    f = fake or FakeDriver(memory_bytes=1 << 30)
    kwargs.setdefault("cublas", FakeCublas(f))
    return f, CudaBackend(driver=f, nvrtc=f, **kwargs)


def stream_of(b: CudaBackend) -> int:
    return int(b._stream)


@pytest.fixture
def budget() -> Iterator[DeviceBudget]:
    with DeviceBudget.create(0, 512 * MiB) as owner:
        worker = DeviceBudget.attach(owner.name)
        try:
            yield worker
        finally:
            worker.close()


# ------------------------------------------------------------------ the fake models the driver


def test_the_fake_stream_queues_and_a_fault_surfaces_at_the_synchronize() -> None:
    f, b = make()
    try:
        buf = b.alloc(64)
        ops = b.tensor_ops()
        ops.binary_f32(0, int(buf.ptr), int(buf.ptr), int(buf.ptr), 16)
        assert f.pending(b._stream) == 1  # queued, not run
        ops.binary_f32(0, 0x100, 0x100, 0x100, 16)  # a bad address: the launch itself succeeds
        assert b.context_lost is None and not f.sticky
        with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
            b._drv.call("cuStreamSynchronize", b._stream)
        assert b.context_lost == "CUDA_ERROR_ILLEGAL_ADDRESS"
    finally:
        b.close()


def test_the_fake_release_threshold_keeps_freed_memory_until_a_synchronize() -> None:
    f = FakeDriver(memory_bytes=1 << 30)
    b = CudaBackend(driver=f, nvrtc=f)
    try:
        pool = b._pool
        f.cuMemPoolSetAttribute(pool, CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, f.cuuint64_t(64 * MiB))
        buf = b.alloc(8 * MiB)
        b.free(buf)
        assert b.pool_attribute("RESERVED_MEM_CURRENT") == 8 * MiB  # the free has not run yet
        b._drv.call("cuStreamSynchronize", b._stream)
        assert b.pool_attribute("RESERVED_MEM_CURRENT") == 8 * MiB  # kept: under the threshold
        b._drv.call("cuMemPoolTrimTo", pool, 0)
        assert b.pool_attribute("RESERVED_MEM_CURRENT") == 0  # only a trim gives it back
    finally:
        b.close()


# ------------------------------------------------------------------ queued work is bounded


def test_queued_work_per_run_is_bounded() -> None:
    f, b = make()
    try:
        buf = b.alloc(4096)
        b.begin_run(time.monotonic() + 30)
        most = 0
        for _ in range(20 * QUEUE_BOUND):
            b.add_f32(buf, buf, buf, 1024)
            most = max(most, f.pending(b._stream))
        assert 0 < most <= QUEUE_BOUND
        assert f.blocking_waits == 0
        b.end_run(time.monotonic() + 30)
        assert f.pending(b._stream) == 0
    finally:
        b.close()


def test_a_wait_for_queued_work_ends_at_the_runs_limit_and_the_worker_must_exit() -> None:
    f, b = make(queue_grace_s=0.05)
    try:
        buf = b.alloc(4096)
        f.stalled.add(stream_of(b))  # a kernel that never ends
        b.begin_run(time.monotonic())
        with pytest.raises(QueueOverrun) as info:
            for _ in range(20 * QUEUE_BOUND):
                b.add_f32(buf, buf, buf, 1024)
        assert isinstance(info.value, KernelTimeout)
        assert f.pending(b._stream) <= QUEUE_BOUND + 1
        assert b.queue_overrun
        with pytest.raises(QueueOverrun):  # the run's end says so again: the worker must exit
            b.end_run(time.monotonic())
        assert f.blocking_waits == 0  # no wait ever blocked on the stalled stream
    finally:
        b.close()
    assert f.blocking_waits == 0  # close does not synchronize a stream it cannot drain
    assert f.ctx_refs == {0: 1}  # left to the process exit (which destroys the context and its queue)


@pytest.mark.parametrize("op", ["max_f32", "read", "sum_f32"])
def test_a_wait_for_the_host_inside_a_run_is_bounded_too(op: str) -> None:
    """A reduction to the host or a copy waits behind the queued work: that wait ends at the run's
    limit as well (a blocking cuStreamSynchronize could not be cut short)."""
    f, b = make(queue_grace_s=0.05)
    try:
        x = b.alloc(4096)
        b.begin_run(time.monotonic())
        b.add_f32(x, x, x, 1024)  # queued
        f.stalled.add(stream_of(b))
        with pytest.raises(QueueOverrun):
            if op == "max_f32":
                b.max_f32(x, 16, memoryview(bytearray(4)))
            elif op == "read":
                b.read(x, 0, 64)
            else:
                b.sum_f32(x, 16)
        assert f.blocking_waits == 0
    finally:
        b.close()


def test_run_end_waits_for_queued_work_within_the_grace_then_returns_memory() -> None:
    f, b = make(queue_grace_s=0.05)
    try:
        free_at_start = b.mem_info()[0]
        buf = b.alloc(8 * MiB)
        b.begin_run(time.monotonic() + 30)
        b.add_f32(buf, buf, buf, 1024)
        b.free(buf)
        assert f.pending(b._stream) == 2
        b.end_run(time.monotonic() + 30)
        assert f.pending(b._stream) == 0
        assert b.pool_attribute("RESERVED_MEM_CURRENT") == 0
        assert b.mem_info()[0] == free_at_start

        buf = b.alloc(4096)
        b.add_f32(buf, buf, buf, 1024)
        f.stalled.add(stream_of(b))
        t0 = time.monotonic()
        with pytest.raises(QueueOverrun, match="only destroying the CUDA context cancels it"):
            b.end_run(t0)  # the deadline has passed: the grace period only
        assert b.queue_overrun
    finally:
        b.close()


def test_a_wasm_run_whose_gpu_work_outlives_its_deadline_ends_the_worker() -> None:
    """Through the worker's run_wasm op: KernelTimeout to the client, exit code 73 for the supervisor."""
    from worker.wasm import ops as wasm_ops

    f, b = make(gpu_cap_bytes=64 * MiB, queue_grace_s=0.05)
    with tenant_env("gpu", b, gpu_cap=64 * MiB, wasm_timeout_s=2.0) as env:
        server = _FakeServer(env.ctx)
        f.stalled.add(stream_of(b))
        wat = _guest_adding(4 * QUEUE_BOUND)
        body = memoryview(wat.encode())
        with pytest.raises(KernelTimeout):
            wasm_ops.op_run_wasm(server, {"export": "run", "timeout_s": 2.0}, _Body(body))  # type: ignore[arg-type]
        assert server.exit_code == WORKER_GPU_QUEUE_OVERRUN and server.stop_event.is_set()
        f.stalled.clear()  # (so the test's own teardown can free)
        b.queue_overrun = False
    assert exit_cause(WORKER_GPU_QUEUE_OVERRUN, None) == "gpu_queue_overrun"
    assert "queued GPU work" in exit_reason(WORKER_GPU_QUEUE_OVERRUN)


class _Body:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer


class _FakeServer:
    def __init__(self, ctx: Any) -> None:
        import threading

        self.ctx = ctx
        self.exit_code: int | None = None
        self.stop_event = threading.Event()

    def require_context(self) -> Any:
        return self.ctx


def _guest_adding(times: int) -> str:
    """A guest that allocates a buffer and adds it to itself ``times`` times (all queued GPU work)."""
    return f"""(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "add_f32" (func $add (param i64 i64 i64 i64) (result i32)))
  (memory (export "memory") 1)
  (func (export "run") (result i32)
    (local $h i64) (local $i i32)
    (local.set $h (call $alloc (i64.const 4096)))
    (block $done
      (loop $again
        (br_if $done (i32.ge_u (local.get $i) (i32.const {times})))
        (drop (call $add (local.get $h) (local.get $h) (local.get $h) (i64.const 1024)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $again)))
    (i32.const 0)))"""


# ------------------------------------------------------------------ memory really returned


def test_an_explicit_free_gives_the_memory_back_to_the_device(budget: DeviceBudget) -> None:
    f, b = make(gpu_cap_bytes=64 * MiB)
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=64 * MiB) as block:
        alloc = MeteredAllocator("acme", block, b)
        try:
            free_at_start = b.mem_info()[0]
            h = alloc.alloc(40 * MiB)
            assert b.mem_info()[0] == free_at_start - 40 * MiB
            alloc.free(h)
            assert block.gpu_bytes_in_use == 0
            # the metered bytes were credited back: the device must have them back too
            assert b.pool_attribute("RESERVED_MEM_CURRENT") == 0
            assert b.mem_info()[0] == free_at_start
            assert f.count("cuMemPoolTrimTo") == 1
        finally:
            alloc.free_all()
            b.close()


def test_a_wasm_run_gives_its_freed_memory_back_at_its_end() -> None:
    f, b = make(gpu_cap_bytes=64 * MiB)
    with tenant_env("gpu", b, gpu_cap=64 * MiB) as env:
        free_at_start = b.mem_info()[0]
        with wasm_probe(env, timeout_s=30.0) as s:
            (h,) = s.call("alloc", [32 * MiB])
            assert h > 0
            assert s.call("free", [h]) == [0]  # an explicit free inside the run: batched to the run's end
            (h2,) = s.call("alloc", [16 * MiB])
            assert h2 > 0
        assert b.mem_info()[0] == free_at_start
        assert b.pool_attribute("RESERVED_MEM_CURRENT") == 0


def test_a_pool_oom_drains_trims_and_retries_once() -> None:
    f, b = make(gpu_cap_bytes=4 * MiB)
    try:
        first = b.alloc(3 * MiB)
        b.free(first)  # queued: its bytes are outstanding until the stream runs it
        second = b.alloc(3 * MiB)  # refused at first, then drained, trimmed and retried
        assert f.count("cuMemAllocFromPoolAsync") == 3 and f.count("cuMemPoolTrimTo") == 1
        b.free(second)
    finally:
        b.close()


# ------------------------------------------------------------------ every byte metered


def test_the_fixed_overhead_is_measured_and_charged_to_the_device_budget(budget: DeviceBudget) -> None:
    f = FakeDriver(memory_bytes=1 << 30, context_bytes=48 * MiB, module_bytes=2 * MiB)
    cub = FakeCublas(f, default_pool_bytes=32 * MiB)
    _, b = make(f, cublas=cub, gpu_cap_bytes=64 * MiB)
    try:
        # the context (measured with a throw-away one) and the fixed scratch (one granularity chunk)
        assert b.context_bytes == 48 * MiB
        b.attach_overhead_meter(budget)
        assert budget.used_bytes == b.overhead_bytes == 48 * MiB + 2 * MiB
        assert budget.used_bytes == f.device_reserved(0)  # every byte the device lost is charged
        x = b.alloc(4096)
        b.fill_f32(x, 1.0, 4)  # the kernels' module
        b.matmul_f32(x, x, b.alloc(4096), 2, 2, 2)  # the ops' module and cuBLAS (its default pool)
        pool_bytes = b.pool_attribute("RESERVED_MEM_CURRENT")
        assert budget.used_bytes == f.device_reserved(0) - pool_bytes == 48 * MiB + 2 * MiB + 2 * 2 * MiB + 32 * MiB
        assert b.info()["fixed_overhead_bytes"] == budget.used_bytes
    finally:
        b.close()
    assert budget.used_bytes == 0


def test_a_device_refusing_a_second_context_is_not_fatal_and_context_bytes_skips_the_measure() -> None:
    f = FakeDriver(memory_bytes=1 << 30, context_bytes=48 * MiB)
    f.fail_next("cuCtxCreate", CUresult.CUDA_ERROR_INVALID_DEVICE)  # e.g. compute mode EXCLUSIVE_PROCESS
    _, b = make(f)
    try:
        # never counted as free: the device class's conservative figure (Hopper here), logged
        assert b.context_bytes == default_context_bytes(9) and b.context_bytes_source == "default"
        assert b.overhead_bytes == default_context_bytes(9) + 2 * MiB
        b.alloc(4096)  # and the backend works: its own context is current again
    finally:
        b.close()
    g = FakeDriver(memory_bytes=1 << 30, context_bytes=48 * MiB)
    _, b = make(g, context_bytes=64 * MiB)  # known (e.g. from the hardware check's figures): not measured
    try:
        assert "cuCtxCreate" not in g.calls
        assert b.overhead_bytes == 64 * MiB + 2 * MiB
    finally:
        b.close()


def test_a_device_without_room_for_the_workers_overhead_refuses_it() -> None:
    f = FakeDriver(memory_bytes=1 << 30, context_bytes=48 * MiB)
    _, b = make(f)
    try:
        with DeviceBudget.create(0, 32 * MiB) as small:
            with pytest.raises(GpuMemoryExhausted):
                b.attach_overhead_meter(small)
            assert small.used_bytes == 0
    finally:
        b.close()


def test_a_bind_the_device_budget_cannot_hold_releases_the_context() -> None:
    """Through TenantContext.create (the worker's bind): refused, and the backend closed again."""
    from shared.spec import TenantSpec
    from worker.context import TenantContext

    f = FakeDriver(memory_bytes=1 << 30, context_bytes=48 * MiB)
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=64 * MiB) as owner, \
            DeviceBudget.create(0, 32 * MiB) as small:
        with pytest.raises(GpuMemoryExhausted, match="budget exhausted"):
            TenantContext.create(TenantSpec("acme"), instance=0, incarnation=0, segment=owner.name, backend="cuda",
                                 backend_options={"driver_module": f, "nvrtc_module": f}, budget=small)
        assert small.used_bytes == 0
        assert f.ctx_refs == {0: 0} and not f.pools and not f.allocs  # the backend was closed


def test_the_per_instance_pool_cap_is_the_tenants_cap_a_k_times_cap_backstop() -> None:
    """Each instance's pool maxSize is the tenant's whole cap, so k instances may together reach
    k x cap at the driver; the shared quota block is what holds the tenant to its cap."""
    f = FakeDriver(memory_bytes=1 << 30)
    cap = 8 * MiB
    _, b0 = make(f, gpu_cap_bytes=cap)
    _, b1 = make(f, gpu_cap_bytes=cap)
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=cap) as owner:
        a0 = MeteredAllocator("acme", QuotaBlock.attach(owner.name, instance=0), b0, instance=0)
        a1 = MeteredAllocator("acme", QuotaBlock.attach(owner.name, instance=1), b1, instance=1)
        try:
            a0.alloc(6 * MiB)
            with pytest.raises(GpuMemoryExhausted):
                a1.alloc(6 * MiB)  # the metered cap is across instances
            assert f.count("cuMemAllocFromPoolAsync") == 1  # refused before the driver
            # the driver backstop alone: each pool takes up to the cap -> 2 x cap in all
            raw = [b0.alloc(2 * MiB), b1.alloc(cap)]
            assert sum(p.used for p in f.pools.values()) == 6 * MiB + 2 * MiB + cap > cap
            b0.free(raw[0])
            b1.free(raw[1])
        finally:
            a0.free_all()
            a1.free_all()
            a0.block.close()
            a1.block.close()
            b0.close()
            b1.close()


def test_the_pool_cap_the_driver_enforces_is_read_back() -> None:
    """The driver may round maxSize up: the backend reports (and names in a refusal) what it enforces."""
    f, b = make(FakeDriver(memory_bytes=1 << 30, pool_size_granularity=4 * MiB), gpu_cap_bytes=6 * MiB)
    try:
        assert (b.pool_max_size, b.pool_max_size_effective) == (6 * MiB, 8 * MiB)
        assert b.info()["pool_max_size_effective"] == 8 * MiB
        held = b.alloc(7 * MiB)  # past the size asked for, within what the driver enforces
        with pytest.raises(Exception, match="pool maxSize 8,388,608 B"):
            b.alloc(2 * MiB)
        b.free(held)
    finally:
        b.close()


# ------------------------------------------------------------------ context flags, cuBLAS errors


def test_the_primary_context_blocks_on_waits_set_before_its_first_use() -> None:
    f, b = make()
    try:
        assert f.primary_flags[0] & 7 == f.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC
        assert f.flags_set_while_active == 0  # set before the retain made it active
        assert f.calls.index("cuDevicePrimaryCtxSetFlags") < f.calls.index("cuDevicePrimaryCtxRetain")
    finally:
        b.close()


def test_a_cublas_error_over_a_lost_context_marks_the_context_lost() -> None:
    f, b = make()
    try:
        x = b.alloc(4096)
        b.matmul_f32(x, x, x, 2, 2, 2)  # cuBLAS loaded
        b.tensor_ops().binary_f32(0, 0x100, 0x100, 0x100, 16)  # a faulting kernel, queued
        b.tensor_ops().cublas.mod.fail_next("sgemm", Status.EXECUTION_FAILED)
        with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
            b.matmul_f32(x, x, b.alloc(4096), 2, 2, 2)
        assert b.context_lost == "CUDA_ERROR_ILLEGAL_ADDRESS"  # the worker exits after this request
        assert "cuStreamQuery" in f.calls
    finally:
        b.close()


def test_a_plain_cublas_error_stays_a_plain_error() -> None:
    f, b = make()
    try:
        x = b.alloc(4096)
        b.matmul_f32(x, x, x, 2, 2, 2)
        b.tensor_ops().cublas.mod.fail_next("sgemm", Status.INVALID_VALUE)
        with pytest.raises(CudaError, match="CUBLAS_STATUS_INVALID_VALUE"):
            b.matmul_f32(x, x, x, 2, 2, 2)
        assert b.context_lost is None
    finally:
        b.close()


# ------------------------------------------------------------------ the smaller items


def test_nvrtc_output_goes_into_a_buffer_of_its_own() -> None:
    """``b" " * 1`` is CPython's one shared ``b" "``: NVRTC writing into it would change every b" "."""
    from tests.helpers.fake_cuda import _fill_bytes, nvrtcResult
    from worker.backends._driver import Nvrtc
    from worker.backends.kernels import compile_source

    class OneByteNvrtc:
        def nvrtcCreateProgram(self, *args: Any) -> tuple[Any, ...]:  # noqa: N802
            return (nvrtcResult.NVRTC_SUCCESS, 1)

        def nvrtcCompileProgram(self, *args: Any) -> tuple[Any, ...]:  # noqa: N802
            return (nvrtcResult.NVRTC_SUCCESS,)

        def nvrtcGetCUBINSize(self, prog: Any) -> tuple[Any, ...]:  # noqa: N802
            return (nvrtcResult.NVRTC_SUCCESS, 1)

        def nvrtcGetCUBIN(self, prog: Any, out: Any) -> tuple[Any, ...]:  # noqa: N802
            _fill_bytes(out, b"\0")  # in place, as the real binding writes a char *
            return (nvrtcResult.NVRTC_SUCCESS,)

        def nvrtcDestroyProgram(self, prog: Any) -> tuple[Any, ...]:  # noqa: N802
            return (nvrtcResult.NVRTC_SUCCESS,)

    space = b" "
    try:
        image, arch = compile_source(Nvrtc(OneByteNvrtc()), "src", "x.cu", 9, 0)
        assert (image, arch) == (b"\0", "sm_90")
        assert space[0] == 0x20 and bytes([0x20]) == b" "
    finally:
        if space[0] != 0x20:  # the old code wrote into the shared object: put it back
            _fill_bytes(space, b" ")


def test_argmax_refuses_rows_wider_than_its_int32_indices() -> None:
    f, b = make()
    try:
        x = b.alloc(4096)
        out = memoryview(bytearray(4))
        with pytest.raises(InvalidArgument, match="int32"):
            b.argmax_rows_f32(x, 1, 1 << 31, out)
        assert not any(name == b"twt_argmax_rows_f32" for name, _, _ in f.launches)
    finally:
        b.close()


def test_pinned_memory_is_unregistered_only_after_the_final_synchronize() -> None:
    f, b = make()
    host = bytearray(1 << 16)
    addr = b.pin_host(memoryview(host))
    assert addr is not None
    x = b.alloc(4096)
    b.add_f32(x, x, x, 1024)  # queued work at close
    b.close()
    assert getattr(f, "unregistered_under_queued_work", 0) == 0
    assert not f.host_registered


def test_a_non_sticky_free_error_keeps_the_buffer_metered_until_it_is_freed(budget: DeviceBudget) -> None:
    f, b = make(gpu_cap_bytes=64 * MiB)
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=64 * MiB) as block:
        alloc = MeteredAllocator("acme", block, b, budget=budget)
        try:
            h = alloc.alloc(3 * MiB)
            f.fail_next("cuMemFreeAsync", CUresult.CUDA_ERROR_INVALID_VALUE)
            with pytest.raises(CudaError, match="INVALID_VALUE"):
                alloc.free(h)
            # the pool may still hold it: still metered, still the client's handle, still the backend's
            assert block.gpu_bytes_in_use == 3 * MiB and budget.used_bytes >= 3 * MiB
            assert alloc.handles() == {h: 3 * MiB} and b.in_use == 3 * MiB
            assert alloc.free(h) == 3 * MiB  # freed for real this time
            assert block.gpu_bytes_in_use == 0 and b.in_use == 0

            run_buf = alloc.alloc_buffer(MiB)  # a run-scope buffer: kept for free_all
            f.fail_next("cuMemFreeAsync", CUresult.CUDA_ERROR_INVALID_VALUE)
            with pytest.raises(CudaError):
                alloc.free_buffer(run_buf)
            assert block.gpu_bytes_in_use == MiB
            assert alloc.free_all() == MiB
            assert block.gpu_bytes_in_use == 0
        finally:
            b.close()


def test_the_fixed_scratch_is_one_allocation_made_at_setup() -> None:
    f, b = make()
    try:
        raw = [a for a in f.allocs.values() if a.pool is None]
        assert [a.size for a in raw] == [FIXED_SCRATCH_BYTES]
        x = b.alloc(4096)
        b.sum_f32(x, 16)
        b.max_f32(x, 16, memoryview(bytearray(4)))
        assert [a.size for a in f.allocs.values() if a.pool is None] == [FIXED_SCRATCH_BYTES]
        assert np.isfinite(b.sum_f32(x, 16))
    finally:
        b.close()
