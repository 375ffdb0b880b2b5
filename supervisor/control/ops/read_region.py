"""``read_region``: copy bytes from a buffer into the tenant's shared-memory region (local clients;
``supervisor.client.bulk`` sends it; the frontend resolves the region, the worker copies)."""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["ReadRegion"]


class ReadRegion(WorkerOp):
    name = "read_region"
    args_doc = "`{handle, offset=0, region, region_offset, nbytes}`"
    result_doc = "`{nbytes}` (the bytes are in the region)"
