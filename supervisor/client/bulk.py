"""The client's bulk path: tensor bytes through shared-memory regions instead of message frames.

    SupervisorClient.write(cap, h, data)        len(data) >= threshold, local client
      BulkPath.write                             staging region of this tenant (created once:
        for chunk in plan_chunks(...)              region_create {nbytes, pid}; then attached)
          wait until the chunk's slot is free   <- its previous chunk's reply
          copy data[chunk] into the slot           (one memcpy, ours)
          send write_region {handle, offset, region, region_offset, nbytes}
        wait for the remaining replies             (the worker's copy runs meanwhile: a pipeline)

    read_into is the mirror image (send read_region for chunk k+1 while copying chunk k out).

A staging region is bounded (``region_bytes``), so any payload size moves
through it in chunks rotating over a few slots; a slot is reused only once
the chunk that used it before is answered, so the worker never reads bytes
we are overwriting. A transfer that times out leaves late copies in flight:
its region is given up (released, a fresh one made next time), never reused.

Falling back to frames is always correct: a payload below the threshold, a
remote client, or a region the supervisor will not grant (host quota, the
client's process not on its host) take the frame path; the last two are
remembered for a while so a refused client does not pay a refusal per call.
"""

from __future__ import annotations

import collections
import ctypes
import os
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypeVar, cast

from shared.errors import (
    InvalidArgument,
    MemoryExhausted,
    Overloaded,
    RequestTimeout,
    SegmentError,
    TensorWasmError,
    error_from_dict,
)
from shared import protocol as proto
from shared.region import (
    DEFAULT_CHUNK_BYTES,
    MAX_REGION_BYTES,
    MIN_REGION_BYTES,
    Chunk,
    Region,
    pipeline_chunk_bytes,
    plan_chunks,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["DEFAULT_REGION_BYTES", "DEFAULT_THRESHOLD", "BulkPath", "Transport", "byte_view"]

R = TypeVar("R", bound=proto.FromWire)
#: the typed arguments of a copy between a buffer and a region: ``write_region`` or ``read_region``
#: (the same fields; which one says the direction)
RegionCopy = type[proto.WriteRegion.Args] | type[proto.ReadRegion.Args]

#: payloads from this size on take the region path (below it, one frame is as fast)
DEFAULT_THRESHOLD: Final = 256 << 10
#: the largest staging region a client makes per tenant (charged to the tenant's host quota)
DEFAULT_REGION_BYTES: Final = 64 << 20
#: how long a refused region (quota, not local) sends a tenant's transfers to frames
_REFUSED_FOR_S: Final = 5.0


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (the export ends at once)."""
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


_PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_FromStringAndSize.restype = ctypes.py_object
_PyBytes_FromStringAndSize.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
_PyBytes_AsString.restype = ctypes.c_void_p
_PyBytes_AsString.argtypes = (ctypes.py_object,)


def _new_bytes(n: int) -> bytes:
    """A new, uninitialized bytes object of ``n`` bytes (CPython's documented way to build
    one in place: ``PyBytes_FromStringAndSize(NULL, n)``); fill every byte before it is
    shared or hashed."""
    out: bytes = _PyBytes_FromStringAndSize(None, n)
    return out


def _bytes_address(data: bytes) -> int:
    """The address of a bytes object's first byte (``PyBytes_AsString``)."""
    address: int = _PyBytes_AsString(data)
    return address


def byte_view(data: object) -> memoryview:
    """A flat, C-ordered byte view of bytes, bytearray, memoryview or a numpy array.

    Non-contiguous arrays are copied once into C order (what a frame would
    carry anyway); everything else is viewed without a copy.
    """
    try:
        # memoryview() is the check (TypeError for an object without the buffer protocol)
        view = data if isinstance(data, memoryview) else memoryview(cast("Buffer", data))
    except TypeError:
        raise InvalidArgument(f"expected bytes-like data or a numpy array, got {type(data).__name__}") from None
    if view.nbytes == 0:
        return memoryview(b"")
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B")


class Transport(Protocol):
    """The client's socket as the bulk path uses it: :class:`supervisor.client.api.SupervisorClient`'s
    own request primitives, every one called with the client's lock held.

    Declared here so the bulk path needs no client: the client makes its
    :class:`BulkPath` and hands itself over; the calls only go down.
    """

    #: seconds a reply may take (the client's, read at every transfer)
    timeout_s: float

    def send(self, op: str, cap: bytes, args: Mapping[str, object]) -> int:
        """Send one request without waiting; its rid."""
        ...

    def _recv_one(self, deadline: float, op: str) -> tuple[int, bool, object, bytes | None]:
        """The next reply, whichever request it answers: (rid, ok, result or error dict, body)."""
        ...

    def rate_wait_s(self, cap: bytes) -> float:
        """Seconds until ``cap``'s tenant may send again after a rate refusal (0.0: now)."""
        ...

    def check_rate_wait(self, cap: bytes) -> None:
        """Raise the tenant's rate refusal again while it waits it out (else nothing)."""
        ...

    def _request_locked(self, op: str, cap: bytes, args: Mapping[str, object], *,
                        timeout_s: float | None = None) -> tuple[object, bytes | None]:
        """One call: send, wait for its reply, raise its error; (result, body)."""
        ...

    def _invoke_locked(self, cap: bytes, args: proto.WireArgs[R], *, timeout_s: float | None = None) -> R:
        """The typed call (``SupervisorClient.invoke``): send ``args``, wait, raise its error; its typed reply."""
        ...


@dataclass(eq=False)
class _Staging:
    """One attached region of one tenant: its id at the supervisor and our mapping."""

    region_id: int
    region: Region
    cap: bytes

    @property
    def capacity(self) -> int:
        return self.region.capacity


class BulkPath:
    """Regions of one client (:class:`Transport`; its lock held by every method)."""

    def __init__(self, client: Transport, *, enabled: bool, threshold: int = DEFAULT_THRESHOLD,
                 region_bytes: int = DEFAULT_REGION_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not MIN_REGION_BYTES <= region_bytes <= MAX_REGION_BYTES:
            raise InvalidArgument(f"region_bytes must be in {MIN_REGION_BYTES}..{MAX_REGION_BYTES}, got {region_bytes}")
        self._client = client
        self.enabled = enabled
        self.threshold = max(1, threshold)
        self.region_bytes = region_bytes
        self.chunk_bytes = max(MIN_REGION_BYTES, chunk_bytes)
        self._staging: dict[bytes, _Staging] = {}
        self._refused_until: dict[bytes, float] = {}
        #: regions behind arrays the caller holds (region id -> (region, its data's address))
        self._leases: dict[int, tuple[_Staging, int]] = {}
        #: leases whose array was garbage-collected: released at the next call
        self._released_leases: list[tuple[bytes, int]] = []

    # ------------------------------------------------------------ regions

    def wants(self, cap: bytes, nbytes: int) -> bool:
        """Should a transfer of ``nbytes`` for this tenant take the region path?"""
        if not self.enabled or nbytes < self.threshold:
            return False
        until = self._refused_until.get(cap)
        return until is None or time.monotonic() >= until

    def _create(self, cap: bytes, nbytes: int) -> _Staging | None:
        """A new region of ``nbytes`` for the tenant; None (and frames for a while) when refused."""
        try:
            grant = self._client._invoke_locked(
                cap, proto.RegionCreate.Args(nbytes=max(MIN_REGION_BYTES, nbytes), pid=os.getpid()))
        except (MemoryExhausted, InvalidArgument, SegmentError):
            self._refused_until[cap] = time.monotonic() + _REFUSED_FOR_S
            return None
        try:
            region = Region.attach(grant.name)
        except TensorWasmError:
            self._release_quietly(cap, grant.region)
            self._refused_until[cap] = time.monotonic() + _REFUSED_FOR_S
            return None
        return _Staging(grant.region, region, cap)

    def _staging_for(self, cap: bytes, nbytes: int) -> _Staging | None:
        """This tenant's staging region, grown (up to ``region_bytes``) for ``nbytes``."""
        self.flush_leases()
        want = min(self.region_bytes, max(nbytes, MIN_REGION_BYTES))
        staging = self._staging.get(cap)
        if staging is not None and staging.capacity >= want:
            return staging
        if staging is not None:
            self._drop_staging(staging)
        staging = self._create(cap, want)
        if staging is not None:
            self._staging[cap] = staging
        return staging

    def _drop_staging(self, staging: _Staging) -> None:
        self._staging.pop(staging.cap, None)
        staging.region.close()
        self._release_quietly(staging.cap, staging.region_id)

    def _release_quietly(self, cap: bytes, region_id: int) -> None:
        """Release without waiting: the reply is dropped as a late one (the supervisor also
        reclaims a region whose client died)."""
        try:
            release = proto.RegionRelease.Args(region=region_id)
            self._client.send(release.op, cap, release.to_wire())
        except TensorWasmError:
            pass

    def flush_leases(self) -> None:
        """Release the regions of zero-copy arrays collected since the last call."""
        while self._released_leases:
            cap, region_id = self._released_leases.pop()
            self._leases.pop(region_id, None)  # the mapping goes with the last view of it
            self._release_quietly(cap, region_id)

    def close(self) -> None:
        """Release every region, waiting for each answer (the socket is closed next, and
        closing drops what is still queued)."""
        for staging in list(self._staging.values()):
            self._staging.pop(staging.cap, None)
            staging.region.close()
            self._released_leases.append((staging.cap, staging.region_id))
        for lease, _ in self._leases.values():  # arrays still alive keep their mapping
            self._released_leases.append((lease.cap, lease.region_id))
        self._leases.clear()
        while self._released_leases:
            cap, region_id = self._released_leases.pop()
            try:
                self._client._invoke_locked(cap, proto.RegionRelease.Args(region=region_id), timeout_s=5.0)
            except TensorWasmError:
                pass  # gone already (evicted tenant, stopped supervisor): nothing left to release

    # ---------------------------------------------------------- transfers

    def _chunk(self, total: int) -> int:
        return pipeline_chunk_bytes(total, self.chunk_bytes)

    def _retry_stale(self, cap: bytes, transfer: Callable[[], bool]) -> bool:
        """Run ``transfer``; if the supervisor no longer knows our region (the tenant was
        evicted and registered again, or the supervisor restarted), forget it and run
        ``transfer`` once more with a new one."""
        try:
            return transfer()
        except InvalidArgument as exc:
            staging = self._staging.get(cap)
            if staging is None or not exc.detail.startswith("unknown region"):
                raise
            self._staging.pop(cap, None)
            staging.region.close()  # nothing to release: the supervisor dropped it
            return transfer()

    def write(self, cap: bytes, handle: int, data: memoryview, offset: int) -> bool:
        """Copy ``data`` into the buffer through the tenant's region; False: use frames."""
        return self._retry_stale(cap, lambda: self._write(cap, handle, data, offset))

    def read_into(self, cap: bytes, handle: int, out: memoryview, offset: int) -> bool:
        """Fill ``out`` from the buffer through the tenant's region; False: use frames."""
        return self._retry_stale(cap, lambda: self._staged(cap, proto.ReadRegion.Args, handle, out, offset))

    def _write(self, cap: bytes, handle: int, data: memoryview, offset: int) -> bool:
        leased = self._leased(cap, data)
        if leased is not None:  # the bytes lie in a region already: no copy of ours
            lease, start = leased
            size = self._chunk(len(data))
            chunks = [Chunk(p, min(size, len(data) - p), i, start + p) for i, p in enumerate(range(0, len(data), size))]
            self._pipeline(lease, proto.WriteRegion.Args, handle, offset, chunks, before=None, after=None, own=True)
            return True
        return self._staged(cap, proto.WriteRegion.Args, handle, data, offset)

    def _staged(self, cap: bytes, op: RegionCopy, handle: int, view: memoryview, offset: int) -> bool:
        """Move ``view`` through the tenant's staging region in chunks: ``write_region`` copies
        each chunk into its slot before its request, ``read_region`` out of it after the reply.
        False: no staging region (use frames)."""
        staging = self._staging_for(cap, len(view))
        if staging is None:
            return False
        region = staging.region.data
        writing = op is proto.WriteRegion.Args

        def copy(chunk: Chunk) -> None:
            here = slice(chunk.position, chunk.position + chunk.nbytes)
            there = slice(chunk.region_offset, chunk.region_offset + chunk.nbytes)
            if writing:
                region[there] = view[here]
            else:
                view[here] = region[there]

        chunks = plan_chunks(len(view), staging.capacity, chunk_bytes=self._chunk(len(view)))
        self._pipeline(staging, op, handle, offset, chunks,
                       before=copy if writing else None, after=None if writing else copy)
        return True

    def read_bytes(self, cap: bytes, handle: int, nbytes: int, offset: int) -> bytes | None:
        """``nbytes`` of the buffer as bytes (one copy of ours when they fit the region); None: frames."""
        result: list[bytes] = []

        def transfer() -> bool:
            data = self._read_bytes(cap, handle, nbytes, offset)
            if data is not None:
                result.append(data)
            return data is not None

        return result[0] if self._retry_stale(cap, transfer) else None

    def _read_bytes(self, cap: bytes, handle: int, nbytes: int, offset: int) -> bytes | None:
        staging = self._staging_for(cap, nbytes)
        if staging is None:
            return None
        # One copy of ours, overlapped with the worker's: each chunk goes from its slot
        # straight into the bytes object returned, as soon as its reply is in (while the
        # worker copies the next one). A bytes object is immutable to Python code, so it
        # is made uninitialized and written through its address before anyone sees it
        # (bytes(region) after the last reply was 0.32x a copy into new memory;
        # a zeroed bytearray and bytes() of it would fault in fresh pages twice).
        out = _new_bytes(nbytes)
        dst = _bytes_address(out)
        src = _address(staging.region.data)

        def keep(chunk: Chunk) -> None:
            ctypes.memmove(dst + chunk.position, src + chunk.region_offset, chunk.nbytes)

        chunks = plan_chunks(nbytes, staging.capacity, chunk_bytes=self._chunk(nbytes))
        self._pipeline(staging, proto.ReadRegion.Args, handle, offset, chunks, before=None, after=keep)
        return out

    # ------------------------------------------------------------ leases
    #
    # A lease is a region of its own behind one array the caller holds (get_array's
    # zero-copy view, empty_array): released once that array is garbage-collected.
    # Writing such an array (or a slice of it) needs no copy of ours: the worker
    # copies straight from where it lies.

    def lease(self, cap: bytes, handle: int | None, nbytes: int,
              offset: int = 0) -> tuple[memoryview, Callable[[object], None]] | None:
        """A region of its own for ``nbytes`` (holding the buffer's bytes at ``offset`` when
        ``handle`` is given), for an array that lives in it.

        Returns the bytes' view and ``keep(owner)``: call it with the object
        that exposes the view (an ndarray); the region is released once that
        object is garbage-collected (at this client's next call). None when
        the supervisor grants no region (host quota, region count): copy then.
        """
        self.flush_leases()
        try:
            grant = self._client._invoke_locked(
                cap, proto.RegionCreate.Args(nbytes=max(MIN_REGION_BYTES, nbytes), pid=os.getpid()))
        except (MemoryExhausted, InvalidArgument, SegmentError):
            return None
        region_id = grant.region
        try:
            region = Region.attach(grant.name)
        except BaseException:
            self._release_quietly(cap, region_id)
            raise
        staging = _Staging(region_id, region, cap)
        try:
            if handle is not None:
                chunks = plan_chunks(nbytes, region.capacity, chunk_bytes=self._chunk(nbytes), max_slots=1 << 20)
                self._pipeline(staging, proto.ReadRegion.Args, handle, offset, chunks, before=None, after=None, own=True)
        except BaseException:
            region.close()
            self._release_quietly(cap, region_id)
            raise
        self._leases[region_id] = (staging, _address(region.data))
        released = self._released_leases

        def keep(owner: object) -> None:
            # runs at the owner's collection, on any thread: only queue the release
            weakref.finalize(owner, released.append, (cap, region_id))

        return region.data[:nbytes], keep

    def _leased(self, cap: bytes, view: memoryview) -> tuple[_Staging, int] | None:
        """(lease, offset in it) when ``view`` lies inside one of this tenant's leases."""
        if not self._leases or view.readonly or not len(view):
            return None
        addr = _address(view)
        for staging, base in self._leases.values():
            if staging.cap == cap and base <= addr and addr + len(view) <= base + staging.capacity:
                return staging, addr - base
        return None

    def _pipeline(self, staging: _Staging, copy: RegionCopy, handle: int, offset: int, chunks: list[Chunk], *,
                  before: Callable[[Chunk], None] | None, after: Callable[[Chunk], None] | None,
                  own: bool = False) -> None:
        """Send one request per chunk, at most one in flight per slot; raise the first error.

        A chunk refused with ``Overloaded`` (the tenant's ``max_in_flight``) is
        sent again once an earlier one is answered; refused for the tenant's rate,
        no chunk is sent before its ``retry_after_s`` has passed (the client's
        :meth:`~supervisor.client.api.SupervisorClient.rate_wait_s`). On a timeout
        the region is given up (late copies may still land in it); ``own``: the
        caller does that.
        """
        client = self._client
        timeout = client.timeout_s
        op = copy.op

        def request(chunk: Chunk) -> dict[str, object]:
            return copy(handle=handle, offset=offset + chunk.position, region=staging.region_id,
                        region_offset=chunk.region_offset, nbytes=chunk.nbytes).to_wire()

        if len(chunks) == 1:  # nothing to overlap: one plain request (the common small case)
            chunk = chunks[0]
            if before is not None:
                before(chunk)
            try:
                client._request_locked(op, staging.cap, request(chunk))
            except RequestTimeout:
                if not own:
                    self._drop_staging(staging)
                raise
            if after is not None:
                after(chunk)
            return
        queue = collections.deque(chunks)
        inflight: dict[int, Chunk] = {}  # rid -> chunk
        busy: dict[int, Chunk] = {}  # slot -> the chunk using it until it is answered
        retry: collections.deque[Chunk] = collections.deque()
        first_error: dict[str, object] | None = None
        deadline = time.monotonic() + timeout

        def send(chunk: Chunk) -> None:
            rid = client.send(op, staging.cap, request(chunk))
            inflight[rid] = chunk

        def wait_one() -> None:
            nonlocal first_error, deadline
            got, ok, payload, _ = client._recv_one(deadline, op)
            chunk = inflight.pop(got, None)
            if chunk is None:
                return  # a late reply to an earlier request: dropped
            deadline = time.monotonic() + timeout  # progress: the timeout is per reply
            if ok:
                busy.pop(chunk.slot, None)
                if after is not None:
                    after(chunk)
                return
            err = payload if isinstance(payload, dict) else {"code": "internal", "message": str(payload), "fields": {}}
            if err.get("code") == Overloaded.code and first_error is None:
                retry.append(chunk)  # keeps its slot
                return
            busy.pop(chunk.slot, None)
            if first_error is None:
                first_error = err

        def back_off(wait: float) -> None:
            if inflight:
                wait_one()
            elif time.monotonic() > deadline:
                raise RequestTimeout(op, timeout)
            elif wait > deadline - time.monotonic():
                # the tenant may not send again before this transfer's reply deadline: its
                # refusal, typed (AdmissionRate), not a timeout that never sent anything
                client.check_rate_wait(staging.cap)
            else:  # the tenant's rate: its retry_after_s; else full of other clients' requests
                time.sleep(max(0.001, wait))

        try:
            while True:
                if first_error is None and retry:
                    # the tenant's max_in_flight is full: resend once a request of ours is answered
                    back_off(client.rate_wait_s(staging.cap))
                    if first_error is None and retry and not client.rate_wait_s(staging.cap):
                        send(retry.popleft())
                    continue
                if first_error is None and queue and (wait := client.rate_wait_s(staging.cap)):
                    back_off(wait)  # refused for the tenant's rate: nothing new before retry_after_s
                    continue
                if first_error is None and queue:
                    chunk = queue[0]
                    if chunk.slot in busy:
                        wait_one()
                        continue
                    queue.popleft()
                    if before is not None:
                        before(chunk)
                    busy[chunk.slot] = chunk
                    send(chunk)
                    continue
                if inflight:
                    wait_one()
                    continue
                break
        except RequestTimeout:
            if not own:
                self._drop_staging(staging)
            raise RequestTimeout(op, timeout) from None
        if first_error is not None:
            raise error_from_dict(first_error)
