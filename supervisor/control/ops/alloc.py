"""``alloc`` / ``twt alloc``: a device buffer for a tenant, metered against its GPU cap.

The command and its examples: :mod:`supervisor.cli.commands.alloc`.
"""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["Alloc"]


class Alloc(WorkerOp):
    name = "alloc"
    args_doc = "`{nbytes: int, instance?: int}`"
    result_doc = "`{handle, nbytes}`"
    error_notes = {
        "GpuMemoryExhausted": "tenant cap, device budget or driver OOM; nothing allocated",
        "InvalidArgument": "also: `instance` not one the tenant runs",
    }
