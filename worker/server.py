"""The worker's executor: one thread that owns the data socket and the tenant's context.

    supervisor ROUTER (backend) ──[hdr|body]──► DEALER ── executor thread (this module)
                                                           │ decode [rid, op, args]
                                                           │ handler(op) on TenantContext
                                                ◄──────────┘ reply [rid, ok, payload] (+ body)
    supervisor ROUTER (control) ◄─hb/fault/stop─► DEALER ── control thread (worker.control)

Why the executor owns the data socket instead of an I/O thread handing work
over a queue: every request would pay two GIL hand-offs (~20-40 us each,
measured), which alone would break the routing latency target. Heartbeats
and faults live on their own socket in the control thread, so they keep
flowing while a long WASM run holds the executor (wasmtime and numpy release
the GIL; pure-Python work yields it every switch interval).

Handlers return ``(result, body)``; a :class:`TensorWasmError` becomes an
error reply of the same class, anything else an internal error reply - the
loop itself never dies of a request.

Threads: the executor thread owns the data socket, the tenant context and
every buffer. It shares with the control thread only the ``stop_event``, the
:class:`worker.faults.FaultState` (armed there, consumed here with ``take_*``
under its lock) and ``requests``, which only this thread writes.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import zmq

from shared.checks import is_int
from shared.device_budget import DeviceBudget  # imported at start, not at bind: binding must be fast
from shared.errors import InvalidArgument, ProtocolError, TensorWasmError
from shared.gpu_time import GpuTimeBoard
from shared.log import get_logger, log_event
from shared.exitcodes import context_lost_exit_code
from shared.frames import decode_worker_request, encode_worker_reply
from shared.worker_link import WORKER_WARMED, BindMessage
from worker.context import TenantContext
from worker.device_time import pin_device
from worker.faults import FaultState
from worker.priority import lower_current_thread, restore_start

__all__ = ["Reply", "WorkerServer", "freeze_start", "register_op", "warm_bind_path", "wasm_warm_up"]

_log = get_logger("worker")

Reply = tuple[object, "bytes | memoryview | None"]
Handler = Callable[["WorkerServer", dict[str, object], "zmq.Frame | None"], Reply]

#: ops implemented outside this module, imported on first use ("module:function")
_LAZY_OPS: dict[str, str] = {
    "run_wasm": "worker.wasm.ops:op_run_wasm",
    "write_region": "worker.regions:op_write_region",
    "read_region": "worker.regions:op_read_region",
    "region_drop": "worker.regions:op_region_drop",
    # parking: the supervisor moves the buffers out before the worker exits, and back into a new one
    "export_buffers": "worker.parking:op_export_buffers",
    "export_chunk": "worker.parking:op_export_chunk",
    "import_buffer": "worker.parking:op_import_buffer",
    "import_mapped": "worker.parking:op_import_mapped",
    # ... and its compiled modules as wasmtime artifacts (stored per tenant by the supervisor)
    "export_modules": "worker.wasm.artifacts:op_export_modules",
    "import_modules": "worker.wasm.artifacts:op_import_modules",
    "load_modules": "worker.wasm.artifacts:op_load_modules",
}
_OPS: dict[str, Handler] = {}

#: plain ints: pyzmq's flag constants are enum.Flag members, whose arithmetic costs ~1 us a use
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
#: the serve loop's longest wait for a request (ms) before it looks at the stop flag again: a
#: backstop only, as every stop wakes it at once (:class:`StopFlag`); an idle bound worker wakes
#: every 2 s for it, not 5 times a second
_IDLE_POLL_MS = 2000


class StopFlag(threading.Event):
    """The worker's stop flag (the control thread's ``stop``, SIGTERM, a lost CUDA context): an
    event whose ``set`` also writes a byte to a pipe the serve loop polls beside its socket, so an
    idle worker stops at once rather than at its poll's timeout. A parked tenant's worker is idle
    when its stop comes; waiting out the poll put ~200 ms into every park, and an activation
    waiting for the room a park makes waited that long."""

    def __init__(self) -> None:
        super().__init__()
        self.wake_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        #: ``set`` and ``close`` one at a time: a byte is never written to a closed (reused) descriptor
        self._fd_lock = threading.RLock()  # (SIGTERM's handler may set it on a thread inside set)

    def set(self) -> None:
        super().set()
        with self._fd_lock:
            if self._write_fd < 0:
                return
            try:
                os.write(self._write_fd, b"s")
            except OSError:  # full: woken already
                pass

    def close(self) -> None:
        """Close the pipe (the serve loop is over); a later ``set`` only sets the flag."""
        with self._fd_lock:
            for fd in (self.wake_fd, self._write_fd):
                if fd >= 0:
                    os.close(fd)
            self.wake_fd = self._write_fd = -1


def register_op(name: str) -> Callable[[Handler], Handler]:
    """Decorator: make ``fn(server, args, body) -> (result, body)`` the handler of ``name``."""

    def deco(fn: Handler) -> Handler:
        _OPS[name] = fn
        return fn

    return deco


def _resolve(op: str) -> Handler | None:
    handler = _OPS.get(op)
    if handler is None and op in _LAZY_OPS:
        module, _, attr = _LAZY_OPS[op].partition(":")
        handler = getattr(importlib.import_module(module), attr)
        _OPS[op] = handler
    return handler


class WorkerServer:
    """Serves requests for one tenant instance until told to stop."""

    def __init__(self, sock: zmq.Socket[bytes], faults: FaultState) -> None:
        self.sock = sock
        self.faults = faults
        self.context: TenantContext | None = None
        self.stop_event = StopFlag()
        self.started = time.time()
        self.requests = 0
        #: the process exit code once this worker must end (a lost CUDA context), else None
        self.exit_code: int | None = None
        #: work for an unbound (pool) worker while no request waits, one step per empty look at
        #: the queue (:func:`wasm_warm_up`); dropped at the bind, or at its first error
        self.idle_work: Iterator[None] | None = None

    # --------------------------------------------------------------- loop

    def serve(self) -> None:
        # What is queued is read without a poll (ZMQ_EVENTS says whether a message waits,
        # one getsockopt); only an empty queue is polled, through one zmq_poll item
        # list (``Socket.poll`` builds a Poller and a dict per call, twice zmq_poll's cost).
        # Pipelined requests are read back to back, one poll per burst instead of per request.
        sock = self.sock
        stop = self.stop_event
        recv, events = sock.recv, sock.getsockopt
        # a stop wakes the poll (StopFlag); zmq_poll takes a plain fd beside sockets (its stub says sockets only)
        items = cast("list[tuple[zmq.Socket[bytes], int]]", [(sock, _POLLIN), (stop.wake_fd, _POLLIN)])
        while not stop.is_set():
            if not int(events(_EVENTS)) & _POLLIN:
                if self.idle_work is not None:
                    self._idle_step()  # one step, then look at the queue again
                    continue
                if not zmq.zmq_poll(items, _IDLE_POLL_MS) or stop.is_set():
                    continue
            try:  # recv_multipart, less its getsockopt(RCVMORE) per frame: Frame.more says it
                frame = recv(_NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:
                    frame = recv(_NOBLOCK, copy=False)
                    frames.append(frame)
            except zmq.Again:  # a spurious wake-up (a message is delivered whole): look again
                continue
            self.requests += 1
            self.faults.block_if_hung()
            self.handle(frames)

    def _idle_step(self) -> None:
        """One step of :attr:`idle_work`; none once the worker is bound (its time is the tenant's)
        or the work is done. An error ends the work, never the worker: a warm-up is an optimisation."""
        work = self.idle_work
        if work is None:
            return
        if self.context is not None:
            self.idle_work = None
            freeze_start()
            return
        try:
            next(work)
            return
        except StopIteration:
            pass
        except Exception:  # noqa: BLE001 - the first run then does the set-up itself
            _log.exception("worker.warm_up_failed")
        self.idle_work = None
        freeze_start()
        restore_start()  # a pool worker's start below the normal priority is over (worker.priority)
        # done (or given up): the supervisor counts this pool worker ready from now on
        try:
            self.sock.send(encode_worker_reply(0, True, WORKER_WARMED), _NOBLOCK)
        except zmq.Again:
            log_event(_log, logging.WARNING, "worker.reply_dropped", rid=0, reason="send queue full")

    def handle(self, frames: list[zmq.Frame]) -> None:
        try:
            rid, op, args = decode_worker_request(frames[0].bytes)
        except ProtocolError as exc:
            log_event(_log, logging.WARNING, "worker.bad_request", error=str(exc))
            return
        body = frames[1] if len(frames) > 1 else None
        try:
            try:
                if self.faults.take_kernel_fault():
                    self.require_context().backend.inject_kernel_fault()
                handler = _resolve(op)
                if handler is None:
                    raise InvalidArgument(f"unknown worker op {op!r}")
                result, out_body = handler(self, args, body)
            except TensorWasmError as exc:
                self.reply(rid, False, exc.to_dict())
                return
            except Exception as exc:  # noqa: BLE001 - a bug in one request must not kill the worker
                _log.exception("worker.op_failed op=%s", op)
                self.reply(rid, False, TensorWasmError(f"internal error in worker op {op!r}: {exc!r}").to_dict())
                return
            self.reply(rid, True, result, out_body)
        finally:
            self._check_context()

    def _check_context(self) -> None:
        """End the worker after a sticky CUDA error: its context fails every later call.

        The failing request has had its ``CudaError`` reply; the requests still
        queued get ``WorkerLost`` ("CUDA context lost: ...") from the supervisor.
        """
        lost = self.context.backend.context_lost if self.context is not None else None
        if lost is not None and self.exit_code is None:
            self.exit_code = context_lost_exit_code(lost)
            log_event(_log, logging.ERROR, "worker.cuda_context_lost", error=lost, exit_code=self.exit_code)
            self.stop_event.set()

    def reply(self, rid: int, ok: bool, payload: object, body: bytes | memoryview | None = None) -> None:
        faults = self.faults
        if faults.slow_ms:
            time.sleep(faults.slow_ms / 1000)
        if faults.drop_next and faults.take_drop():
            return
        if faults.corrupt_next and faults.take_corrupt():
            self.sock.send(b"\xc1corrupt\xff", zmq.NOBLOCK)
            return
        header = encode_worker_reply(rid, ok, payload)
        try:
            if body is None:
                self.sock.send(header, _NOBLOCK)
            else:
                self.sock.send_multipart([header, body], _NOBLOCK, copy=len(body) < 65536)
        except zmq.Again:
            log_event(_log, logging.WARNING, "worker.reply_dropped", rid=rid, reason="send queue full")

    def require_context(self) -> TenantContext:
        if self.context is None:
            raise InvalidArgument("worker is not bound to a tenant yet")
        return self.context

    def close(self) -> None:
        if self.context is not None:
            self.context.close()
            self.context = None
        self.stop_event.close()


# --------------------------------------------------------------------- ops


def _int_arg(args: dict[str, object], name: str, default: int | None = None) -> int:
    value = args.get(name, default)
    if not is_int(value):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
    return value


@register_op("bind")
def op_bind(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``bind {spec, instance, incarnation, segment, backend, backend_options}`` -> ``{pid, backend...}``.

    Turns an idle (pool) worker into tenant ``spec.tenant_id``'s instance; once only.
    """
    if server.context is not None:
        raise InvalidArgument(f"worker is already bound to {server.context.tenant_id!r}")
    restore_start()  # a pool worker bound before it was warmed: the tenant's from now on (worker.priority)
    msg = BindMessage.from_wire(args)
    spec = msg.spec
    options = dict(msg.backend_options)
    budget = None
    budget_segment = options.pop("budget_segment", None)
    if budget_segment:
        budget = DeviceBudget.attach(str(budget_segment))
    board = None  # the device's GPU-time lease board and the tenant's slot on it (shared.gpu_time)
    board_segment = options.pop("gpu_time_segment", None)
    if board_segment:
        board = GpuTimeBoard.attach(str(board_segment), tenant_slot=_int_arg(options, "gpu_time_slot"))
    options.pop("gpu_time_slot", None)
    guest_nice = _int_arg(options, "guest_nice", 0)
    options.pop("guest_nice", None)
    device_cpus = _device_cpus(options.pop("device_cpus", None), options.get("device_index", 0))
    try:
        server.context = TenantContext.create(
            spec,
            instance=_int_arg(args, "instance"),
            incarnation=_int_arg(args, "incarnation", 0),
            segment=str(msg.segment),
            backend=str(msg.backend),
            backend_options=options,
            budget=budget,
            faults=server.faults,
            board=board,
        )
    except BaseException:
        if board is not None:
            board.close()  # its worker slot is free again at once, not only at this process's death
        raise
    if device_cpus:  # the stub's device on a core of its own (shared.device_cpus)
        pin_device(server.context.gate, device_cpus)
    # this thread runs the guest from now on: below the threads that drive the device (worker.priority)
    lower_current_thread(guest_nice)
    return {"pid": os.getpid(), **server.context.info()}, None


def _device_cpus(pairs: object, device: object) -> tuple[int, ...]:
    """The CPUs of ``device`` in a bind's ``device_cpus`` option (``[[device, cpu], ...]``)."""
    if not isinstance(pairs, (list, tuple)):
        return ()
    return tuple(int(p[1]) for p in pairs
                 if isinstance(p, (list, tuple)) and len(p) == 2 and p[0] == device and is_int(p[1]))


def warm_bind_path() -> None:
    """Run the parts of a first ``bind`` that need no tenant, before the worker says hello.

    A pool worker binds once, and that bind was the first time this process ran the
    spec's decode and checks, the reply's encoding and the read of its own start time
    from /proc (the slot claims record it) - on the registration's critical path, which is
    the bind (the commit's fsync overlaps it). Run here, while the worker waits in the
    pool: it takes a few percent off a warm registration (``twt bench registry``). Touches no
    segment and no device."""
    from shared.quota import _process_start_ms
    from shared.spec import TenantSpec

    _process_start_ms(os.getpid())  # cached for this process
    wire = BindMessage(spec=TenantSpec("warm-up"), instance=0, incarnation=0, segment="twt-warm-up",
                       backend="stub", backend_options={"device_index": 0}).to_wire()
    for _ in range(2):  # two runs, as measured (the first of a code path costs the most, not only it)
        BindMessage.from_wire(wire)
        encode_worker_reply(0, True, {"pid": os.getpid(), "tenant": "warm-up", "instance": 0, "incarnation": 0,
                                      "buffers": 0, "buffer_bytes": 0})


def freeze_start() -> None:
    """Move what the worker's start made - its imports, the ops' modules, the warmed WASM host: ~40,000
    objects in a spawned worker, kept for its life - out of the collector's walks (``gc.freeze``), once
    the warm-up is over or dropped at the bind. Else the first automatic generation-2 collection (~25 s
    into a heavy loop) walks them all, 35-80 ms on whichever op set it off, while the worker may hold
    the device's lease. A forked worker's preload is frozen already (worker.preload); this covers what
    it made since, and a spawned worker's whole start. The collect first keeps the start's garbage
    out of what is frozen; it runs in the pool's idle time, or once at the bound worker's first empty
    queue (a bind that came before the warm-up ended)."""
    gc.collect()
    gc.freeze()


def wasm_warm_up() -> Iterator[None]:
    """A pool worker's idle work (:attr:`WorkerServer.idle_work`): import the modules of the ops
    an activation sends (the parking imports, the WASM host; one a step), then warm the host
    step by step (:func:`worker.wasm.host.pool_warm_up`: the engine, the linker with the host
    functions, the engine's fingerprint, one run of our own module). Runs while the worker waits
    in the pool, so an activation and its first ``run_wasm`` pay only for the tenant's own state
    and module. Lazily imported: worker.wasm pulls in wasmtime; numpy loads before a worker's first
    device op (:meth:`worker.backends.base.Backend.prepare`), not here: most tenants run none."""
    yield  # nothing before the loop has looked at the queue once
    for op in _LAZY_OPS:  # an activation's ops (import_buffer, import_modules, run_wasm ...): their modules
        if op not in _OPS:
            _resolve(op)
            yield
    yield from importlib.import_module("worker.wasm.host").pool_warm_up()


@register_op("ping")
def op_ping(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``ping {}`` -> ``{pid, tenant, instance, requests, uptime_s}`` (works unbound too)."""
    ctx = server.context
    return {
        "pid": os.getpid(),
        "tenant": ctx.tenant_id if ctx else None,
        "instance": ctx.instance if ctx else None,
        "requests": server.requests,
        "uptime_s": round(time.time() - server.started, 3),
    }, None


@register_op("alloc")
def op_alloc(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``alloc {nbytes}`` -> ``{handle, nbytes}``; GpuMemoryExhausted when refused (no device call)."""
    ctx = server.require_context()
    nbytes = _int_arg(args, "nbytes")
    return {"handle": ctx.allocator.alloc(nbytes), "nbytes": nbytes}, None


@register_op("free")
def op_free(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``free {handle}`` -> ``{freed: nbytes}``; the bytes are released from the quota."""
    ctx = server.require_context()
    return {"freed": ctx.allocator.free(_int_arg(args, "handle"))}, None


@register_op("write")
def op_write(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``write {handle, offset}`` + body -> ``{written}``: copy the body into the buffer."""
    ctx = server.require_context()
    data = body.buffer if body is not None else memoryview(b"")
    n = ctx.allocator.write(_int_arg(args, "handle"), _int_arg(args, "offset", 0), data)
    return {"written": n}, None


@register_op("read")
def op_read(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``read {handle, offset, nbytes}`` -> ``{nbytes}`` + body with the bytes."""
    ctx = server.require_context()
    data = ctx.allocator.read(_int_arg(args, "handle"), _int_arg(args, "offset", 0), _int_arg(args, "nbytes"))
    return {"nbytes": len(data)}, data


@register_op("buffers")
def op_buffers(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``buffers {}`` -> ``{buffers: [[handle, nbytes], ...], bytes}`` of this instance."""
    ctx = server.require_context()
    handles = ctx.allocator.handles()
    return {"buffers": sorted(handles.items()), "bytes": sum(handles.values())}, None


@register_op("echo")
def op_echo(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``echo {text}`` -> ``{text}`` (shared.protocol.Echo: its arguments were checked against it)."""
    return {"text": args["text"]}, None
