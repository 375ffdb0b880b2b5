"""The command half of ``read`` / ``twt read``: a tenant's device buffer, into a file or shown as float32 values.

    twt read acme 1:7 --out data.bin
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

from shared import protocol as proto
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._buffers import connect_tenant, held_buffer
from supervisor.cli.commands._cli import add_capability_option
from supervisor.client.cli_args import non_negative_int, print_json

__all__ = ["ReadCommand"]

#: float32 values ``twt read`` shows when it prints rather than writes a file
_SHOWN = 8


class ReadCommand(OpCommand):
    name = "read"
    command = "read"
    help = "read a tenant's device buffer"
    description = ("Read the buffer HANDLE of TENANT: into --out FILE, or else print its size and "
                   f"its first {_SHOWN} float32 values.")
    json_help = "print {handle, nbytes, float32: [...]} as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", metavar="TENANT")
        p.add_argument("handle", metavar="HANDLE")
        p.add_argument("--out", type=Path, default=None, metavar="FILE", help="write the bytes here (default: print)")
        p.add_argument("--offset", type=non_negative_int, default=0, help="byte offset in the buffer (default: 0)")
        p.add_argument("--nbytes", type=non_negative_int, default=None,
                       help="bytes to read (default: to the end of the buffer)")
        add_capability_option(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        client, cap = connect_tenant(args, connect)
        with client:
            handle, size = held_buffer(client, cap, args)
            nbytes = args.nbytes if args.nbytes is not None else max(0, size - args.offset)
            data = client.read(cap, handle, nbytes, offset=args.offset)
        if args.out is not None:
            args.out.write_bytes(data)
            if not args.json:
                print(f"read {len(data):,} B of {proto.format_handle(handle)}  {args.tenant} into {args.out}")
        floats = [v for (v,) in struct.iter_unpack("<f", data[: len(data) // 4 * 4])]
        if args.json:
            print_json({"handle": handle, "text": proto.format_handle(handle), "nbytes": len(data),
                        "float32": floats[:_SHOWN]})
        elif args.out is None:
            shown = ", ".join(f"{v:g}" for v in floats[:_SHOWN])
            more = f", ... ({len(floats)} values)" if len(floats) > _SHOWN else ""
            sys.stdout.write(f"{proto.format_handle(handle)}  {args.tenant}: {len(data):,} B; as float32: "
                             f"[{shown}{more}]\n")
        return 0
