"""``reset`` / ``twt reset``: clear a failed tenant and start its instances again (same capability).

The command and its examples: :mod:`supervisor.cli.commands.reset`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import arg_str
from supervisor.control.ops._base import Args, Reply, ServiceOp

if TYPE_CHECKING:
    from supervisor.control.service import ServiceOps

__all__ = ["Reset"]


class Reset(ServiceOp):
    name = "reset"
    args_doc = "`{tenant}`"
    result_doc = ("the tenant's status record, once it runs: its failed state and restart history cleared, its "
                  "instances started, its capability unchanged")
    error_notes = {
        "UnknownTenant": "also: evicted meanwhile",
        "TenantFailed": "it failed again while starting",
    }

    def serve(self, part: ServiceOps, reply: Reply, args: Args) -> None:
        reply.when(part.reset(arg_str(args, "tenant")))
