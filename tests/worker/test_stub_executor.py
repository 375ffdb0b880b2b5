"""The stub's device as an executor outside Python (worker._stubexec, worker.backends.stub_executor):
its GEMMs equal numpy's to the byte; a queued chunk's charge is the executor's own stamp; the ring and
the driver's run-ahead are bounded; a process killed mid-chunk leaves nothing behind; without the
extension (or with it turned off) the stub keeps its Python path. Never a timing."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from shared.log import _fields_of
from shared.quota import QuotaBlock
from tests.helpers import timeouts
from tests.worker.test_async_ops import WaitedBoard
from worker.backends import stub_executor
from worker.backends.stub import StubBackend, StubBuffer
from worker.backends.timing import ThreadTimer
from worker.device_time import _AHEAD_DIV, _RUN_AHEAD_CHUNKS, DeviceGate

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

needs_executor = pytest.mark.skipif(not stub_executor.available(), reason="worker._stubexec is not built")


def _buf(be: StubBackend, values: np.ndarray[Any, Any]) -> StubBuffer:
    buf = be.alloc(values.nbytes)
    be.write(buf, 0, memoryview(values.astype(np.float32).tobytes()))
    return buf


def _timer() -> stub_executor.ExecutorTimer:
    timer = stub_executor.make()
    assert timer is not None
    return timer


def _record_charges(timer: stub_executor.ExecutorTimer, charged: list[int], events: list[str] | None = None) -> None:
    """Every chunk charge the gate takes from ``timer`` (its settles and collections) is appended to
    ``charged`` as well; each settle is noted in ``events``, if given, before it waits."""
    settle, collect = timer.settle, timer.collect_done

    def spy_settle(until_ns: int | None) -> tuple[list[int], BaseException | None]:
        if events is not None:
            events.append("settle")
        got = settle(until_ns)
        charged.extend(got[0])
        return got

    def spy_collect() -> list[int]:
        got = collect()
        charged.extend(got)
        return got

    timer.settle = spy_settle  # type: ignore[method-assign]
    timer.collect_done = spy_collect  # type: ignore[method-assign]


@needs_executor
@pytest.mark.parametrize(("m", "k", "n"), [(2, 1, 2), (7, 3, 5), (64, 64, 64), (100, 256, 33), (256, 17, 128)])
def test_a_launched_gemm_equals_numpys_matmul_to_the_byte(m: int, k: int, n: int) -> None:
    be = StubBackend()
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    ba, bb, bc = _buf(be, a), _buf(be, b), be.alloc(4 * m * n)
    timer = _timer()
    try:
        assert timer.launch("matmul_f32", (ba, bb, bc, m, k, n))
        times, error = timer.settle(None)
        assert error is None and len(times) == 1 and times[0] >= 0
        assert be.read(bc, 0, 4 * m * n) == np.matmul(a, b).tobytes()
    finally:
        timer.close()


@needs_executor
def test_what_the_kernel_does_not_take_is_left_to_the_caller() -> None:
    """A vector side (numpy calls gemv: another rounding), an overlap of C with A, a buffer too short,
    another op: False, nothing launched - the gate then runs the op itself."""
    be = StubBackend()
    a, b, c = be.alloc(4 * 64), be.alloc(4 * 64), be.alloc(4 * 64)
    timer = _timer()
    try:
        assert not timer.launch("matmul_f32", (a, b, c, 1, 8, 8))
        assert not timer.launch("matmul_f32", (a, b, c, 8, 8, 1))
        assert not timer.launch("matmul_f32", (a, b, a, 8, 8, 8))
        assert not timer.launch("matmul_f32", (a, b, c, 16, 16, 16))
        assert not timer.launch("add_f32", (a, b, c, 64))
        assert timer.pending == 0 and timer.launched == 0
    finally:
        timer.close()


@needs_executor
def test_the_ring_is_bounded_and_settling_frees_it() -> None:
    ext = stub_executor._load()
    found = stub_executor.find_sgemm()
    assert found is not None
    timer = stub_executor.ExecutorTimer(ext.Executor(found[0], found[1], 2))
    be = StubBackend()
    a, b, c = be.alloc(4 * 64), be.alloc(4 * 64), be.alloc(4 * 64)
    try:
        assert timer.launch("matmul_f32", (a, b, c, 8, 8, 8))
        assert timer.launch("matmul_f32", (a, b, c, 8, 8, 8))
        assert timer.full()
        with pytest.raises(RuntimeError, match="ring is full"):
            timer.launch("matmul_f32", (a, b, c, 8, 8, 8))
        times, _ = timer.settle(None)
        assert len(times) == 2 and not timer.full()
        assert timer.launch("matmul_f32", (a, b, c, 8, 8, 8))
        assert len(timer.settle(None)[0]) == 1
    finally:
        timer.close()


def _voluntary_switches() -> int:
    """The calling thread's voluntary context switches so far (each sleep it woke from)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc/thread-self/status")


@needs_executor
@pytest.mark.skipif(not os.path.exists("/proc/thread-self/status"), reason="per-thread switches: Linux")
def test_a_driver_waiting_for_several_chunks_is_woken_once_not_at_each_chunks_end() -> None:
    """A drain while eight GEMMs run: the executor wakes the waiting driver when the last one is done,
    not at every chunk's end (each wake-up is a syscall the device pays between two chunks, and the
    driver went back to sleep after each); the same for a wait until at most two are left."""
    be = StubBackend()
    n = 256
    rng = np.random.default_rng(3)
    a = _buf(be, rng.standard_normal((n, n)).astype(np.float32))
    b = _buf(be, rng.standard_normal((n, n)).astype(np.float32))
    c = be.alloc(4 * n * n)
    timer = stub_executor.make()
    assert timer is not None
    try:
        for below in (0, 2):
            wakes, switches = timer.wakes, _voluntary_switches()
            for _ in range(8):
                assert timer.launch("matmul_f32", (a, b, c, n, n, n))
            waited = timer.running > below + 1  # (still running once launched: the wait spans their ends)
            if below:
                timer.wait_below(below)
                assert timer.running <= below
            else:
                timer.drain()
            switches = _voluntary_switches() - switches
            assert timer.wakes - wakes <= 1
            if waited:
                assert switches <= 2, f"woken {switches} times waiting for 8 chunks (below={below})"
            timer.settle(None)
    finally:
        timer.close()


@needs_executor
def test_launched_chunks_not_started_are_withdrawn_never_the_running_one() -> None:
    """A long GEMM running and short ones queued behind it: ``withdraw`` takes back the queued ones
    that have not started, never a started one - the chunks that ran are a prefix of the launches,
    each equal to numpy's, the withdrawn ones never write their output and are never collected; a
    pending gated launch is never withdrawn. Whatever the interleaving (how many were taken back is
    the host's timing: not asserted)."""
    be = StubBackend()
    rng = np.random.default_rng(11)
    big, small = 768, 64
    x = rng.standard_normal((big, big)).astype(np.float32)
    y = rng.standard_normal((small, small)).astype(np.float32)
    xa, ya = _buf(be, x), _buf(be, y)
    outs = [be.alloc(4 * big * big)] + [be.alloc(4 * small * small) for _ in range(6)]
    timer = _timer()
    try:
        assert timer.launch("matmul_f32", (xa, xa, outs[0], big, big, big))
        for c in outs[1:]:
            assert timer.launch("matmul_f32", (ya, ya, c, small, small, small))
        back = timer.withdraw(100)  # (the first too when the executor has not started it yet)
        assert 0 <= back <= 7 and timer.running <= 7 - back
        assert timer.launched == 7 - back
        times, _ = timer.settle(None)
        assert len(times) == 7 - back and timer.pending == 0 and timer.running == 0
        first = np.frombuffer(be.read(outs[0], 0, 4 * big * big), np.float32).reshape(big, big)
        if back < 7:  # (numpy's own threads sum a GEMM this large in another order: close, not equal)
            assert np.allclose(first, np.matmul(x, x), rtol=1e-4, atol=1e-3)
        else:
            assert not first.any()
        want = np.matmul(y, y).tobytes()
        for i, c in enumerate(outs[1:], start=1):
            got = be.read(c, 0, 4 * small * small)
            assert got == (want if i < 7 - back else bytes(4 * small * small)), i
        assert timer.withdraw(5) == 0  # (nothing left to take back)
    finally:
        timer.close()


@needs_executor
def test_a_pending_gated_launch_is_never_withdrawn() -> None:
    """A gated GEMM waiting for a grant that does not come: ``withdraw`` takes nothing (the gate's
    own cancel takes it out), and nothing runs."""
    be = StubBackend()
    a, b, c = be.alloc(4 * 64), be.alloc(4 * 64), be.alloc(4 * 64)
    board = bytearray(64)
    mv = memoryview(board)
    mine = 4  # (another worker's word, busy, in the owner word: never this one's)
    board[0:8] = (6 | 1).to_bytes(8, "little")
    timer = _timer()
    try:
        assert timer.launch_gated("matmul_f32", (a, b, c, 8, 8, 8), mv, 0, 8, mine)
        assert timer.withdraw(5) == 0 and timer.running == 1
        assert not timer.resolve(cancel=True)
        assert timer.running == 0 and timer.launched == 0
    finally:
        timer.close()
        mv.release()


@needs_executor
def test_a_run_handed_over_at_a_boundary_withdraws_its_queued_gemms_and_runs_each_once(block: QuotaBlock) -> None:
    """A run of GEMMs whose boundaries hand the device over now and then: at each such boundary the
    launches not yet started are withdrawn (the grantee waits for the running chunk only), and the
    run launches them again after the next grant - every GEMM runs and is charged exactly once
    (launches = GEMMs + withdrawn), the result numpy's, the board told all of it."""
    be = StubBackend()
    board = WaitedBoard(True)
    told: list[int] = []
    finishes = [0]
    gave_at: list[int] = []

    def finish(ns: int, now: int | None = None, *, last: bool = True, **kw: object) -> bool:
        told.append(ns)
        finishes[0] += 1
        gave = not last and finishes[0] % 3 == 0
        if gave:
            gave_at.append(timer.running)
        return gave

    board.finish = finish  # type: ignore[method-assign]
    board.charge = told.append  # type: ignore[attr-defined]
    gate = DeviceGate(block, be, board)  # type: ignore[arg-type]
    n = 160
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    a, b, c = _buf(be, x), _buf(be, y), be.alloc(4 * n * n)
    charged: list[int] = []
    withdrawn: list[tuple[int, int]] = []  # (most, taken back)
    launches = [0]
    try:
        gate.submit("scale_f32", be.scale_f32, (c, 1.0, 1))  # (makes the queue and its timer)
        gate.sync()
        timer = gate._executor
        assert isinstance(timer, stub_executor.ExecutorTimer)
        launch, withdraw = timer.launch, timer.withdraw
        _record_charges(timer, charged)

        def spy_launch(name: str, args: tuple[object, ...]) -> bool:
            launches[0] += 1
            return launch(name, args)

        def spy_withdraw(most: int) -> int:
            back = withdraw(most)
            withdrawn.append((most, back))
            return back

        timer.launch = spy_launch  # type: ignore[method-assign]
        timer.withdraw = spy_withdraw  # type: ignore[method-assign]
        told.clear()
        for _ in range(48):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n), time.monotonic_ns() + 10**10)
        gate.sync()
        assert gave_at, "no boundary handed the device over"
        # asked at each handover with chunks launched and not run (and maybe where they all ran meanwhile)
        assert sum(1 for r in gave_at if r) <= len(withdrawn) <= len(gave_at)
        back = sum(got for _, got in withdrawn)
        assert all(0 <= got <= most for most, got in withdrawn)
        assert launches[0] == 48 + back
        assert len(charged) == 48
        assert sum(told) == sum(charged) > 0
        assert be.read(c, 0, 4 * n * n) == np.matmul(x, y).tobytes()
    finally:
        gate.release()
        gate.close()


@needs_executor
def test_a_run_of_launched_gemms_makes_room_in_the_queue_only_as_they_run(block: QuotaBlock) -> None:
    """More GEMMs than the queue's bound, launched on the executor: the device thread makes room for
    the guest inside its pass, as the GEMMs complete - and counts a GEMM complete only once the executor
    ran it (its output written), never at its launch: the bound stays on ops queued and not complete."""
    be = StubBackend()
    board = WaitedBoard(True)
    board.finish = lambda ns, now=None, **kw: False  # type: ignore[method-assign]
    board.charge = lambda ns: None  # type: ignore[attr-defined]
    gate = DeviceGate(block, be, board)  # type: ignore[arg-type]
    n, count = 160, 24  # (big enough not to be batched as small ops: each its own launch)
    rng = np.random.default_rng(11)
    x, y = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    want = np.matmul(x, y)

    def written(buf: StubBuffer) -> bool:
        """The GEMM's output, all of it (no NaN left; to rounding: a GEMM split in chunks may differ
        from numpy's in its last bits)."""
        got = np.frombuffer(be.read(buf, 0, want.nbytes), np.float32).reshape(n, n)
        return bool(np.allclose(got, want, rtol=1e-4, atol=1e-4))

    a, b = _buf(be, x), _buf(be, y)
    outs = [_buf(be, np.full((n, n), np.nan, np.float32)) for _ in range(count)]
    reports: list[tuple[int, int, bool]] = []  # (done, ops in the pass, the newest done GEMM's output written)
    go = threading.Event()
    try:
        gate.submit("scale_f32", be.scale_f32, (outs[0], 1.0, 1))  # (makes the queue and its timer)
        gate.sync()
        queue = gate.queue
        assert queue is not None and isinstance(gate._executor, stub_executor.ExecutorTimer)
        queue.max_ops, queue.low_ops = 4, 2
        completed = queue.completed

        def spy(done: int) -> None:
            last = queue._batch[done - 1] if done > 0 else None
            reports.append((done, len(queue._batch), last is None or last.name != "matmul_f32"
                            or written(cast("StubBuffer", last.args[2]))))
            completed(done)

        queue.completed = spy  # type: ignore[method-assign]
        gate.submit("hold", lambda: go.wait(timeouts.scaled(30)), ())  # the device thread held: the GEMMs queue
        host = threading.Thread(target=lambda: [
            gate.submit("matmul_f32", be.matmul_f32, (a, b, out, n, n, n), time.monotonic_ns() + 10**10)
            for out in outs])
        host.start()
        end = time.monotonic() + timeouts.scaled(30)
        while queue.waited_full == 0:  # four GEMMs queued, the fifth waits for room
            assert host.is_alive() and time.monotonic() < end
            time.sleep(0.001)
        go.set()
        host.join(timeouts.scaled(30))
        gate.sync()
        assert all(written(out) for out in outs)
        assert queue.peak_ops <= 4
        assert any(done < ops for done, ops, _ in reports), "no room made inside a pass"
        assert all(ok for *_, ok in reports), "a GEMM counted complete before it ran"
    finally:
        go.set()
        gate.release()
        gate.close()


@needs_executor
def test_at_the_run_ahead_bound_the_driver_sleeps_on_a_timer_not_on_the_executors_wake(block: QuotaBlock) -> None:
    """A run of GEMMs queued behind a long one: at the run-ahead bound the driver sleeps for the launched
    chunks' estimated time, bounded by a timer of its own, and asks the executor to wake it only where
    the last launched chunk starts (a wake-up is a syscall of the device's between two chunks) - each
    of its waits a bounded one for at most one chunk left, never longer than what is queued by the
    estimates; results numpy's."""
    be = StubBackend()
    board = WaitedBoard(True)
    told: list[int] = []
    board.charge = told.append  # type: ignore[attr-defined]
    gate = DeviceGate(block, be, board)  # type: ignore[arg-type]
    rng = np.random.default_rng(9)
    big, n = 768, 256
    xb = rng.standard_normal((big, big)).astype(np.float32)
    x, y = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    ab, cb = _buf(be, xb), be.alloc(4 * big * big)
    a, b, c = _buf(be, x), _buf(be, y), be.alloc(4 * n * n)
    waits: list[tuple[int, int, int, int]] = []  # (below, until_ns, when, the launched chunks' estimates)
    try:
        gate.submit("scale_f32", be.scale_f32, (c, 1.0, 1))  # (makes the queue and its timer)
        gate.sync()
        timer = gate._executor
        assert isinstance(timer, stub_executor.ExecutorTimer)
        wait_below = timer.wait_below

        def spy_wait_below(below: int, until_ns: int = -1) -> bool:
            waits.append((below, until_ns, time.monotonic_ns(), sum(e for *_, e in gate._unsettled)))
            return wait_below(below) if until_ns == -1 else wait_below(below, until_ns)

        timer.wait_below = spy_wait_below  # type: ignore[method-assign]
        deadline = time.monotonic_ns() + 10**11
        gate.submit("matmul_f32", be.matmul_f32, (ab, ab, cb, big, big, big), deadline)
        for _ in range(24):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n), deadline)
        gate.sync()
        assert waits, "the driver never reached its run-ahead bound behind a long GEMM"
        for below, until_ns, when, queued in waits:
            # (a timer, set before the call: the driver may be descheduled past it before it waits)
            assert below == 1 and until_ns > 0 and until_ns - when <= queued
        assert be.read(c, 0, 4 * n * n) == np.matmul(x, y).tobytes()
        got = np.frombuffer(be.read(cb, 0, 4 * big * big), np.float32).reshape(big, big)
        assert np.allclose(got, np.matmul(xb, xb), rtol=1e-4, atol=1e-3)  # (numpy's threads sum in another order)
    finally:
        gate.release()
        gate.close()


@needs_executor
def test_a_launched_chunk_keeps_its_buffers_alive_until_collected() -> None:
    """A buffer freed while its GEMM is in flight: the chunk holds the bytes (a Py_buffer export), so
    the kernel never writes freed memory; they are let go at the collect."""
    be = StubBackend()
    n = 128
    a, b, c = _buf(be, np.ones((n, n))), _buf(be, np.ones((n, n))), be.alloc(4 * n * n)
    data = c.data
    timer = _timer()
    try:
        for _ in range(4):
            assert timer.launch("matmul_f32", (a, b, c, n, n, n))
        be.free(c)
        be.free(a)
        times, _ = timer.settle(None)
        assert len(times) == 4
        assert np.frombuffer(data, np.float32)[0] == float(n)
    finally:
        timer.close()


@needs_executor
def test_queued_gemms_through_the_gate_are_charged_the_executors_own_stamps(block: QuotaBlock) -> None:
    """Through the gate on a board where another worker always waits (its boundaries ask): every
    queued GEMM launched on the executor, each chunk's charge - to the block, the run's totals and the
    board - the executor's thread CPU stamp; results numpy's. Before each launch the driver is at most
    its run-ahead in front of the device (``DeviceGate._ahead``: a run of GEMMs' bound)."""
    be = StubBackend()
    board = WaitedBoard(True)
    charged: list[int] = []
    told: list[int] = []
    board.finish = lambda ns, now=None, **kw: (told.append(ns), False)[1]  # type: ignore[method-assign]
    board.charge = told.append  # type: ignore[attr-defined]
    gate = DeviceGate(block, be, board)  # type: ignore[arg-type]
    n = 96
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    a, b, c = _buf(be, x), _buf(be, y), be.alloc(4 * n * n)
    ahead: list[tuple[int, int]] = []
    try:
        gate.submit("scale_f32", be.scale_f32, (c, 1.0, 1))  # (makes the queue and its timer)
        gate.sync()
        timer = gate._executor
        assert isinstance(timer, stub_executor.ExecutorTimer)
        launch = timer.launch
        _record_charges(timer, charged)

        def spy_launch(name: str, args: tuple[object, ...]) -> bool:
            running = timer.running
            ahead.append((running, sum(e for *_, e in gate._unsettled[len(gate._unsettled) - running:])
                          if running else 0))
            return launch(name, args)

        timer.launch = spy_launch  # type: ignore[method-assign]
        before_block, before_told = block.gpu_time_ns, sum(told)
        gate.take_run_totals()
        launched0 = timer.launched
        for _ in range(40):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n), time.monotonic_ns() + 10**10)
        gate.sync()
        assert timer.launched - launched0 == 40 == len(charged)
        assert be.read(c, 0, 4 * n * n) == np.matmul(x, y).tobytes()
        run_ns, _ = gate.take_run_totals()
        assert run_ns == sum(charged) > 0
        assert block.gpu_time_ns - before_block == sum(charged)
        assert sum(told) - before_told == sum(charged)
        bound = max(gate.chunk_ns * _RUN_AHEAD_CHUNKS, gate.chunk_ns // _AHEAD_DIV)  # (a run of GEMMs)
        for running, est in ahead:
            assert running < 2 or est < bound
    finally:
        gate.release()
        gate.close()


@needs_executor
@pytest.mark.parametrize("gave", [True, False])
def test_a_stretchs_end_tells_the_board_before_it_waits_for_the_launched_chunks(block: QuotaBlock, gave: bool) -> None:
    """At the end of a stretch of launched GEMMs the board hears of it (``finish``, where it may pass the
    device on) before the driver waits for the chunks still running - the grantee's first launch queued
    behind them, not after the giver's wait - and those chunks are charged at once after it
    (``GpuTimeBoard.charge``): every chunk's stamp told to the board once, whether the device went on
    or stayed."""
    be = StubBackend()
    board = WaitedBoard(True)
    events: list[str] = []
    told: list[int] = []

    def finish(ns: int, now: int | None = None, *, last: bool = True, **kw: object) -> bool:
        told.append(ns)
        events.append("finish-last" if last else "finish")
        return gave and last

    def charge(ns: int) -> None:
        told.append(ns)
        events.append("charge")

    def end_op(*, idle: bool = False) -> bool:
        events.append("finish-last")  # (the last op ended at a boundary told, every chunk collected there)
        return False

    board.finish = finish  # type: ignore[method-assign]
    board.charge = charge  # type: ignore[attr-defined]
    board.end_op = end_op  # type: ignore[method-assign]
    board.holds = lambda: True  # type: ignore[method-assign]  # (the lease held idle since the last boundary)
    gate = DeviceGate(block, be, board)  # type: ignore[arg-type]
    n = 128
    a, b, c = _buf(be, np.ones((n, n))), _buf(be, np.ones((n, n))), be.alloc(4 * n * n)
    charged: list[int] = []
    try:
        gate.submit("scale_f32", be.scale_f32, (c, 1.0, 1))  # (makes the queue and its timer)
        gate.sync()
        timer = gate._executor
        assert isinstance(timer, stub_executor.ExecutorTimer)
        launch = timer.launch
        _record_charges(timer, charged, events)

        def spy_launch(name: str, args: tuple[object, ...]) -> bool:
            events.append("launch")
            return launch(name, args)

        timer.launch = spy_launch  # type: ignore[method-assign]
        told.clear()
        events.clear()
        for _ in range(12):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n), time.monotonic_ns() + 10**10)
        gate.sync()
        assert events.count("launch") == 12
        end = len(events) - 1 - events[::-1].index("finish-last")
        last_launch = len(events) - 1 - events[::-1].index("launch")
        assert last_launch < end
        assert "settle" not in events[last_launch:end]  # the board first, the wait after
        assert len(charged) == 12
        assert sum(told) == sum(charged) > 0
        assert np.all(np.frombuffer(be.read(c, 0, 4 * n * n), np.float32) == n)
    finally:
        gate.release()
        gate.close()


@needs_executor
def test_a_host_op_after_launched_gemms_runs_after_them(block: QuotaBlock) -> None:
    """A queued op the executor does not take (an elementwise add) runs on the driver once every GEMM
    launched before it ran: it reads their result."""
    be = StubBackend()
    gate = DeviceGate(block, be)
    n = 64
    a, b = _buf(be, np.ones((n, n))), _buf(be, np.ones((n, n)))
    c, d = be.alloc(4 * n * n), be.alloc(4 * n * n)
    try:
        for _ in range(6):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n))
        gate.submit("add_f32", be.add_f32, (c, c, d, n * n))
        gate.sync()
        assert isinstance(gate._executor, stub_executor.ExecutorTimer)
        assert np.all(np.frombuffer(be.read(d, 0, 4 * n * n), np.float32) == 2.0 * n)
    finally:
        gate.release()
        gate.close()


_KILLED = """
import sys, time
from worker.backends import stub_executor
from worker.backends.stub import StubBackend
be = StubBackend()
timer = stub_executor.make()
assert timer is not None
n = 512
a, b, c = be.alloc(4 * n * n), be.alloc(4 * n * n), be.alloc(4 * n * n)
for _ in range(timer._ex.ring):
    assert timer.launch("matmul_f32", (a, b, c, n, n, n))
print(timer.thread_id, flush=True)
time.sleep(60)
"""


@needs_executor
def test_a_process_killed_mid_chunk_leaves_nothing_behind() -> None:
    """SIGKILL while the executor runs: the process and its executor thread are gone, and nothing of
    it can stay: the executor has no shared state (its ring is the process's memory - no /dev/shm
    segment mapped or open while it ran; other tests' segments come and go meanwhile)."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None
        tid = int(proc.stdout.readline())
        assert os.path.exists(f"/proc/{proc.pid}/task/{tid}")  # the executor thread, running
        with open(f"/proc/{proc.pid}/maps", encoding="utf-8") as f:
            assert "/dev/shm/" not in f.read()
        fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        assert not [fd for fd in fds if fd.startswith("/dev/shm/")]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=timeouts.scaled(30)) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert not os.path.exists(f"/proc/{proc.pid}")


_FALLBACK = """
import json
from shared.log import _fields_of
from shared.quota import QuotaBlock
from worker.backends.stub import StubBackend
from worker.device_time import DeviceGate
owner = QuotaBlock.create('fallback')
blk = QuotaBlock.attach(owner.name, instance=0)
be = StubBackend()
gate = DeviceGate(blk, be)
n = 16
a, b, c = be.alloc(4 * n * n), be.alloc(4 * n * n), be.alloc(4 * n * n)
be.fill_f32(a, 1.0, n * n)
be.fill_f32(b, 2.0, n * n)
gate.submit('matmul_f32', be.matmul_f32, (a, b, c, n, n, n))
gate.sync()
print(json.dumps({'executor': be.device_executor, 'timer': type(gate._qtimer).__name__,
                  'c0': be.read(c, 0, 4).hex(), 'charged': blk.gpu_time_ns > 0}))
gate.release(); gate.close(); blk.close(); owner.unlink(); owner.close()
"""


def test_turned_off_the_stub_runs_its_queued_ops_on_the_python_device_thread() -> None:
    import json
    import struct

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TWT_STUB_EXECUTOR": "0"}
    proc = subprocess.run([sys.executable, "-c", _FALLBACK], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeouts.scaled(60))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"executor": False, "timer": "ThreadTimer", "c0": struct.pack("<f", 32.0).hex(),
                   "charged": True}


def test_without_the_extension_or_a_blas_the_stub_falls_back_and_says_why_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(stub_executor, "_logged", False)
    monkeypatch.setattr(stub_executor, "_ext", None)
    monkeypatch.setattr(stub_executor, "_why_not", "the extension worker._stubexec is not built (test)")
    be = StubBackend()
    assert not be.device_executor
    caplog.set_level(logging.INFO)
    assert isinstance(be.queue_timer(), ThreadTimer)
    assert isinstance(be.queue_timer(), ThreadTimer)
    lines = [_fields_of(r) for r in caplog.records if "stub_executor.unavailable" in r.getMessage()]
    assert len(lines) == 1 and "not built (test)" in str(lines[0]["reason"])
    # a BLAS without cblas_sgemm: the same fallback
    monkeypatch.setattr(stub_executor, "_ext", object())
    monkeypatch.setattr(stub_executor, "_why_not", "")
    monkeypatch.setattr(stub_executor, "_logged", False)
    monkeypatch.setattr(stub_executor, "find_sgemm", lambda: None)
    assert stub_executor.available()
    assert stub_executor.make() is None
