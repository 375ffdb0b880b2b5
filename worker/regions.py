"""The worker's side of shared-memory regions: map what the supervisor names, copy, unmap.

    supervisor ──[write_region {handle, offset, region_name, region_offset, nbytes}]──► executor
                                                   WorkerRegions.get(name)   map once (tenant checked),
                                                                             backend.pin_host (cuda:
                                                                             cuMemHostRegister)
                                                   backend.write_host        region -> device buffer
    supervisor ──[region_drop {name}]──────────────► WorkerRegions.drop       unpin, unmap

Which regions a worker may map is decided by the supervisor alone: it binds
each region to exactly one tenant, refuses a request that names a region of
another tenant, and puts the region's *name* into the forwarded arguments
itself (a client names regions by id and never sees this field accepted from
it). The worker checks the region's header label against its own tenant as
well, so a confused supervisor still cannot make it map a stranger's bytes.

Mappings are cached (a region is used for many chunks) and bounded
(:data:`MAX_MAPPED`, least recently used unmapped first). All of it runs on
the executor thread, like every backend call.
"""

from __future__ import annotations

import collections
import logging

import zmq

from shared.errors import InvalidArgument, SegmentError
from shared.log import get_logger, log_event
from shared.region import Region
from worker.backends.base import Backend
from worker.context import TenantContext
from worker.server import Reply, WorkerServer, _int_arg

__all__ = ["MAX_MAPPED", "WorkerRegions", "op_read_region", "op_region_drop", "op_write_region"]

_log = get_logger("worker.regions")

#: regions one worker keeps mapped at once (more are unmapped least recently used first)
MAX_MAPPED = 32
_EXTENSION = "regions"


class _Mapped:
    __slots__ = ("region", "addr")

    def __init__(self, region: Region, addr: int | None) -> None:
        self.region = region
        self.addr = addr  # pinned base address of region.data, or None (pageable copies)


class WorkerRegions:
    """The regions one tenant instance has mapped (a :class:`TenantContext` extension)."""

    def __init__(self, tenant_id: str, backend: Backend, *, max_mapped: int = MAX_MAPPED) -> None:
        self.tenant_id = tenant_id
        self.backend = backend
        self.max_mapped = max_mapped
        self._mapped: collections.OrderedDict[str, _Mapped] = collections.OrderedDict()

    @classmethod
    def of(cls, ctx: TenantContext) -> WorkerRegions:
        """The context's regions (made on first use, closed with the context)."""
        regions = ctx.extensions.get(_EXTENSION)
        if regions is None:
            regions = cls(ctx.tenant_id, ctx.backend)
            ctx.extensions[_EXTENSION] = regions
        assert isinstance(regions, WorkerRegions)
        return regions

    def get(self, name: object) -> _Mapped:
        """The mapping of region ``name`` (mapped and pinned on first use)."""
        if not isinstance(name, str):
            raise InvalidArgument("the request names no region (region_name missing)")
        found = self._mapped.get(name)
        if found is not None:
            self._mapped.move_to_end(name)
            return found
        try:
            region = Region.attach(name, tenant_id=self.tenant_id)
        except SegmentError as exc:
            raise InvalidArgument(f"region cannot be used: {exc.detail}") from None
        addr = self.backend.pin_host(region.data)
        mapped = _Mapped(region, addr)
        self._mapped[name] = mapped
        while len(self._mapped) > self.max_mapped:
            self._unmap(*self._mapped.popitem(last=False))
        return mapped

    def drop(self, name: str) -> bool:
        """Unpin and unmap ``name`` (released by its client); False when it was not mapped."""
        mapped = self._mapped.pop(name, None)
        if mapped is None:
            return False
        self._unmap(name, mapped)
        return True

    def _unmap(self, name: str, mapped: _Mapped) -> None:
        if mapped.addr is not None:
            self.backend.unpin_host(mapped.addr)  # before the pages go
        mapped.region.close()
        log_event(_log, logging.DEBUG, "region.unmapped", region=name)

    def names(self) -> list[str]:
        return list(self._mapped)

    def close(self) -> None:
        """Unpin and unmap everything (context close; before the backend closes)."""
        while self._mapped:
            self._unmap(*self._mapped.popitem(last=False))


def _copy_region(server: WorkerServer, args: dict[str, object], what: str) -> int:
    """Run a write_region (region -> buffer) or read_region (buffer -> region) request;
    the number of bytes copied."""
    ctx = server.require_context()
    mapped = WorkerRegions.of(ctx).get(args.get("region_name"))
    region_offset = _int_arg(args, "region_offset", 0)
    nbytes = _int_arg(args, "nbytes")
    span = mapped.region.span(region_offset, nbytes, what)
    allocator = ctx.allocator
    buf = allocator.lookup(args.get("handle"))
    writing = what == "write_region"
    off = allocator.check_range(buf, args.get("offset", 0), len(span), "write" if writing else "read")
    addr = None if mapped.addr is None else mapped.addr + region_offset
    copy = ctx.backend.write_host if writing else ctx.backend.read_host
    copy(buf, off, span, addr)
    return len(span)


def op_write_region(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``write_region {handle, offset, region_name, region_offset, nbytes}`` -> ``{written}``:
    copy ``nbytes`` of the region at ``region_offset`` into the buffer at ``offset``."""
    return {"written": _copy_region(server, args, "write_region")}, None


def op_read_region(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``read_region {handle, offset, region_name, region_offset, nbytes}`` -> ``{nbytes}``:
    copy ``nbytes`` of the buffer at ``offset`` into the region at ``region_offset``."""
    return {"nbytes": _copy_region(server, args, "read_region")}, None


def op_region_drop(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``region_drop {name}`` -> ``{dropped}``: the supervisor released the region."""
    ctx = server.context
    name = args.get("name")
    if ctx is None or not isinstance(name, str):
        return {"dropped": False}, None
    regions = ctx.extensions.get(_EXTENSION)
    dropped = isinstance(regions, WorkerRegions) and regions.drop(name)
    return {"dropped": dropped}, None
