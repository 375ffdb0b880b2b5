"""The worker's side of parking: its buffers out to the supervisor, and into a new worker.

    supervisor (supervisor.lifecycle.parking)          worker (this module)
    export_buffers {}                       ───►  {buffers: [[handle, nbytes]...], seq}
    export_chunk {handle, offset, nbytes}   ───►  {nbytes} + body: the bytes        (repeated)
          ... the worker is stopped; later, a fresh worker is bound with the same incarnation ...
    import_mapped {path, buffers: [[handle, nbytes, offset]...], seq} ───► {written}  (once)
      or, where the supervisor kept the copy in its own memory:
    import_buffer {handle, nbytes, offset, seq} + body ───► {written}                 (repeated)
    import_buffer {handle: nil, seq}        ───►  {written: 0}  (an instance without buffers)

``import_mapped`` is the one-copy restore: the supervisor kept the instance's
buffers end to end in one file of its run dir (supervisor.store.parked_bytes);
the worker maps it privately and read-only in effect (copy-on-write, never
written) and writes each buffer from the mapping straight into the backend's
buffer - no message carries the bytes, no intermediate object holds them.
Every message is bounded (the supervisor sends chunks of at most
``PARK_CHUNK_BYTES``); the bytes move through the backend's ``read`` / ``write``,
so the stub and cuda backends need nothing of their own (the cuda backend copies
device <-> host with its stream-ordered copies). An import allocates through the
metered allocator: the restored buffer is charged to the tenant's GPU quota like
any allocation, and a refusal is a typed :class:`GpuMemoryExhausted`.

Threads: the executor thread, like every op.
"""

from __future__ import annotations

import mmap
import os
import re
from typing import TYPE_CHECKING

from shared.checks import is_int
from shared.errors import InvalidArgument, SegmentError

if TYPE_CHECKING:
    import zmq

    from worker.server import Reply, WorkerServer

__all__ = ["op_export_buffers", "op_export_chunk", "op_import_buffer", "op_import_mapped"]

#: a parked file's path: ``<run dir>/parked/p<128 random bits>`` (supervisor.store.parked_bytes
#: names them so); nothing else is opened
_PARKED_PATH = re.compile(r"/(?:[^/\0]+/)*parked/p[0-9a-f]{32}")
#: the most buffers one instance holds (worker.allocator's bound) and so one import names
_MAX_ENTRIES = 1 << 16


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


def _entries(value: object) -> list[tuple[int, int, int]]:
    if not isinstance(value, list) or len(value) > _MAX_ENTRIES:
        raise InvalidArgument(f"buffers must be a list of at most {_MAX_ENTRIES} [handle, nbytes, offset]")
    out: list[tuple[int, int, int]] = []
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 3 and all(is_int(x) and x >= 0 for x in entry)
                and entry[1] > 0):
            raise InvalidArgument(f"a buffers entry is [handle, nbytes > 0, offset], got {entry!r:.80}")
        out.append((entry[0], entry[1], entry[2]))
    return out


def op_import_mapped(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``import_mapped {path, buffers: [[handle, nbytes, offset]...], seq}`` -> ``{written}``: every
    parked buffer of this instance back under its old handle, each copied once from the parked
    file's mapping into the backend's buffer (see the module docstring)."""
    alloc = server.require_context().allocator
    path = args.get("path")
    if not isinstance(path, str) or not _PARKED_PATH.fullmatch(path):
        raise InvalidArgument(f"path must name a parked file (<run dir>/parked/p<32 hex>), got {path!r:.120}")
    entries = _entries(args.get("buffers"))
    seq = _int(args, "seq")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SegmentError(os.path.basename(path), f"cannot open the parked file: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        for handle, nbytes, offset in entries:
            if offset + nbytes > size:
                raise InvalidArgument(f"buffer {handle:#x} at [{offset}, {offset + nbytes}) is past the parked "
                                      f"file's {size} B")
        if not entries or not size:
            alloc.restore_seq(seq)
            return {"written": 0}, None
        # private: the backend may take a writable view (the cuda backend's host address); a write
        # would copy the page, never reach the file - and none happens
        try:
            mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:  # no address space or commit charge left for it
            raise SegmentError(os.path.basename(path), f"cannot map the parked file: {exc.strerror}") from None
    finally:
        os.close(fd)
    written = 0
    try:
        with memoryview(mapping) as whole:
            for handle, nbytes, offset in entries:
                with whole[offset:offset + nbytes] as part:
                    written += alloc.import_buffer(handle, nbytes, 0, part, seq)
    finally:
        mapping.close()
    return {"written": written}, None
