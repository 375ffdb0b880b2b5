"""The command half of ``register`` / ``twt register``: a new tenant, answered once every instance is ready.

    twt register acme --memory-quota 2GiB --gpu-cap 512MiB --instances 2 --cap-out acme.cap
    twt register --file tenants.toml acme        # a [[tenant]] table (flags given as well override it)

A tenant capability is printed as hex on stdout (``CAP=$(twt register acme)``)
or written with ``--cap-out FILE`` (hex and a newline, mode 0600);
``shared.capability.read_capability_file(path)`` reads it back (so does
``twt run --capability FILE``).
"""

from __future__ import annotations

import argparse

from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import (
    ADMIN_TIMEOUT_S,
    add_cap_out,
    build_spec,
    check_cap_out,
    emit_capability,
    fetch_tenant,
    spec_flags,
)

__all__ = ["RegisterCommand"]


class RegisterCommand(OpCommand):
    name = "register"
    command = "register"
    help = "register a tenant (flags or a TOML file) and print its capability"
    description = ("Register a tenant with the running supervisor and print its capability as hex "
                   "(or write it to --cap-out). Returns once every instance is ready. With --file, the tenant "
                   "comes from a TOML file: one tenant table, or [[tenant]] tables (name the one to register; a "
                   "[supervisor] table is ignored, so the supervisor's own config file works); flags override it.")
    json_help = "print {tenant, capability} as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", nargs="?", metavar="TENANT", help="tenant id (optional with --file)")
        spec_flags(p)
        add_cap_out(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        spec = build_spec(args)
        check_cap_out(args.cap_out)
        with connect(ADMIN_TIMEOUT_S) as client:
            cap = client.register(None, spec)
            rec = fetch_tenant(client, str(spec.tenant_id))
        emit_capability(args, str(spec.tenant_id), cap, rec)
        return 0
