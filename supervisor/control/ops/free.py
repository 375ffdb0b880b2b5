"""``free`` / ``twt free``: free a tenant's device buffer.

    twt free acme 1:7
"""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["Free"]


class Free(WorkerOp):
    name = "free"
    args_doc = "`{handle}`"
    result_doc = "`{freed: nbytes}`"
    error_notes = {
        "InvalidArgument": "unknown or freed handle, an instance the tenant does not run",
        "BufferLost": "its instance restarted",
    }
