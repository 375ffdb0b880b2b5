"""The worker's side of GPU-time sharing: every device op runs through one :class:`DeviceGate`.

    guest import (matmul_f32, ...) ──► DeviceGate.op(name, fn, args)
        plan (worker.chunks)         long ops cut into chunks of ~2 ms (ns/unit learned per op)
        for each chunk:
            board.acquire(deadline)       the device lease (shared.gpu_time): waits are observed
            timer.time(fn, *chunk)        stub: the op's CPU time while holding; cuda: CUDA events
            block.charge_gpu_time(ns)     the tenant's quota block: status/metrics see it live
            board.finish(ns)              pass/used/cap charged; the quantum may pass the device on
    end of the run ──► DeviceGate.release()   the device goes to the next tenant at once

Without a board (a context made by a test, or a supervisor of an older
layout) ops are still timed and charged, just not scheduled.

Threads: only the worker's executor thread calls the gate (tensor ops run
there), so it keeps no lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from shared.errors import KernelTimeout
from shared.gpu_time import GpuTimeBoard
from shared.log import get_logger, log_event
from shared.quota import QuotaBlock
from worker.backends.base import Backend
from worker.backends.timing import OpTimer
from worker.chunks import plan

__all__ = ["CHUNK_S", "DeviceGate"]

T = TypeVar("T")

_log = get_logger("worker.device_time")

#: the longest a single launch should hold the device (the preemption latency bound)
CHUNK_S = 0.002
#: a first chunk's cost guess (ns per unit), before this worker measured that op: low, so the first is short
_FIRST_NS_PER_UNIT = 0.05


class DeviceGate:
    """Times, charges and (with a board) schedules one worker's device ops."""

    def __init__(self, block: QuotaBlock, backend: Backend, board: GpuTimeBoard | None = None,
                 chunk_s: float = CHUNK_S) -> None:
        self.block = block
        self.backend = backend
        self.board = board
        self.chunk_ns = int(chunk_s * 1e9)
        self._timer: OpTimer | None = None
        #: op name -> learned ns per cost unit (exponential average over chunks)
        self._rate: dict[str, float] = {}
        #: totals of the current run (``GuestRun`` reads and resets them)
        self.run_time_ns = 0
        self.run_wait_ns = 0
        self.chunks = 0

    def _timer_(self) -> OpTimer:
        if self._timer is None:
            self._timer = self.backend.op_timer()
        return self._timer

    def op(self, name: str, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None = None) -> T | None:
        """Run op ``name`` = ``fn(*args)`` on the device, in chunks where it splits (see module doc);
        the result of ``fn`` for an op run whole (a sum), else None."""
        p = plan(name, self.backend, args)
        if p is None:
            ns, waited, result = self._run(fn, args, deadline_ns)
            self.block.observe_gpu_wait(waited)
            return result
        units, cost, chunk = p
        lo = 0
        rate = self._rate.get(name, _FIRST_NS_PER_UNIT)
        target = self.chunk_ns
        wait = 0
        while lo < units:
            step = max(1, int(target / (rate * cost)))
            hi = min(units, lo + step)
            ns, waited, _ = self._run(fn, chunk(lo, hi), deadline_ns)
            wait += waited
            if ns > 0:
                measured = ns / ((hi - lo) * cost)
                rate = measured if name not in self._rate else 0.5 * rate + 0.5 * measured
                self._rate[name] = rate
            lo = hi
        self.block.observe_gpu_wait(wait)
        return None

    def _run(self, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None) -> tuple[int, int, T | None]:
        """One launch under the lease: (device ns, ns waited for the device, its result)."""
        board = self.board
        waited = 0
        if board is not None:
            try:
                waited = board.acquire(deadline_ns)
            except TimeoutError as exc:
                raise KernelTimeout(0.0, message=f"waiting for the device: {exc}") from None
        self.run_wait_ns += waited
        ns = 0
        result: list[T] = []
        try:
            ns = self._timer_().time(lambda: result.append(fn(*args)))
        finally:
            self.chunks += 1
            self.run_time_ns += ns
            self.block.charge_gpu_time(ns)
            if board is not None:
                if board.finish(ns) and board.throttled_wait_ns():
                    self.block.count_gpu_throttled()
        return ns, waited, result[0] if result else None

    def take_run_totals(self) -> tuple[int, int]:
        """(device ns, wait ns) since the last call: one run's figures for its reply."""
        out = (self.run_time_ns, self.run_wait_ns)
        self.run_time_ns = self.run_wait_ns = 0
        return out

    def release(self) -> None:
        """End of a run: the device goes to the next tenant (never raises)."""
        if self.board is None:
            return
        try:
            self.board.release()
        except Exception as exc:  # noqa: BLE001 - a closed board at shutdown: logged
            log_event(_log, logging.WARNING, "device_time.release_failed", error=repr(exc))

    def close(self) -> None:
        """Give the device back, free the worker slot, release the timer's events."""
        if self.board is not None:
            self.board.close()
            self.board = None
        if self._timer is not None:
            self._timer.close()
            self._timer = None
