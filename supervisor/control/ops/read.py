"""``read`` / ``twt read``: a tenant's device buffer, into a file or shown as float32 values.

The command and its examples: :mod:`supervisor.cli.commands.read`.
"""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["Read"]


class Read(WorkerOp):
    name = "read"
    args_doc = "`{handle, offset=0, nbytes}`"
    result_doc = "`{nbytes}`"
    body_out_doc = "the bytes"
    error_notes = {
        "Overloaded": "while this client leaves more than `max_client_reply_bytes` of big replies unread",
    }
