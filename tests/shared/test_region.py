"""shared.region: names, mode, header, attach checks, spans, views outliving close, chunk plans;
and the client's byte views (numpy arrays accepted wherever bytes are)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from shared import _atomics
from shared.errors import InvalidArgument, SegmentError
from shared.quota import KIND_REGION, QuotaBlock, cleanup_stale_segments, read_header
from shared.region import (
    DATA_OFFSET,
    MAX_REGION_BYTES,
    MIN_REGION_BYTES,
    Region,
    check_span,
    plan_chunks,
    round_region_size,
)
from supervisor.client.bulk import byte_view

pytestmark = pytest.mark.timeout(30)

PREFIX = f"t{os.getpid()}"


def test_create_attach_header_mode_and_unlink() -> None:
    with Region.create("acme", 100_000, prefix=PREFIX) as owner:
        assert owner.capacity == round_region_size(100_000) and owner.capacity % mmap.PAGESIZE == 0
        assert owner.name.startswith(f"twt-{PREFIX}-r") and len(owner.name.rsplit("-r", 1)[1]) == 32
        assert os.stat(f"/dev/shm/{owner.name}").st_mode & 0o777 == 0o600
        header = read_header(owner.name)
        assert (header.kind, header.label, header.owner_pid) == (KIND_REGION, "acme", os.getpid())
        other = Region.attach(owner.name, tenant_id="acme")
        try:
            other.span(10, 3)[:] = b"abc"
            assert bytes(owner.data[10:13]) == b"abc"
            with pytest.raises(SegmentError, match="another tenant"):
                Region.attach(owner.name, tenant_id="beta")
            with pytest.raises(SegmentError):
                other.unlink()  # only the creator unlinks
        finally:
            other.close()
    assert not os.path.exists(f"/dev/shm/{owner.name}")
    with pytest.raises(SegmentError, match="does not exist"):
        Region.attach(owner.name)


def test_a_quota_block_is_not_a_region() -> None:
    with QuotaBlock.create("acme") as block:
        with pytest.raises(SegmentError):
            Region.attach(block.name)
    with pytest.raises(SegmentError):
        Region.attach("not-ours")


def test_names_are_unique() -> None:
    regions = [Region.create("acme", MIN_REGION_BYTES, prefix=PREFIX) for _ in range(5)]
    try:
        assert len({r.name for r in regions}) == 5
    finally:
        for r in regions:
            r.unlink()
            r.close()


def test_a_view_keeps_the_mapping_alive_after_close() -> None:
    with Region.create("acme", MIN_REGION_BYTES, prefix=PREFIX) as owner:
        owner.data[:4] = b"keep"
        attached = Region.attach(owner.name)
        array = np.frombuffer(attached.span(0, 4), dtype=np.uint8)
        attached.close()  # the array still exports the mapping: the unmap waits for it
        assert attached.closed
        with pytest.raises(SegmentError):
            attached.span(0, 1)
    assert bytes(array) == b"keep"  # unlinked and closed: the memory lives as long as the view


def test_stale_regions_of_a_dead_supervisor_are_removed() -> None:
    owner = Region.create("acme", MIN_REGION_BYTES, prefix=PREFIX)
    try:
        _atomics.store(owner._buf, 24, 2**22 + 777)  # header: owner pid of a process that never ran
        assert owner.name in cleanup_stale_segments(f"twt-{PREFIX}")
        assert not os.path.exists(f"/dev/shm/{owner.name}")
    finally:
        try:
            owner.unlink()
        finally:
            owner.close()


@pytest.mark.parametrize("bad", [0, MIN_REGION_BYTES - 1, MAX_REGION_BYTES + 1, -5, True, 1.5, "64KiB"])
def test_region_size_bounds(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        round_region_size(bad)


@pytest.mark.parametrize(
    ("offset", "n"), [(-1, 1), (0, -1), (0, 101), (100, 1), (50, 51), (True, 1), (0, None), ("0", 1)]
)
def test_check_span_refuses_out_of_range(offset: object, n: object) -> None:
    with pytest.raises(InvalidArgument):
        check_span(100, offset, n)


def test_check_span_accepts_edges() -> None:
    assert check_span(100, 0, 100) == (0, 100)
    assert check_span(100, 100, 0) == (100, 0)


@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 1 << 20, (1 << 20) + 1, 5 * (1 << 20) + 12345, 64 << 20])
@pytest.mark.parametrize("capacity", [64 << 10, 1 << 20, 8 << 20, 64 << 20])
def test_chunk_plans_cover_the_payload_and_fit_their_slots(total: int, capacity: int) -> None:
    chunks = plan_chunks(total, capacity, chunk_bytes=4 << 20)
    assert sum(c.nbytes for c in chunks) == total
    position = 0
    slot_spans: dict[int, tuple[int, int]] = {}
    for i, c in enumerate(chunks):
        assert c.position == position and c.nbytes > 0
        position += c.nbytes
        assert 0 <= c.region_offset and c.region_offset + c.nbytes <= capacity
        assert c.nbytes <= 4 << 20
        # a slot always sits at the same place, and distinct slots never overlap
        start, size = slot_spans.setdefault(c.slot, (c.region_offset, c.nbytes))
        assert c.region_offset == start and c.nbytes <= size
        assert c.slot == i % (max(x.slot for x in chunks) + 1)
    spans = sorted(slot_spans.values())
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_chunk_plan_distinct_places_when_asked() -> None:
    chunks = plan_chunks(10 << 20, 16 << 20, chunk_bytes=1 << 20, max_slots=1 << 20)
    assert len({c.region_offset for c in chunks}) == len(chunks) == 10


def test_byte_view_takes_bytes_and_arrays() -> None:
    assert byte_view(b"abc").tobytes() == b"abc"
    assert byte_view(bytearray(b"xy")).format == "B"
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    v = byte_view(a)
    assert len(v) == a.nbytes and v.tobytes() == a.tobytes()
    assert byte_view(a[:, ::2]).tobytes() == np.ascontiguousarray(a[:, ::2]).tobytes()
    assert len(byte_view(np.float32(2.5))) == 4
    assert len(byte_view(np.zeros((0, 3)))) == 0
    with pytest.raises(InvalidArgument):
        byte_view(12)
    assert DATA_OFFSET % mmap.PAGESIZE == 0


def test_pipeline_chunk_sizes() -> None:
    from shared.region import DEFAULT_CHUNK_BYTES, MIN_PIPELINE_CHUNK_BYTES, pipeline_chunk_bytes

    mib = 1 << 20
    assert pipeline_chunk_bytes(1 * mib) == MIN_PIPELINE_CHUNK_BYTES  # one chunk: nothing to overlap
    assert pipeline_chunk_bytes(16 * mib) == 4 * mib  # about four chunks
    assert pipeline_chunk_bytes(256 * mib) == DEFAULT_CHUNK_BYTES
    assert pipeline_chunk_bytes(256 * mib, largest=mib) == mib


def test_a_full_dev_shm_refuses_the_region_instead_of_a_later_sigbus(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def ours() -> set[str]:  # this test's prefix only: other tests (parallel workers) make segments meanwhile
        return {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}

    before = ours()
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SegmentError, match="no room"):
        Region.create("acme", MIN_REGION_BYTES, prefix=PREFIX)
    assert ours() <= before  # nothing left behind


def test_a_created_region_has_its_memory() -> None:
    with Region.create("acme", 1 << 20, prefix=PREFIX) as owner:
        assert os.stat(f"/dev/shm/{owner.name}").st_blocks * 512 >= owner.capacity  # allocated, not sparse
