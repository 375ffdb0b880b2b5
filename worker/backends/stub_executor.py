"""The stub's device as an executor outside Python: its queued GEMM chunks launched asynchronously.

The stub's device is this host's CPU. Its queued chunks ran on the worker's Python device thread,
which also did the launching: between two kernels the device idled for that thread's Python (the
lease, the accounting, the next chunk's plan; docs/GPU-QUOTAS.md "The stub device"). Here, as on a
GPU, the device thread is a *driver*: a GEMM chunk is launched by pushing a descriptor into a short
ring (``worker._stubexec``, C) and the driver goes on while the executor thread runs the launched
chunks back to back without the GIL, stamping each one (its thread CPU time: the charge; its
monotonic start and end: the work trace's launch row). The gate collects the stamps the way it
reads a CUDA stream's events (:class:`ExecutorTimer` is a ``PendingTimer``): a chunk's device time
is pending until the gate *settles* the timer - at every board boundary and when the ring is full -
so the board hears of work only once it is complete and the lease moves only once the executor has
run everything launched under it.

Ops other than a plain float32 GEMM (fills, elementwise, reductions: microseconds each on the
stub) run on the driver itself, as before, once the executor has run what was launched before
them (:meth:`ExecutorTimer.time`): host-synchronous, timed by the driver's thread CPU time.

The kernel is the ``sgemm`` numpy's own ``matmul`` calls: found in the BLAS library numpy loaded
(its ``cblas_sgemm``, ILP64 or not: numpy 2.x wheels carry scipy-openblas, ``scipy_cblas_sgemm64_``).
Where the extension or the symbol is missing, :func:`make` says why once (a log line) and the stub
keeps its Python path (:class:`~worker.backends.timing.ThreadTimer`). ``TWT_STUB_EXECUTOR=0`` turns
the executor off (an A/B of the two paths).
"""

from __future__ import annotations

import ctypes
import logging
import os
from time import thread_time_ns
from typing import Any

from shared.errors import KernelTimeout
from shared.log import get_logger, log_event

__all__ = ["RING", "ExecutorTimer", "available", "find_sgemm", "make"]

_log = get_logger("worker.stub_executor")

#: the most chunks launched and not collected: a full ring makes the gate settle first
RING = 16
#: the sgemm symbols tried in the library numpy loaded, with whether each takes 64-bit ints
_SYMBOLS = (("scipy_cblas_sgemm64_", True), ("cblas_sgemm64_", True), ("scipy_cblas_sgemm", False),
            ("cblas_sgemm", False))

_ext: Any = None
_why_not = ""
_logged = False


def _load() -> Any:
    """The C extension (None when it was not built, or the executor is turned off)."""
    global _ext, _why_not
    if _ext is None and not _why_not:
        if os.environ.get("TWT_STUB_EXECUTOR", "1") == "0":
            _why_not = "TWT_STUB_EXECUTOR=0"
        else:
            try:
                from worker import _stubexec  # type: ignore[attr-defined]
            except ImportError as exc:
                _why_not = f"the extension worker._stubexec is not built ({exc})"
            else:
                _ext = _stubexec
    return _ext


def available() -> bool:
    """Whether the executor can be made (the extension built, not turned off); the BLAS is looked up
    only when one is (:func:`make`)."""
    return _load() is not None


def _blas_paths() -> list[str]:
    """The shared libraries this process has mapped whose name says BLAS (numpy's, once loaded)."""
    seen: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = os.path.basename(path).lower()
                if ".so" in name and "blas" in name and path not in seen:
                    seen.append(path)
    except OSError:
        pass
    return seen


def find_sgemm() -> tuple[int, bool, str] | None:
    """numpy's ``cblas_sgemm``: (its address, whether it takes 64-bit ints, the library's path), from
    the BLAS library numpy has loaded (numpy imported first, so that the one-thread setting applies:
    ``worker.backends.stub.load_numpy``); None when there is none."""
    import numpy  # noqa: F401 - loads the BLAS (the caller set its thread count)

    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in _blas_paths():
        try:
            lib = ctypes.CDLL(path, mode=mode)  # the copy numpy loaded, not a second one
        except OSError:
            continue
        for symbol, ilp64 in _SYMBOLS:
            fn = getattr(lib, symbol, None)
            if fn is not None:
                addr = ctypes.cast(fn, ctypes.c_void_p).value
                if addr:
                    return addr, ilp64, path
    return None


def make(ring: int = RING) -> ExecutorTimer | None:
    """A new executor and its timer, or None (why: logged once a process)."""
    global _logged
    ext = _load()
    why = _why_not
    found = None
    if ext is not None:
        found = find_sgemm()
        if found is None:
            why = "no cblas_sgemm in the BLAS numpy loaded"
    if ext is None or found is None:
        if not _logged:
            _logged = True
            log_event(_log, logging.INFO, "stub_executor.unavailable", reason=why,
                      fallback="the stub's queued ops run on the Python device thread")
        return None
    addr, ilp64, _ = found
    return ExecutorTimer(ext.Executor(addr, ilp64, ring))


class ExecutorTimer:
    """The stub's queue timer with the executor (a ``PendingTimer``; see the module doc).

    :meth:`launch` launches a GEMM chunk (pending: its time is read at :meth:`settle`); :meth:`time`
    runs any other op on the calling thread once the executor is idle (host-synchronous: its
    thread CPU time, returned at once). ``spans``: the (start, end, cpu ns) stamps of the chunks the
    last :meth:`settle` read, in order (the gate's work trace)."""

    #: host-synchronous ops run here too (:meth:`time`): the gate may batch small ones
    host_ops = True

    def __init__(self, executor: Any) -> None:
        self._ex = executor
        self.spans: list[tuple[int, int, int]] = []
        self.settles = 0

    @property
    def pending(self) -> int:
        """Chunks launched and not yet settled."""
        return int(self._ex.pending)

    @property
    def thread_id(self) -> int | None:
        """The executor thread's native id (None: closed)."""
        tid = self._ex.tid
        return None if tid is None else int(tid)

    @property
    def launched(self) -> int:
        """Chunks launched on the executor, all told."""
        return int(self._ex.launched)

    @property
    def wakes(self) -> int:
        """Times the executor woke a driver waiting in :meth:`wait_below`, :meth:`drain` or :meth:`settle`
        (once what it waited for held: not at every chunk's end)."""
        return int(self._ex.wakes)

    def full(self) -> bool:
        return bool(self._ex.pending >= self._ex.ring)


    def launch(self, name: str, args: tuple[object, ...]) -> bool:
        """Launch op ``name``'s chunk on the executor when it is a plain float32 GEMM (``matmul_f32``,
        its own argument order: a, b, c, m, k, n) on buffers it can address; False: the caller runs it
        (:meth:`time`). The ring must have room (:meth:`full`)."""
        if name != "matmul_f32" or len(args) != 6:
            return False
        a, b, c, m, k, n = args
        da, db, dc = getattr(a, "data", None), getattr(b, "data", None), getattr(c, "data", None)
        if da is None or db is None or dc is None:
            return False
        return bool(self._ex.sgemm(da, db, dc, m, k, n))

    def launch_gated(self, name: str, args: tuple[object, ...], board: object, owner_off: int, busy_off: int,
                     mine: int) -> bool:
        """Launch op ``name``'s chunk as :meth:`launch` does, gated on the device's lease: the executor
        starts it once the owner word at ``board[owner_off]`` names this worker (``mine``, idle: a grant
        - it takes the word busy with its own CAS and stamps ``board[busy_off]``) or already holds it
        busy (``mine | 1``: the driver's CAS won). Into an empty ring only (nothing launched and not
        collected); :meth:`resolve` must follow once the driver's wait for the lease is over. False:
        not launched (not a GEMM it runs, or the arguments do not fit)."""
        if name != "matmul_f32" or len(args) != 6 or self._ex.pending:
            return False
        a, b, c, m, k, n = args
        da, db, dc = getattr(a, "data", None), getattr(b, "data", None), getattr(c, "data", None)
        if da is None or db is None or dc is None:
            return False
        return bool(self._ex.sgemm_gated(da, db, dc, m, k, n, board, owner_off, busy_off, mine))

    def resolve(self, *, cancel: bool) -> bool:
        """The driver's wait for the lease is over: ``cancel`` False, it holds the lease busy and the
        gated chunk runs; True, its wait was refused and the chunk is taken out - unless the executor
        took the lease for it first (then the driver holds the lease: True is returned). Whether the
        gated chunk runs."""
        return int(self._ex.gate_resolve(cancel)) > 0

    @property
    def gated(self) -> tuple[int, int, int]:
        """(gated launches, those whose lease the executor took with its own CAS, those cancelled)."""
        g = self._ex.gated
        return int(g[0]), int(g[1]), int(g[2])

    @property
    def running(self) -> int:
        """Chunks launched and not yet run."""
        return int(self._ex.running)

    def withdraw(self, most: int) -> int:
        """Take back up to ``most`` of the newest launched chunks that have not started (never the running
        one): they never run and are never settled. How many were taken back (0 while a gated launch
        is pending)."""
        return int(self._ex.withdraw(most)) if most > 0 else 0

    def wait_below(self, n: int, until_ns: int = -1) -> bool:
        """Wait until at most ``n`` launched chunks have not run yet, or ``until_ns`` (CLOCK_MONOTONIC;
        -1: no bound) passed: whether they have."""
        return bool(self._ex.wait(until_ns, n))

    def drain(self) -> None:
        """Wait until every launched chunk ran (read at the next :meth:`settle`)."""
        self._ex.wait(-1)

    def time(self, fn: Any, *args: object) -> int:
        """``fn(*args)`` on this thread once every launched chunk ran (the stream's order); its
        thread CPU time."""
        if self._ex.running:
            self._ex.wait(-1)
        t0 = thread_time_ns()
        fn(*args)
        return thread_time_ns() - t0

    def settle(self, until_ns: int | None) -> tuple[list[int], BaseException | None]:
        """Wait for the launched chunks (not past ``until_ns``: a ``KernelTimeout``, the chunks still
        pending), then their device times, oldest first."""
        self.settles += 1
        if not self._ex.wait(-1 if until_ns is None else until_ns):
            raise KernelTimeout(0.0, message="the stub executor's launched chunks still running past the "
                                              "run's deadline")
        return self._collect(), None

    def collect_done(self) -> list[int]:
        """The device times of the launched chunks that already ran, oldest first (no wait; the rest
        stay pending); ``spans`` as :meth:`settle` sets it."""
        return self._collect()

    def _collect(self) -> list[int]:
        """The stamps of the chunks that ran since the last collection: ``spans`` set, the CPU times returned."""
        got = self._ex.collect()
        self.spans = [(start, end, cpu) for cpu, start, end in got]
        return [cpu for cpu, _, _ in got]

    def close(self) -> None:
        """Stop the executor once what was launched ran."""
        self._ex.close()

