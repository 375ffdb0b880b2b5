"""``write_region``: copy bytes from the tenant's shared-memory region into a buffer (local clients;
``supervisor.client.bulk`` sends it; the frontend resolves the region, the worker copies)."""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["WriteRegion"]


class WriteRegion(WorkerOp):
    name = "write_region"
    args_doc = "`{handle, offset=0, region, region_offset, nbytes}`"
    result_doc = "`{written}`"
    error_notes = {
        "InvalidArgument": "unknown region, or another tenant's; either range",
    }
