"""The worker's side of shared-memory regions, in process: ops on a bound context (stub, and
cuda on the fake driver with pinned DMA), range checks, another tenant's region, cleanup."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shared.errors import InvalidArgument
from shared.quota import QuotaBlock
from shared.region import MIN_REGION_BYTES, Region
from shared.spec import TenantSpec
from tests.helpers.fake_cuda import FakeDriver
from worker.backends.cuda import CudaBackend
from worker.backends.stub import StubBackend
from worker.context import TenantContext
from worker.faults import FaultState
from worker.regions import WorkerRegions, op_read_region, op_region_drop, op_write_region
from worker.server import WorkerServer

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


class _Server(WorkerServer):
    """A WorkerServer without a socket: the op handlers only need its context."""

    def __init__(self, ctx: TenantContext) -> None:
        self.context = ctx
        self.faults = ctx.faults


@pytest.fixture(params=["stub", "cuda"])
def env(request: pytest.FixtureRequest) -> Iterator[tuple[_Server, Region, FakeDriver | None]]:
    fake = None
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=64 * MiB) as owner_block:
        block = QuotaBlock.attach(owner_block.name, instance=0)
        if request.param == "cuda":
            fake = FakeDriver(memory_bytes=1 << 30)
            backend: Any = CudaBackend(driver=fake, nvrtc=fake)
        else:
            backend = StubBackend()
        ctx = TenantContext(TenantSpec("acme"), 0, 0, block, backend, faults=FaultState())
        region = Region.create("acme", 4 * MiB, prefix=f"test{os.getpid()}")
        try:
            yield _Server(ctx), region, fake
        finally:
            ctx.close()
            region.unlink()
            region.close()


def _write(server: _Server, region: Region, handle: int, offset: int, region_offset: int, n: int) -> Any:
    args = {"handle": handle, "offset": offset, "region_name": region.name, "region_offset": region_offset, "nbytes": n}
    return op_write_region(server, args, None)[0]


def _read(server: _Server, region: Region, handle: int, offset: int, region_offset: int, n: int) -> Any:
    args = {"handle": handle, "offset": offset, "region_name": region.name, "region_offset": region_offset, "nbytes": n}
    return op_read_region(server, args, None)[0]


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 1_000_003, 4 * MiB])
def test_round_trip_through_the_region(env: tuple[_Server, Region, FakeDriver | None], n: int) -> None:
    server, region, _ = env
    ctx = server.context
    assert ctx is not None
    h = ctx.allocator.alloc(8 * MiB)
    payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    region.data[:n] = payload
    assert _write(server, region, h, 17, 0, n) == {"written": n}
    assert ctx.allocator.read(h, 17, n) == payload
    region.data[:n] = bytes(n)
    assert _read(server, region, h, 17, 0, n) == {"nbytes": n}
    assert bytes(region.data[:n]) == payload


def test_cuda_copies_are_dma_from_registered_pages(env: tuple[_Server, Region, FakeDriver | None]) -> None:
    server, region, fake = env
    if fake is None:
        pytest.skip("the stub copies host memory")
    ctx = server.context
    assert ctx is not None
    h = ctx.allocator.alloc(MiB)
    region.data[100:104] = b"dma!"
    _write(server, region, h, 0, 100, 4)
    assert fake.calls.count("cuMemHostRegister") == 1
    assert list(fake.host_registered.values()) == [region.capacity]
    _write(server, region, h, 4, 100, 4)  # mapped and pinned once
    assert fake.calls.count("cuMemHostRegister") == 1
    assert ctx.allocator.read(h, 0, 8) == b"dma!dma!"
    assert op_region_drop(server, {"name": region.name}, None)[0] == {"dropped": True}
    assert fake.host_registered == {}  # unregistered before the pages were unmapped
    _write(server, region, h, 0, 100, 4)  # maps again on demand
    ctx.close()
    assert fake.host_registered == {}


def test_cuda_register_refused_falls_back_to_pageable_copies(env: tuple[_Server, Region, FakeDriver | None]) -> None:
    server, region, fake = env
    if fake is None:
        pytest.skip("cuda only")
    from tests.helpers.fake_cuda import CUresult

    fake._fail["cuMemHostRegister"] = [CUresult.CUDA_ERROR_NOT_PERMITTED]
    ctx = server.context
    assert ctx is not None
    h = ctx.allocator.alloc(MiB)
    region.data[:5] = b"slow!"
    _write(server, region, h, 0, 0, 5)
    assert ctx.allocator.read(h, 0, 5) == b"slow!"
    assert fake.host_registered == {}


@pytest.mark.parametrize(
    ("offset", "region_offset", "n"),
    [(0, -1, 1), (0, 0, -1), (0, 4 * MiB, 1), (0, 4 * MiB - 1, 2), (MiB - 1, 0, 2), (-1, 0, 1), (0, True, 1)],
)
def test_out_of_range_is_refused_and_copies_nothing(
    env: tuple[_Server, Region, FakeDriver | None], offset: int, region_offset: int, n: int
) -> None:
    server, region, _ = env
    ctx = server.context
    assert ctx is not None
    h = ctx.allocator.alloc(MiB)
    ctx.allocator.write(h, 0, memoryview(b"keep"))
    region.data[:4] = b"gone"
    for op in (_write, _read):
        with pytest.raises(InvalidArgument):
            op(server, region, h, offset, region_offset, n)
    assert ctx.allocator.read(h, 0, 4) == b"keep" and bytes(region.data[:4]) == b"gone"


def test_another_tenants_region_is_refused(env: tuple[_Server, Region, FakeDriver | None]) -> None:
    server, _, _ = env
    ctx = server.context
    assert ctx is not None
    h = ctx.allocator.alloc(MiB)
    other = Region.create("beta", MIN_REGION_BYTES, prefix=f"test{os.getpid()}")
    try:
        other.data[:6] = b"secret"
        with pytest.raises(InvalidArgument, match="another tenant"):
            _write(server, other, h, 0, 0, 6)
        with pytest.raises(InvalidArgument, match="another tenant"):
            _read(server, other, h, 0, 0, 6)
        assert bytes(other.data[:6]) == b"secret"
        with pytest.raises(InvalidArgument, match="does not exist"):
            op_write_region(server, {"handle": h, "region_name": "twt-nope-r00", "nbytes": 1}, None)
        with pytest.raises(InvalidArgument, match="names no region"):
            op_write_region(server, {"handle": h, "nbytes": 1}, None)
    finally:
        other.unlink()
        other.close()


def test_mappings_are_bounded(env: tuple[_Server, Region, FakeDriver | None]) -> None:
    server, region, fake = env
    ctx = server.context
    assert ctx is not None
    regions = WorkerRegions.of(ctx)
    regions.max_mapped = 2
    extra = [Region.create("acme", MIN_REGION_BYTES, prefix=f"test{os.getpid()}") for _ in range(3)]
    try:
        for r in extra:
            regions.get(r.name)
        assert regions.names() == [extra[1].name, extra[2].name]
        if fake is not None:
            assert len(fake.host_registered) == 2
    finally:
        for r in extra:
            r.unlink()
            r.close()


def test_gpu_phase_runs_against_the_fake_driver() -> None:
    """tests/gpu/phase_regions.py (run on the H200 by the GPU check) works end to end here;
    its timings mean nothing on the fake, its bookkeeping does."""
    from tests.gpu.phase_regions import TARGET, run

    fake = FakeDriver(memory_bytes=1 << 30)
    rows = run(fake, sizes_mib=(1, 3), repeat=1, chunk_bytes=MiB)
    assert [r["name"].split(" ")[0] for r in rows] == ["H2D", "D2H", "H2D"] * 2
    for row in rows:
        assert row["region_gbps"] > 0 and row["raw_gbps"] > 0
        if row["target"] is None:
            assert row["verdict"] == "INFO"
        else:
            assert row["target"] == TARGET and row["verdict"] in ("PASS", "MISS")
    assert fake.host_registered == {}  # region unregistered, pinned host memory freed
    assert "cuMemHostRegister" in fake.calls and "cuMemHostUnregister" in fake.calls
