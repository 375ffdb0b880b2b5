"""The metered allocator: every GPU byte is counted in shared memory before the backend sees it.

    alloc(n):  block.consume_gpu_bytes(n)      refused -> GpuMemoryExhausted, no backend call
               budget.consume(n)               (device budget, when present) refused -> roll back
               backend.alloc(n)                DeviceOutOfMemory -> roll back both, GpuMemoryExhausted
    free(h):   backend.free(buf); block.release_gpu_bytes(n); budget credited only for what the
               backend has really returned to the device (settle)

Why the device budget is not credited at the free itself: ``cuMemFreeAsync``
returns memory to the tenant's *pool*, which gives it back to the device only
at a synchronize or a trim (``reclaim``, batched per request or run). Credited
at the free, the budget would admit another tenant's allocation that the
driver then refuses for want of memory still reserved here. So freed bytes are
*withheld* and :meth:`MeteredAllocator.settle` credits the budget with what
the backend no longer holds (``backend.retained_bytes()``: the pool's reserved
memory beyond its live buffers, read from the driver) - after every free, after
an allocation (it may reuse retained memory), after ``reclaim`` and at the end
of a run. A budget refusal while bytes are withheld reclaims (synchronize +
trim), settles and asks once more. The tenant's own counter is credited at the
free: its pool reuses what it retains, and its ``maxSize`` bounds both.

Handles are ints that name (instance, incarnation, sequence) so the
supervisor can route a handle to the process holding it, and a handle from a
previous incarnation of the instance is refused rather than aliasing a new
buffer (see :func:`shared.frames.make_handle`).
"""

from __future__ import annotations

import logging

from shared.checks import is_int
from shared.errors import GpuMemoryExhausted, InvalidArgument
from shared.log import get_logger, log_event
from shared.frames import MAX_BUFFERS_PER_INSTANCE, handle_incarnation, handle_instance, make_handle
from shared.quota import QuotaBlock
from worker.backends.base import Backend, ByteMeter, DeviceBuffer, DeviceOutOfMemory
from worker.faults import FaultState

__all__ = ["MeteredAllocator"]

MAX_BUFFER_BYTES = (1 << 63) - 1
_log = get_logger("worker.allocator")


class MeteredAllocator:
    """Buffers of one tenant instance, metered against its quota block."""

    def __init__(
        self,
        tenant_id: str,
        block: QuotaBlock,
        backend: Backend,
        *,
        instance: int = 0,
        incarnation: int = 0,
        budget: ByteMeter | None = None,
        faults: FaultState | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.block = block
        self.backend = backend
        self.instance = instance
        self.incarnation = incarnation
        self.budget = budget
        self.faults = faults
        self._buffers: dict[int, DeviceBuffer] = {}
        #: run-scope buffers whose free failed while the backend still holds them (still metered)
        self._stuck: list[DeviceBuffer] = []
        self._seq = 0
        #: freed bytes still charged to the device budget: the backend has not returned them yet
        self.withheld_bytes = 0

    # ----------------------------------------------------------- metering

    def alloc_buffer(self, nbytes: int) -> DeviceBuffer:
        """Metered allocation of a buffer not entered in the handle table (WASM run scope)."""
        if not is_int(nbytes):
            raise InvalidArgument(f"nbytes must be an int, got {type(nbytes).__name__}")
        if not 0 < nbytes <= MAX_BUFFER_BYTES:
            raise InvalidArgument(f"nbytes must be in 1..2**63-1, got {nbytes}")
        self.block.consume_gpu_bytes(nbytes)  # refusal: nothing else happens
        if self.budget is not None:
            try:
                self._consume_budget(nbytes)
            except BaseException:
                self.block.release_gpu_bytes(nbytes)
                raise
        try:
            if self.faults is not None and self.faults.take_oom():
                raise DeviceOutOfMemory(nbytes, 0, 0, "injected out-of-memory (fault 'oom')")
            buf = self.backend.alloc(nbytes)
        except DeviceOutOfMemory as oom:
            self._unmeter(nbytes)
            raise GpuMemoryExhausted(
                self.tenant_id,
                nbytes,
                oom.limit,
                oom.in_use,
                message=f"tenant {self.tenant_id!r}: device refused {nbytes:,} B: {oom}",
            ) from None
        except BaseException:
            self._unmeter(nbytes)
            raise
        if self.withheld_bytes:
            self.settle()  # the pool may have served it from memory it retained: credited now
        return buf

    def _consume_budget(self, nbytes: int) -> None:
        """The device budget's consume; refused while freed bytes are withheld: return them to the
        device (the backend's reclaim: synchronize + trim), credit what came back, ask once more."""
        assert self.budget is not None
        try:
            self.budget.consume(nbytes)
            return
        except GpuMemoryExhausted:
            if not self.withheld_bytes:
                raise
        self.backend.reclaim()
        self.settle()
        self.budget.consume(nbytes)

    def settle(self) -> None:
        """Credit the device budget with the withheld bytes the backend no longer holds.

        Never more than was withheld, never what the backend's pool still reserves
        (``retained_bytes``): the budget stays at or above what this worker really holds.
        """
        if self.budget is None or not self.withheld_bytes:
            return
        retained = self.backend.retained_bytes()
        credit = self.withheld_bytes - min(self.withheld_bytes, max(0, retained))
        if credit:
            self.withheld_bytes -= credit
            self.budget.release(credit)

    def free_buffer(self, buf: DeviceBuffer) -> None:
        """Free a buffer from :meth:`alloc_buffer` and release its bytes.

        When the backend's free fails and it still holds the buffer (a
        non-sticky driver error: the pool may still hold the memory), the bytes
        stay metered and the buffer is kept for :meth:`free_all` to try again.
        """
        try:
            self.backend.free(buf)
        except BaseException:
            if self.backend.holds(buf):
                if buf not in self._stuck:
                    self._stuck.append(buf)
                raise
            self._forget_stuck(buf)
            self._unmeter(buf.nbytes, freed=True)
            raise
        self._forget_stuck(buf)
        self._unmeter(buf.nbytes, freed=True)

    def _forget_stuck(self, buf: DeviceBuffer) -> None:
        if self._stuck and buf in self._stuck:
            self._stuck.remove(buf)

    def _unmeter(self, nbytes: int, *, freed: bool = False) -> None:
        """Release ``nbytes`` from the tenant's counter and the device budget; a freed buffer's bytes
        reach the budget through :meth:`settle` (only once the backend has given them back)."""
        try:
            if self.budget is not None:
                if freed:
                    self.withheld_bytes += nbytes
                    self.settle()
                else:
                    self.budget.release(nbytes)
        finally:
            self.block.release_gpu_bytes(nbytes)

    # ------------------------------------------------------------ handles

    def alloc(self, nbytes: int) -> int:
        if len(self._buffers) >= MAX_BUFFERS_PER_INSTANCE:
            # bounded, so the ``buffers`` reply listing them always decodes (shared.frames)
            raise InvalidArgument(
                f"this instance holds {len(self._buffers):,} buffers, the most one instance may hold "
                f"({MAX_BUFFERS_PER_INSTANCE:,}); free some first"
            )
        buf = self.alloc_buffer(nbytes)
        self._seq += 1
        handle = make_handle(self.instance, self.incarnation, self._seq)
        self._buffers[handle] = buf
        return handle

    def lookup(self, handle: object) -> DeviceBuffer:
        if not is_int(handle):
            raise InvalidArgument(f"buffer handle must be an int, got {type(handle).__name__}")
        buf = self._buffers.get(handle)
        if buf is None:
            if handle_instance(handle) != self.instance or handle_incarnation(handle) != self.incarnation & 0xFFFF:
                raise InvalidArgument(
                    f"buffer handle {handle:#x} belongs to another worker instance or to one that restarted"
                )
            raise InvalidArgument(f"unknown buffer handle {handle:#x} (never allocated, or already freed)")
        return buf

    def free(self, handle: int) -> int:
        """Free a client buffer and give its memory back to the device (``reclaim``).

        A failed free whose buffer the backend still holds keeps the handle
        (and its metered bytes): the client may free it again.
        """
        buf = self.lookup(handle)
        try:
            self.free_buffer(buf)
        finally:
            if not self.backend.holds(buf):
                self._buffers.pop(handle, None)
                if buf in self._stuck:
                    self._stuck.remove(buf)
        self.backend.reclaim()
        self.settle()
        return buf.nbytes

    def check_range(self, buf: DeviceBuffer, offset: object, nbytes: int, what: str = "access") -> int:
        if not is_int(offset):
            raise InvalidArgument(f"offset must be an int, got {type(offset).__name__}")
        if offset < 0 or nbytes < 0 or offset + nbytes > buf.nbytes:
            raise InvalidArgument(
                f"{what} of {nbytes} B at offset {offset} is outside the {buf.nbytes}-byte buffer"
            )
        return offset

    def write(self, handle: int, offset: int, data: memoryview) -> int:
        buf = self.lookup(handle)
        off = self.check_range(buf, offset, len(data), "write")
        self.backend.write(buf, off, data)
        return len(data)

    def read(self, handle: int, offset: int, nbytes: object) -> bytes:
        buf = self.lookup(handle)
        if not is_int(nbytes):
            raise InvalidArgument(f"nbytes must be an int, got {type(nbytes).__name__}")
        off = self.check_range(buf, offset, nbytes, "read")
        return self.backend.read(buf, off, nbytes)

    # ------------------------------------------------------------ parking (worker.parking)

    @property
    def seq(self) -> int:
        """The sequence of the last handle made: a restored instance continues after it, so a
        freed handle never names a new buffer."""
        return self._seq

    def import_buffer(self, handle: int, nbytes: int, offset: int, data: memoryview, seq: int) -> int:
        """Restore a parked buffer under its old ``handle``: the chunk at ``offset`` 0 allocates it
        (metered like :meth:`alloc`), every chunk is written in place. The handle must name this
        instance and incarnation (the supervisor binds a restored instance with the incarnation
        its handles carry). Returns the bytes written."""
        self.restore_seq(seq)
        self._seq = max(self._seq, handle & 0xFFFFFFFF)  # never a new handle equal to a restored one
        if handle_instance(handle) != self.instance or handle_incarnation(handle) != self.incarnation & 0xFFFF:
            raise InvalidArgument(f"handle {handle:#x} does not belong to instance {self.instance} "
                                  f"incarnation {self.incarnation}: it cannot be restored here")
        if offset == 0:
            if handle in self._buffers:
                raise InvalidArgument(f"buffer {handle:#x} exists already: it cannot be restored again")
            if len(self._buffers) >= MAX_BUFFERS_PER_INSTANCE:
                raise InvalidArgument(f"this instance holds {MAX_BUFFERS_PER_INSTANCE:,} buffers already")
            self._buffers[handle] = self.alloc_buffer(nbytes)
        buf = self.lookup(handle)
        if buf.nbytes != nbytes:
            raise InvalidArgument(f"buffer {handle:#x} holds {buf.nbytes} B, the restore says {nbytes}")
        off = self.check_range(buf, offset, len(data), "restore")
        self.backend.write(buf, off, data)
        return len(data)

    def restore_seq(self, seq: object) -> None:
        """Continue handles after ``seq`` (never goes back)."""
        if not is_int(seq) or not 0 <= seq <= 0xFFFFFFFF:
            raise InvalidArgument(f"seq must be an int in 0..2**32-1, got {seq!r}")
        self._seq = max(self._seq, seq)

    def handles(self) -> dict[int, int]:
        """handle -> size of every live buffer."""
        return {h: b.nbytes for h, b in self._buffers.items()}

    def bytes_held(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def free_all(self) -> int:
        """Free every buffer (shutdown); returns bytes released. Never raises."""
        total = 0
        for handle in list(self._buffers):
            buf = self._buffers.pop(handle)
            try:
                self.free_buffer(buf)
            except Exception as exc:  # noqa: BLE001 - keep freeing; the bytes were released in finally
                log_event(_log, logging.WARNING, "buffer.free_failed", tenant=self.tenant_id,
                          handle=handle, nbytes=buf.nbytes, error=repr(exc))
            total += buf.nbytes
        for buf in list(self._stuck):
            try:
                self.free_buffer(buf)
            except Exception as exc:  # noqa: BLE001 - shutdown: the process exit frees the rest
                log_event(_log, logging.WARNING, "buffer.free_failed", tenant=self.tenant_id,
                          handle=0, nbytes=buf.nbytes, error=repr(exc))
            else:
                total += buf.nbytes
        try:
            self.backend.reclaim()  # back on the device, so the budget is credited now
            self.settle()
        except Exception as exc:  # noqa: BLE001 - shutdown: the rest is credited at close or with the slot
            log_event(_log, logging.WARNING, "buffer.reclaim_failed", tenant=self.tenant_id,
                      withheld=self.withheld_bytes, error=repr(exc))
        return total
