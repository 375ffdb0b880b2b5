"""``restart`` / ``twt restart``: new worker processes for a tenant, one instance at a time.

The command and its examples: :mod:`supervisor.cli.commands.restart`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import arg_str
from supervisor.control.ops._base import Args, Reply, ServiceOp

if TYPE_CHECKING:
    from supervisor.control.service import ServiceOps

__all__ = ["Restart"]


class Restart(ServiceOp):
    name = "restart"
    args_doc = "`{tenant}`"
    result_doc = ("the tenant's status record, once every instance was replaced by a new worker, one at a time "
                  "(no restart counted)")
    error_notes = {
        "TenantFailed": "reset it first",
    }

    def serve(self, part: ServiceOps, reply: Reply, args: Args) -> None:
        reply.when(part.restart(arg_str(args, "tenant")))
