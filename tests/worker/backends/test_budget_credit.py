"""The device budget is credited for a free only once the memory is back on the device.

``cuMemFreeAsync`` hands memory back to the tenant's pool, which returns it to the device only at a
synchronize or a trim. Credited at the free, the budget would admit another tenant that the driver
then refuses (CUDA_ERROR_OUT_OF_MEMORY although the budget said yes). worker.allocator withholds
freed bytes and credits what the pool no longer reserves (``retained_bytes``, the pool's
RESERVED_MEM_CURRENT beyond its live buffers). Two tenants share one fake device here (one
FakeDriver: its pools, scratch and contexts all take from one capacity), each with its own
backend, allocator and slot of one device budget whose limit is the device's capacity.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

from shared.device_budget import DeviceBudget
from shared.errors import GpuMemoryExhausted
from shared.quota import QuotaBlock
from tests.helpers.fake_cuda import CUresult, FakeDriver
from worker.allocator import MeteredAllocator
from worker.backends import create_backend
from worker.backends.base import DeviceBuffer
from worker.backends.cuda import CudaBackend

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
DEVICE = 64 * MiB
SCRATCH = 2 * MiB  # each backend's fixed scratch: one 2 MiB granule on the fake


@dataclass
class Tenant:
    backend: CudaBackend
    alloc: MeteredAllocator
    block: QuotaBlock


@contextmanager
def device(tenants: int = 2, capacity: int = DEVICE) -> Iterator[tuple[FakeDriver, DeviceBudget, list[Tenant]]]:
    fake = FakeDriver(memory_bytes=DEVICE)
    with DeviceBudget.create(0, capacity) as owner, ExitStack() as stack:
        out = []
        for i in range(tenants):
            budget = DeviceBudget.attach(owner.name)
            stack.callback(budget.close)
            block = stack.enter_context(QuotaBlock.create(f"t{i}"))
            be = CudaBackend(0, driver=fake, nvrtc=fake)
            stack.callback(be.close)  # (closed first: it gives its overhead back to the budget)
            be.attach_overhead_meter(budget)  # as TenantContext does: the scratch is charged
            out.append(Tenant(be, MeteredAllocator(f"t{i}", block, be, budget=budget), block))
        yield fake, owner, out


def test_a_free_is_not_credited_while_the_pool_still_holds_it() -> None:
    """The issue's case: tenant A frees inside a run (no synchronize yet); tenant B's allocation that
    needs that memory is refused by the budget, before any driver call, instead of by the driver."""
    with device() as (fake, budget, (a, b)):
        buf = a.alloc.alloc_buffer(40 * MiB)
        a.backend.begin_run(None)
        a.alloc.free_buffer(buf)  # as a guest's free (or a run's release) does: cuMemFreeAsync only
        assert a.block.gpu_bytes_in_use == 0  # the tenant's own quota is free at once (its pool reuses it)
        assert budget.used_bytes == 2 * SCRATCH + 40 * MiB == fake.device_reserved(0)
        assert a.alloc.withheld_bytes == 40 * MiB
        calls = fake.count("cuMemAllocFromPoolAsync")
        with pytest.raises(GpuMemoryExhausted, match="device 0 budget exhausted"):
            b.alloc.alloc_buffer(30 * MiB)
        assert fake.count("cuMemAllocFromPoolAsync") == calls  # never reached the driver
        # the run ends: its queued work done, the pool trimmed, then the budget credited
        a.backend.end_run(None)
        a.alloc.settle()
        assert a.alloc.withheld_bytes == 0 and budget.used_bytes == 2 * SCRATCH
        b.alloc.alloc_buffer(30 * MiB)
        assert budget.used_bytes == 2 * SCRATCH + 30 * MiB == fake.device_reserved(0)


def test_the_budget_never_holds_less_than_the_device_gives_and_the_driver_never_refuses() -> None:
    """A seeded walk of allocations, run-scoped frees, run ends and client frees by two tenants:
    after every step the budget covers what the device has given (sizes are whole granules, so the
    pools' rounding plays no part), and every refusal is the budget's, never the driver's."""
    rng = random.Random(20261205)
    with device() as (fake, budget, tenants):
        held: list[list[DeviceBuffer]] = [[], []]
        handles: list[list[int]] = [[], []]
        refused = 0
        for _ in range(400):
            i = rng.randrange(2)
            t = tenants[i]
            step = rng.random()
            try:
                if step < 0.35:
                    held[i].append(t.alloc.alloc_buffer(rng.randint(1, 8) * 2 * MiB))
                elif step < 0.45:
                    handles[i].append(t.alloc.alloc(rng.randint(1, 4) * 2 * MiB))
                elif step < 0.75 and held[i]:
                    t.alloc.free_buffer(held[i].pop(rng.randrange(len(held[i]))))
                elif step < 0.85 and handles[i]:
                    t.alloc.free(handles[i].pop(rng.randrange(len(handles[i]))))  # reclaims, then credits
                else:
                    t.backend.end_run(None)
                    t.alloc.settle()
            except GpuMemoryExhausted as exc:
                assert "budget exhausted" in str(exc), exc  # "device refused" would be the driver's OOM
                refused += 1
            assert budget.used_bytes >= fake.device_reserved(0)
        assert refused > 0  # the walk did press on the limit
        for i, t in enumerate(tenants):
            for buf in held[i]:
                t.alloc.free_buffer(buf)
            t.alloc.free_all()
        assert budget.used_bytes == 2 * SCRATCH == fake.device_reserved(0)


def test_memory_the_pool_reuses_is_not_counted_twice() -> None:
    with device(tenants=1) as (fake, budget, (a,)):
        x = a.alloc.alloc_buffer(8 * MiB)
        a.alloc.free_buffer(x)
        a.alloc.alloc_buffer(8 * MiB)
        # the fake keeps a queued free outstanding (it does not reuse it before the stream ran it):
        # the budget holds exactly what the pool reserves - never less, and no more once settled
        assert budget.used_bytes == fake.device_reserved(0) == SCRATCH + 16 * MiB
        a.backend.reclaim()
        a.alloc.settle()
        assert a.alloc.withheld_bytes == 0
        assert budget.used_bytes == fake.device_reserved(0) == SCRATCH + 8 * MiB


def test_a_refusal_while_bytes_are_withheld_returns_them_and_asks_again() -> None:
    with device(tenants=1, capacity=SCRATCH + 8 * MiB) as (fake, budget, (a,)):
        x = a.alloc.alloc_buffer(6 * MiB)
        a.alloc.free_buffer(x)
        trims = fake.count("cuMemPoolTrimTo")
        a.alloc.alloc_buffer(6 * MiB)  # 6 withheld + 6 new > 8: reclaim, credit, then admitted
        assert fake.count("cuMemPoolTrimTo") == trims + 1
        assert budget.used_bytes == SCRATCH + 6 * MiB == fake.device_reserved(0)
        assert budget.snapshot().refusals == 1  # the first ask was refused, and counted
        with pytest.raises(GpuMemoryExhausted, match="budget exhausted"):
            a.alloc.alloc_buffer(4 * MiB)  # nothing withheld: a plain refusal


def test_a_lost_context_keeps_its_freed_bytes_charged_until_the_process_ends() -> None:
    """The memory of a lost context comes back only when the process dies (the supervisor then
    returns the worker's slot): until then the budget keeps it, even after close."""
    with device(tenants=1) as (fake, budget, (a,)):
        x = a.alloc.alloc_buffer(8 * MiB)
        fake.fail_next("cuMemFreeAsync", CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)  # sticky
        a.alloc.free_buffer(x)
        assert a.backend.context_lost == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert a.block.gpu_bytes_in_use == 0 and budget.used_bytes == SCRATCH + 8 * MiB
        a.backend.close()
        a.alloc.settle()
        assert a.alloc.withheld_bytes == 8 * MiB and budget.used_bytes == 8 * MiB  # (the overhead went)


def test_closing_credits_what_the_destroyed_pool_held() -> None:
    with device(tenants=1) as (fake, budget, (a,)):
        a.backend.begin_run(None)
        a.alloc.free_buffer(a.alloc.alloc_buffer(4 * MiB))
        assert a.alloc.withheld_bytes == 4 * MiB
        a.backend.close()  # (a run never ended: the pool is destroyed with what it held)
        a.alloc.settle()
        assert a.alloc.withheld_bytes == 0 and budget.used_bytes == 0


def test_a_host_backend_credits_at_the_free() -> None:
    stub = create_backend("stub", {"capacity_bytes": 64 * MiB})
    with DeviceBudget.create(0, 64 * MiB) as budget, QuotaBlock.create("s") as block:
        alloc = MeteredAllocator("s", block, stub, budget=budget)
        alloc.free_buffer(alloc.alloc_buffer(4 * MiB))
        assert alloc.withheld_bytes == 0 and budget.used_bytes == 0
    stub.close()
