"""The worker's side of GPU-time sharing: every device op runs through one :class:`DeviceGate`.

    guest import (matmul_f32, ...) ──► DeviceGate.op(name, fn, args)
        plan (worker.chunks)         every op cut into chunks of ~2 ms (cost model per op and shape)
        for each chunk:
            board.acquire(deadline)       the device lease (shared.gpu_time): waits are observed
            timer.time(fn, *chunk)        stub: the op's CPU time while holding; cuda: CUDA events
            block.charge_gpu_time(ns)     the tenant's quota block: status/metrics see it live
            board.finish(ns, last)        pass/used/cap charged; the device may pass on (at an op's
                                          end to a waiter when this worker's host gaps are long)
    end of the run ──► DeviceGate.release()   the device goes to the next tenant at once

Refusals: an op that gets no device time before the run's deadline (its wait
ran out, or the tenant's cap cannot give it time before then) raises
``KernelTimeout``; every later op of the same run is refused at once, without
waiting again. Refusals are counted (``refused``) and logged at most once a
second, not once per op.

Without a board (a context made by a test, or a supervisor of an older
layout) ops are still timed and charged, just not scheduled. With the
scheduler off (``gpu_time_scheduler = false``) there is no gate at all: ops
run without asking the board (no acquire, finish or release); the stub,
whose device is this host's CPU, still runs one op at a time per device (an
``flock`` on the board's file), as a GPU's contexts time-slice.

**Queued ops.** An op whose result the guest does not read at once (every
tensor op that writes a device buffer and returns nothing: fill, axpy,
binary, gemm, layernorm, ...) is *submitted* (:meth:`DeviceGate.submit`):
it goes to the worker's :class:`DeviceQueue`, one serial device thread that
runs the queued ops in order, each through the same path as above (chunks,
lease per chunk, charge), and the host call returns at once - the guest's
host code overlaps the device's work. What the guest reads synchronises
(:meth:`DeviceGate.sync`): ``read``, ``sum_f32``, an op writing into guest
memory, ``write`` and ``free`` (a buffer a queued op still uses), and the
run's end. The lease is taken by the device thread while it runs the
tenant's queued work; charges stay the device's time (CUDA events, the stub
executor thread's own CPU time).

    host (executor thread) ── submit ──► [ queue: <= MAX_QUEUED_OPS ops, <= MAX_QUEUED_BYTES ] ──► device thread
                           ◄── sync ───  waits until the queue is empty; raises what a queued op raised

* **Bounded.** At most :data:`MAX_QUEUED_OPS` ops and :data:`MAX_QUEUED_BYTES`
  bytes of device buffers named by queued ops (an op larger than that alone
  is admitted into an empty queue); a full queue makes ``submit`` wait.
* **Errors** of a queued op (a device fault, a backend error, a host bug)
  are kept and raised at the next synchronising call, once - the same
  exception the op would have raised, so the guest gets the same error code
  there; the ops queued behind it, and those submitted until that sync, are
  dropped (as on a CUDA stream after a fault). A ``KernelTimeout`` is raised
  at the next submit too: the run is over.
* **Deadlines.** A queued op that starts past the run's deadline, or whose
  wait for the lease runs out, raises ``KernelTimeout`` and drops the rest of
  the queue; the run ends as a timeout. A wait at the run's end is bounded by
  one chunk in flight (the deadline is checked before every chunk).

Threads: the worker's executor thread submits and syncs; queued ops run on
the device thread; a synchronous op runs on the executor thread once the
queue is empty. The board, timer and totals are therefore used by one
thread at a time (the queue's condition orders them).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from shared.errors import KernelTimeout
from shared.gpu_time import GpuTimeBoard
from shared.log import get_logger, log_event
from shared.quota import QuotaBlock
from worker.backends.base import Backend, DeviceBuffer
from worker.backends.timing import OpTimer
from worker.chunks import CostModel, plan

__all__ = ["CHUNK_S", "MAX_QUEUED_BYTES", "MAX_QUEUED_OPS", "DeviceGate", "DeviceQueue"]

T = TypeVar("T")

_log = get_logger("worker.device_time")

#: the longest a single launch should hold the device (the preemption latency bound)
CHUNK_S = 0.002
#: refused ops (no GPU time before the run's deadline) are logged at most once per this many seconds
_REFUSED_LOG_INTERVAL_S = 1.0
#: the most ops a worker keeps queued for the device: a guest submitting more waits for room
MAX_QUEUED_OPS = 64
#: the most bytes of device buffers the queued ops name (their inputs and outputs, counted per op)
MAX_QUEUED_BYTES = 256 << 20
#: how long past the run's deadline a wait for queued work may last before the gate gives up on it
#: (one chunk in flight finishes well inside it; what does not is the backend's queue overrun)
QUEUE_GRACE_S = 5.0


class DeviceQueue:
    """One serial device thread running a worker's queued ops in order (see module doc).

    Accounting for tests and status: ``submitted`` / ``ran`` / ``dropped`` ops,
    ``busy_ns`` (the device thread's CPU time in ops), ``overlapped`` (submits
    that returned while the device was running an earlier op: host work
    overlapping device work), ``waited_full`` (submits that waited for room).
    """

    def __init__(self, max_ops: int = MAX_QUEUED_OPS, max_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._items: deque[tuple[Callable[[], object], int]] = deque()
        self._bytes = 0
        self._running = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.submitted = 0
        self.ran = 0
        self.dropped = 0
        self.busy_ns = 0
        self.overlapped = 0
        self.waited_full = 0
        self.peak_ops = 0
        self.peak_bytes = 0

    @property
    def pending(self) -> int:
        """Ops queued or running."""
        with self._cond:
            return len(self._items) + (1 if self._running else 0)

    def submit(self, work: Callable[[], object], nbytes: int, deadline_ns: int | None = None) -> None:
        """Queue ``work``; waits while the queue is full. Behind a failed queued op ``work`` is dropped
        (the next :meth:`sync` reports the failure); a queued op's ``KernelTimeout`` is raised here
        (once), as is one when the deadline passes waiting for room."""
        with self._cond:
            while self._items and (len(self._items) >= self.max_ops or self._bytes + nbytes > self.max_bytes):
                self.waited_full += 1
                if not self._wait(deadline_ns):
                    raise KernelTimeout(0.0, message="waiting for room in the device queue: the run's deadline passed")
            err = self._error
            if err is not None:
                if isinstance(err, KernelTimeout):  # the run is over: its caller must know now
                    self._error = None
                    raise err
                self.dropped += 1  # behind a failed op, as on a CUDA stream: the next sync reports it
                return
            if self._closed:
                raise RuntimeError("the device queue is closed")
            self._items.append((work, nbytes))
            self._bytes += nbytes
            self.submitted += 1
            self.peak_ops = max(self.peak_ops, len(self._items))
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            if self._running:
                self.overlapped += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="twt-device", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def sync(self, deadline_ns: int | None = None, *, raise_error: bool = True) -> bool:
        """Wait until every queued op ran (or was dropped); raise a queued op's error (once) unless
        ``raise_error`` is false. False when ``deadline_ns`` passed first (the work is still queued)."""
        with self._cond:
            while self._items or self._running:
                if not self._wait(deadline_ns):
                    return False
            if raise_error:
                self._raise_error()
            return True

    def take_error(self) -> BaseException | None:
        """The error a queued op raised and nobody was told yet (cleared)."""
        with self._cond:
            err, self._error = self._error, None
            return err

    def _wait(self, deadline_ns: int | None) -> bool:
        if deadline_ns is None:
            self._cond.wait()
            return True
        left = deadline_ns - time.monotonic_ns()
        if left <= 0:
            return False
        self._cond.wait(left / 1e9)
        return True

    def _raise_error(self) -> None:
        err = self._error
        if err is not None:
            self._error = None
            raise err

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._items and not self._closed:
                    cond.wait()
                if not self._items:
                    return
                work, nbytes = self._items.popleft()
                self._running = True
            t0 = time.thread_time_ns()
            err: BaseException | None = None
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept for the next call into the gate
                err = exc
            busy = time.thread_time_ns() - t0
            with cond:
                self._running = False
                self._bytes -= nbytes
                self.busy_ns += busy
                self.ran += 1
                if err is not None:
                    self._error = err
                    self.dropped += len(self._items)
                    for _, b in self._items:
                        self._bytes -= b
                    self._items.clear()
                cond.notify_all()

    def close(self, timeout_s: float = QUEUE_GRACE_S) -> None:
        """Stop the device thread once the queue is empty (waits at most ``timeout_s``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout_s)


class DeviceGate:
    """Times, charges and (with a board) schedules one worker's device ops."""

    def __init__(self, block: QuotaBlock, backend: Backend, board: GpuTimeBoard | None = None,
                 chunk_s: float = CHUNK_S) -> None:
        self.block = block
        self.backend = backend
        self.board = board
        self.chunk_ns = int(chunk_s * 1e9)
        self._timer: OpTimer | None = None
        #: chunk sizes per op and shape (worker.chunks)
        self.costs = CostModel(*backend.device_rates())
        #: totals of the current run (``GuestRun`` reads and resets them)
        self.run_time_ns = 0
        self.run_wait_ns = 0
        self.chunks = 0
        #: ops refused for lack of GPU time before the run's deadline (all runs), and the rate
        #: limit of their log lines: the first of a burst is logged, the rest counted in the next
        self.refused = 0
        self._refused_logged = 0
        self._refused_log_at = 0.0
        #: this run was refused once: every later op of it is refused at once (no board, no wait)
        self._run_refused: KernelTimeout | None = None
        #: the worker's queued ops (created on the first submit)
        self.queue: DeviceQueue | None = None
        #: the name of the last queued op that failed (its error is reported at the next sync)
        self.failed_op = ""
        #: this worker took the lease since the last release (with the scheduler off it never does)
        self._leased = False
        #: with the scheduler off on a host-serial backend: the fd whose flock serialises the device
        self._serial = -1

    def _timer_(self) -> OpTimer:
        if self._timer is None:
            self._timer = self.backend.op_timer()
        return self._timer

    def op(self, name: str, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None = None) -> T | None:
        """Run op ``name`` = ``fn(*args)`` on the device now, in chunks where it splits (see module
        doc), after every queued op (their error, if any, is raised first); the op's result (a sum),
        or None."""
        self.sync(deadline_ns)
        return self._op(name, fn, args, deadline_ns)

    def submit(self, name: str, fn: Callable[..., object], args: tuple[object, ...],
               deadline_ns: int | None = None) -> None:
        """Queue op ``name`` = ``fn(*args)`` (its result is dropped: an op that only writes device
        buffers) and return; waits while the queue is full. Dropped behind a failed queued op (the
        next :meth:`sync` raises its error); ``KernelTimeout`` past the run's deadline."""
        queue = self.queue
        if queue is None:
            queue = self.queue = DeviceQueue()
        nbytes = sum(a.nbytes for a in args if isinstance(a, DeviceBuffer))
        queue.submit(lambda: self._queued(name, fn, args, deadline_ns), nbytes, deadline_ns)

    def _queued(self, name: str, fn: Callable[..., object], args: tuple[object, ...], deadline_ns: int | None) -> None:
        """A queued op on the device thread: refused at once when it starts past the deadline."""
        if deadline_ns is not None and time.monotonic_ns() > deadline_ns:
            raise self._refuse(KernelTimeout(0.0, message="the run's deadline passed with device work queued"))
        try:
            self._op(name, fn, args, deadline_ns, queued=True)
        except BaseException:
            self.failed_op = name  # the sync that reports the error names the op
            raise

    def sync(self, deadline_ns: int | None = None) -> None:
        """Wait for every queued op; raise a queued op's error (once). A wait lasts at most until
        the deadline plus :data:`QUEUE_GRACE_S` (the deadline is checked before each chunk, so
        only a chunk in flight can run past it): ``KernelTimeout`` beyond."""
        queue = self.queue
        if queue is None:
            return
        bound = None if deadline_ns is None else deadline_ns + int(QUEUE_GRACE_S * 1e9)
        if not queue.sync(bound):
            raise KernelTimeout(QUEUE_GRACE_S, message="queued device work still running past the run's deadline")

    def _op(self, name: str, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None, *,
            queued: bool = False) -> T | None:
        p = plan(name, self.backend, args)
        if p is None:
            ns, waited, result = self._run(fn, args, deadline_ns, last=True, queued=queued)
            self.block.observe_gpu_wait(waited)
            return result
        call = p.call or fn
        costs = self.costs
        lo = 0
        wait = 0
        results: list[object] = []
        while lo < p.units:
            hi = lo + costs.units_for(name, p, self.chunk_ns, p.units - lo)
            ns, waited, got = self._run(call, p.chunk(lo, hi), deadline_ns, last=hi >= p.units, queued=queued)
            wait += waited
            costs.observe(name, p, hi - lo, ns)
            if p.combine is not None:
                results.append(got)
            lo = hi
        self.block.observe_gpu_wait(wait)
        return p.combine(results) if p.combine is not None else None

    def _refuse(self, exc: KernelTimeout) -> KernelTimeout:
        """Count a refused op; log at most one line a second (with how many were not logged)."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refused_log_at >= _REFUSED_LOG_INTERVAL_S:
            log_event(_log, logging.WARNING, "device_time.refused", error=str(exc), refused=self.refused,
                      not_logged=self.refused - self._refused_logged - 1)
            self._refused_logged = self.refused
            self._refused_log_at = now
        self._run_refused = exc
        return exc

    def _run(self, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None, *,
             last: bool, queued: bool = False) -> tuple[int, int, T | None]:
        """One launch under the lease: (device ns, ns waited for the device, its result). A queued
        op's chunk is refused past the deadline (a wait at the run's end is one chunk at most)."""
        board = self.board
        waited = 0
        if self._run_refused is not None:
            raise self._refuse(KernelTimeout(0.0, message=str(self._run_refused)))
        if queued and deadline_ns is not None and time.monotonic_ns() > deadline_ns:
            raise self._refuse(KernelTimeout(0.0, message="the run's deadline passed with device work queued"))
        serial = -1
        if board is not None and not board.scheduler:
            serial = self._serial_fd(board)
            board = None  # scheduler off: no gate at all (the board is not asked)
        if board is not None:
            if deadline_ns is not None:
                throttled = board.throttled_wait_ns()
                if throttled and time.monotonic_ns() + throttled > deadline_ns:
                    raise self._refuse(KernelTimeout(0.0, message=(
                        f"waiting for the device: the tenant's GPU-time cap gives it no time before the "
                        f"run's deadline (next in {throttled / 1e6:.1f} ms)"))) from None
            try:
                waited = board.acquire(deadline_ns)
                self._leased = True
            except TimeoutError as exc:
                raise self._refuse(KernelTimeout(0.0, message=f"waiting for the device: {exc}")) from None
        self.run_wait_ns += waited
        ns = 0
        result: list[T] = []
        if serial >= 0:
            fcntl.flock(serial, fcntl.LOCK_EX)
        try:
            ns = self._timer_().time(lambda: result.append(fn(*args)))
        finally:
            if serial >= 0:
                fcntl.flock(serial, fcntl.LOCK_UN)
            self.chunks += 1
            self.run_time_ns += ns
            self.block.charge_gpu_time(ns)
            if board is not None:
                if board.finish(ns, last=last) and board.throttled_wait_ns():
                    self.block.count_gpu_throttled()
        return ns, waited, result[0] if result else None

    def _serial_fd(self, board: GpuTimeBoard) -> int:
        """With the scheduler off, a backend whose device is this host's CPU (the stub) still runs
        one op at a time per device, as a GPU's contexts time-slice: an ``flock`` on the board's
        /dev/shm file (no board call, no file of its own). -1 for other backends (the GPU does it)."""
        if not getattr(self.backend, "serial_device", False):
            return -1
        if self._serial < 0:
            try:
                self._serial = os.open(os.path.join("/dev/shm", board.name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log_event(_log, logging.WARNING, "device_time.serial_unavailable", error=repr(exc))
                self._serial = -2  # not again: ops then overlap on the host's cores
        return self._serial

    def take_run_totals(self) -> tuple[int, int]:
        """(device ns, wait ns) since the last call: one run's figures for its reply (a new run
        starts with it: its ops are no longer refused for the last run's deadline)."""
        out = (self.run_time_ns, self.run_wait_ns)
        self.run_time_ns = self.run_wait_ns = 0
        self._run_refused = None
        return out

    def release(self, deadline_ns: int | None = None) -> None:
        """End of a run: its queued work is waited for (bounded as :meth:`sync`; an error nobody
        read is logged), then the device goes to the next tenant (never raises)."""
        queue = self.queue
        if queue is not None:
            bound = None if deadline_ns is None else deadline_ns + int(QUEUE_GRACE_S * 1e9)
            if not queue.sync(bound, raise_error=False):
                log_event(_log, logging.WARNING, "device_time.queue_overrun", pending=queue.pending)
            err = queue.take_error()
            if err is not None and not isinstance(err, KernelTimeout):
                log_event(_log, logging.WARNING, "device_time.queued_op_failed", error=repr(err))
        self._run_refused = None
        if self.board is None or not self._leased:
            return
        self._leased = False
        try:
            self.board.release()
        except Exception as exc:  # noqa: BLE001 - a closed board at shutdown: logged
            log_event(_log, logging.WARNING, "device_time.release_failed", error=repr(exc))

    def close(self) -> None:
        """Give the device back, free the worker slot, release the timer's events."""
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        if self._serial >= 0:
            os.close(self._serial)
            self._serial = -1
        if self.board is not None:
            self.board.close()
            self.board = None
        if self._timer is not None:
            self._timer.close()
            self._timer = None
