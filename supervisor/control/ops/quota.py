"""``quota``: the tenant's quota block as it is now (answered by the supervisor, no worker)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.control.ops._base import Args, FrontendOp

if TYPE_CHECKING:
    from supervisor.admission.frontend import Frontend
    from supervisor.runtime.tenants import TenantRuntime

__all__ = ["Quota"]


class Quota(FrontendOp):
    name = "quota"
    result_doc = "the tenant's `QuotaSnapshot` as a map (answered by the supervisor)"

    def serve(self, frontend: Frontend, rt: TenantRuntime, args: Args, body: object) -> object:
        return rt.block.snapshot().to_dict()
