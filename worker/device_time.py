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
layout) ops are still timed and charged, just not scheduled.

Threads: only the worker's executor thread calls the gate (tensor ops run
there), so it keeps no lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from shared.errors import KernelTimeout
from shared.gpu_time import GpuTimeBoard
from shared.log import get_logger, log_event
from shared.quota import QuotaBlock
from worker.backends.base import Backend
from worker.backends.timing import OpTimer
from worker.chunks import CostModel, plan

__all__ = ["CHUNK_S", "DeviceGate"]

T = TypeVar("T")

_log = get_logger("worker.device_time")

#: the longest a single launch should hold the device (the preemption latency bound)
CHUNK_S = 0.002
#: refused ops (no GPU time before the run's deadline) are logged at most once per this many seconds
_REFUSED_LOG_INTERVAL_S = 1.0


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

    def _timer_(self) -> OpTimer:
        if self._timer is None:
            self._timer = self.backend.op_timer()
        return self._timer

    def op(self, name: str, fn: Callable[..., T], args: tuple[object, ...], deadline_ns: int | None = None) -> T | None:
        """Run op ``name`` = ``fn(*args)`` on the device, in chunks where it splits (see module doc);
        the op's result (a sum), or None."""
        p = plan(name, self.backend, args)
        if p is None:
            ns, waited, result = self._run(fn, args, deadline_ns, last=True)
            self.block.observe_gpu_wait(waited)
            return result
        call = p.call or fn
        costs = self.costs
        lo = 0
        wait = 0
        results: list[object] = []
        while lo < p.units:
            hi = lo + costs.units_for(name, p, self.chunk_ns, p.units - lo)
            ns, waited, got = self._run(call, p.chunk(lo, hi), deadline_ns, last=hi >= p.units)
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
             last: bool) -> tuple[int, int, T | None]:
        """One launch under the lease: (device ns, ns waited for the device, its result)."""
        board = self.board
        waited = 0
        if self._run_refused is not None:
            raise self._refuse(KernelTimeout(0.0, message=str(self._run_refused)))
        if board is not None:
            if deadline_ns is not None:
                throttled = board.throttled_wait_ns()
                if throttled and time.monotonic_ns() + throttled > deadline_ns:
                    raise self._refuse(KernelTimeout(0.0, message=(
                        f"waiting for the device: the tenant's GPU-time cap gives it no time before the "
                        f"run's deadline (next in {throttled / 1e6:.1f} ms)"))) from None
            try:
                waited = board.acquire(deadline_ns)
            except TimeoutError as exc:
                raise self._refuse(KernelTimeout(0.0, message=f"waiting for the device: {exc}")) from None
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
                if board.finish(ns, last=last) and board.throttled_wait_ns():
                    self.block.count_gpu_throttled()
        return ns, waited, result[0] if result else None

    def take_run_totals(self) -> tuple[int, int]:
        """(device ns, wait ns) since the last call: one run's figures for its reply (a new run
        starts with it: its ops are no longer refused for the last run's deadline)."""
        out = (self.run_time_ns, self.run_wait_ns)
        self.run_time_ns = self.run_wait_ns = 0
        self._run_refused = None
        return out

    def release(self) -> None:
        """End of a run: the device goes to the next tenant (never raises)."""
        self._run_refused = None
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
