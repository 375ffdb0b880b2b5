"""CUDA events around each op on the tenant's stream: the device time a tenant is charged.

    cuEventRecord(start, stream) ── op's launches ── cuEventRecord(end, stream)
    cuEventSynchronize(end)        the op is complete: the device lease can pass on
    cuEventElapsedTime(start, end) ms, GPU clock (resolution ~0.5 us)

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

__all__ = ["CudaEventTimer"]

_log = get_logger("worker.cuda_timing")


class CudaEventTimer:
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

    def time(self, fn: Callable[..., object], *args: object) -> int:
        drv = self._drv
        self._current()
        drv.call("cuEventRecord", self._start, self._stream)
        fn(*args)
        drv.call("cuEventRecord", self._end, self._stream)
        drv.call("cuEventSynchronize", self._end)
        ms = drv.call("cuEventElapsedTime", self._start, self._end)
        return max(0, round(float(ms) * 1e6))

    def close(self) -> None:
        for event in (self._start, self._end):
            try:
                self._drv.call("cuEventDestroy", event)
            except Exception as exc:  # noqa: BLE001 - cleanup goes on; logged
                log_event(_log, logging.WARNING, "cuda_timing.close_failed", error=str(exc))
