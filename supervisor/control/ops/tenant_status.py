"""``tenant_status``: one tenant's record (``twt status TENANT``; ``register`` and ``scale --wait`` read it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import arg_str
from shared.records import TenantRecord
from supervisor.client.api import SupervisorClient
from supervisor.control.ops._base import AdminOp, Args, Reply
from supervisor.control.ops._cli import unreachable_on_timeout

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["TenantStatus", "fetch_tenant"]


class TenantStatus(AdminOp):
    name = "tenant_status"
    args_doc = "`{tenant}`"
    result_doc = "one record"

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.ok(part.records.tenant_record(part.runtime(arg_str(args, "tenant"))).to_wire())


def fetch_tenant(client: SupervisorClient, tenant: str) -> TenantRecord:
    """One tenant's record (as :func:`~supervisor.control.ops.status.fetch_status`, for one tenant)."""
    return unreachable_on_timeout(client, lambda: client.tenant_status(None, tenant))
