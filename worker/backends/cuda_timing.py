"""CUDA events around each op's device work on the tenant's stream: the device time a tenant is charged.

    cuEventRecord(start, stream)   right before the op's first launch (``launching``: after the
                                   Python and cuBLAS launch preparation, not before it)
    launches ...                   cuEventRecord(end, stream) right after each (``launched``)
    (the op's own synchronize, a result copied to the host: after the end event, not charged)
    cuEventSynchronize(end)        the op is complete: the device lease can pass on
    cuEventElapsedTime(start, end) ms, GPU clock (resolution ~0.5 us)

An op that launches through neither hook is timed around the whole call (the start recorded before
it, the end after it): correct, only less tight. The kernels and the tensor ops call the hooks
through their backend (``hooks``), which forwards them to its current timer.

The events are made once per worker (``CU_EVENT_DEFAULT``: timing enabled)
and reused; synchronising on the end event makes each op complete before the
lease moves, which is what keeps two tenants' kernels from overlapping in the
accounting. Kept out of ``cuda.py`` so the backend only gains two small
methods (``op_timer``, ``view``).

**Queued ops** (worker.device_time's ``DeviceQueue``: the guest's host code goes on while the
device works) use :class:`CudaStretchTimer` instead: a ring of event pairs, one pair per chunk,
recorded the same way, but nothing is waited for at the chunk - ``time()`` returns 0 (*pending*)
and the gate *settles* the timer at a board boundary (:meth:`CudaStretchTimer.settle`)::

    chunk 1: record(start1) launches record(end1)   time() -> 0, pair pending
    chunk 2: record(start2) launches record(end2)   time() -> 0 ...
    settle(until): poll cuEventQuery(end1), (end2) ... in order (sleeping between polls, never
                   past ``until``), then cuEventElapsedTime of each pair: the chunks' device times

Typing: cuda-python's bindings (and the tests' fake driver and cuBLAS) are untyped modules
(mypy: ignore_missing_imports). The handles they give are held as ``object`` and passed back; a
bindings module and what its calls return stay dynamically typed, converted (int(), bytes) where read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from shared.log import get_logger, log_event
from worker.backends._driver import Driver

__all__ = ["NO_HOOKS", "STRETCH_RING_PAIRS", "CudaEventTimer", "CudaStretchTimer", "LaunchHooks", "TimerHooks"]

_log = get_logger("worker.cuda_timing")
#: event pairs a queue timer holds (made once per worker): at most this many chunks are pending on
#: the device before the gate settles them (a full ring settles early)
STRETCH_RING_PAIRS = 16
#: a settle's polls sleep this long at first, doubling up to the cap (a wait for ~2 ms of queued
#: work then costs ~10 wake-ups and overshoots its end by at most the cap)
_POLL_FIRST_S = 10e-6
_POLL_CAP_S = 200e-6


class LaunchHooks:
    """Called by code that launches device work, around each launch (see the module docstring).
    This base does nothing: what ops see when no timer is running."""

    def launching(self) -> None:
        """A launch is about to be made: the charged interval starts here (its first one)."""

    def launched(self) -> None:
        """A launch was made: the charged interval ends here (so far)."""

    def defers_sync(self) -> bool:
        """True while a queued op runs: a launch must not synchronize (the gate's settle waits)."""
        return False


NO_HOOKS = LaunchHooks()


class TimerHooks(LaunchHooks):
    """A backend's hooks: forwarded to the op timer *of the calling thread* (the kernels outlive
    timers). Per thread because a worker times its synchronous ops on its executor thread and its
    queued ops on its device thread (worker.device_time), each with its own timer."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def timer(self) -> LaunchHooks:
        """The calling thread's timer (NO_HOOKS when it has none)."""
        timer: LaunchHooks = getattr(self._local, "timer", NO_HOOKS)
        return timer

    @timer.setter
    def timer(self, value: LaunchHooks) -> None:
        self._local.timer = value

    def launching(self) -> None:
        self.timer.launching()

    def launched(self) -> None:
        self.timer.launched()

    def defers_sync(self) -> bool:
        return self.timer.defers_sync()


class CudaEventTimer(LaunchHooks):
    """Times ops on one stream with a reused pair of CUDA events."""

    def __init__(self, drv: Driver, stream: object, make_current: Callable[[], None]) -> None:
        self._drv = drv
        self._stream = stream
        self._current = make_current
        make_current()
        self._start = drv.call("cuEventCreate", 0)
        try:
            self._end = drv.call("cuEventCreate", 0)
        except BaseException:
            drv.call("cuEventDestroy", self._start)
            raise
        self._active = False
        self._started = False
        self._ended = False

    def time(self, fn: Callable[..., object], *args: object) -> int:
        drv = self._drv
        self._current()
        drv.call("cuEventRecord", self._start, self._stream)  # moved to the first launch by launching()
        self._active, self._started, self._ended = True, False, False
        try:
            fn(*args)
        finally:
            self._active = False
        if not self._ended:
            drv.call("cuEventRecord", self._end, self._stream)
        drv.call("cuEventSynchronize", self._end)
        ms = drv.call("cuEventElapsedTime", self._start, self._end)
        return max(0, round(float(ms) * 1e6))

    def launching(self) -> None:
        if self._active and not self._started:
            self._started = True
            self._drv.call("cuEventRecord", self._start, self._stream)  # a re-record: the last one counts

    def launched(self) -> None:
        if self._active:
            self._ended = True
            self._drv.call("cuEventRecord", self._end, self._stream)

    def close(self) -> None:
        for event in (self._start, self._end):
            try:
                self._drv.call("cuEventDestroy", event)
            except Exception as exc:  # noqa: BLE001 - cleanup goes on; logged
                log_event(_log, logging.WARNING, "cuda_timing.close_failed", error=str(exc))


class CudaStretchTimer(LaunchHooks):
    """Times queued chunks with a ring of event pairs and reads them only at a settle.

    Made on the worker's device thread (the backend's context made current there first); every
    call comes from that thread. ``time()`` records a pair around the chunk's launches and returns
    0: the chunk is *pending* until :meth:`settle`. The gate settles before it tells the board of
    the chunks (a board boundary) and when the ring is full (:meth:`full`), so the lease never
    moves while this worker's work may still run, yet the host waits once per boundary, not once
    per chunk. Counters for tests and the GPU check: ``settles``, ``queries``, ``pairs_settled``.
    """

    def __init__(self, drv: Driver, stream: object, make_current: Callable[[], None],
                 on_overrun: Callable[[], None], ring: int = STRETCH_RING_PAIRS) -> None:
        if ring < 1:
            raise ValueError(f"a stretch timer needs at least one event pair, not {ring}")
        self._drv = drv
        self._stream = stream
        self._current = make_current
        self._on_overrun = on_overrun
        self._pairs: list[tuple[object, object]] = []
        make_current()
        try:
            for _ in range(ring):
                start = drv.call("cuEventCreate", 0)
                try:
                    end = drv.call("cuEventCreate", 0)
                except BaseException:
                    drv.call("cuEventDestroy", start)
                    raise
                self._pairs.append((start, end))
        except BaseException:
            self.close()
            raise
        self._head = 0  # the oldest pending pair
        self._pending = 0
        self._pair: tuple[object, object] | None = None  # the pair of the chunk running now
        self._started = False
        self._ended = False
        self.settles = 0
        self.queries = 0
        self.pairs_settled = 0

    @property
    def capacity(self) -> int:
        """Event pairs in the ring: the most chunks pending at once."""
        return len(self._pairs)

    @property
    def pending(self) -> int:
        """Chunks timed and not yet settled."""
        return self._pending

    def full(self) -> bool:
        """No free pair: the gate must settle before the next chunk."""
        return self._pending >= len(self._pairs)

    def time(self, fn: Callable[..., object], *args: object) -> int:
        """Run ``fn(*args)`` (its launches) between a new pair's records; 0: its time is pending.
        A pair whose end was recorded is pending even when ``fn`` raised (its launches may run)."""
        if self.full():
            raise RuntimeError("the stretch timer's ring is full: settle it before timing another chunk")
        drv = self._drv
        self._current()
        start, end = self._pairs[(self._head + self._pending) % len(self._pairs)]
        drv.call("cuEventRecord", start, self._stream)  # moved to the first launch by launching()
        self._pair, self._started, self._ended = (start, end), False, False
        try:
            fn(*args)
        finally:
            self._pair = None
            if not self._ended:
                drv.call("cuEventRecord", end, self._stream)
            self._pending += 1
        return 0

    def launching(self) -> None:
        pair = self._pair
        if pair is not None and not self._started:
            self._started = True
            self._drv.call("cuEventRecord", pair[0], self._stream)  # a re-record: the last one counts

    def launched(self) -> None:
        pair = self._pair
        if pair is not None:
            self._ended = True
            self._drv.call("cuEventRecord", pair[1], self._stream)

    def defers_sync(self) -> bool:
        return self._pair is not None

    def settle(self, until_ns: int | None) -> tuple[list[int], BaseException | None]:
        """Wait for the pending chunks, oldest first, and read their device times (ns, in order).

        Polls ``cuEventQuery`` on each pair's end event (sleeping between polls: a blocking
        ``cuEventSynchronize`` could not end at the deadline); past ``until_ns``
        (``time.monotonic_ns``) the work overran: ``on_overrun()`` is called, which raises (the
        worker must exit; the pairs stay pending). A failed query (a launch's fault: sticky) ends
        the settle: it returns the times of the pairs before it and the error - the failing pair
        is the next one, ``len(times)``; every pair is dropped (no time can be read after a fault).
        """
        drv = self._drv
        query = drv.mod.cuEventQuery
        not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
        times: list[int] = []
        if not self._pending:
            return times, None
        self._current()
        self.settles += 1
        pause = _POLL_FIRST_S
        n = len(self._pairs)
        while self._pending:
            start, end = self._pairs[self._head]
            while True:
                self.queries += 1
                (err,) = query(end)
                if not err:
                    break
                if err != not_ready:
                    return times, self._drop(drv.error("cuEventQuery", err))
                if until_ns is not None and time.monotonic_ns() >= until_ns:
                    self._on_overrun()
                    raise RuntimeError("on_overrun returned")  # it raises; never reached
                time.sleep(pause)
                pause = min(pause * 2, _POLL_CAP_S)
            try:
                ms = drv.call("cuEventElapsedTime", start, end)
            except Exception as exc:  # noqa: BLE001 - returned as a query's fault is
                return times, self._drop(exc)
            times.append(max(0, round(float(ms) * 1e6)))
            self._head = (self._head + 1) % n
            self._pending -= 1
            self.pairs_settled += 1
        return times, None

    def _drop(self, exc: BaseException) -> BaseException:
        self._head = (self._head + self._pending) % len(self._pairs)
        self._pending = 0
        return exc

    def close(self) -> None:
        """Destroy the events (pending records complete on their own; the driver frees them then)."""
        try:
            self._current()
        except Exception as exc:  # noqa: BLE001 - cleanup goes on; logged
            log_event(_log, logging.WARNING, "cuda_timing.close_failed", error=str(exc))
        pairs, self._pairs = self._pairs, []
        self._pending = 0
        for pair in pairs:
            for event in pair:
                try:
                    self._drv.call("cuEventDestroy", event)
                except Exception as exc:  # noqa: BLE001 - cleanup goes on; logged
                    log_event(_log, logging.WARNING, "cuda_timing.close_failed", error=str(exc))
