"""The ``tensorwasm`` host ABI: what an untrusted guest may call, and how every call is checked.

    guest (wasm)                 host import (this module)                 tenant
    ───────────                  ─────────────────────────                 ──────
    alloc(nbytes)        ──►  GuestRun.alloc     allocator.alloc_buffer ──► GPU quota (shm CAS) -> backend
    write(h, off, p, n)  ──►  GuestRun.write     guest memory[p:p+n] ─────► buffer[off:off+n]   (one memcpy)
    read(h, off, p, n)   ──►  GuestRun.read      buffer[off:off+n] ───────► guest memory[p:p+n]
    fill/axpy/sum_f32    ──►  backend op         one call per tensor, never per element
    matmul_f32, ...      ──►  TensorOp.call      the op table of worker.wasm.tensor_abi: checks, then backend op
    log(p, n)            ──►  bounded, rate-limited log line
    free(h)              ──►  allocator.free_buffer (run-scoped buffers only)

Every argument is hostile until checked. i32 pointers and lengths arrive
signed: they are masked to u32 and bounds-checked against the guest's linear
memory *as it is at the moment of the call* (``memory.grow`` may have moved
it); i64 offsets and counts are checked against the buffer. A failed check,
an unknown or freed handle, a quota refusal or a backend failure returns a
negative :class:`ErrorCode`; nothing ever raises into wasmtime (a Python
exception there would become a trap, and a bug would look like the guest's
fault). ``docs/WASM-ABI.md`` is the guest author's copy of this contract.

Handles are i64 values private to one run: 1, 2, 3 ... in the order the run
made them (client buffers passed as ``{"handle": h}`` arguments are entered
first). They are never reused within a run, so a double free is reported,
and they mean nothing to any other run, tenant or worker.

Typing: the caller an import receives is a wasmtime.Caller, or wasmtime's raw caller pointer on
the unchecked import path (ctypes); here it is an ``object``, only handed to the memory span.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from shared.errors import (
    GpuMemoryExhausted,
    InvalidArgument,
    KernelTimeout,
    MemoryExhausted,
    TensorWasmError,
)
from shared.log import get_logger, log_event
from shared.wasm_abi import ErrorCode
from worker.backends.base import DeviceBuffer
from worker.context import TenantContext
from worker.device_time import QUEUE_GRACE_S, QueueOverrun
from worker.wasm.tensor_abi import TENSOR_OPS

__all__ = [
    "HANDLERS",
    "IMPORTS",
    "IMPORT_MODULE",
    "ErrorCode",
    "GuestRun",
    "LogLimiter",
    "NoGuestMemory",
    "guest_view",
]

T = TypeVar("T")

_log = get_logger("worker.wasm")

#: the only module name a guest may import from
IMPORT_MODULE = "tensorwasm"

#: import name -> (parameter types, result type); the guest's declared type must match exactly
IMPORTS: dict[str, tuple[tuple[str, ...], str]] = {
    "alloc": (("i64",), "i64"),
    "free": (("i64",), "i32"),
    "write": (("i64", "i64", "i32", "i32"), "i32"),
    "read": (("i64", "i64", "i32", "i32"), "i32"),
    "fill_f32": (("i64", "f32", "i64"), "i32"),
    "axpy_f32": (("i64", "f32", "i64", "i64"), "i32"),
    "sum_f32": (("i64", "i64", "i32"), "i32"),
    "log": (("i32", "i32"), "i32"),
}
IMPORTS.update({op.name: op.wasm_type for op in TENSOR_OPS})


_OK = int(ErrorCode.OK)
_INVALID = int(ErrorCode.INVALID)
_BAD_HANDLE = int(ErrorCode.BAD_HANDLE)
_MEMORY_BOUNDS = int(ErrorCode.MEMORY_BOUNDS)
_BUFFER_BOUNDS = int(ErrorCode.BUFFER_BOUNDS)
_NOT_OWNED = int(ErrorCode.NOT_OWNED)
_NO_MEMORY = int(ErrorCode.NO_MEMORY)
_RATE_LIMITED = int(ErrorCode.RATE_LIMITED)
_TOO_MANY = int(ErrorCode.TOO_MANY_HANDLES)
_BACKEND = int(ErrorCode.BACKEND)
_INTERNAL = int(ErrorCode.INTERNAL)

#: live buffers one run may hold at once (the handle table is bounded)
MAX_LIVE_HANDLES = 4096
#: longest log line kept; longer messages are truncated (and still count as one)
MAX_LOG_BYTES = 1024
#: log lines one run may emit, and how many of them the reply carries
MAX_LOG_LINES_PER_RUN = 256
MAX_LOG_LINES_IN_REPLY = 32

_U32 = 0xFFFFFFFF

# A memoryview straight over guest memory: no copy, and no ctypes array type
# per length (ctypes caches every ``c_ubyte * n`` type it ever made).
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PyBUF_READ = 0x100
_PyBUF_WRITE = 0x200


def guest_view(address: int, nbytes: int, *, writable: bool) -> memoryview:
    """A memoryview of ``nbytes`` at ``address`` (already bounds-checked by the caller)."""
    view: memoryview = _memory_view(address, nbytes, _PyBUF_WRITE if writable else _PyBUF_READ)
    return view


class NoGuestMemory(Exception):
    """Internal: the guest has no exported linear memory to read or write."""


#: ``span(caller) -> (address, size)`` of the guest's linear memory at this moment
MemorySpan = Callable[[object], tuple[int, int]]


class LogLimiter:
    """Token bucket for guest log lines, shared by every run of one worker."""

    def __init__(self, rate_per_s: float = 50.0, burst: int = 100) -> None:
        self.rate = rate_per_s
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.dropped = 0

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.dropped += 1
        return False


def _printable(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else "\N{REPLACEMENT CHARACTER}" for ch in text)


class GuestRun:
    """One run's host-side state: the handle table, guest memory access, the log budget.

    Methods named after the imports take ``(caller, *wasm_args)`` and return
    the import's integer result; they raise only for host bugs, which the
    adapters in :mod:`worker.wasm.host` turn into :attr:`ErrorCode.INTERNAL`.
    """

    def __init__(self, ctx: TenantContext, limiter: LogLimiter) -> None:
        self.ctx = ctx
        self.tenant_id = ctx.tenant_id
        self.allocator = ctx.allocator
        self.backend = ctx.backend
        self.limiter = limiter
        #: guest handle -> (buffer, owned by this run)
        self.buffers: dict[int, tuple[DeviceBuffer, bool]] = {}
        self.next_handle = 1
        self.gpu_bytes = 0
        self.gpu_peak_bytes = 0
        self.host_calls = 0
        self.logs: list[str] = []
        self.log_lines = 0
        #: guest lines dropped by the per-run or per-worker limit
        self.logs_dropped = 0
        self.span: MemorySpan | None = None
        #: cuBLAS workspace lent to the backend for this run's GEMMs (metered like any buffer)
        self.workspace: DeviceBuffer | None = None
        self.workspace_tried = False
        #: when the run started (``time.monotonic()``); no wait for its device work lasts past the
        #: tenant's longest run time from here (the run's own deadline is applied at :meth:`finish`)
        self.started = time.monotonic()
        self.backend.begin_run(self.started + float(ctx.spec.wasm_timeout_s))
        #: device ops run through the context's gate (GPU-time lease, timing, charging);
        #: ``deadline_ns`` (time.monotonic_ns) bounds a wait for the device: the run's deadline
        self.gate = ctx.gate
        self.gate.take_run_totals()  # a trapped run before this one left its figures behind
        self.deadline_ns: int | None = None
        #: the run's deadline passed inside a device op (a wait for the device's lease that ran
        #: out): the guest gets an error code like any failed op, but its run is over - the host
        #: ends it as a timeout whatever the guest returns (see :meth:`WasmHost.run`)
        self.deadline_passed: KernelTimeout | None = None
        #: the run's queued device work outlived its deadline plus the grace: the worker must exit
        self.queue_overrun = False
        #: ends the guest's execution at its next loop or call (set by the host): a run refused
        #: device time must not spin on ops that all fail (each one logged)
        self.interrupt: Callable[[], None] | None = None

    # ------------------------------------------------------------ helpers

    def _guest(self, caller: object, ptr: int, length: int) -> int | None:
        """Address of guest bytes ``[ptr, ptr+length)`` (u32-masked), or None when out of bounds."""
        if self.span is None:
            raise NoGuestMemory
        base, size = self.span(caller)
        if ptr + length > size:
            return None
        return base + ptr

    def guest_range(self, caller: object, ptr: int, nbytes: int) -> memoryview | int:
        """A writable view of guest bytes ``[ptr, ptr+nbytes)`` (ptr already u32), or an error code."""
        try:
            address = self._guest(caller, ptr, nbytes)
        except NoGuestMemory:
            return _NO_MEMORY
        if address is None:
            return _MEMORY_BOUNDS
        return guest_view(address, nbytes, writable=True) if nbytes else memoryview(bytearray())

    def gemm(self, a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer, m: int, k: int, n: int) -> None:
        """``matmul_f32`` on the backend, with a workspace metered against the tenant's GPU quota.

        The backend says how much workspace it wants (cuBLAS: a few MiB; the
        stub: none). It is allocated once per run through the metered
        allocator, so the library never allocates behind the quota; when the
        quota has no room for it the GEMM runs with the backend's fixed
        fallback workspace (cuda: 64 KiB of its scratch) rather than failing.
        """
        self.backend.matmul_f32(a, b, c, m, k, n, workspace=self.gemm_workspace())

    def gemm_workspace(self) -> DeviceBuffer | None:
        """The run's GEMM workspace (every GEMM-like op's, see :meth:`gemm`), allocated on first use."""
        if not self.workspace_tried:
            self.workspace_tried = True
            want = self.backend.gemm_workspace_bytes()
            if want > 0:
                try:
                    self.workspace = self.allocator.alloc_buffer(want)
                except TensorWasmError as exc:
                    log_event(_log, logging.INFO, "wasm.gemm_without_workspace", tenant=self.tenant_id,
                              nbytes=want, reason=f"{type(exc).__name__}: {exc}")
                else:
                    self.gpu_bytes += want
                    self.gpu_peak_bytes = max(self.gpu_peak_bytes, self.gpu_bytes)
        return self.workspace

    def device_op(self, name: str, fn: Callable[..., T], args: tuple[object, ...]) -> T | None:
        """``fn(*args)`` on the device under this worker's lease (see :mod:`worker.device_time`),
        after the queued ops (the guest reads its result at once)."""
        try:
            return self.gate.op(name, fn, args, self.deadline_ns)
        except KernelTimeout as exc:
            self._timed_out(exc)
            raise

    def device_submit(self, name: str, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        """Queue ``fn(*args)`` for the device and return (an op whose result the guest does not read
        at once; see :mod:`worker.device_time`). ``KernelTimeout`` when the run is over."""
        try:
            self.gate.submit(name, fn, args, self.deadline_ns)
        except KernelTimeout as exc:
            self._timed_out(exc)
            raise

    def device_sync(self) -> None:
        """Wait for the queued device work (the guest is about to read or reuse what it wrote);
        raises what a queued op raised, once."""
        try:
            self.gate.sync(self.deadline_ns)
        except KernelTimeout as exc:
            self._timed_out(exc)
            raise

    def end_sync(self) -> None:
        """The guest returned: its queued work is part of the call and is waited for. A deadline
        that passed in it ends the run as a timeout; another error nobody read is logged (the
        guest never asked for it). The run's queued work ends here: its last stretch passes the
        device on as it drains (``DeviceGate.sync``'s ``run_end``)."""
        try:
            self.gate.sync(self.deadline_ns, run_end=True)
        except KernelTimeout as exc:
            self.deadline_passed = exc
        except TensorWasmError as exc:
            self._op_failed(self.gate.failed_op or "queued", exc)
        except Exception:  # noqa: BLE001 - a host bug in a queued op: logged as the import adapter does
            _log.exception("wasm.host_import_failed import=%s", self.gate.failed_op or "queued")

    def _timed_out(self, exc: KernelTimeout) -> None:
        self.deadline_passed = exc
        interrupt, self.interrupt = self.interrupt, None
        if interrupt is not None:
            interrupt()

    def gpu_totals(self) -> dict[str, float]:
        """This run's device time and its waits for the device (the ``run_wasm`` reply's fields)."""
        busy, wait = self.gate.take_run_totals()
        return {"gpu_time_s": round(busy / 1e9, 9), "gpu_wait_s": round(wait / 1e9, 9)}

    def add_client_buffer(self, buf: DeviceBuffer) -> int:
        """Enter a client-allocated buffer (not freed at run end); its guest handle."""
        handle = self.next_handle
        self.next_handle += 1
        self.buffers[handle] = (buf, False)
        return handle

    def release(self) -> int:
        """Free every buffer this run allocated (return, trap or timeout); bytes released."""
        released = 0
        # queued work first (it uses these buffers); then the device goes to the next tenant
        self.queue_overrun = not self.gate.release(self.deadline_ns)
        for handle, (buf, owned) in list(self.buffers.items()):
            if not owned:
                continue
            try:
                self.allocator.free_buffer(buf)
            except Exception as exc:  # noqa: BLE001 - the bytes were released in free_buffer's finally
                log_event(_log, logging.WARNING, "wasm.release_failed", tenant=self.tenant_id,
                          handle=handle, nbytes=buf.nbytes, error=repr(exc))
            released += buf.nbytes
        self.buffers.clear()
        if self.workspace is not None:
            ws, self.workspace = self.workspace, None
            try:
                self.allocator.free_buffer(ws)
            except Exception as exc:  # noqa: BLE001 - the bytes were released in free_buffer's finally
                log_event(_log, logging.WARNING, "wasm.release_failed", tenant=self.tenant_id,
                          handle=0, nbytes=ws.nbytes, error=repr(exc))
            released += ws.nbytes
        self.gpu_bytes = 0
        return released

    def finish(self, timeout_s: float) -> None:
        """The run-end hook (after :meth:`release`): its queued device work is waited for until
        the deadline (``started + timeout_s``) plus a grace period, and its freed memory returned
        to the device. Raises ``KernelTimeout`` (``QueueOverrun``) past that: the worker exits."""
        if self.queue_overrun:
            raise QueueOverrun(QUEUE_GRACE_S, message="queued device work still running past the run's deadline")
        self.backend.end_run(self.started + timeout_s)
        self.allocator.settle()  # the run's frees are back on the device now: the budget gets them

    # ------------------------------------------------------------ imports

    def alloc(self, caller: object, nbytes: int) -> int:
        if nbytes <= 0:
            return _INVALID
        if len(self.buffers) >= MAX_LIVE_HANDLES:
            return _TOO_MANY
        try:
            buf = self.allocator.alloc_buffer(nbytes)
        except GpuMemoryExhausted as exc:
            return int(self._refusal_code(exc, nbytes))
        except MemoryExhausted:
            return int(ErrorCode.DEVICE_OOM)
        except InvalidArgument:
            return _INVALID
        except TensorWasmError as exc:
            log_event(_log, logging.WARNING, "wasm.alloc_failed", tenant=self.tenant_id, nbytes=nbytes, error=str(exc))
            return _BACKEND
        handle = self.next_handle
        self.next_handle += 1
        self.buffers[handle] = (buf, True)
        self.gpu_bytes += nbytes
        if self.gpu_bytes > self.gpu_peak_bytes:
            self.gpu_peak_bytes = self.gpu_bytes
        return handle

    def _refusal_code(self, exc: GpuMemoryExhausted, nbytes: int) -> ErrorCode:
        """The tenant's own cap (GPU_QUOTA) or the device / device budget (DEVICE_OOM)?"""
        cap = self.ctx.block.gpu_memory_bytes_cap
        own = exc.tenant_id == self.tenant_id  # the device budget's refusals name no tenant
        if own and cap is not None and exc.limit == cap and exc.current + nbytes > cap:
            return ErrorCode.GPU_QUOTA
        return ErrorCode.DEVICE_OOM

    def free(self, caller: object, handle: int) -> int:
        entry = self.buffers.get(handle)
        if entry is None:
            return _BAD_HANDLE
        buf, owned = entry
        if not owned:
            return _NOT_OWNED
        code = _OK
        try:
            self.device_sync()  # a queued op may still use it
        except TensorWasmError as exc:  # a queued op's error: reported here, the buffer still freed
            code = self._op_failed(self.gate.failed_op or "queued", exc)
        del self.buffers[handle]
        self.gpu_bytes -= buf.nbytes
        try:
            self.allocator.free_buffer(buf)
        except Exception as exc:  # noqa: BLE001 - quota already released; report, do not trap
            log_event(_log, logging.WARNING, "wasm.free_failed", tenant=self.tenant_id, error=repr(exc))
            return _BACKEND
        return code

    def write(self, caller: object, handle: int, dst_off: int, src_ptr: int, length: int) -> int:
        """guest memory[src_ptr : src_ptr+len] -> buffer[dst_off : dst_off+len]."""
        return self._copy(caller, handle, dst_off, src_ptr, length, to_guest=False)

    def read(self, caller: object, handle: int, src_off: int, dst_ptr: int, length: int) -> int:
        """buffer[src_off : src_off+len] -> guest memory[dst_ptr : dst_ptr+len]."""
        return self._copy(caller, handle, src_off, dst_ptr, length, to_guest=True)

    def _copy(self, caller: object, handle: int, off: int, ptr: int, length: int, *, to_guest: bool) -> int:
        """One copy between guest memory and buffer ``handle`` at ``off``, or an error code.

        Checks in the ABI's fixed order: handle, buffer range, guest-memory range.
        """
        entry = self.buffers.get(handle)
        if entry is None:
            return _BAD_HANDLE
        buf = entry[0]
        n = length & _U32
        if off < 0 or off + n > buf.nbytes:
            return _BUFFER_BOUNDS
        try:
            address = self._guest(caller, ptr & _U32, n)
        except NoGuestMemory:
            return _NO_MEMORY
        if address is None:
            return _MEMORY_BOUNDS
        if n:
            try:
                self.device_sync()  # a read sees the queued ops' results; a write lands after their reads
            except TensorWasmError as exc:
                return self._op_failed(self.gate.failed_op or "queued", exc)
            view = guest_view(address, n, writable=to_guest)
            if to_guest:
                self.backend.read_into(buf, off, view)
            else:
                self.backend.write(buf, off, view)
        return _OK

    def _f32_buffer(self, handle: int, count: int) -> DeviceBuffer | int:
        """The buffer holding ``count`` float32 values, or an error code (handle, domain, range)."""
        entry = self.buffers.get(handle)
        if entry is None:
            return _BAD_HANDLE
        if count < 0:
            return _INVALID
        if count * 4 > entry[0].nbytes:
            return _BUFFER_BOUNDS
        return entry[0]

    def fill_f32(self, caller: object, handle: int, value: float, count: int) -> int:
        buf = self._f32_buffer(handle, count)
        if isinstance(buf, int):
            return buf
        if count:
            try:
                self.device_submit("fill_f32", self.backend.fill_f32, (buf, value, count))
            except TensorWasmError as exc:
                return self._op_failed("fill_f32", exc)
        return _OK

    def axpy_f32(self, caller: object, n: int, a: float, x: int, y: int) -> int:
        """y[:n] = a * x[:n] + y[:n] (float32)."""
        xe = self.buffers.get(x)
        ye = self.buffers.get(y)
        if xe is None or ye is None:
            return _BAD_HANDLE
        if n < 0:
            return _INVALID
        if n * 4 > xe[0].nbytes or n * 4 > ye[0].nbytes:
            return _BUFFER_BOUNDS
        if n:
            try:
                self.device_submit("axpy_f32", self.backend.axpy_f32, (n, a, xe[0], ye[0]))
            except TensorWasmError as exc:
                return self._op_failed("axpy_f32", exc)
        return _OK

    def sum_f32(self, caller: object, handle: int, count: int, out_ptr: int) -> int:
        """Sum of the first ``count`` floats, stored as a little-endian f32 at ``out_ptr``."""
        buf = self._f32_buffer(handle, count)
        if isinstance(buf, int):
            return buf
        try:
            address = self._guest(caller, out_ptr & _U32, 4)
        except NoGuestMemory:
            return _NO_MEMORY
        if address is None:
            return _MEMORY_BOUNDS
        try:
            total = (self.device_op("sum_f32", self.backend.sum_f32, (buf, count)) if count else None) or 0.0
        except TensorWasmError as exc:
            return self._op_failed("sum_f32", exc)
        # the guest is suspended in this call, so its memory cannot have moved meanwhile
        ctypes.memmove(address, ctypes.byref(ctypes.c_float(total)), 4)
        return _OK

    def _op_failed(self, op: str, exc: TensorWasmError) -> int:
        log_event(_log, logging.WARNING, "wasm.op_failed", tenant=self.tenant_id, op=op,
                  error=f"{type(exc).__name__}: {exc}")
        return _BACKEND

    def log(self, caller: object, ptr: int, length: int) -> int:
        """One bounded log line (truncated to MAX_LOG_BYTES), rate-limited per run and per worker."""
        p = ptr & _U32
        n = length & _U32
        try:
            address = self._guest(caller, p, n)
        except NoGuestMemory:
            return _NO_MEMORY
        if address is None:
            return _MEMORY_BOUNDS
        if self.log_lines >= MAX_LOG_LINES_PER_RUN:
            self.logs_dropped += 1
            return _RATE_LIMITED
        keep = min(n, MAX_LOG_BYTES)
        return self.log_line(ctypes.string_at(address, keep) if keep else b"", n > keep)

    def log_line(self, raw: bytes, truncated: bool, stream: str = "log") -> int:
        """One guest line (from ``log`` or WASI stdout/stderr) under the run's and the worker's limits.

        ``OK``, or ``RATE_LIMITED`` when dropped (counted in ``logs_dropped``).
        """
        if self.log_lines >= MAX_LOG_LINES_PER_RUN or not self.limiter.take():
            self.logs_dropped += 1
            return _RATE_LIMITED
        self.log_lines += 1
        text = _printable(raw)
        if truncated:
            text += " [truncated]"
        log_event(_log, logging.INFO, "wasm.log", tenant=self.tenant_id, instance=self.ctx.instance,
                  stream=stream, message=text)
        if len(self.logs) < MAX_LOG_LINES_IN_REPLY:
            self.logs.append(text)
        return _OK



#: import name -> ``handler(run, caller, *wasm_args) -> int``: what the host calls for each import
HANDLERS: dict[str, Callable[..., int]] = {
    **{name: getattr(GuestRun, name) for name in ("alloc", "free", "write", "read", "fill_f32", "axpy_f32",
                                                   "sum_f32", "log")},
    **{op.name: op.call for op in TENSOR_OPS},
}
assert set(HANDLERS) == set(IMPORTS), "every import needs a handler"
