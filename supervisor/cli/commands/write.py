"""The command half of ``write`` / ``twt write``: bytes into a tenant's device buffer (the body frame).

    twt write acme 1:7 --from data.bin
    twt write acme 1:7 --fill 1.5
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

from shared import protocol as proto
from shared.errors import InvalidArgument
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._buffers import connect_tenant, held_buffer, report
from supervisor.cli.commands._cli import add_capability_option
from supervisor.client.cli_args import non_negative_int

__all__ = ["WriteCommand"]


class WriteCommand(OpCommand):
    name = "write"
    command = "write"
    help = "write bytes into a tenant's device buffer"
    description = ("Write a file's bytes (--from) or one float32 value repeated (--fill) into the "
                   "buffer HANDLE of TENANT, at --offset.")
    json_help = "print {handle, written} as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", metavar="TENANT")
        p.add_argument("handle", metavar="HANDLE")
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--from", dest="source", type=Path, metavar="FILE",
                            help="write this file's bytes (default: none; give --from or --fill)")
        source.add_argument("--fill", type=float, metavar="V",
                            help="fill from --offset to the end with float32 V, the WASM tensor ops' element type "
                            "(default: none; give --from or --fill)")
        p.add_argument("--offset", type=non_negative_int, default=0, help="byte offset in the buffer (default: 0)")
        add_capability_option(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        client, cap = connect_tenant(args, connect)
        with client:
            handle, size = held_buffer(client, cap, args)
            if args.source is not None:
                data = args.source.read_bytes()
            else:
                room = max(0, size - args.offset)
                data = struct.pack("<f", args.fill) * (room // 4) + bytes(room % 4)
            if args.offset + len(data) > size:
                raise InvalidArgument(f"{len(data):,} B at offset {args.offset:,} do not fit the {size:,}-byte "
                                      f"buffer {proto.format_handle(handle)}")
            written = client.write(cap, handle, data, offset=args.offset)
        return report(args, handle, f"wrote {written:,} B to {proto.format_handle(handle)}  {args.tenant} "
                      f"(offset {args.offset:,})", written=written)
