"""``scale`` / ``twt scale``: run N worker instances for a tenant, live.

The command and its examples: :mod:`supervisor.cli.commands.scale`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import arg_int, arg_str
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Scale"]


class Scale(AdminOp):
    name = "scale"
    args_doc = "`{tenant, instances}`"
    result_doc = ("the tenant's status record (new instances start; removed ones drain, then stop; 0: state "
                  "`stopped`)")
    error_notes = {
        "CapacityExhausted": "`max_workers` reached; nothing changed",
    }

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.ok(part.scale(arg_str(args, "tenant"), arg_int(args, "instances")).to_wire())
