"""``region_create``: a shared-memory data region bound to the tenant, for a client on this host.

See :mod:`supervisor.routing.regions` (who owns what) and docs/PROTOCOL.md
"Bulk data: shared-memory regions"; refused over TCP (the row is ``local_only``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.control.ops._base import Args, FrontendOp

if TYPE_CHECKING:
    from supervisor.admission.frontend import Frontend
    from supervisor.runtime.tenants import TenantRuntime

__all__ = ["RegionCreate"]


class RegionCreate(FrontendOp):
    name = "region_create"
    args_doc = ("`{nbytes, pid?}` (64 KiB..1 GiB; `pid` is ignored: the region belongs to the process the "
                "kernel says is at the other end of the ipc connection, `SO_PEERCRED`)")
    result_doc = "`{region, name, nbytes}` (answered by the supervisor; `nbytes` rounded up to pages)"
    error_notes = {
        "MemoryExhausted": "the tenant's host quota",
        "InvalidArgument": "size, a connection without peer credentials, more than 64 regions; any region op over the TCP frontend: regions serve local clients only",
    }

    def serve(self, frontend: Frontend, rt: TenantRuntime, args: Args, body: object) -> object:
        # "pid" here is the one the frontend read from the connection's peer credentials (the
        # client's own value was dropped at decode); absent when the connection has none
        owned = frontend.regions.create(rt.tenant_id, rt.block, args.get("nbytes"), args.get("pid"),
                                        generation=rt.generation)
        return {"region": owned.region_id, "name": owned.name, "nbytes": owned.nbytes}
