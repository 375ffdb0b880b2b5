"""``twt alloc | free | buffers | write | read``: a tenant's device buffers from the command line.

A buffer lives on one instance of its tenant (the worker process that
allocated it) and dies with it. Handles are printed as ``INSTANCE:SEQ``
(``1:7``: the 7th buffer of instance 1); every command that takes a handle
accepts that text, or the raw integer a library caller sees, and looks it up
among the buffers the tenant holds now (the ``buffers`` op), so a handle that
is gone (freed, never allocated, or lost when its instance restarted) is
named as such with the list of those held, before anything is sent.

Each command connects anew: buffers outlive the client that allocated them
and stay until freed, evicted, or their instance restarts. The capability is
obtained with the run dir's ``admin.cap``, or read from ``--capability FILE``
by a tenant that holds its own. ``--connect tcp://HOST:PORT --server-key=KEY``
reaches a remote supervisor instead (with ``--capability FILE``, or
``--admin-cap FILE`` where the supervisor allows remote admin).
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import InvalidArgument
from shared.sizes import format_size, parse_size
from supervisor.cli._common import (
    add_capability_option,
    add_run_dir,
    client_of,
    non_negative_int,
    print_json,
    print_table,
    tenant_capability_file,
    tenant_capability_of,
)
from supervisor.client.api import SupervisorClient

__all__ = ["add_parser", "format_held", "resolve_handle"]

#: float32 values ``twt read`` shows when it prints rather than writes a file
_SHOWN = 8
#: seconds a buffer command waits for an answer (a write or read of a large buffer moves its bytes)
BUFFER_TIMEOUT_S = 30.0


def format_held(held: Mapping[int, int]) -> str:
    """``0:1 (4KiB), 1:2 (1MiB)`` or ``none``: the buffers a tenant holds, for messages."""
    if not held:
        return "none"
    return ", ".join(f"{proto.format_handle(h)} ({format_size(n)})" for h, n in sorted(held.items()))


def resolve_handle(text: str | int, held: Mapping[int, int], tenant: str) -> int:
    """``1:7`` or a raw handle -> the handle of a buffer ``tenant`` holds (``held``: handle -> bytes).

    InvalidArgument, naming the buffers held, when it is none of them; ValueError for text that is
    not a handle at all.
    """
    if isinstance(text, int):
        wanted: int | tuple[int, int] = text
    else:
        value = text.strip()
        wanted = proto.parse_handle_text(value) if ":" in value else _raw_handle(value)
    for handle in held:
        if handle == wanted or (proto.handle_instance(handle), proto.handle_seq(handle)) == wanted:
            return handle
    shown = text if isinstance(text, str) and ":" in text else (
        proto.format_handle(wanted) if isinstance(wanted, int) else text)
    raise InvalidArgument(
        f"buffer {shown} is not held by {tenant!r} (freed, never allocated, or lost when its instance restarted); "
        f"it holds: {format_held(held)}"
    )


def _raw_handle(value: str) -> int:
    try:
        handle = int(value, 0)
    except ValueError:
        raise ValueError(f"not a buffer handle: {value!r} (INSTANCE:SEQ as twt alloc prints it, e.g. 1:7, "
                         "or the raw integer)") from None
    if handle < 0:
        raise ValueError(f"not a buffer handle: {value!r} (negative)")
    return handle


# ----------------------------------------------------------------- parsers


def _common(p: argparse.ArgumentParser, *, json_help: str) -> None:
    add_capability_option(p)
    p.add_argument("--json", action="store_true", help=json_help)
    add_run_dir(p)


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a buffer needs at least one byte, got {text!r}")
    return n


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("alloc", help="allocate a device buffer for a tenant; prints its handle",
                       description="Allocate SIZE bytes of device memory for TENANT, metered against its GPU cap. "
                       "Prints the handle (INSTANCE:SEQ). Buffers a run uses together must live on one instance: "
                       "--instance puts it there.")
    p.add_argument("tenant", metavar="TENANT")
    p.add_argument("size", type=_size, metavar="SIZE", help="bytes, e.g. 4096 or 1MiB")
    p.add_argument("--instance", type=non_negative_int, default=None, metavar="N",
                   help="allocate on instance N (default: the least loaded)")
    _common(p, json_help="print {handle, text, instance, nbytes} as JSON")
    p.set_defaults(func=run_alloc)

    p = sub.add_parser("free", help="free a tenant's device buffer",
                       description="Free the buffer HANDLE (INSTANCE:SEQ, or the raw integer) of TENANT.")
    p.add_argument("tenant", metavar="TENANT")
    p.add_argument("handle", metavar="HANDLE")
    _common(p, json_help="print {handle, freed} as JSON")
    p.set_defaults(func=run_free)

    p = sub.add_parser("buffers", help="list a tenant's device buffers on every instance",
                       description="List the buffers TENANT holds, on every ready instance: handle, instance, size.")
    p.add_argument("tenant", metavar="TENANT")
    _common(p, json_help="print [{handle, text, instance, nbytes}...] as JSON")
    p.set_defaults(func=run_buffers)

    p = sub.add_parser("write", help="write bytes into a tenant's device buffer",
                       description="Write a file's bytes (--from) or one float32 value repeated (--fill) into the "
                       "buffer HANDLE of TENANT, at --offset.")
    p.add_argument("tenant", metavar="TENANT")
    p.add_argument("handle", metavar="HANDLE")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", type=Path, metavar="FILE", help="write this file's bytes (default: none; give --from or --fill)")
    source.add_argument("--fill", type=float, metavar="V",
                        help="fill from --offset to the end with float32 V, the WASM tensor ops' element type "
                        "(default: none; give --from or --fill)")
    p.add_argument("--offset", type=non_negative_int, default=0, help="byte offset in the buffer (default: 0)")
    _common(p, json_help="print {handle, written} as JSON")
    p.set_defaults(func=run_write)

    p = sub.add_parser("read", help="read a tenant's device buffer",
                       description="Read the buffer HANDLE of TENANT: into --out FILE, or else print its size and "
                       f"its first {_SHOWN} float32 values.")
    p.add_argument("tenant", metavar="TENANT")
    p.add_argument("handle", metavar="HANDLE")
    p.add_argument("--out", type=Path, default=None, metavar="FILE", help="write the bytes here (default: print)")
    p.add_argument("--offset", type=non_negative_int, default=0, help="byte offset in the buffer (default: 0)")
    p.add_argument("--nbytes", type=non_negative_int, default=None,
                   help="bytes to read (default: to the end of the buffer)")
    _common(p, json_help="print {handle, nbytes, float32: [...]} as JSON")
    p.set_defaults(func=run_read)


# ----------------------------------------------------------------- commands


def _record(handle: int, nbytes: int) -> dict[str, object]:
    return {"handle": handle, "text": proto.format_handle(handle), "instance": proto.handle_instance(handle),
            "nbytes": nbytes}


def _connect(args: argparse.Namespace) -> tuple[SupervisorClient, TenantCapability]:
    cap_file = tenant_capability_file(args.capability, args.tenant) if args.capability is not None else None
    client = client_of(args, BUFFER_TIMEOUT_S)
    try:
        return client, tenant_capability_of(client, args.tenant, cap_file)
    except BaseException:
        client.close()
        raise


def _held(client: SupervisorClient, cap: TenantCapability, args: argparse.Namespace) -> tuple[int, int]:
    """(handle, size) of the buffer ``args.handle`` names, among those the tenant holds now."""
    held = client.buffers(cap)
    handle = resolve_handle(args.handle, held, args.tenant)
    return handle, held[handle]


def _report(args: argparse.Namespace, handle: int, text: str, **fields: object) -> int:
    """A command's result on one buffer: ``{handle, text, **fields}`` as JSON with --json, else ``text``."""
    if args.json:
        print_json({"handle": handle, "text": proto.format_handle(handle), **fields})
    else:
        print(text)
    return 0


def run_alloc(args: argparse.Namespace) -> int:
    client, cap = _connect(args)
    with client:
        handle = client.alloc(cap, args.size, instance=args.instance)
    if args.json:
        print_json(_record(handle, args.size))
    else:
        print(f"{proto.format_handle(handle)}  {args.tenant}: {format_size(args.size)} on instance "
              f"{proto.handle_instance(handle)}")
    return 0


def run_free(args: argparse.Namespace) -> int:
    client, cap = _connect(args)
    with client:
        handle, _ = _held(client, cap, args)
        freed = client.free(cap, handle)
    return _report(args, handle, f"freed {proto.format_handle(handle)}  {args.tenant}: {format_size(freed)}",
                   freed=freed)


def run_buffers(args: argparse.Namespace) -> int:
    client, cap = _connect(args)
    with client:
        held = client.buffers(cap)
    if args.json:
        print_json([_record(h, n) for h, n in sorted(held.items())])
        return 0
    if not held:
        print(f"{args.tenant}: no buffers")
        return 0
    print_table(("HANDLE", "INSTANCE", "SIZE"),
                [(proto.format_handle(h), proto.handle_instance(h), format_size(n)) for h, n in sorted(held.items())])
    print(f"{len(held)} buffer(s), {format_size(sum(held.values()))}")
    return 0


def run_write(args: argparse.Namespace) -> int:
    client, cap = _connect(args)
    with client:
        handle, size = _held(client, cap, args)
        if args.source is not None:
            data = args.source.read_bytes()
        else:
            room = max(0, size - args.offset)
            data = struct.pack("<f", args.fill) * (room // 4) + bytes(room % 4)
        if args.offset + len(data) > size:
            raise InvalidArgument(f"{len(data):,} B at offset {args.offset:,} do not fit the {size:,}-byte buffer "
                                  f"{proto.format_handle(handle)}")
        written = client.write(cap, handle, data, offset=args.offset)
    return _report(args, handle, f"wrote {written:,} B to {proto.format_handle(handle)}  {args.tenant} "
                   f"(offset {args.offset:,})", written=written)


def run_read(args: argparse.Namespace) -> int:
    client, cap = _connect(args)
    with client:
        handle, size = _held(client, cap, args)
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
