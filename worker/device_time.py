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
``flock`` on the board's file), as a GPU time-slices its contexts.

**Queued ops** (a backend with ``queues_ops``: the stub, cuda). An op whose result
the guest does not read at once (every op that only writes device buffers:
fill, axpy, GEMM, elementwise ...) is *submitted* (:meth:`DeviceGate.submit`)
to the worker's :class:`DeviceQueue` and the host call returns: the guest's
host code overlaps the device's work. One device thread runs the queued ops
in order. What the guest reads synchronises (:meth:`DeviceGate.sync`):
``read``/``write`` of a buffer, ``free``, ``sum_f32``, an op writing guest
memory, and the run's end::

    guest (executor thread) ── submit ──► [ <= MAX_QUEUED_OPS ops, <= MAX_QUEUED_BYTES ] ──► device thread
                            ◄── sync ───  waits until the queue is empty; raises a queued op's error

* **One stretch of work.** The device thread treats the queued work as one
  stretch: it acquires the lease once - before a small op, before it looks
  at the queue, so that what the guest queues during the wait joins its
  launch; before a bigger op, at its launch, the op planned before the
  wait (after a handover the device idles until the grantee launches) -
  runs op after op (each chunked as above; a run of *small* ops, each planned and
  estimated by the submitting thread, as one launch: one lease check, one
  measurement, one flush decision, each op still its own call with its own
  wait and error; a run of big one-chunk ops of one kind and shape - a GEMM loop - through
  one lean loop, :meth:`DeviceGate._queued_run`, each op launched and timed alone), and
  tells the board (``finish``) only at a chunk boundary after
  ~:data:`CHUNK_S` of holding (a quarter of it while another worker waits, unless the
  board's last answer still holds: ``GpuTimeBoard.quiet``) - where the board may hand the
  device over (the quantum's end, a waiter's claim) - and when the queue runs empty and
  no op follows within :data:`QUEUE_LINGER_S` (the stretch's end: the device
  is lent to a waiter at once; a worker whose ops come far apart does not
  wait for its next op while another worker waits, and ends its stretch with
  a pass of small ops even with more queued: :meth:`DeviceGate._lend_after_pass`; at a
  run's end, the executor waiting in :meth:`DeviceGate.release`, it passes the device on).
  The board charges
  the device time of what ran in between; an op's wait is the time it was
  ready (submitted, its worker's earlier ops done) and not running.
* **Pending device time** (cuda: a ``PendingTimer``). The launches return
  at once; each chunk's time is read from its events only when the timer is
  *settled* (:meth:`DeviceGate._settle`): before every flush - so the board
  hears of work only once it is complete - and when the timer's ring is
  full. The flush rule then counts the cost model's estimate of the pending
  chunks, not the time held (docs/GPU-QUOTAS.md, "Asynchronous cuda under
  the gate").
* **Bounded.** At most :data:`MAX_QUEUED_OPS` ops queued or taken by the device
  thread and not complete (besides the one running) and :data:`MAX_QUEUED_BYTES`
  bytes of the device buffers they name (an op larger alone is admitted into
  an empty queue); a full queue makes ``submit`` wait, until the deadline. Room
  is made as each op completes (:meth:`DeviceQueue.completed`: launched chunks
  count once they ran or settled), not when the device thread's whole pass
  returns: a guest run of more ops than the bound keeps the queue fed.
* **Errors** of a queued op are kept and raised at the next synchronising
  call, once - the exception the op would have raised; the ops behind it
  are dropped (as on a CUDA stream after a fault). A ``KernelTimeout`` is
  raised at the next submit too: the run is over.
* **Deadlines bound queued work.** A queued op (each chunk) is refused past
  the run's deadline and the rest of the queue dropped; a wait for queued
  work is therefore one chunk in flight past the deadline at most, and gives
  up at the deadline plus :data:`QUEUE_GRACE_S` (``QueueOverrun``: the
  worker exits, as for the cuda backend's queue).

**The work trace** (off by default; ``shared.gpu_time.WorkTrace``, the board's ``work``):
the worker's work intervals (from a submit into a queue with none open until its last op is
done; a synchronous op's call) and the device's busy and launch spans, for ``twt bench share
--mix``'s "device busy while any tenant has work"; off, each hook is one ``is None`` test.

Threads: the executor thread submits and syncs; queued ops run on the device
thread; a synchronous op runs on the executor thread once the queue is empty
(and the device thread has told the board its stretch ended). The board,
timers and totals are thus used by one thread at a time, ordered by the
queue's condition. With ``stub_device_cpus`` (shared.device_cpus) the device thread runs only on
its device's CPU and the worker's other threads on the rest (:func:`pin_device`, at bind). The device
thread asks the kernel for a short time slice, the stub's executor thread for its shortest
(``shared.prctl.short_slice``): woken to launch or to take a handed-over lease, they preempt the guest
code running on their core instead of waiting out its slice, the device idle meanwhile.

**The stub's executor** (``worker.backends.stub_executor``: a C thread running launched GEMM chunks
back to back, the stub's device). The device thread is then its driver: a GEMM chunk is launched and
pending until settled, as on cuda; a boundary tells the board what already ran and lets the launched
chunks run on - waited for after its ``finish`` where the device went on or the stretch ended, and
charged at once (``GpuTimeBoard.charge``): a grantee's first launch queues behind them; the driver runs
at most 1/:data:`_AHEAD_DIV` of a chunk ahead (:meth:`DeviceGate._ahead`) - in a run of big ops
(:meth:`DeviceGate._queued_run`) a whole chunk, whose launches not yet started are withdrawn where a
boundary passes the device on (:meth:`DeviceGate._withdraw`) and launched again after the next grant;
at the bound the driver sleeps on its own timer by the estimates, not woken by the executor at each
refill; other ops run on the driver once the executor is idle. A stretch's first GEMM is launched
before the driver waits for the lease (:class:`_GatedChunk`): the executor starts it the moment a
grant names this worker, its own CAS taking the lease busy. With ``stub_device_cpus`` the executor's
thread is the one on the device's CPU.
"""

from __future__ import annotations

import bisect
import fcntl
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar, cast

from shared.device_cpus import set_threads_affinity
from shared.errors import KernelTimeout
from shared.gpu_time import GpuTimeBoard, WorkTrace
from shared.log import get_logger, log_event
from shared.prctl import short_slice
from shared.quota import QuotaBlock
from worker.backends.base import Backend, DeviceBuffer
from worker.backends.stub_executor import ExecutorTimer
from worker.backends.timing import OpTimer, PendingTimer
from worker.chunks import CostModel, Plan, plan
from worker.priority import name_thread, start_thread

__all__ = ["CHUNK_S", "MAX_QUEUED_BYTES", "MAX_QUEUED_OPS", "QUEUE_GRACE_S", "DeviceGate", "DeviceQueue",
           "QueueOverrun", "pin_device"]

T = TypeVar("T")

_log = get_logger("worker.device_time")

#: the longest a single launch should hold the device (the preemption latency bound)
CHUNK_S = 0.002
#: refused ops (no GPU time before the run's deadline) are logged at most once per this many seconds
_REFUSED_LOG_INTERVAL_S = 1.0
#: the most ops a worker keeps queued for the device: a guest submitting more waits for room
MAX_QUEUED_OPS = 64
#: the most bytes of device buffers the queued ops name (inputs and outputs, counted per op)
MAX_QUEUED_BYTES = 256 << 20
#: EWMA weight of the newest sample (1 / 2**shift)
_EWMA_SHIFT = 2
#: a stretch's end lends the device when the worker's ops come more than this far apart on average
#: (the board's own floor for lending at an op's end) ...
_LEND_GAP_NS = 75_000
#: ... and more than this many times their device time apart (the board's grace: four op lengths)
_LEND_RATIO = 4
#: while another worker waits, a stretch whose device work is under 1/this of the time it has held the
#: lease since its last boundary ends at the next op's end (the device is lent): a chatty tenant whose
#: ops arrive as fast as the device thread's own per-op host work runs them would otherwise hold an
#: idle device until its quantum ends, its queue never running empty
_LEND_BUSY_DIV = 8
#: a queued op estimated under 1/this of a chunk (~30 us) is small: its launch is mostly the device
#: thread's own per-op work, and a run of small ops goes to the device as one launch
#: (:meth:`DeviceGate._queued_batch`) ...
_SMALL_DIV = 64
#: ... estimated under 1/this of a chunk together (~250 us: a batch holds the device no longer than a
#: few ops would; batches of GEMMs of ~1 ms, descheduled mid-way on a loaded host, held the lease for
#: 10-20 ms with no boundary inside, and a chatty tenant's ops waited that long)
_BATCH_DIV = 8
#: when the queue runs empty the device thread waits this long for the guest's next op before it
#: ends the stretch (and lends the device): a guest loop's next submit (one host call, ~10-60 us)
#: continues the stretch; a tenant's host work (0.1 ms and more) does not keep an idle device
QUEUE_LINGER_S = 50e-6
#: the stub's executor's time slice (``shared.prctl.short_slice``: the kernel's least, 0.1 ms): woken
#: by a launch or a grant, it preempts what runs on the device's core instead of waiting up to that
#: code's slice (~1.4 ms), the device idle meanwhile
DEVICE_SLICE_NS = 100_000
#: the device thread's slice (the stub executor's driver): short enough that its wake-ups preempt the
#: guests' code (their ~1.4 ms), long enough that a burst of launches and board calls (0.1-0.3 ms) is
#: not rescheduled past its first 0.1 ms by any wake-up on that core - a thread rescheduled there waits,
#: runnable, until a tick (4 ms at HZ 250) or a sleep
DRIVER_SLICE_NS = 300_000
#: the stub's executor: the chunks launched ahead of the running one hold at most 1/this of a chunk
#: by their estimates (:meth:`DeviceGate._ahead`) ...
_AHEAD_DIV = 2
#: ... and in a run of big ops (:meth:`DeviceGate._queued_run`) at most this many chunks: there a
#: boundary that passes the device on withdraws the launched chunks not yet started (they run again
#: after the next grant), so the handover waits for the running chunk only, however deep the queue -
#: and the driver, on the host's busy core, has a chunk's time to wake and refill it, not half of one;
#: ``TWT_RUN_AHEAD=0`` keeps the half chunk there too (an A/B of the run-ahead)
_RUN_AHEAD_CHUNKS = 0 if os.environ.get("TWT_RUN_AHEAD", "1") == "0" else 1
#: at the run-ahead bound the driver sleeps on a timer by the launched chunks' estimates, not woken by
#: the executor (:meth:`DeviceGate._ahead`); ``TWT_AHEAD_SLEEP=0``: woken by it (an A/B) ...
_AHEAD_SLEEP = os.environ.get("TWT_AHEAD_SLEEP", "1") != "0"
#: ... at least this long a sleep (a chunk's estimate of zero never spins)
_AHEAD_SLEEP_MIN_NS = 20_000
#: the stub's executor starts a stretch's first GEMM at the grant (:class:`_GatedChunk`);
#: ``TWT_GATED_LAUNCH=0`` turns it off (an A/B of the handover)
_GATED = os.environ.get("TWT_GATED_LAUNCH", "1") != "0"
#: an op's ``small_est`` when it cannot join a batch (larger than any batch's budget)
_NOT_SMALL = 1 << 62
#: how long past the run's deadline a wait for queued work may last (one chunk in flight ends well
#: inside it; work that does not is a queue overrun: the run ends and the worker exits)
QUEUE_GRACE_S = 1.0


def pin_device(gate: DeviceGate, cpus: Iterable[int]) -> bool:
    """The stub's device as a core of its own (shared.device_cpus), at a worker's bind: every thread
    of this process onto the CPUs of its affinity set other than ``cpus``, and the gate's device
    thread (now, or when it starts) onto ``cpus`` - with the stub's executor, the executor's thread
    (now, or when it is made) instead. A set that cannot apply (no CPU would be left, or
    ``cpus`` not usable by this process) is logged and changes nothing: the device thread then shares
    the worker's CPUs, as without the setting. True when applied."""
    device = frozenset(cpus)
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError) as exc:  # not Linux
        log_event(_log, logging.WARNING, "device_time.device_cpus_fallback", cpus=sorted(device), reason=repr(exc))
        return False
    rest = allowed - device
    if not device or not rest:
        log_event(_log, logging.WARNING, "device_time.device_cpus_fallback", cpus=sorted(device),
                  allowed=sorted(allowed), reason="no CPU of the worker's affinity set would be left for its "
                                                  "other threads" if device else "no CPU given")
        return False
    try:  # may this process run there at all (its cpuset)? tried on this thread, then put back
        os.sched_setaffinity(0, device)
    except OSError as exc:
        log_event(_log, logging.WARNING, "device_time.device_cpus_fallback", cpus=sorted(device),
                  allowed=sorted(allowed), reason=repr(exc))
        return False
    queue = gate.queue
    executor = gate._executor
    if gate.backend.device_executor:
        # the stub's executor is the device: its thread there (now, or when made: DeviceGate._queue_timer),
        # the device thread - its driver - with the worker's other threads
        device_tid = executor.thread_id if executor is not None else None
    else:
        device_tid = queue.thread_id if queue is not None else None
    refused = set_threads_affinity(rest, skip=() if device_tid is None else (device_tid,))
    for tid, why in refused:
        log_event(_log, logging.WARNING, "device_time.affinity_refused", thread=tid, error=repr(why))
    gate.device_cpus = device
    if executor is not None:
        if device_tid is not None:
            _pin(device_tid, device)
    elif gate.backend.device_executor:
        if gate._qtimer is not None and queue is not None and queue.thread_id is not None:
            _pin(queue.thread_id, device)  # no executor after all (fell back): the device thread runs the ops
    elif queue is not None:
        queue.cpus = device
        if device_tid is not None:
            _pin(device_tid, device)
    log_event(_log, logging.INFO, "device_time.device_cpus", device=sorted(device), rest=sorted(rest))
    return True


def _pin(tid: int, cpus: frozenset[int]) -> None:
    """Thread ``tid`` (0: the calling one) onto ``cpus``; a refusal is logged."""
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as exc:
        log_event(_log, logging.WARNING, "device_time.affinity_refused", thread=tid or threading.get_native_id(),
                  error=repr(exc))


def _same_args(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """The same arguments: each the same object, or an equal ``int`` (sizes: the host call makes new
    int objects). Never equal contents of another object (a view of other memory is another op)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is not y and (type(x) is not int or type(y) is not int or x != y):
            return False
    return True


class QueueOverrun(KernelTimeout):
    """Queued device work still ran past the run's deadline plus :data:`QUEUE_GRACE_S`: it cannot be
    cancelled, so the worker must exit (the supervisor restarts it; the lease goes with the process)."""


@dataclass(slots=True)
class _Item:
    """One queued op: what to run, the bytes it names, when it was submitted and how much device
    time (wall ns of this worker's own ops) had run by then (its wait excludes its own queue); its
    chunk plan (None: it runs whole) and the cost model's estimate of it whole (-1: no plan), made
    by the submitting thread, outside the device thread's hold of the lease (``planned``)."""

    name: str
    fn: Callable[..., object]
    args: tuple[object, ...]
    deadline_ns: int | None
    nbytes: int
    submit_ns: int
    own_busy_ns: int
    plan: Plan | None = None
    est: int = -1
    planned: bool = False
    #: its estimate when it may join a batch of small ops (planned, one launch whole, small), else
    #: :data:`_NOT_SMALL`: the device thread then finds a batch's end without a walk in Python
    small_est: int = -1


class _GatedChunk:
    """A stretch's first chunk on the stub's executor, launched before the driver waits for the lease
    (``shared.gpu_time.GatedLaunch``): the executor starts it the moment a grant names this worker,
    its own CAS taking the lease busy - the driver's wake, its look at the board and its launch are
    then no device idle of the handover. ``runs``: it was launched and runs (the driver launches
    nothing else for it)."""

    __slots__ = ("executor", "name", "args", "runs", "armed")

    def __init__(self, executor: ExecutorTimer, name: str, args: tuple[object, ...]) -> None:
        self.executor = executor
        self.name = name
        self.args = args
        self.runs = False
        self.armed = False

    def arm(self, buf: memoryview, owner_off: int, busy_off: int, mine: int) -> bool:
        self.armed = self.executor.launch_gated(self.name, self.args, buf, owner_off, busy_off, mine)
        return self.armed

    def resolve(self, *, cancel: bool) -> bool:
        self.runs = self.executor.resolve(cancel=cancel)
        return self.runs


class DeviceQueue:
    """A bounded FIFO of queued ops and the device thread that runs them (see the module doc).

    Counters for tests and status: ``submitted``, ``ran``, ``dropped``,
    ``overlapped`` (submits that returned while the device ran an earlier op:
    host work overlapping device work), ``waited_full`` (submits that waited
    for room), ``peak_ops`` and ``peak_bytes`` (the most queued at once).
    """

    def __init__(self, run: Callable[[list[_Item]], tuple[int, BaseException | None]], end: Callable[[], None], *,
                 max_ops: int = MAX_QUEUED_OPS, max_bytes: int = MAX_QUEUED_BYTES,
                 linger: Callable[[], bool] | None = None, lend: Callable[[], bool] | None = None,
                 work: WorkTrace | None = None, settles: Callable[[], bool] | None = None) -> None:
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        #: runs the ops taken off the queue, in order: (how many ran whole, the error of the next
        #: one or None); one call for every op queued when the device thread looked
        self._run_items = run
        self._end_stretch = end
        #: whether an empty queue waits :data:`QUEUE_LINGER_S` for the guest's next op (None: always)
        self._linger = linger
        #: whether the stretch ends after a pass although ops were queued during it (None: never)
        self._lend = lend
        self._cond = threading.Condition()
        self._items: deque[_Item] = deque()
        self._bytes = 0
        self._running = False
        #: ops taken off the queue by the device thread in its current pass (the list it runs,
        #: ``_batch``), of which the first ``_done`` are complete (the device thread's
        #: :meth:`completed`, written without the lock) and the first ``_freed`` had their bytes
        #: given back (under the lock): the ops taken and not complete, all but the one running, still
        #: count as queued - room is made as each op completes, not when the whole pass returns
        self._inflight = 0
        self._batch: list[_Item] = []
        self._done = 0
        self._freed = 0
        #: submitters waiting for room (the device thread wakes them as ops complete, at ``low_ops``)
        self._room_waiters = 0
        #: a submitter waiting for room is woken once the pass's ops not complete are this few: it
        #: then queues several ops in one wake-up, not one op per op completed
        self.low_ops = max(1, max_ops // 2)
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        #: the CPUs the device thread runs on (None: the worker's; :func:`pin_device`)
        self.cpus: frozenset[int] | None = None
        #: threads waiting in :meth:`sync` (the device thread does not linger for more work then)
        self._syncing = 0
        #: wall ns the device thread spent running this worker's ops (an op's wait excludes them)
        self.own_busy_ns = 0
        #: the work trace (None: off): the queue's work interval, open since ``_work_since`` (0: none
        #: open) - from the submit into a queue with no work to the end of its last op; ``settles``:
        #: the ops' device work is complete only once the stretch's end settled it (cuda's pending
        #: timer), so the interval closes after the stretch's end, not when the last launch returned
        self._work = work
        self._work_since = 0
        self._settles = settles
        self.submitted = 0
        self.ran = 0
        self.dropped = 0
        self.overlapped = 0
        self.waited_full = 0
        self.peak_ops = 0
        self.peak_bytes = 0

    @property
    def pending(self) -> int:
        """Ops queued or running."""
        with self._cond:
            return len(self._items) + self._inflight

    def submit(self, item: _Item) -> None:
        """Queue ``item``; waits while the queue is full (``KernelTimeout`` at its deadline). Behind
        a failed queued op the item is dropped (the next :meth:`sync` reports the failure); a queued
        op's ``KernelTimeout`` is raised here (once): the run is over."""
        with self._cond:
            if self._full(item) and self._error is None:
                # counted as waiting before the room is looked at again: the device thread stores its
                # completions, then reads the count - one of the two sees the other's write (the GIL
                # orders them), so a completion never passes a waiter unwoken
                self._room_waiters += 1
                try:
                    while self._full(item) and self._error is None:
                        self.waited_full += 1
                        if not self._wait(item.deadline_ns):
                            raise KernelTimeout(0.0, message="waiting for room in the device queue: the run's "
                                                             "deadline passed")
                finally:
                    self._room_waiters -= 1
            err = self._error
            if err is not None:
                if isinstance(err, KernelTimeout):
                    self._error = None
                    raise err
                self.dropped += 1
                return
            if self._closed:
                raise RuntimeError("the device queue is closed")
            if self._work is not None and not self._work_since:
                self._work_since = item.submit_ns  # (stamped before this lock: the op's submit)
            self._items.append(item)
            self._bytes += item.nbytes
            self.submitted += 1
            self.peak_ops = max(self.peak_ops, len(self._items) + max(0, self._inflight - self._done - 1))
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            if self._running:
                self.overlapped += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="twt-device", daemon=True)
                start_thread(self._thread)  # the worker's normal priority, above its guest's
            self._cond.notify_all()

    def _full(self, item: _Item) -> bool:
        """Whether ``item`` must wait for room (under the lock): at most :attr:`max_ops` ops queued or
        taken and not complete besides the one running, :attr:`max_bytes` of the buffers they name (an op
        larger alone goes into an empty queue). The bytes of the ops completed since are given back here."""
        done = self._done
        if done > self._freed:
            self._bytes -= sum(it.nbytes for it in self._batch[self._freed:done])
            self._freed = done
        return bool(self._items or self._running) and (
            len(self._items) + max(0, self._inflight - done - 1) >= self.max_ops
            or self._bytes + item.nbytes > self.max_bytes)

    def completed(self, done: int) -> None:
        """The device thread: the first ``done`` ops of the pass it runs are complete (they ran, or
        their launched chunks did: never one still running or pending) - room for as many. A submitter
        waiting for room is woken once the pass has :attr:`low_ops` ops or fewer not complete (and at
        the pass's end). Without the lock unless a submitter waits: one store per op."""
        if done <= self._done:
            return
        self._done = done
        if self._room_waiters and self._inflight - done <= self.low_ops:
            with self._cond:
                self._cond.notify_all()

    def sync(self, deadline_ns: int | None = None, *, raise_error: bool = True) -> bool:
        """Wait until every queued op ran (or was dropped); raise a queued op's error (once) unless
        ``raise_error`` is false. False when ``deadline_ns`` passed first (work still queued)."""
        with self._cond:
            self._syncing += 1
            self._cond.notify_all()  # a device thread lingering for the next op ends its stretch now
            try:
                while self._items or self._running:
                    if not self._wait(deadline_ns):
                        return False
            finally:
                self._syncing -= 1
            if raise_error:
                err, self._error = self._error, None
                if err is not None:
                    raise err
            return True

    def take_more(self, items: list[_Item]) -> int:
        """The device thread takes what was queued since it last looked onto ``items`` (the list it
        is running: they are in flight from now on); how many."""
        with self._cond:
            n = len(self._items)
            if n:
                items.extend(self._items)
                self._items.clear()
                self._inflight += n
            return n

    def take_error(self) -> BaseException | None:
        """The error a queued op raised that nobody was told of yet (cleared)."""
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

    @property
    def thread_id(self) -> int | None:
        """The device thread's native id (None: not started)."""
        thread = self._thread
        return None if thread is None else thread.native_id

    def _loop(self) -> None:
        name_thread()
        short_slice(DRIVER_SLICE_NS)  # its wake-ups launch the device's next work: they preempt guest code
        if self.cpus is not None:
            _pin(0, self.cpus)  # the device thread, at its start
        cond = self._cond
        while True:
            with cond:
                while not self._items and not self._closed:
                    cond.wait()
                if not self._items:
                    return
                # every op queued now, in one call: the gate runs a run of small ops as one launch
                items = list(self._items)
                self._items.clear()
                self._inflight = len(items)
                self._batch = items  # (take_more extends this list: the same pass)
                self._done = self._freed = 0
                self._running = True
                if self._room_waiters:
                    cond.notify_all()  # the op about to run no longer counts: room for one
            try:
                ran, err = self._run_items(items)
            except BaseException as exc:  # noqa: BLE001 - kept for the next call into the gate
                ran, err = 0, exc
            work = self._work
            done_at = time.monotonic_ns() if work is not None else 0
            with cond:
                self.ran += ran + (1 if err is not None else 0)
                self._bytes -= sum(item.nbytes for item in items[self._freed:])
                self._inflight = 0
                self._batch = []
                self._done = self._freed = 0
                if self._room_waiters:
                    cond.notify_all()  # room for the pass's ops: a submitter queues before any linger
                if err is not None:
                    self._error = err
                    self.dropped += len(items) - ran - 1 + len(self._items)
                    self._bytes -= sum(item.nbytes for item in self._items)
                    self._items.clear()
                idle = not self._items
                if work is not None and idle and self._work_since and not (
                        self._settles is not None and self._settles()):
                    # its last op has finished: no work from here to its next submit (a linger, a
                    # stretch's end with the device held, are no work of this worker's)
                    work.add(WorkTrace.WORK, self._work_since, done_at)
                    self._work_since = 0
                # a chatty worker's stretch ends after its pass, the ops its guest queued meanwhile
                # still queued: they wait for its claim, a turn later (DeviceGate._lend_after_pass)
                lend = not idle and err is None and self._lend is not None and self._lend()
                if idle and not self._closed and err is None and not self._syncing and (
                        self._linger is None or self._linger()):
                    cond.wait(QUEUE_LINGER_S)  # the guest's next op may be a host call away
                    idle = not self._items
            if idle or lend:
                try:
                    self._end_stretch()  # the board hears of the stretch's end before anyone syncs
                except Exception as exc:  # noqa: BLE001 - a closed board at shutdown: logged
                    log_event(_log, logging.WARNING, "device_time.stretch_end_failed", error=repr(exc))
                    with cond:  # (a queued op's fault found at the settle): reported at the next sync
                        if self._error is None:
                            self._error = exc
            with cond:
                self._running = False
                if work is not None and self._work_since and not self._items:
                    work.add(WorkTrace.WORK, self._work_since, time.monotonic_ns())  # settled: done
                    self._work_since = 0
                cond.notify_all()

    def close(self, timeout_s: float = QUEUE_GRACE_S) -> None:
        """Stop the device thread once the queue is empty (waits at most ``timeout_s``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)


class DeviceGate:
    """Times, charges and (with a board) schedules one worker's device ops."""

    def __init__(self, block: QuotaBlock, backend: Backend, board: GpuTimeBoard | None = None,
                 chunk_s: float = CHUNK_S) -> None:
        self.block = block
        self.backend = backend
        self.board = board
        if board is not None and getattr(backend, "serial_device", False):
            board.spin = False  # the device is this host's CPU: a waiter sleeps, never spins
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
        #: the worker's queued ops (a backend with ``queues_ops``; made on the first submit)
        self.queue: DeviceQueue | None = None
        #: the name of the last queued op that failed (the sync reporting its error names it)
        self.failed_op = ""
        #: a run's queued work outlived its deadline plus the grace: the worker must exit
        self.queue_overrun = False
        #: the device thread's stretch: it holds the lease busy since ``_held_since`` (0: not held
        #: busy) with ``_pending_ns`` of device time not yet told to the board
        self._held_since = 0
        self._pending_ns = 0
        #: the last chunk boundary of the stretch not told to the board (0: none since the last flush):
        #: the board's answer still held there (``GpuTimeBoard.quiet``)
        self._quiet_at = 0
        #: the executor waits in :meth:`release` for the run's queued work: its stretch's end passes
        #: the device on (the board's ``release``), not the executor once it woke
        self._run_ending = False
        #: ns the device thread waited for the lease, all told (one writer: the device thread)
        self._lease_wait_ns = 0
        #: the stretch holds the board's lease (not only the flock or nothing: the scheduler off)
        self._held_board = False
        self._qtimer: OpTimer | None = None
        #: ``_qtimer`` when it is the stub's executor (worker.backends.stub_executor), else None
        self._executor: ExecutorTimer | None = None
        #: ``_qtimer`` when its chunks are pending until settled (cuda's stretch timer), else None
        self._pending_timer: PendingTimer | None = None
        #: an asynchronous queue timer's (``PendingTimer``: cuda) chunks not yet settled, in order:
        #: (op, plan, units, estimated ns); the estimates' sum decides the next flush
        self._unsettled: list[tuple[str, Plan | None, int, int]] = []
        self._unsettled_est_ns = 0
        #: the chunk about to run (set by :meth:`_op`), and the deadline a settle is bounded by
        self._chunk: tuple[str, Plan | None, int] = ("", None, 0)
        self._stretch_deadline_ns: int | None = None
        #: the error a settle raised (it names its own op in ``failed_op``)
        self._settle_error: BaseException | None = None
        #: this worker's queued ops (EWMAs, ns): the interval between its submits inside a run, and
        #: each op's device time - a stretch's end lends the device only for a mostly idle worker
        self._submit_at = 0
        self._submit_gap_ns = 0
        self._op_dev_ns = 0
        #: op kinds whose first-use loads the backend made before the lease (:meth:`_prepare`)
        self._prepared: set[str] = set()
        #: ops of the batch being launched that ran whole, and its ops' plans and estimates
        #: (:meth:`_queued_batch`)
        self._batch_ran = 0
        self._batch_plans: list[tuple[Plan, int]] = []
        #: the op or batch being run is small (:meth:`_small_run`) and the last of the device thread's
        #: pass (:meth:`_queued_items`); after the pass: the pass ended with small ops
        self._pass_end = False
        #: with the scheduler off on a host-serial backend (the stub): the fd whose flock serialises
        #: the device (-1 not opened, -2 unavailable)
        self._serial = -1
        #: the board's work trace (None: off; shared.gpu_time.WorkTrace): this worker's work and busy
        #: intervals; with a pending timer, the unsettled chunks' launch stamps and where the last
        #: settled chunk ended (the next one starts after it on the stream)
        self._work: WorkTrace | None = getattr(board, "work", None)  # (a test's stand-in board has none)
        self._unsettled_at: list[int] = []
        self._busy_end = 0
        #: a run of big ops (:meth:`_queued_run`): how many of the newest unsettled chunks are its own
        #: launches, which a boundary passing the device on may withdraw (0: none may), and how many
        #: the last boundary withdrew (the run launches them again)
        self._withdraw_max = 0
        self._withdrawn = 0
        #: the last op submitted (name, arguments) and its plan and bytes named: the next submit of the
        #: same op on the same arguments reuses them (the submitting thread's host work, ~5 us a GEMM,
        #: competes with the stub's device for the host's cores)
        self._last_name = ""
        self._last_args: tuple[object, ...] = ()
        self._last_plan: Plan | None = None
        self._last_nbytes = 0
        #: the CPUs the device thread runs on (None: the worker's own; :func:`pin_device`)
        self.device_cpus: frozenset[int] | None = None

    def _timer_(self) -> OpTimer:
        if self._timer is None:
            self._timer = self.backend.op_timer()
        return self._timer

    def op(self, name: str, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None = None) -> T | None:
        """Run op ``name`` = ``fn(*args)`` on the device now, after every queued op (whose error, if
        any, is raised first), in chunks where it splits (see module doc); its result (a sum), or None."""
        self.sync(deadline_ns)
        self._prepare(name)
        work = self._work
        if work is None:
            return cast("T | None", self._op(name, fn, args, deadline_ns, self._run))
        t0 = time.monotonic_ns()  # the op is this worker's work from here until it returns
        try:
            return cast("T | None", self._op(name, fn, args, deadline_ns, self._run))
        finally:
            work.add(WorkTrace.WORK, t0, time.monotonic_ns())

    def submit(self, name: str, fn: Callable[..., object], args: tuple[object, ...],
               deadline_ns: int | None = None) -> None:
        """Queue op ``name`` = ``fn(*args)`` (an op that only writes device buffers: its result is
        dropped) and return; waits while the queue is full. Run at once (:meth:`op`) on a backend
        that queues no ops. ``KernelTimeout`` once the run is over (see the module doc)."""
        if not self.backend.queues_ops:
            self.op(name, fn, args, deadline_ns)
            return
        if self._run_refused is not None:
            raise self._refuse(KernelTimeout(0.0, message=str(self._run_refused)))
        queue = self.queue
        if queue is None:
            queue = self.queue = DeviceQueue(self._queued_items, self._end_stretch, linger=self._linger,
                                             lend=self._lend_after_pass, work=self._work,
                                             settles=lambda: self._pending_timer is not None)
            # (the stub's executor: its thread is the device's, pinned when made - _queue_timer)
            queue.cpus = None if self.backend.device_executor else self.device_cpus
        if name not in self._prepared and not queue.pending:
            self._prepare(name)
        if name == self._last_name and _same_args(args, self._last_args):
            # the op its guest submitted last, on the same buffers and sizes (a GEMM loop's): its plan
            # and byte count again (a plan is a function of the backend and the arguments alone)
            p, nbytes = self._last_plan, self._last_nbytes
        else:
            nbytes = sum(a.nbytes for a in args if isinstance(a, DeviceBuffer))
            p = plan(name, self.backend, args)
            self._last_name, self._last_args, self._last_plan, self._last_nbytes = name, args, p, nbytes
        now = time.monotonic_ns()
        if self._submit_at:
            gap = now - self._submit_at
            self._submit_gap_ns += (gap - self._submit_gap_ns) >> _EWMA_SHIFT if self._submit_gap_ns else gap
        self._submit_at = now
        est = int(self.costs.predict_ns(name, p, p.units)) if p is not None else -1
        small = p is not None and p.combine is None and 0 <= est <= self.chunk_ns // _SMALL_DIV
        try:
            queue.submit(_Item(name, fn, args, deadline_ns, nbytes, now, queue.own_busy_ns, p, est, True,
                               est if small else _NOT_SMALL))
        except KernelTimeout as exc:
            raise self._refuse(exc) from None

    def _prepare(self, name: str) -> None:
        """The backend loads what op ``name`` loads on first use (kernels, a BLAS handle) before the
        lease is taken for it (:meth:`Backend.prepare`), once per op kind; only with nothing queued
        (the device thread is not using the backend meanwhile). A failed load is left to the op: it
        fails again there, where its error is reported, as it did without this."""
        if name in self._prepared:
            return
        self._prepared.add(name)
        try:
            self.backend.prepare(name)
        except Exception:  # noqa: BLE001 - see the docstring: the op reports it
            pass

    def sync(self, deadline_ns: int | None = None, *, run_end: bool = False) -> None:
        """Wait for every queued op; raise a queued op's error (once). The wait ends at the deadline
        plus :data:`QUEUE_GRACE_S` at most (the deadline is checked before every queued chunk, so
        only a chunk in flight runs past it): :class:`QueueOverrun` beyond. ``run_end``: the guest
        returned - no op of this run follows, so the stretch that drains the queue passes the device
        on itself (as for :meth:`release`), not once this thread has woken and reached ``release``."""
        queue = self.queue
        if queue is None:
            return
        if not self._drain(queue, deadline_ns, run_end=run_end):
            raise QueueOverrun(QUEUE_GRACE_S, message="queued device work still running past the run's deadline")

    def _drain(self, queue: DeviceQueue, deadline_ns: int | None, *, run_end: bool, raise_error: bool = True) -> bool:
        """Wait for ``queue``'s ops until the deadline plus :data:`QUEUE_GRACE_S` (False: still
        running then). ``run_end``: no op of this run follows - the stretch that drains the queue
        passes the device on itself (``_run_ending``, read by the device thread at an op's end)."""
        bound = None if deadline_ns is None else deadline_ns + int(QUEUE_GRACE_S * 1e9)
        self._run_ending = run_end
        try:
            return queue.sync(bound, raise_error=raise_error)
        finally:
            self._run_ending = False

    def _op(self, name: str, fn: Callable[..., object], args: tuple[object, ...], deadline_ns: int | None,
            run: Callable[..., tuple[int, int, object]], wait0: int = 0, planned: Plan | None | bool = False) -> object:
        p = plan(name, self.backend, args) if planned is False else cast("Plan | None", planned)
        if p is None:
            self._chunk = (name, None, 0)
            ns, waited, result = run(fn, args, deadline_ns, last=True, op=name)
            self.block.observe_gpu_wait(wait0 + waited)
            return result
        call = p.call or fn
        costs = self.costs
        lo = 0
        wait = wait0
        results: list[object] = []
        while lo < p.units:
            hi = lo + costs.units_for(name, p, self.chunk_ns, p.units - lo)
            self._chunk = (name, p, hi - lo)
            if lo == 0 and hi >= p.units and p.call is None and p.combine is None:
                # one chunk: the op on its own arguments (the views of a chunk [0, units) name the same
                # memory; making them was a few us of this thread's Python per GEMM, the device idle)
                ns, waited, got = run(fn, args, deadline_ns, last=True, op=name)
            else:  # (a chunk's arguments are the op's own, in its order, unless it has a call of its own)
                ns, waited, got = run(call, p.chunk(lo, hi), deadline_ns, last=hi >= p.units,
                                      op="" if p.call is not None else name)
            wait += waited
            costs.observe(name, p, hi - lo, ns)
            if p.combine is not None:
                results.append(got)
            lo = hi
        self.block.observe_gpu_wait(wait)
        return p.combine(results) if p.combine is not None else None

    # ------------------------------------------------------------ the device thread

    def _queued_items(self, items: list[_Item]) -> tuple[int, BaseException | None]:
        """The device thread's turn: every op queued when it looked, in order (the queue's runner).
        Before a small op the lease is taken first (:meth:`_hold`), then what was queued meanwhile is
        taken too; a run of small ops (:meth:`_small_run`) goes to the device as one launch
        (:meth:`_queued_batch`), any other op alone (:meth:`_queued`), which takes the lease at its
        launch - its plan and first chunk made before the wait, not after it while the device idles.
        Returns (ops run whole, the error of the next or None)."""
        queue = self.queue
        assert queue is not None
        small = self.chunk_ns // _SMALL_DIV
        i = 0
        while i < len(items):
            if not self._held_since and 0 <= items[i].est <= small and self._scheduling_board() is not None:
                try:
                    self._hold(items[i].deadline_ns)
                except BaseException as exc:  # noqa: BLE001 - refused: the op's own error
                    self.failed_op = items[i].name
                    return i, exc
                queue.take_more(items)  # what the guest queued during the wait joins this stretch
            if items[i].small_est == _NOT_SMALL:
                ran, err = self._queued_run(items, i)
                if err is not None:
                    return i + ran, err
                if ran:
                    i += ran
                    self._completed(queue, i)
                    continue
            batch = self._small_run(items, i)
            self._pass_end = i + max(1, batch) >= len(items) and (
                batch >= 1 or 0 <= items[i].est <= small)  # (cuda: small ops launch alone)
            t0 = time.monotonic_ns()
            w0 = self._lease_wait_ns
            try:
                if batch > 1:
                    self._queued_batch(items[i:i + batch])
                else:
                    self._queued(items[i])
            except BaseException as exc:  # noqa: BLE001 - the queue keeps it for the next sync
                return i + (self._batch_ran if batch > 1 else 0), exc
            finally:
                # one writer: this thread; a lease wait at the launch is no time running this worker's ops
                queue.own_busy_ns += time.monotonic_ns() - t0 - (self._lease_wait_ns - w0)
            i += max(1, batch)
            self._completed(queue, i)
        return len(items), None

    def _completed(self, queue: DeviceQueue, launched: int) -> None:
        """Room in the queue as the pass's ops complete (:meth:`DeviceQueue.completed`): of its first
        ``launched`` ops, those whose chunks are no longer on the device - each chunk launched and not
        yet run (the stub's executor) or not settled (cuda's pending timer) may be one more op not
        complete, so an op counts complete only once every chunk launched before its end has."""
        executor = self._executor
        if executor is not None:
            launched -= executor.running
        elif self._pending_timer is not None:
            launched -= self._pending_timer.pending
        queue.completed(launched)

    def _queued_run(self, items: list[_Item], i: int) -> tuple[int, BaseException | None]:
        """A run of consecutive big queued ops of one kind and shape from ``items[i]`` on, each one
        chunk, on a host-synchronous timer (the stub): one lean loop. Per op
        only what the op needs - its deadline, its launch timed, the lease's boundary (the same rule
        as :meth:`_run_queued`'s) - and per run what was per op before: the cost model learns the
        run's mean once, the ops' waits are observed in one call, the op-length average moves once.
        Between two GEMMs of a busy worker the device (the stub: this thread) idled for this thread's
        own Python, ~35 us an op through :meth:`_queued`. Returns (ops run whole, the error of the next
        or None); (0, None) when ``items[i]`` does not start such a run (the caller runs it alone).
        The lease is taken at each launch that does not hold it, as :meth:`_run_queued` takes it; the
        run stops where an op does not fit and past a deadline (the op path refuses it). With the stub's
        executor each op is launched (pending until settled, the driver kept within its run-ahead) and
        the boundary counts the launched work's estimate where that is more than the time held."""
        first = items[i]
        p = first.plan
        if (p is None or not first.planned or p.call is not None or p.combine is not None
                or (self._pending_timer is not None and self._executor is None) or self._run_refused is not None):
            return 0, None
        board = self._scheduling_board()
        if board is not None and board.trace is not None:
            return 0, None  # (the handover trace stamps every launch: the op path does)
        qtimer = self._queue_timer()
        executor = self._executor  # the stub's executor: each GEMM launched, pending until settled
        if self._pending_timer is not None and executor is None:
            return 0, None
        name, shape, units = first.name, p.shape, p.units
        costs = self.costs
        if costs.units_for(name, p, self.chunk_ns, units) < units:
            return 0, None  # more than one chunk: the chunk loop (_queued)
        queue = self.queue
        assert queue is not None
        serial = self._serial_fd() if board is None else -1
        work = self._work
        mono = time.monotonic_ns
        waits: list[int] = []
        total = 0
        j = i
        end = len(items)
        own = queue.own_busy_ns
        self._chunk = (name, p, units)
        self._pass_end = False
        error: BaseException | None = None
        est = first.est if first.est >= 0 else self.chunk_ns
        launches = 0
        run_ahead = self.chunk_ns * _RUN_AHEAD_CHUNKS if board is not None else 0
        while j < end:
            it = items[j]
            ip = it.plan
            if j > i and (ip is None or it.name != name or ip.units != units or ip.shape != shape
                          or ip.call is not None or ip.combine is not None):
                break
            start = mono()
            dl = it.deadline_ns
            if dl is not None and start > dl:
                break  # refused by the op path (it ends the stretch first)
            wait = max(0, start - it.submit_ns - (own - it.own_busy_ns))
            waited = ns = now = 0
            gated = None
            try:
                if not self._held_since:
                    # a boundary gave the lease up: taken back at the launch, as _run_queued does (its
                    # fast path while still ours; a wait, this op's, when the device went on - the GEMM
                    # launched before it, started by the executor at the grant: _GatedChunk)
                    if board is not None:
                        gated = self._gate(name, it.args) if executor is not None else None
                        waited = self._acquire(board, dl, gated)
                        self._lease_wait_ns += waited
                        self.run_wait_ns += waited
                        self._held_board = True
                    self._held_since = mono()
                if serial >= 0:
                    fcntl.flock(serial, fcntl.LOCK_EX)
                launched = mono() if work is not None else 0
                went = False
                try:
                    if executor is None:
                        ns = qtimer.time(it.fn, *it.args)
                    else:
                        if gated is not None and gated.runs:
                            went = True  # launched before the wait, started at the grant
                        else:
                            if self._unsettled:
                                self._ahead(executor, run_ahead)
                                if executor.full():
                                    self._settle()
                            went = executor.launch(name, it.args)
                        if not went:
                            ns = qtimer.time(it.fn, *it.args)
                        elif serial >= 0:
                            executor.drain()  # the scheduler off: one op at a time per device, in the flock
                finally:
                    if serial >= 0:
                        fcntl.flock(serial, fcntl.LOCK_UN)
                    if went:
                        launches += 1
                        self._unsettled.append((name, p, units, est))
                        self._unsettled_est_ns += est
                        if work is not None:
                            self._unsettled_at.append(launched)
                    elif work is not None:
                        self._busy(work, launched, ns, False)
                    self.chunks += 1
                    self.run_time_ns += ns
                    self._pending_ns += ns
                    total += ns
                    now = mono()
                if executor is None:
                    self._boundary(board, now - self._held_since, last=True, pending=False)  # (_pass_end: False)
                else:
                    # (a run-ahead deeper than the half chunk: its launches not started are withdrawn
                    # where the device goes on - _flush)
                    self._withdraw_max = min(launches, len(self._unsettled)) if run_ahead else 0
                    self._boundary(board, max(now - self._held_since, self._unsettled_est_ns), last=True,
                                   pending=bool(self._unsettled))
            except BaseException as exc:  # noqa: BLE001 - the op's own error (kept by the queue)
                self.failed_op = it.name
                error = exc
            finally:
                own += (now if now else mono()) - start - waited
                queue.own_busy_ns = own  # one writer: this thread (the submitter reads it)
                self._withdraw_max = 0
            back, self._withdrawn = self._withdrawn, 0
            if error is not None:
                if back:  # (withdrawn, then the boundary failed: they never ran)
                    j = max(i, j + 1 - back)
                    del waits[j - i:]
                    launches = min(launches, j - i)
                break
            waits.append(wait + waited)
            j += 1
            if back:
                # the device went on at that boundary and the newest launches had not started: they
                # run again from the first of them, after the next grant (their waits the next ones')
                j -= back
                launches -= back
                self.chunks -= back
                del waits[len(waits) - back:]
            # room in the queue for the ops complete: the guest queues the rest of its run meanwhile
            queue.completed(j - executor.running if executor is not None else j)
        ran = j - i
        if ran:
            timed = ran - launches  # (launched ones: the cost model learns each at the settle)
            per = total // timed if timed else est
            if timed:
                costs.observe(name, p, units, per)
            self._op_dev_ns += (per - self._op_dev_ns) >> _EWMA_SHIFT if self._op_dev_ns else per
        if waits:
            self.block.observe_gpu_waits(waits)
        return ran, error

    def _hold(self, deadline_ns: int | None) -> None:
        """The lease for the stretch ahead, before its ops are looked at: the guest's ops queued
        during the wait run in the same stretch (a run of small ones as one launch). An op refused
        already, or past its deadline, is left to refuse itself; a refusal here is the op's."""
        board = self._scheduling_board()
        if board is None or self._held_since or self._run_refused is not None or (
                deadline_ns is not None and time.monotonic_ns() > deadline_ns):
            return
        waited = self._acquire(board, deadline_ns)
        self._lease_wait_ns += waited
        self._held_since = time.monotonic_ns()
        self._held_board = True
        self.run_wait_ns += waited

    def _small_run(self, items: list[_Item], i: int) -> int:
        """How many ops from ``items[i]`` on are small enough to go to the device as one launch: each
        one whose cost model estimate is under 1/:data:`_SMALL_DIV` of a chunk (so it is one chunk),
        together under 1/:data:`_BATCH_DIV` of one (the preemption bound holds for the batch); their
        plans and estimates are kept in ``_batch_plans``. The launch of a small op is mostly this
        thread's own per-op work (planning, timing, charging: ~15 us for a 1 us fill), and a chatty
        tenant's stretch held the device idle for it. Only where a chunk's time is known when it
        returns (the stub): cuda's event pairs name the op that faulted, one pair per op."""
        self._batch_plans = []
        budget = self.chunk_ns // _BATCH_DIV
        if items[i].small_est > budget:
            return 0  # (a big op, planned by its submitter: the common case of a GEMM loop, no walk)
        if self._run_refused is not None or (
                self._queue_timer() is self._pending_timer and self._executor is None):
            return 0  # (the stub's executor runs a batch on the driver, host-synchronous: its time known)
        small = self.chunk_ns // _SMALL_DIV
        costs = self.costs
        j = i
        end = min(len(items), i + MAX_QUEUED_OPS)
        ests = [item.small_est for item in items[i:end]]
        if ests and min(ests) >= 0:
            # planned by their submitters (every submit): the batch's end by C loops, not a Python walk
            # - after a handover the device waits for this thread, cold, to reach its launch
            return bisect.bisect_right(list(itertools.accumulate(ests)), budget)  # (plans: _learn_batch)
        while j < end:
            item = items[j]
            p, est = item.plan, item.est
            if not item.planned:
                p = plan(item.name, self.backend, item.args)
                est = int(costs.predict_ns(item.name, p, p.units)) if p is not None else -1
            if p is None or p.combine is not None or est > small or est > budget:  # (small: one launch whole)
                break
            budget -= est
            self._batch_plans.append((p, est))
            j += 1
        return j - i

    def _queue_timer(self) -> OpTimer:
        """The timer of queued chunks (made on first use; ``_pending_timer`` too where it is one)."""
        if self._qtimer is None:
            self._qtimer = timer = self.backend.queue_timer()
            self._pending_timer = timer if isinstance(timer, PendingTimer) else None
            self._executor = timer if isinstance(timer, ExecutorTimer) else None
            if self._executor is not None and self._executor.thread_id:
                # the stub's device: back from its wait for a launch, it preempts what runs on its core
                short_slice(DEVICE_SLICE_NS, self._executor.thread_id)
            cpus = self.device_cpus
            if cpus is not None and self.backend.device_executor:
                # the device's core (pin_device): the executor's thread; without one (not built, no BLAS
                # found) the device thread itself, which the queue left on the worker's CPUs
                tid = self._executor.thread_id if self._executor is not None else 0
                if tid is not None:
                    _pin(tid, cpus)
        return self._qtimer

    def _queued_batch(self, items: list[_Item]) -> None:
        """Small queued ops (:meth:`_small_run`) as one launch: one lease check, one measurement, one
        flush decision, each op its own function on its own arguments in order. Each op's wait is
        observed (from when it was ready to the launch); the batch's device time is charged whole.
        An op that raises ends the batch: the ops before it ran (``_batch_ran``), the rest are dropped."""
        queue = self.queue
        assert queue is not None
        self._batch_ran = 0
        if self._run_refused is not None:
            raise self._refuse(KernelTimeout(0.0, message=str(self._run_refused)))
        started = 0

        def launch() -> None:
            nonlocal started
            started = time.monotonic_ns()
            for it in items:
                it.fn(*it.args)
                self._batch_ran += 1

        deadlines = [it.deadline_ns for it in items if it.deadline_ns is not None]
        self._chunk = (items[0].name, None, 0)
        own = queue.own_busy_ns
        try:
            ns, _, _ = self._run_queued(launch, (), min(deadlines) if deadlines else None, last=True)
        except BaseException:
            if self._batch_ran < len(items):
                self.failed_op = items[self._batch_ran].name
            raise
        finally:
            if started:
                self.block.observe_gpu_waits(
                    [max(0, started - it.submit_ns - (own - it.own_busy_ns)) for it in items])
        self.chunks += len(items) - 1  # launches, as one op each would count
        self._learn_batch(items, ns)
        per = ns // len(items)
        self._op_dev_ns += (per - self._op_dev_ns) >> _EWMA_SHIFT if self._op_dev_ns else per

    def _learn_batch(self, items: list[_Item], ns: int) -> None:
        """The cost model learns from a batch: its device time shared by the ops' estimates, one
        observation per op and shape (a batch of one shape is one observation of all its units)."""
        plans = self._batch_plans or [(it.plan, it.est) for it in items if it.plan is not None]
        total = sum(est for _, est in plans)
        if ns <= 0 or total <= 0 or len(plans) != len(items):
            return
        groups: dict[tuple[str, tuple[int, ...]], tuple[Plan, int, int]] = {}
        for it, (p, est) in zip(items, plans):
            key = (it.name, p.shape)
            first, units, share = groups.get(key, (p, 0, 0))
            groups[key] = (first, units + p.units, share + est)
        for (name, _), (p, units, share) in groups.items():
            self.costs.observe(name, p, units, ns * share // total)

    def _linger(self) -> bool:
        """Whether the device thread, its queue empty, waits for the guest's next op before the
        stretch ends: not while another worker waits for a worker whose ops come far apart (it lends
        at the stretch's end anyway: the wait would only hold the device idle)."""
        board = self._scheduling_board()
        if board is None or not self._held_board:
            return True
        gap = self._submit_gap_ns
        return not (gap > _LEND_GAP_NS and gap > _LEND_RATIO * self._op_dev_ns and board.others_waiting())

    def _lend_after_pass(self) -> bool:
        """Whether the stretch ends after a pass with ops still queued: the pass ended with small ops
        of a worker that would not linger (:meth:`_linger`: its ops come far apart, another worker
        waits). A chatty tenant's guest queues an op or two during each pass; a stretch that went on
        through them held the device for a few us of work per pass, pass after pass. A worker of
        bigger ops keeps its stretch through them (their device work is the stretch)."""
        return self._pass_end and not self._linger()

    def _queued(self, item: _Item) -> None:
        """A queued op on the device thread. Its wait: from when it was ready (submitted, and the
        worker's own earlier ops done) to its start, the lease wait of its first chunk included."""
        queue = self.queue
        assert queue is not None
        ready_wait = max(0, time.monotonic_ns() - item.submit_ns - (queue.own_busy_ns - item.own_busy_ns))
        try:
            if self._run_refused is not None:
                raise self._refuse(KernelTimeout(0.0, message=str(self._run_refused)))
            before = self.run_time_ns + self._unsettled_est_ns  # pending chunks: their estimates
            self._op(item.name, item.fn, item.args, item.deadline_ns, self._run_queued, wait0=ready_wait,
                     planned=item.plan if item.planned else False)
            ns = max(0, self.run_time_ns + self._unsettled_est_ns - before)
            self._op_dev_ns += (ns - self._op_dev_ns) >> _EWMA_SHIFT if self._op_dev_ns else ns
        except BaseException as exc:
            if exc is not self._settle_error:  # a settle's fault names the chunk that failed
                self.failed_op = item.name
            raise

    def _run_queued(self, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None, *,
                    last: bool, op: str = "") -> tuple[int, int, T | None]:
        """One chunk of a queued op inside the stretch: the lease is acquired only when not already
        held busy; the board hears of it (:meth:`_flush`) once ~a chunk's time has passed since,
        or at the stretch's end (:meth:`_end_stretch`). ``op``: the op's name when ``args`` are its
        own arguments in its own order (a chunk of it): the stub's executor may launch it
        (``worker.backends.stub_executor``), else it runs through the timer."""
        if deadline_ns is not None and time.monotonic_ns() > deadline_ns:
            self._flush(last=True)
            raise self._refuse(KernelTimeout(0.0, message="the run's deadline passed with device work queued"))
        board = self._scheduling_board()
        qtimer = self._queue_timer()
        self._stretch_deadline_ns = deadline_ns
        pending = self._pending_timer
        if pending is not None and pending.full():
            self._settle()  # a full ring settles early (no board boundary)
        before = pending.pending if pending is not None else 0
        result: list[T] = []
        ns = 0
        serial = self._serial_fd() if board is None else -1
        waited = 0
        # the lease last, right before the launch: whatever this thread does after the grant, the device
        # waits for (after a handover the thread runs cold, on a core it had to win)
        gated = None
        if board is not None and not self._held_since:
            gated = self._gate(op, args)  # (the stub's executor: the chunk launched before the wait)
            waited = self._acquire(board, deadline_ns, gated)
            self._lease_wait_ns += waited
            self._held_since = time.monotonic_ns()
            self._held_board = True
        elif not self._held_since:
            self._held_since = time.monotonic_ns()
        self.run_wait_ns += waited
        if serial >= 0:
            fcntl.flock(serial, fcntl.LOCK_EX)
        trace = board.trace if board is not None else None
        if trace is not None and board is not None:
            trace.launch(board.worker_slot or 0, time.monotonic_ns())
        work = self._work
        launched = time.monotonic_ns() if work is not None else 0
        executor = self._executor
        prelaunched = gated is not None and gated.runs
        if executor is not None and op and self._unsettled and not prelaunched:
            self._ahead(executor)
        try:
            if executor is not None and op and (prelaunched or executor.launch(op, args)):
                if serial >= 0:
                    executor.drain()  # the scheduler off: one op at a time per device, inside the flock
            else:
                ns = qtimer.time(lambda: result.append(fn(*args)))
        finally:
            if trace is not None:
                trace.chunk_end = time.monotonic_ns()
            if serial >= 0:
                fcntl.flock(serial, fcntl.LOCK_UN)
            if work is not None:
                self._busy(work, launched, ns, pending is not None and pending.pending > before)
            self.chunks += 1
            self.run_time_ns += ns
            self._pending_ns += ns
            held = time.monotonic_ns() - self._held_since
            is_pending = pending is not None
            if pending is not None:
                # launches return in microseconds: what is held is the device work pending, the
                # cost model's estimate of the unsettled chunks (an op it cannot split: a whole chunk)
                if pending.pending > before:
                    name, p, units = self._chunk
                    est = self.chunk_ns if p is None else int(self.costs.predict_ns(name, p, units))
                    self._unsettled.append((name, p, units, est))
                    self._unsettled_est_ns += est
                if executor is None:
                    held = self._unsettled_est_ns
                else:
                    # the stub's executor: the driver is at most a ring ahead, and its host-synchronous
                    # ops run here - the time held, or the launched work's estimate where that is more
                    held = max(held, self._unsettled_est_ns)
                    is_pending = bool(self._unsettled)
            self._boundary(board, held, last=last, pending=is_pending)
        return ns, waited, result[0] if result else None

    def _ahead(self, executor: ExecutorTimer, limit: int = 0) -> None:
        """The stub's executor: how far the driver runs ahead. Before a launch, the chunks launched and
        not yet run may hold at most 1/:data:`_AHEAD_DIV` of a chunk by their estimates (at least the
        one running): a boundary that passes the device on waits for them (the preemption bound is
        one chunk and that), while the next launch is already queued when the running one ends.
        ``limit``: a deeper bound (ns of estimates), where a boundary that passes the device on
        withdraws the launches not yet started (a run of big ops: :data:`_RUN_AHEAD_CHUNKS`)."""
        limit = max(limit, self.chunk_ns // _AHEAD_DIV)
        while True:
            running = executor.running
            if running < 2:
                return
            ests = [e for *_, e in self._unsettled[-running:]]
            total = sum(ests)
            if total < limit:
                return
            if _AHEAD_SLEEP:
                # asleep for the estimated time until the chunks after the running one hold half the
                # bound, on a timer of this thread's own core: the executor's wake-up at a count of
                # chunks left was a syscall of the device's between two of its chunks (a futex wake,
                # across CPUs in a VM an interrupt: 10-20 us, one per two or three chunks traced).
                # The executor still wakes it where the last launched chunk starts (estimates too
                # long: the queue would run dry); an early wake only looks again
                sleep = max(total - ests[0] - limit // 2, _AHEAD_SLEEP_MIN_NS)
                executor.wait_below(1, time.monotonic_ns() + sleep)
                continue
            # asleep until the newest chunks left hold under half the bound (at least one left): one
            # wake-up per few chunks, each a syscall of the executor's between two chunks, not one each
            left = bisect.bisect_left(list(itertools.accumulate(reversed(ests))), limit // 2)
            executor.wait_below(max(1, min(left, running - 1)))

    def _boundary(self, board: GpuTimeBoard | None, held: int, *, last: bool, pending: bool) -> None:
        """A chunk boundary of a queued launch (:meth:`_run_queued`'s and :meth:`_queued_run`'s):
        whether the board hears of the stretch now (:meth:`_flush`), lends the device, or - its last
        answer still holding - is not asked. ``held``: ns held busy (with ``pending``, asynchronous
        launches, the estimate of the unsettled chunks); ``last``: the op's last chunk."""
        # a boundary every ~chunk held; a quarter of that while another worker waits (its claim is
        # served at the first boundary after it is due: a boundary costs a few us)
        waiting = board is not None and held >= self.chunk_ns // 4 and board.others_waiting()
        if last and board is not None and ((
                waiting and not pending and self._pending_ns * _LEND_BUSY_DIV < held) or (
                self._lend_after_pass())):
            # the device mostly idle under this stretch: its pace is the worker's host side (a
            # chatty tenant's ops arriving as fast as this thread runs them), not device work;
            # or a chatty worker's pass ends (DeviceGate._lend_after_pass): lent here, before the
            # pass's bookkeeping (waits observed, costs learnt)
            self._flush(last=True, idle=True)
        elif not last or held >= self.chunk_ns:
            self._flush(last=False)
        elif waiting:
            if board is not None and board.quiet():
                # the board's last answer holds (no claim due, the quantum not over): asking the
                # policy again at every GEMM's end cost the device thread 10-20 us each, the device
                # idle; the next boundary tells it where its last chunk began
                self._quiet_at = time.monotonic_ns()
            else:
                self._flush(last=False)

    def _flush(self, *, last: bool, idle: bool = False) -> None:
        """Tell the board and the quota block what ran since the last flush (a chunk boundary:
        the board may hand the device over); ``last``: the stretch ended; ``idle``: nothing is queued
        behind it (the board lends the device to a waiter now)."""
        if not self._held_since:
            if self._unsettled:
                self._drain_carried()
            return
        board = self.board if self._held_board else None
        # the stub's executor: the board hears of what already ran, the launched chunks run on, waited
        # for after it where the device went on or the stretch ended, and charged then (a drain before
        # every boundary idled the device for the driver's wake, the board's call and the next launch;
        # before a stretch's end, the grantee's first launch waited for the giver's drain)
        soft = self._executor is not None and board is not None
        error: BaseException | None = None
        try:
            self._settle(wait=not soft)  # (cuda) the lease moves only once this worker's pending work is complete
        except KernelTimeout:
            raise  # overran: the work may still run, so the stretch keeps the lease until the exit
        except Exception as exc:  # noqa: BLE001 - a fault: charged what settled, the board told, then raised
            error = exc
        pending = self._pending_ns
        self._held_since = self._pending_ns = 0
        self.block.charge_gpu_time(pending)
        # the board that granted the stretch hears of its end even if the scheduler was switched off since
        self._held_board = False
        chunk_from, self._quiet_at = self._quiet_at, 0
        if board is not None:
            gave = board.finish(pending, last=last, idle=idle, chunk_from=chunk_from)
            if gave and self._withdraw_max and self._executor is not None:
                self._withdraw()
            if self._unsettled and (gave or last):
                # the grantee's first launch may start beside them: at most the driver's run-ahead
                # (DeviceGate._ahead), each chunk charged its own executor's CPU time; at the stretch's
                # end the board is told the rest before the flush returns (GpuTimeBoard.charge)
                self._drain_carried()
            if gave and board.throttled_wait_ns():
                # (no sched_yield after a handover: on a host loaded past its cores it hands the giver's
                # slice to any runnable process and the giver asks again late - GPU-QUOTAS.md)
                self.block.count_gpu_throttled()
        if error is not None:
            raise error

    def _withdraw(self) -> None:
        """The device went on at a boundary of a run of big ops: its newest launches not yet started are
        taken back from the executor (at most ``_withdraw_max``: never a chunk of an earlier op path),
        so that the grantee waits for the running chunk only; the run launches them again
        (``_withdrawn``)."""
        executor = self._executor
        assert executor is not None
        back = executor.withdraw(self._withdraw_max)
        self._withdraw_max = 0
        if not back:
            return
        self._withdrawn = back
        del self._unsettled[len(self._unsettled) - back:]
        if self._work is not None:
            del self._unsettled_at[len(self._unsettled_at) - back:]
        self._unsettled_est_ns = sum(est for *_, est in self._unsettled)

    def _drain_carried(self) -> None:
        """Chunks a soft boundary (:meth:`_flush`) left running when the device went on (or the stretch
        ended without the lease): waited for here, and charged at once - the block, and the board
        without touching the lease (``GpuTimeBoard.charge``)."""
        before = self._pending_ns
        self._settle()
        ran = self._pending_ns - before
        self._pending_ns = before
        self.block.charge_gpu_time(ran)
        board = self.board
        if board is not None and ran > 0:
            board.charge(ran)

    def _settle(self, *, wait: bool = True) -> None:
        """An asynchronous queue timer's pending chunks: wait for them (bounded by the run's
        deadline plus :data:`QUEUE_GRACE_S`; past it the timer raises the backend's queue overrun),
        add their device time to what the next flush charges, let the cost model learn each. A
        fault names the first chunk that failed (``failed_op``) and is raised. ``wait`` False (the
        stub's executor only): the chunks that already ran, the rest left pending."""
        timer = self._pending_timer
        if not self._unsettled or timer is None:
            return
        deadline = self._stretch_deadline_ns
        try:
            if not wait and self._executor is not None:
                times, error = self._executor.collect_done(), None
            else:
                times, error = timer.settle(None if deadline is None else deadline + int(QUEUE_GRACE_S * 1e9))
        except KernelTimeout:
            self.queue_overrun = True
            raise
        done, self._unsettled = self._unsettled[:len(times)], self._unsettled[len(times):]
        if self._work is not None:
            self._busy_settled(self._work, times)
        total = 0
        for (name, p, units, _), ns in zip(done, times):
            if p is not None:
                self.costs.observe(name, p, units, ns)
            total += ns
        self.run_time_ns += total
        self._pending_ns += total
        if error is not None:
            if self._unsettled:
                self.failed_op = self._unsettled[0][0]
            self._unsettled = []
            self._unsettled_at = []
            self._settle_error = error
        self._unsettled_est_ns = sum(est for *_, est in self._unsettled)
        if error is not None:
            raise error

    def _busy(self, work: WorkTrace, launched: int, ns: int, pending: bool) -> None:
        """The work trace's rows of a launch that just returned: its wall span, and its charged time
        ending at the launch's end (a host-synchronous timer: the stub's CPU time, a sync op's
        events) - or, for a chunk pending on the stream (``pending``), its launch stamp, kept until
        the settle."""
        if pending:
            self._unsettled_at.append(launched)
            return
        end = time.monotonic_ns()
        if ns > 0:
            work.add(WorkTrace.LAUNCH, launched, end, WorkTrace.BUSY, max(launched, end - ns), end)
        else:
            work.add(WorkTrace.LAUNCH, launched, end)

    def _busy_settled(self, work: WorkTrace, times: list[int]) -> None:
        """The busy rows of settled chunks (``times``, in launch order): each placed on the stream at
        its launch or the previous chunk's end, whichever is later, and ending by the settle's return
        (it waited for them all)."""
        now = time.monotonic_ns()
        stamps, self._unsettled_at = self._unsettled_at[:len(times)], self._unsettled_at[len(times):]
        executor = self._executor
        if executor is not None and len(executor.spans) == len(times):
            # the stub's executor stamped each chunk itself: its wall span (a launch row, as a
            # host-synchronous launch's) and its charged CPU time ending at its end - on the device's
            # one CPU (every worker's executor there: no two ran at once) a CORE row, laid end to end
            # with the others by the reader
            cpus = self.device_cpus
            kind = WorkTrace.CORE if cpus is not None and len(cpus) == 1 else WorkTrace.BUSY
            for start, end, ns in executor.spans:
                if ns > 0:
                    work.add(WorkTrace.LAUNCH, start, end, kind, max(start, end - ns), end)
                else:
                    work.add(WorkTrace.LAUNCH, start, end)
                self._busy_end = max(self._busy_end, end)
            return
        prev = self._busy_end
        for launched, ns in zip(stamps, times):
            start = max(launched, prev)
            end = min(start + ns, now)
            if ns > 0:
                work.add(WorkTrace.BUSY, min(start, end), end)
            prev = max(prev, end)
        self._busy_end = prev

    def _end_stretch(self) -> None:
        """The queue ran empty: the stretch ends. A worker whose ops come far apart next to their
        device time (a chatty tenant: 20 us ops, 0.1-1 ms of host work between them) lends the
        device to a waiter now; one that keeps the device busy (a GEMM loop whose guest thread
        was late) keeps it within its grace, as the board decides for any op's end - lending to
        such tenants at every hiccup of a loaded host turned a 7:3 split into 58:42."""
        gap = self._submit_gap_ns
        idle = gap > _LEND_GAP_NS and gap > _LEND_RATIO * self._op_dev_ns
        board = self.board
        if self._unsettled and not self._held_since:
            # a soft boundary's chunks still running: the lease taken busy again (its fast path: still
            # this worker's), so that the flush below waits for them and tells the board all of it
            # before the device can be lent; else (it went on meanwhile) waited for and carried
            if board is not None and board.scheduler and board.holds():
                try:
                    self._hold(self._stretch_deadline_ns)
                except KernelTimeout:
                    pass
            if not self._held_since:
                self._drain_carried()
        if not self._held_since and board is not None and board.scheduler:
            # its last op ended at a chunk boundary already told (the lease held idle since): the board
            # hears of the op's end now - a lend, or the waiters woken - rather than take it as running
            board.end_op(idle=idle)
        else:
            self._flush(last=True, idle=idle)
        queue = self.queue
        if self._run_ending and board is not None and board.scheduler and (
                queue is not None and not queue.pending) and board.holds():
            # the run's last op is done and its guest waits in release(): the device goes on now, as
            # release() would pass it once its thread woke from that wait (the device idle meanwhile)
            board.release()

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

    def _scheduling_board(self) -> GpuTimeBoard | None:
        """The board to ask, or None: none given, or the scheduler is off (then there is no gate)."""
        board = self.board
        return board if board is not None and board.scheduler else None

    def _gate(self, op: str, args: tuple[object, ...]) -> _GatedChunk | None:
        """The chunk ``op`` (its own arguments) as a gated launch for the lease wait ahead (the stub's
        executor, nothing of this worker's launched and not settled), or None."""
        executor = self._executor
        if executor is None or not op or self._unsettled or not _GATED:
            return None
        return _GatedChunk(executor, op, args)

    def _acquire(self, board: GpuTimeBoard, deadline_ns: int | None, gated: _GatedChunk | None = None) -> int:
        """The lease for a chunk (ns waited); a refusal past the deadline or for the tenant's cap.
        ``gated``: the chunk, launched before the wait if the fast path fails (``gated.runs``: it runs,
        started by the executor under this worker's lease)."""
        if deadline_ns is not None:
            throttled = board.throttled_wait_ns()
            if throttled and time.monotonic_ns() + throttled > deadline_ns:
                raise self._refuse(KernelTimeout(0.0, message=(
                    f"waiting for the device: the tenant's GPU-time cap gives it no time before the "
                    f"run's deadline (next in {throttled / 1e6:.1f} ms)"))) from None
        try:
            return board.acquire(deadline_ns, gated)
        except TimeoutError as exc:
            raise self._refuse(KernelTimeout(0.0, message=f"waiting for the device: {exc}")) from None

    def _run(self, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None, *,
             last: bool, op: str = "") -> tuple[int, int, T | None]:
        """One launch under the lease: (device ns, ns waited for the device, its result); host-synchronous
        (``op``, the op's name, is not used here)."""
        waited = 0
        if self._run_refused is not None:
            raise self._refuse(KernelTimeout(0.0, message=str(self._run_refused)))
        board = self._scheduling_board()
        if board is not None:
            waited = self._acquire(board, deadline_ns)
        self.run_wait_ns += waited
        ns = 0
        result: list[T] = []
        serial = self._serial_fd() if board is None else -1
        if serial >= 0:
            fcntl.flock(serial, fcntl.LOCK_EX)
        trace = board.trace if board is not None else None
        if trace is not None and board is not None:
            trace.launch(board.worker_slot or 0, time.monotonic_ns())
        work = self._work
        launched = time.monotonic_ns() if work is not None else 0
        try:
            ns = self._timer_().time(lambda: result.append(fn(*args)))
        finally:
            if trace is not None:
                trace.chunk_end = time.monotonic_ns()
            if serial >= 0:
                fcntl.flock(serial, fcntl.LOCK_UN)
            if work is not None:
                self._busy(work, launched, ns, False)
            self.chunks += 1
            self.run_time_ns += ns
            self.block.charge_gpu_time(ns)
            if board is not None:
                if board.finish(ns, last=last) and board.throttled_wait_ns():
                    self.block.count_gpu_throttled()
        return ns, waited, result[0] if result else None

    def _serial_fd(self) -> int:
        """With the scheduler off, a backend whose device is this host's CPU (the stub) still runs one
        op at a time per device, as a GPU time-slices its contexts: an ``flock`` on the board's
        /dev/shm file (no board call). -1 for other backends and without a board."""
        board = self.board
        if board is None or not getattr(self.backend, "serial_device", False):
            return -1
        if self._serial == -1:
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

    def release(self, deadline_ns: int | None = None) -> bool:
        """End of a run: its queued work is waited for (bounded as :meth:`sync`; an error nobody
        read is logged), then the device goes to the next tenant. Never raises; False when queued
        work outlived the wait (a queue overrun: the caller must end the worker)."""
        ok = True
        queue = self.queue
        if queue is not None:
            if not self._drain(queue, deadline_ns, run_end=True, raise_error=False):
                ok = False
                self.queue_overrun = True
                log_event(_log, logging.WARNING, "device_time.queue_overrun", pending=queue.pending)
            err = queue.take_error()
            if err is not None and not isinstance(err, KernelTimeout):
                log_event(_log, logging.WARNING, "device_time.queued_op_failed", op=self.failed_op, error=repr(err))
        self._run_refused = None
        self._submit_at = 0  # the time to the next run is no gap between this run's ops
        if self._work is not None:
            self._work.flush()  # a run's rows are on disk when its reply goes out
        if self.queue_overrun:  # (a settle's too: its work may still run on the device)
            ok = False
        if self.board is None or not ok:
            return ok  # an overrun: the device thread may still hold the lease; the process exit frees it
        try:
            if self.board.scheduler:  # off: the board was never asked (a lease taken before a live switch
                self.board.release()  # to off is stolen from once idle past its grace)
        except Exception as exc:  # noqa: BLE001 - a closed board at shutdown: logged
            log_event(_log, logging.WARNING, "device_time.release_failed", error=repr(exc))
        return ok

    def close(self) -> None:
        """Give the device back, free the worker slot, release the timer's events."""
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        if self._serial >= 0:
            os.close(self._serial)
            self._serial = -1
        if self._qtimer is not None:  # (before the board: a gated launch's executor held its mapping)
            self._qtimer.close()
            self._qtimer = self._pending_timer = self._executor = None
        if self.board is not None:
            self.board.close()
            self.board = None
        if self._timer is not None:
            self._timer.close()
            self._timer = None
