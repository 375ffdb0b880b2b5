"""``free`` / ``twt free``: free a tenant's device buffer.

The command and its examples: :mod:`supervisor.cli.commands.free`.
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
