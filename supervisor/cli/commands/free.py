"""The command half of ``free`` / ``twt free``: free a tenant's device buffer.

    twt free acme 1:7
"""

from __future__ import annotations

import argparse

from shared import protocol as proto
from shared.sizes import format_size
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._buffers import connect_tenant, held_buffer, report
from supervisor.cli.commands._cli import add_capability_option

__all__ = ["FreeCommand"]


class FreeCommand(OpCommand):
    name = "free"
    command = "free"
    help = "free a tenant's device buffer"
    description = "Free the buffer HANDLE (INSTANCE:SEQ, or the raw integer) of TENANT."
    json_help = "print {handle, freed} as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", metavar="TENANT")
        p.add_argument("handle", metavar="HANDLE")
        add_capability_option(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        client, cap = connect_tenant(args, connect)
        with client:
            handle, _ = held_buffer(client, cap, args)
            freed = client.free(cap, handle)
        return report(args, handle, f"freed {proto.format_handle(handle)}  {args.tenant}: {format_size(freed)}",
                      freed=freed)
