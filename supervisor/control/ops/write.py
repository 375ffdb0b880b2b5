"""``write`` / ``twt write``: bytes into a tenant's device buffer (the body frame).

    twt write acme 1:7 --from data.bin
    twt write acme 1:7 --fill 1.5
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
