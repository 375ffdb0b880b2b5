"""``write`` / ``twt write``: bytes into a tenant's device buffer (the body frame).

The command and its examples: :mod:`supervisor.cli.commands.write`.
"""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["Write"]


class Write(WorkerOp):
    name = "write"
    args_doc = "`{handle, offset=0}`"
    body_in_doc = "the bytes"
    result_doc = "`{written}`"
    error_notes = {
        "InvalidArgument": "out of range",
    }
