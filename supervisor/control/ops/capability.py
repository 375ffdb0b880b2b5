"""``capability`` / ``twt capability``: the capability of a registered tenant, or of a role.

The monitor capability grants the read-only ops only (``shared.protocol.MONITOR_OPS``:
status, events, version, hello) and is accepted over TCP without
``allow_remote_admin``: a monitoring host holds it instead of the admin one. It is
minted from the registry key like the admin capability: the same bytes across
restarts, revoked (with every other capability) by ``twt rotate-key``.

The command and its examples: :mod:`supervisor.cli.commands.capability`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import InvalidArgument
from shared.protocol import arg_opt_str
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["ROLES", "Capability"]

#: the roles ``--role`` names (a tenant's capability is asked for by its name instead)
ROLES = ("monitor",)


class Capability(AdminOp):
    name = "capability"
    args_doc = "`{tenant}` or `{role: \"monitor\"}`"
    result_doc = ("`{capability}`: the registered tenant's token (how tenants from the config file get theirs), "
                  "or the monitor role's (read-only ops only, accepted over TCP without `allow_remote_admin`)")
    error_notes = {
        "InvalidArgument": "neither or both of tenant and role, an unknown role",
    }

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        tenant, role = arg_opt_str(args, "tenant"), arg_opt_str(args, "role")
        if (tenant is None) == (role is None):
            raise InvalidArgument("capability: name a tenant or a role (role: one of " + ", ".join(ROLES) + ")")
        if role is not None:
            if role not in ROLES:
                raise InvalidArgument(f"capability: unknown role {role!r:.40} (known: {', '.join(ROLES)})")
            cap = part.registry.monitor_capability(part.admin_cap)
            reply.ok({"capability": cap.to_bytes()})
            return
        assert tenant is not None
        tcap = part.registry.tenant_capability(part.admin_cap, tenant)
        reply.ok({"capability": tcap.to_bytes()})
