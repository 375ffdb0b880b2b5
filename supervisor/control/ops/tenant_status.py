"""``tenant_status``: one tenant's record (``twt status TENANT``; ``register`` and ``scale --wait`` read it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import arg_str
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["TenantStatus"]


class TenantStatus(AdminOp):
    name = "tenant_status"
    args_doc = "`{tenant}`"
    result_doc = "one record"

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.ok(part.records.tenant_record(part.runtime(arg_str(args, "tenant"))).to_wire())
