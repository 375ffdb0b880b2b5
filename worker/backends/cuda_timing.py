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

Typing: cuda-python's bindings (and the tests' fake driver and cuBLAS) are untyped modules
(mypy: ignore_missing_imports). The handles they give are held as ``object`` and passed back; a
bindings module and what its calls return stay dynamically typed, converted (int(), bytes) where read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shared.log import get_logger, log_event
from worker.backends._driver import Driver

__all__ = ["NO_HOOKS", "CudaEventTimer", "LaunchHooks", "TimerHooks"]

_log = get_logger("worker.cuda_timing")


class LaunchHooks:
    """Called by code that launches device work, around each launch (see the module docstring).
    This base does nothing: what ops see when no timer is running."""

    def launching(self) -> None:
        """A launch is about to be made: the charged interval starts here (its first one)."""

    def launched(self) -> None:
        """A launch was made: the charged interval ends here (so far)."""


NO_HOOKS = LaunchHooks()


class TimerHooks(LaunchHooks):
    """A backend's hooks: forwarded to its current op timer (the kernels outlive timers)."""

    def __init__(self) -> None:
        self.timer: LaunchHooks = NO_HOOKS

    def launching(self) -> None:
        self.timer.launching()

    def launched(self) -> None:
        self.timer.launched()


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
