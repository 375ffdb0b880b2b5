"""``capability`` / ``twt capability``: the capability of a registered tenant.

    twt capability acme                          # as hex on stdout
    twt capability acme --cap-out acme.cap       # hex and a newline, mode 0600
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shared.protocol import arg_str
from supervisor.control.ops._base import AdminOp, Args, Connect
from supervisor.control.ops._cli import add_cap_out, check_cap_out, emit_capability, tenant_argument

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Capability"]


class Capability(AdminOp):
    name = "capability"
    args_doc = "`{tenant}`"
    result_doc = "`{capability}`: the registered tenant's token (how tenants from the config file get theirs)"
    errors_doc = "`UnknownTenant`"
    command = "capability"
    help = "print the capability of a registered tenant"
    description = ("Print (or write with --cap-out) the current capability of a registered tenant, e.g. one "
                   "registered from the supervisor's config file. Capabilities minted before an eviction stay "
                   "revoked.")
    json_help = "print {tenant, capability} as JSON"

    def serve(self, part: AdminOps, client: bytes, rid: int, args: Args) -> None:
        cap = part.registry.tenant_capability(part.admin_cap, arg_str(args, "tenant"))
        self.answer(part, client, rid, {"capability": cap.to_bytes()})

    def arguments(self, p: argparse.ArgumentParser) -> None:
        tenant_argument(p)
        add_cap_out(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        check_cap_out(args.cap_out)
        with connect() as client:
            cap = client.tenant_capability(None, args.tenant)
        emit_capability(args, args.tenant, cap)
        return 0
