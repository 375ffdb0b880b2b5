"""The worker's side of parking: its buffers out to the supervisor, and into a new worker.

    supervisor (supervisor.lifecycle.parking)          worker (this module)
    export_buffers {}                       ───►  {buffers: [[handle, nbytes]...], seq}
    export_chunk {handle, offset, nbytes}   ───►  {nbytes} + body: the bytes        (repeated)
          ... the worker is stopped; later, a fresh worker is bound with the same incarnation ...
    import_buffer {handle, nbytes, offset, seq} + body ───► {written}                 (repeated)
    import_buffer {handle: nil, seq}        ───►  {written: 0}  (an instance without buffers)

Every message is bounded (the supervisor sends chunks of at most
``PARK_CHUNK_BYTES``); the bytes move through the backend's ``read`` / ``write``,
so the stub and cuda backends need nothing of their own (the cuda backend copies
device <-> host with its stream-ordered copies). An import allocates through the
metered allocator: the restored buffer is charged to the tenant's GPU quota like
any allocation, and a refusal is a typed :class:`GpuMemoryExhausted`.

Threads: the executor thread, like every op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.checks import is_int
from shared.errors import InvalidArgument

if TYPE_CHECKING:
    import zmq

    from worker.server import Reply, WorkerServer

__all__ = ["op_export_buffers", "op_export_chunk", "op_import_buffer"]


def _int(args: dict[str, object], name: str) -> int:
    value = args.get(name)
    if not is_int(value) or value < 0:
        raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
    return value


def op_export_buffers(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``export_buffers {}`` -> ``{buffers: [[handle, nbytes]...], seq}``: what parking copies out."""
    alloc = server.require_context().allocator
    return {"buffers": sorted(alloc.handles().items()), "seq": alloc.seq}, None


def op_export_chunk(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``export_chunk {handle, offset, nbytes}`` -> ``{nbytes}`` + body: one chunk of a buffer."""
    alloc = server.require_context().allocator
    data = alloc.read(_int(args, "handle"), _int(args, "offset"), _int(args, "nbytes"))
    return {"nbytes": len(data)}, data


def op_import_buffer(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``import_buffer {handle, nbytes, offset, seq}`` + body -> ``{written}``: one chunk of a parked
    buffer back under its old handle (``handle`` nil: only continue handles after ``seq``)."""
    alloc = server.require_context().allocator
    if args.get("handle") is None:
        alloc.restore_seq(args.get("seq"))
        return {"written": 0}, None
    data = body.buffer if body is not None else memoryview(b"")
    written = alloc.import_buffer(_int(args, "handle"), _int(args, "nbytes"), _int(args, "offset"), data,
                                  _int(args, "seq"))
    return {"written": written}, None
