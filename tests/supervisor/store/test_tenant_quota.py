"""TenantQuota: a tenant's quota as a segment while workers run, as a record otherwise - the same
counters either way, and the block's rules for the supervisor's own charges on the record."""

from __future__ import annotations

import itertools
import os

import pytest

from shared.errors import GpuMemoryExhausted, MemoryExhausted, SegmentError
from shared.quota import QuotaBlock, QuotaCounters, new_segment_name
from supervisor.store.tenant_quota import TenantQuota

pytestmark = pytest.mark.timeout(60)


def _quota(tid: str = "t", mem: int = 1 << 20, gpu: int | None = 1 << 20) -> TenantQuota:
    prefix = f"test{os.getpid()}"
    slots = itertools.count(1)
    record = QuotaCounters(generation=3, memory_quota_bytes=mem, gpu_memory_bytes_cap=gpu,
                           cuda_mem_pool_quota_bytes=None)
    return TenantQuota(tid, record, lambda: new_segment_name(prefix, next(slots)))


def test_a_round_trip_through_the_record_keeps_every_counter() -> None:
    q = _quota()
    name = q.open()
    try:
        worker = QuotaBlock.attach(name, instance=2)
        worker.consume_gpu_bytes(300_000)
        worker.consume_bytes(5000)
        with pytest.raises(GpuMemoryExhausted):
            worker.consume_gpu_bytes(1 << 20)
        worker.release_gpu_bytes(100_000)
        worker.charge_gpu_time(123_456, ops=7)
        worker.observe_gpu_wait(2_000_000)
        worker.count_gpu_throttled()
        worker.close()
        q.consume_bytes(4096)  # the supervisor's own charge (a parked buffer's copy)
        q.reclaim_instance(2)  # the worker died: its share comes back (the record keeps none)
        before = q.snapshot()
        assert q.close_segment()
        assert q.name == "" and q.segment is None and not os.path.exists(f"/dev/shm/{name}")
        held = q.snapshot()
        assert held.to_dict() == before.to_dict() | {"name": ""}
        again = q.open()
        assert again != name
        after = q.snapshot()
        assert after.to_dict() | {"name": ""} == held.to_dict()
        assert after.bytes_in_use == 4096 and after.gpu_refusals == 1 and after.gpu_time_ns == 123_456
        q.release_bytes(4096)  # the charge moved into the segment's unattributed share
        assert q.bytes_in_use == 0 and q.snapshot().cpu_underflows == 0
    finally:
        q.unlink()
        q.close()


def test_the_record_follows_the_blocks_rules() -> None:
    q = _quota(mem=10_000, gpu=None)
    q.consume_bytes(6000)
    with pytest.raises(MemoryExhausted) as info:
        q.consume_bytes(5000)
    assert info.value.to_dict()["fields"] == {"tenant_id": "t", "requested": 5000, "limit": 10_000, "current": 6000}
    snap = q.snapshot()
    assert snap.bytes_in_use == 6000 and snap.cpu_refusals == 1 and snap.cpu_high_water == 6000
    q.consume_gpu_bytes(1 << 40)  # no cap: counted, never refused
    q.release_gpu_bytes(1 << 40)
    q.release_bytes(7000)  # more than held: saturates, an underflow counted
    snap = q.snapshot()
    assert snap.bytes_in_use == 0 and snap.cpu_underflows == 1 and snap.gpu_high_water == 1 << 40
    q.set_limits(memory_quota_bytes=20_000, gpu_memory_bytes_cap=512)
    with pytest.raises(GpuMemoryExhausted):
        q.consume_gpu_bytes(1024)
    with pytest.raises(ValueError):
        q.set_limits(memory_quota_bytes=-1)
    with pytest.raises(TypeError):
        q.consume_bytes("1")  # type: ignore[arg-type]
    assert q.memory_quota_bytes == 20_000 and q.gpu_memory_bytes_cap == 512
    q.open()  # limits and counts go into the segment
    try:
        assert q.snapshot().gpu_refusals == 1 and q.memory_quota_bytes == 20_000
        with pytest.raises(GpuMemoryExhausted):
            q.consume_gpu_bytes(1024)
    finally:
        q.unlink()
        q.close()
    assert q.closed
    with pytest.raises(SegmentError):
        q.open()
    with pytest.raises(SegmentError):
        q.snapshot()


def test_tenants_share_a_fresh_record_until_one_changes_it() -> None:
    from shared.spec import TenantSpec
    from supervisor.store.registry import TenantRegistry

    registry, admin = TenantRegistry.new(segment_prefix=f"test{os.getpid()}", lazy_segments=True)
    with registry:
        for name in ("a", "b", "c"):
            registry.register_with_capability(admin, TenantSpec(name, memory_quota_bytes=1 << 20))
        a, b, c = (registry.block(admin, n) for n in ("a", "b", "c"))
        assert a.segment is None and a.name == ""  # lazy: no segment until a worker is bound
        a.consume_bytes(1000)
        with pytest.raises(MemoryExhausted):
            b.consume_bytes(2 << 20)
        registry.set_quota(admin, "c", memory_quota_bytes=4096)
        assert (a.bytes_in_use, a.snapshot().cpu_refusals, a.memory_quota_bytes) == (1000, 0, 1 << 20)
        assert (b.bytes_in_use, b.snapshot().cpu_refusals, b.memory_quota_bytes) == (0, 1, 1 << 20)
        assert (c.bytes_in_use, c.snapshot().cpu_refusals, c.memory_quota_bytes) == (0, 0, 4096)
        registry.register_with_capability(admin, TenantSpec("d", memory_quota_bytes=1 << 20))
        d = registry.block(admin, "d")
        assert d.snapshot().to_dict() | {"tenant_id": "a"} == registry.block(admin, "a").snapshot().to_dict() | {
            "bytes_in_use": 0, "cpu_high_water": 0}  # a fresh tenant starts clean
        name = d.open()
        assert os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(f"/dev/shm/{name}")  # the registry's close unlinks what it made
