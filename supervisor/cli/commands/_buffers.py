"""What the buffer commands share (``twt alloc | free | buffers | write | read``, and ``twt run``'s
``handle=`` arguments): handles as people type them, looked up among the buffers a tenant holds.

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
from collections.abc import Mapping

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import InvalidArgument
from shared.sizes import format_size, parse_size
from supervisor.cli.commands._base import Connect
from supervisor.cli.commands._cli import tenant_capability_file, tenant_capability_of
from supervisor.client.api import SupervisorClient
from supervisor.client.cli_args import print_json

__all__ = ["BUFFER_TIMEOUT_S", "buffer_size", "connect_tenant", "format_held", "held_buffer", "record", "report",
           "resolve_handle"]

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


def buffer_size(text: str) -> int:
    """argparse type: a buffer's size, at least one byte."""
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a buffer needs at least one byte, got {text!r}")
    return n


def record(handle: int, nbytes: int) -> dict[str, object]:
    return {"handle": handle, "text": proto.format_handle(handle), "instance": proto.handle_instance(handle),
            "nbytes": nbytes}


def connect_tenant(args: argparse.Namespace, connect: Connect,
                   timeout_s: float = BUFFER_TIMEOUT_S) -> tuple[SupervisorClient, TenantCapability]:
    """A client and ``args.tenant``'s capability (``--capability FILE``, read first, or obtained with the admin one)."""
    cap_file = tenant_capability_file(args.capability, args.tenant) if args.capability is not None else None
    client = connect(timeout_s)
    try:
        return client, tenant_capability_of(client, args.tenant, cap_file)
    except BaseException:
        client.close()
        raise


def held_buffer(client: SupervisorClient, cap: TenantCapability, args: argparse.Namespace) -> tuple[int, int]:
    """(handle, size) of the buffer ``args.handle`` names, among those the tenant holds now."""
    held = client.buffers(cap)
    handle = resolve_handle(args.handle, held, args.tenant)
    return handle, held[handle]


def report(args: argparse.Namespace, handle: int, text: str, **fields: object) -> int:
    """A command's result on one buffer: ``{handle, text, **fields}`` as JSON with --json, else ``text``."""
    if args.json:
        print_json({"handle": handle, "text": proto.format_handle(handle), **fields})
    else:
        print(text)
    return 0
