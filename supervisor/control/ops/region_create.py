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
    args_doc = "`{nbytes, pid}` (64 KiB..1 GiB; `pid`: the client's process)"
    result_doc = "`{region, name, nbytes}` (answered by the supervisor; `nbytes` rounded up to pages)"
    errors_doc = ("`MemoryExhausted` (the tenant's host quota), `InvalidArgument` (size, a `pid` that does not run "
                  "on the supervisor's host, more than 64 regions; any region op over the TCP frontend: regions "
                  "serve local clients only)")

    def serve(self, frontend: Frontend, rt: TenantRuntime, args: Args, body: object) -> object:
        owned = frontend.regions.create(rt.tenant_id, rt.block, args.get("nbytes"), args.get("pid"),
                                        generation=rt.generation)
        return {"region": owned.region_id, "name": owned.name, "nbytes": owned.nbytes}
