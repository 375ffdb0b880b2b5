"""``buffers`` / ``twt buffers``: the buffers a tenant holds, on every ready instance (a fan-out, merged).

The command and its examples: :mod:`supervisor.cli.commands.buffers`.
"""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["Buffers"]


class Buffers(WorkerOp):
    name = "buffers"
    result_doc = "`{buffers: [[handle, nbytes]...], bytes}` across every ready instance (a fan-out, merged)"
    error_notes = {
        "WorkerLost": "an instance died while answering",
    }
