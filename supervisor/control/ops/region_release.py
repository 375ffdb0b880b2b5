"""``region_release``: give a tenant's shared-memory region back (its workers unmap it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.control.ops._base import Args, FrontendOp

if TYPE_CHECKING:
    from supervisor.admission.frontend import Frontend
    from supervisor.runtime.tenants import TenantRuntime

__all__ = ["RegionRelease"]


class RegionRelease(FrontendOp):
    name = "region_release"
    args_doc = "`{region}`"
    result_doc = "`{released: nbytes}` (answered by the supervisor)"
    error_notes = {
        "InvalidArgument": "unknown region, or another tenant's",
    }

    def serve(self, frontend: Frontend, rt: TenantRuntime, args: Args, body: object) -> object:
        owned = frontend.regions.release(rt.tenant_id, args.get("region"))
        frontend.dispatcher.unmap_region(rt, owned.name)
        return {"released": owned.nbytes}
