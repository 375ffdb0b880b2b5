"""The command half of ``capability`` / ``twt capability``: the capability of a registered tenant, or of a role.

    twt capability acme                          # as hex on stdout
    twt capability acme --cap-out acme.cap       # hex and a newline, mode 0600
    twt capability --role monitor --cap-out monitor.cap   # the read-only monitoring capability

The monitor capability grants the read-only ops only (``shared.protocol.MONITOR_OPS``:
status, events, version, hello) and is accepted over TCP without
``allow_remote_admin``: a monitoring host holds it instead of the admin one. It is
minted from the registry key like the admin capability: the same bytes across
restarts, revoked (with every other capability) by ``twt rotate-key``.
"""

from __future__ import annotations

import argparse

from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import add_cap_out, check_cap_out, emit_capability
from supervisor.control.ops.capability import ROLES

__all__ = ["CapabilityCommand"]


class CapabilityCommand(OpCommand):
    name = "capability"
    command = "capability"
    help = "print the capability of a registered tenant, or of the read-only monitor role"
    description = ("Print (or write with --cap-out) the current capability of a registered tenant, e.g. one "
                   "registered from the supervisor's config file, or with --role monitor the read-only "
                   "monitoring capability (status, events, version; remote without allow_remote_admin). "
                   "Capabilities minted before an eviction stay revoked; rotate-key revokes them all.")
    json_help = "print {tenant, capability} as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", metavar="TENANT", nargs="?", help="the tenant (or --role)")
        p.add_argument("--role", choices=ROLES,
                       help="a role's capability instead of a tenant's: monitor = the read-only ops (status, "
                       "events, version), accepted remotely without allow_remote_admin (default: none)")
        add_cap_out(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        if (args.tenant is None) == (args.role is None):
            raise ValueError("name a TENANT or a --role (not both)")
        check_cap_out(args.cap_out)
        with connect() as client:
            if args.role is not None:
                emit_capability(args, args.role, client.role_capability(None, args.role))
                return 0
            cap = client.tenant_capability(None, args.tenant)
        emit_capability(args, args.tenant, cap)
        return 0
