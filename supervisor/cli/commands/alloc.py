"""The command half of ``alloc`` / ``twt alloc``: a device buffer for a tenant, metered against its GPU cap.

    twt alloc acme 1MiB --instance 1
"""

from __future__ import annotations

import argparse

from shared import protocol as proto
from shared.sizes import format_size
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._buffers import buffer_size, connect_tenant, record
from supervisor.cli.commands._cli import add_capability_option
from supervisor.client.cli_args import non_negative_int, print_json

__all__ = ["AllocCommand"]


class AllocCommand(OpCommand):
    name = "alloc"
    command = "alloc"
    help = "allocate a device buffer for a tenant; prints its handle"
    description = ("Allocate SIZE bytes of device memory for TENANT, metered against its GPU cap. "
                   "Prints the handle (INSTANCE:SEQ). Buffers a run uses together must live on one instance: "
                   "--instance puts it there.")
    json_help = "print {handle, text, instance, nbytes} as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", metavar="TENANT")
        p.add_argument("size", type=buffer_size, metavar="SIZE", help="bytes, e.g. 4096 or 1MiB")
        p.add_argument("--instance", type=non_negative_int, default=None, metavar="N",
                       help="allocate on instance N (default: the least loaded)")
        add_capability_option(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        client, cap = connect_tenant(args, connect)
        with client:
            handle = client.alloc(cap, args.size, instance=args.instance)
        if args.json:
            print_json(record(handle, args.size))
        else:
            print(f"{proto.format_handle(handle)}  {args.tenant}: {format_size(args.size)} on instance "
                  f"{proto.handle_instance(handle)}")
        return 0
