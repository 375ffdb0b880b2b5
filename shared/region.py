"""Shared-memory data regions: bulk bytes between a local client and its tenant's workers.

Triton's system shared-memory extension is the model: a region is created
once, and requests then carry ``(region, offset, size)`` instead of the bytes.

    client                         supervisor                         worker (tenant T)
      region_create{nbytes,pid} ─►  Region.create (owner, 0600,
                                    charged to T's host quota) ──► reply {region, name}
      Region.attach(name)
      copy bytes into the region
      write_region{handle, region, ─► region bound to T? ─────────► Region.attach(name, tenant=T)
                   region_offset,     (else refused)                 copy region -> device buffer
                   nbytes}                                           (cuda: DMA from registered pages)

Layout: one header page, then the data. The header is the quota blocks'
header (magic, layout version, kind ``KIND_REGION``, owner pid + start
time, label = tenant id), so :func:`shared.quota.cleanup_stale_segments`
removes a dead supervisor's regions like its quota blocks, and an attacher
checks it is mapping a region of the tenant it expects. The data starts at
:data:`DATA_OFFSET` (page aligned, as ``cuMemHostRegister`` likes it).

Names are ``twt-<registry prefix>-r<128 random bits>``: under the
supervisor's prefix (which starts with its run dir's namespace, see
:func:`shared.quota.segment_namespace`) and unguessable. ``SharedMemory`` creates them with mode
0600 (only the supervisor's user can map them). Only the creating process
(the supervisor) unlinks; clients and workers attach without telling the
resource tracker (see :mod:`shared._shm`).

Payloads larger than a region move in chunks: :func:`plan_chunks` splits a
transfer into chunks that rotate over a few slots of the region, so the
client fills slot ``k+1`` while the worker copies slot ``k`` (a pipeline of
bounded memory that serves any buffer size).
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Final

from shared import _shm
from shared._segment import MappedSegment
from shared.checks import is_int
from shared.errors import InvalidArgument, SegmentError
from shared.quota import KIND_REGION, NAME_MAX, SEGMENT_PREFIX, check_header, write_header

__all__ = [
    "DATA_OFFSET",
    "DEFAULT_CHUNK_BYTES",
    "MAX_REGION_BYTES",
    "MIN_PIPELINE_CHUNK_BYTES",
    "MIN_REGION_BYTES",
    "Chunk",
    "Region",
    "check_span",
    "pipeline_chunk_bytes",
    "plan_chunks",
    "region_name",
    "round_region_size",
]

#: the header page before the data (page aligned data for cuMemHostRegister)
DATA_OFFSET: Final = mmap.PAGESIZE if mmap.PAGESIZE >= 4096 else 4096
#: smallest and largest data size of one region (a bounded mapping per region;
#: the tenant's host quota bounds the total)
MIN_REGION_BYTES: Final = 64 << 10
MAX_REGION_BYTES: Final = 1 << 30
#: the largest chunk of a pipelined transfer: large enough that a request's fixed
#: cost (~150-400 us through the supervisor) is small next to its copy (~1 ms
#: at DRAM speed), small enough that four of them overlap in a 64 MiB region
#: (measured on 256 MiB: 16 MiB chunks 0.57-0.63x memcpy, 8 MiB 0.53-0.59x,
#: 4 MiB 0.40-0.53x, 32 MiB 0.49-0.56x)
DEFAULT_CHUNK_BYTES: Final = 16 << 20
#: the smallest chunk a transfer is cut into for the sake of overlap
MIN_PIPELINE_CHUNK_BYTES: Final = 2 << 20


def pipeline_chunk_bytes(total: int, largest: int = DEFAULT_CHUNK_BYTES) -> int:
    """The chunk size for a ``total``-byte transfer: about a quarter of it (so copies on both
    sides overlap), between :data:`MIN_PIPELINE_CHUNK_BYTES` and ``largest``."""
    return max(min(MIN_PIPELINE_CHUNK_BYTES, largest), min(largest, -(-total // 4)))


def round_region_size(nbytes: object) -> int:
    """``nbytes`` rounded up to whole pages; InvalidArgument outside the region bounds."""
    if not is_int(nbytes):
        raise InvalidArgument(f"region size must be an int, got {type(nbytes).__name__}")
    if not MIN_REGION_BYTES <= nbytes <= MAX_REGION_BYTES:
        raise InvalidArgument(
            f"region size {nbytes:,} B is outside {MIN_REGION_BYTES:,}..{MAX_REGION_BYTES:,} B"
        )
    page = mmap.PAGESIZE
    return (nbytes + page - 1) // page * page


def region_name(prefix: str) -> str:
    """A fresh, unguessable region name under a supervisor's segment prefix."""
    if not prefix or not all(c.isalnum() or c in "-_" for c in prefix):
        raise ValueError(f"segment prefix must be alphanumeric (plus - _), got {prefix!r}")
    name = f"{SEGMENT_PREFIX}{prefix}-r{secrets.token_hex(16)}"
    if len(name) > NAME_MAX:
        raise ValueError(f"segment prefix of {len(prefix)} characters makes region names longer than {NAME_MAX}")
    return name


def check_span(capacity: int, offset: object, nbytes: object, what: str = "region access") -> tuple[int, int]:
    """``(offset, nbytes)`` as ints when ``[offset, offset+nbytes)`` lies in ``capacity`` bytes."""
    for name, value in (("region_offset", offset), ("nbytes", nbytes)):
        if not is_int(value):
            raise InvalidArgument(f"{what}: {name} must be an int, got {type(value).__name__}")
    assert isinstance(offset, int) and isinstance(nbytes, int)
    if offset < 0 or nbytes < 0 or offset + nbytes > capacity:
        raise InvalidArgument(
            f"{what} of {nbytes} B at region offset {offset} is outside the {capacity:,}-byte region"
        )
    return offset, nbytes


@dataclass(frozen=True, slots=True)
class Chunk:
    """One step of a chunked transfer: ``nbytes`` at ``position`` of the payload, staged
    at ``region_offset`` of the region (in slot ``slot``)."""

    position: int
    nbytes: int
    slot: int
    region_offset: int


def plan_chunks(total: int, capacity: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                max_slots: int = 4) -> list[Chunk]:
    """Split a ``total``-byte transfer over a ``capacity``-byte region.

    The region is cut into up to ``max_slots`` equal slots of at most
    ``chunk_bytes`` (two halves when a chunk would fill it, so copies still
    overlap; a payload that fits one chunk is one chunk); chunk ``i`` uses
    slot ``i % slots``, so a sender may reuse a slot once the chunk that used
    it before is answered. ``total == 0`` is no chunk at all.
    """
    if total < 0 or capacity <= 0 or chunk_bytes <= 0 or max_slots <= 0:
        raise ValueError(f"bad chunk plan input: total={total} capacity={capacity} "
                         f"chunk_bytes={chunk_bytes} max_slots={max_slots}")
    if total == 0:
        return []
    if total <= min(capacity, chunk_bytes):
        return [Chunk(0, total, 0, 0)]
    size = min(chunk_bytes, capacity)
    slots = max(1, min(max_slots, capacity // size))
    page = mmap.PAGESIZE
    if slots < 2 <= max_slots and capacity >= 2 * page:
        size, slots = capacity // 2, 2  # room for two: the copies on both sides overlap
    if size > page:
        size -= size % page  # page-aligned slots: DMA-friendly, no false sharing
    out = []
    for i, position in enumerate(range(0, total, size)):
        slot = i % slots
        out.append(Chunk(position, min(size, total - position), slot, slot * size))
    return out


def _reserve(name: str, size: int) -> None:
    """Give the segment its memory now: a full /dev/shm (a container's 64 MiB default) then
    refuses the region here, instead of a SIGBUS at the first write past the space left."""
    fd = os.open(os.path.join(_shm.SHM_DIR, name), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise SegmentError(name, f"no room in {_shm.SHM_DIR} for a region of {size:,} B "
                                 f"({exc.strerror}); free some or enlarge it") from None
    finally:
        os.close(fd)


class Region(MappedSegment):
    """One mapped region: a header page and :attr:`capacity` bytes of data at :attr:`data`.

    The supervisor :meth:`create`\\ s (owns, unlinks); clients and workers
    :meth:`attach`. ``close()`` may leave the mapping to the garbage
    collector when views of :attr:`data` are still alive (an ndarray handed
    out as a zero-copy view): the memory stays valid as long as they do.
    """

    _what = "region"

    def __init__(self, segment: _shm.Segment, tenant_id: str, *, owner: bool) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        self._map(segment, owner=owner)
        self._bind_counters()
        self.tenant_id = tenant_id
        self.capacity = len(self._buf) - DATA_OFFSET
        self.data: memoryview = self._buf[DATA_OFFSET:]

    @classmethod
    def create(cls, tenant_id: str, nbytes: int, *, prefix: str, generation: int = 0) -> Region:
        """Create a region of ``nbytes`` (rounded up to pages) for ``tenant_id``; the caller owns it."""
        size = round_region_size(nbytes)
        name = region_name(prefix)
        seg = _shm.create(name, DATA_OFFSET + size)
        try:
            _reserve(name, DATA_OFFSET + size)
            write_header(seg.buf, KIND_REGION, tenant_id, generation, DATA_OFFSET + size)
            return cls(seg, tenant_id, owner=True)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str, *, tenant_id: str | None = None) -> Region:
        """Map an existing region (never tracked); ``tenant_id`` given: refuse another tenant's."""
        if not name.startswith(SEGMENT_PREFIX) or "/" in name or len(name) > NAME_MAX:
            raise SegmentError(name, "not a region name")
        try:
            seg = _shm.attach(name)
        except FileNotFoundError:
            raise SegmentError(name, "region does not exist (released, or its supervisor stopped)") from None
        except (OSError, ValueError) as exc:
            raise SegmentError(name, f"region cannot be mapped: {exc}") from None
        try:
            if len(seg.buf) < DATA_OFFSET + MIN_REGION_BYTES:
                raise SegmentError(name, f"too small for a region ({len(seg.buf)} bytes)")
            label = check_header(name, seg.buf, KIND_REGION)
            if tenant_id is not None and label != tenant_id:
                raise SegmentError(name, f"region belongs to another tenant, not {tenant_id!r}")
            return cls(seg, label, owner=False)
        except BaseException:
            seg.close()
            raise

    def span(self, offset: object, nbytes: object, what: str = "region access") -> memoryview:
        """The data bytes ``[offset, offset+nbytes)``; InvalidArgument when out of range."""
        if self._closed:
            raise SegmentError(self.name, "region is closed")
        off, n = check_span(self.capacity, offset, nbytes, what)
        return self.data[off : off + n]

    def close(self) -> None:
        """Unmap; when a view of the data is still exported, leave the unmap to the GC."""
        if self._closed:
            return
        data, self.data = self.data, memoryview(b"")
        try:
            data.release()
            super().close()
        except BufferError:
            # A caller still holds a view (a zero-copy ndarray): the mapping must outlive
            # it, and it does - the last view unmaps it. Only our bookkeeping ends here.
            self._closed = True

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.capacity:,} B"
        return f"<Region {self.name} tenant={self.tenant_id!r} {state}>"
