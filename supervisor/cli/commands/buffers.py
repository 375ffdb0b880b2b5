"""The command half of ``buffers`` / ``twt buffers``: the buffers a tenant holds, on every ready instance (a fan-out, merged).

    twt buffers acme
"""

from __future__ import annotations

import argparse

from shared import protocol as proto
from shared.sizes import format_size
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._buffers import connect_tenant, record
from supervisor.cli.commands._cli import add_capability_option
from supervisor.client.cli_args import print_json, print_table

__all__ = ["BuffersCommand"]


class BuffersCommand(OpCommand):
    name = "buffers"
    command = "buffers"
    help = "list a tenant's device buffers on every instance"
    description = "List the buffers TENANT holds, on every ready instance: handle, instance, size."
    json_help = "print [{handle, text, instance, nbytes}...] as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", metavar="TENANT")
        add_capability_option(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        client, cap = connect_tenant(args, connect)
        with client:
            held = client.buffers(cap)
        if args.json:
            print_json([record(h, n) for h, n in sorted(held.items())])
            return 0
        if not held:
            print(f"{args.tenant}: no buffers")
            return 0
        print_table(("HANDLE", "INSTANCE", "SIZE"),
                    [(proto.format_handle(h), proto.handle_instance(h), format_size(n)) for h, n in sorted(held.items())])
        print(f"{len(held)} buffer(s), {format_size(sum(held.values()))}")
        return 0
