"""Consecutive big queued ops of one kind and shape, each one chunk, go through one lean loop on the
device thread (worker.device_time ``DeviceGate._queued_run``): each op still runs on its own arguments
in order, timed alone and counted, its wait observed; an op's error is its own (the ops before it ran,
the rest are dropped); the lease's boundaries are kept (a boundary that gave the device up is followed
by the next op taking the lease again, its wait that op's); an op of another shape ends the run; with
the scheduler off the stub's ops still take the device's flock one at a time.

The cost model is pinned (every op one chunk, none small) so that which path runs does not depend on
how fast this host runs a GEMM.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest

from shared.errors import KernelTimeout
from shared.gpu_time import GpuTimeBoard
from shared.quota import QuotaBlock
from tests.worker.test_async_ops import WAIT_S, CountingBoard, _Slow
from worker.backends.base import DeviceBuffer
from worker.backends.stub import StubBackend
from worker.backends.timing import ThreadTimer
from worker.chunks import Plan
from worker.device_time import DeviceGate

pytestmark = pytest.mark.timeout(120)

N = 8  # the matrices' side: tiny, the path is what is tested


class _CountingTimer(ThreadTimer):
    def __init__(self) -> None:
        self.calls = 0

    def time(self, fn: Callable[..., object], *args: object) -> int:
        self.calls += 1
        return super().time(fn, *args)


def _gate(block: QuotaBlock, board: object, chunk_s: float = 0.002) -> tuple[DeviceGate, StubBackend, _CountingTimer]:
    be = StubBackend()
    timer = _CountingTimer()
    be.queue_timer = lambda: timer  # type: ignore[method-assign]
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board), chunk_s=chunk_s)
    big = 100 * gate.chunk_ns

    def predict_ns(name: str, p: Plan, units: int) -> float:
        return float(big)  # never small (no batch)

    def units_for(name: str, p: Plan, target_ns: int, left: int) -> int:
        return left  # one chunk

    gate.costs.predict_ns = predict_ns  # type: ignore[method-assign]
    gate.costs.units_for = units_for  # type: ignore[method-assign]
    return gate, be, timer


def _matrix(be: StubBackend, values: np.ndarray) -> DeviceBuffer:
    buf = be.alloc(values.nbytes)
    be.write(buf, 0, memoryview(values.astype(np.float32).tobytes()))
    return buf


def _read(be: StubBackend, buf: DeviceBuffer, rows: int, cols: int) -> np.ndarray:
    return np.frombuffer(be.read(buf, 0, 4 * rows * cols), dtype=np.float32).reshape(rows, cols)


class _Spy:
    """Counts the gate's calls into its lean loop and into the one-op path."""

    def __init__(self, gate: DeviceGate) -> None:
        self.runs: list[int] = []
        self.alone = 0
        run, alone = gate._queued_run, gate._queued

        def queued_run(items: list[object], i: int) -> tuple[int, BaseException | None]:
            got = run(items, i)  # type: ignore[arg-type]
            if got[0]:
                self.runs.append(got[0])
            return got

        def queued(item: object) -> None:
            self.alone += 1
            alone(item)  # type: ignore[arg-type]

        gate._queued_run = queued_run  # type: ignore[method-assign,assignment]
        gate._queued = queued  # type: ignore[method-assign]


def _held_back(gate: DeviceGate, be: StubBackend) -> _Slow:
    """An op of no plan holding the device thread: what the test queues meanwhile is taken at once."""
    slow = _Slow()
    gate.submit("slow", slow, ())
    assert slow.started.wait(WAIT_S)
    return slow


def test_a_run_of_gemms_is_one_loop_each_op_still_its_own(block: QuotaBlock) -> None:
    board = CountingBoard(True)
    gate, be, timer = _gate(block, board, chunk_s=3600.0)  # no boundary inside the test's stretch
    spy = _Spy(gate)
    try:
        rng = np.random.default_rng(1)
        a_vals = [rng.standard_normal((N, N)) for _ in range(12)]
        b_vals = rng.standard_normal((N, N))
        b = _matrix(be, b_vals)
        pairs = [(_matrix(be, av), be.alloc(4 * N * N)) for av in a_vals]
        slow = _held_back(gate, be)
        for a, c in pairs:
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
        slow.go.set()
        gate.sync()
        for av, (_, c) in zip(a_vals, pairs):
            np.testing.assert_allclose(_read(be, c, N, N), (av.astype(np.float32) @ b_vals.astype(np.float32)),
                                       rtol=1e-4, atol=1e-4)
        assert spy.runs == [12] and spy.alone == 1  # the slow op alone, then the GEMMs in one loop
        assert timer.calls == 13 and gate.chunks == 13  # each op timed and counted alone
        assert block.snapshot().gpu_waits == 13  # every op's wait observed
        assert board.calls["acquire"] == 1  # one stretch
        assert block.gpu_time_ns == gate.run_time_ns > 0
        assert gate.costs._factor  # the cost model learnt the run
        gate.release()
    finally:
        slow.go.set()
        gate.close()


def test_an_op_failing_inside_a_run_keeps_the_ops_before_and_drops_the_rest(block: QuotaBlock) -> None:
    board = CountingBoard(True)
    gate, be, _ = _gate(block, board, chunk_s=3600.0)
    try:
        b = _matrix(be, np.eye(N))
        outs = [be.alloc(4 * N * N) for _ in range(6)]
        a = _matrix(be, np.full((N, N), 2.0))
        calls = {"n": 0}

        def gemm(*args: object) -> None:
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("the fourth GEMM failed")
            be.matmul_f32(*args)  # type: ignore[arg-type]

        slow = _held_back(gate, be)
        for c in outs:
            gate.submit("matmul_f32", gemm, (a, b, c, N, N, N))
        slow.go.set()
        with pytest.raises(RuntimeError, match="fourth"):
            gate.sync()
        assert gate.failed_op == "matmul_f32"
        assert calls["n"] == 4  # the ops after the failed one were dropped
        for c in outs[:3]:
            assert (_read(be, c, N, N) == 2.0).all()
        for c in outs[4:]:
            assert (_read(be, c, N, N) == 0.0).all()
        assert gate.queue is not None and gate.queue.dropped == 2
        assert block.snapshot().gpu_waits == 4  # the slow op and the three GEMMs that ran
        gate.sync()  # the error was raised once
        gate.release()
    finally:
        gate.close()


def test_an_op_of_another_shape_ends_the_run(block: QuotaBlock) -> None:
    board = CountingBoard(True)
    gate, be, timer = _gate(block, board, chunk_s=3600.0)
    spy = _Spy(gate)
    try:
        a, b, c = _matrix(be, np.ones((N, N))), _matrix(be, np.ones((N, N))), be.alloc(4 * N * N)
        a2, b2, c2 = _matrix(be, np.ones((N, 2 * N))), _matrix(be, np.ones((2 * N, N))), be.alloc(4 * N * N)
        slow = _held_back(gate, be)
        for _ in range(3):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
        for _ in range(2):
            gate.submit("matmul_f32", be.matmul_f32, (a2, b2, c2, N, 2 * N, N))
        gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
        slow.go.set()
        gate.sync()
        assert spy.runs == [3, 2, 1]
        assert (_read(be, c, N, N) == N).all() and (_read(be, c2, N, N) == 2 * N).all()
        assert timer.calls == 7 and block.snapshot().gpu_waits == 7
        gate.release()
    finally:
        slow.go.set()
        gate.close()


class _GivingBoard(CountingBoard):
    """A board that takes the device away at every boundary (``finish`` gives it up) and whose lease
    then comes back after ``wait_ns`` (reported by ``acquire`` as the wait)."""

    def __init__(self, wait_ns: int) -> None:
        super().__init__(True)
        self.wait_ns = wait_ns

    def acquire(self, deadline_ns: int | None = None, gated: object = None) -> int:
        super().acquire(deadline_ns, gated)  # type: ignore[arg-type]
        return self.wait_ns

    def finish(self, charged_ns: int, now: int | None = None, *, last: bool = True, idle: bool = False,
               chunk_from: int = 0) -> bool:
        super().finish(charged_ns, now, last=last, idle=idle, chunk_from=chunk_from)
        return True


def test_a_run_takes_the_lease_again_after_a_boundary_gave_it_up_and_that_wait_is_the_ops(block: QuotaBlock) -> None:
    wait_ns = 7_000_000
    board = _GivingBoard(wait_ns)
    gate, be, _ = _gate(block, board, chunk_s=1e-9)  # a boundary after every op
    spy = _Spy(gate)
    try:
        a, b, c = _matrix(be, np.ones((N, N))), _matrix(be, np.ones((N, N))), be.alloc(4 * N * N)
        slow = _held_back(gate, be)
        for _ in range(5):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
        slow.go.set()
        gate.sync()
        assert spy.runs == [5]
        assert board.calls["acquire"] == 6  # the slow op's, then each GEMM's after a boundary gave it up
        assert board.calls["finish"] >= 6
        snap = block.snapshot()
        assert snap.gpu_waits == 6
        assert snap.gpu_wait_ns >= 6 * wait_ns  # every lease wait is its op's
        assert gate.run_wait_ns == 6 * wait_ns
        gate.release()
    finally:
        slow.go.set()
        gate.close()


def test_a_stretch_whose_last_op_ended_at_a_told_boundary_tells_the_board_the_ops_end(block: QuotaBlock) -> None:
    """Every op's end a boundary (``finish`` with ``last=False``, the lease held idle after it): when the
    queue then runs empty the board hears of the op's end (``end_op``: a lend or a wake-up) instead of
    taking the op as running until the worker's next request; a stretch that ends holding the lease
    busy ends with ``finish(last=True)`` as before, and no ``end_op``."""
    board = CountingBoard(True)
    gate, be, _ = _gate(block, board, chunk_s=1e-9)  # a boundary after every op
    try:
        a, b, c = _matrix(be, np.ones((N, N))), _matrix(be, np.ones((N, N))), be.alloc(4 * N * N)
        slow = _held_back(gate, be)
        for _ in range(3):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
        slow.go.set()
        gate.sync()
        assert board.calls.get("end_op") == 1 and len(board.ended) == 1
        finish = board.calls["finish"]
        gate.release()
    finally:
        slow.go.set()
        gate.close()
    board = CountingBoard(True)
    gate, be, _ = _gate(block, board, chunk_s=3600.0)  # no boundary inside the stretch
    try:
        a, b, c = _matrix(be, np.ones((N, N))), _matrix(be, np.ones((N, N))), be.alloc(4 * N * N)
        gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
        gate.sync()
        assert "end_op" not in board.calls and board.calls["finish"] == 1 and finish >= 4
        gate.release()
    finally:
        gate.close()


def test_with_the_scheduler_off_a_run_takes_the_devices_flock_per_op(block: QuotaBlock,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    board = GpuTimeBoard.create(0, scheduler=False)
    try:
        mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        gate, be, timer = _gate(block, mine)
        spy = _Spy(gate)
        locks: list[int] = []
        real_flock = fcntl.flock

        def flock(fd: int, op: int) -> None:
            locks.append(op)
            real_flock(fd, op)

        monkeypatch.setattr(fcntl, "flock", flock)
        try:
            a, b, c = _matrix(be, np.ones((N, N))), _matrix(be, np.ones((N, N))), be.alloc(4 * N * N)
            slow = _held_back(gate, be)
            for _ in range(4):
                gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
            slow.go.set()
            gate.sync()
            assert spy.runs == [4]
            assert locks == [fcntl.LOCK_EX, fcntl.LOCK_UN] * 5  # the slow op's, then one per GEMM
            assert (_read(be, c, N, N) == N).all()
            assert board.snapshot().holder is None  # the board was never asked
            gate.release()
        finally:
            monkeypatch.undo()
            slow.go.set()
            gate.close()
            mine.close()
    finally:
        board.unlink()
        board.close()


def test_a_run_past_its_deadline_is_refused_by_the_op_path(block: QuotaBlock) -> None:
    board = CountingBoard(True)
    gate, be, _ = _gate(block, board, chunk_s=3600.0)
    try:
        a, b, c = _matrix(be, np.ones((N, N))), _matrix(be, np.ones((N, N))), be.alloc(4 * N * N)
        slow = _held_back(gate, be)
        deadline = time.monotonic_ns() + 50_000_000
        for _ in range(3):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N), deadline)
        time.sleep(0.1)  # the deadline passes before the GEMMs run
        slow.go.set()
        with pytest.raises(KernelTimeout):
            gate.sync()
        assert gate.refused >= 1
        assert (_read(be, c, N, N) == 0.0).all()  # none ran
        gate.release()
    finally:
        gate.close()


def test_a_submit_of_the_op_submitted_last_reuses_its_plan(block: QuotaBlock,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.device_time as device_time

    plans: list[str] = []
    real_plan = device_time.plan

    def counting_plan(name: str, backend: object, args: tuple[object, ...]) -> object:
        plans.append(name)
        return real_plan(name, backend, args)  # type: ignore[arg-type]

    monkeypatch.setattr(device_time, "plan", counting_plan)
    board = CountingBoard(True)
    gate, be, _ = _gate(block, board, chunk_s=3600.0)
    try:
        a, b = _matrix(be, np.ones((N, N))), _matrix(be, np.full((N, N), 2.0))
        c, d = be.alloc(4 * N * N), be.alloc(4 * N * N)
        for _ in range(3):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, N, N, N))
        assert len(plans) == 1  # the same op on the same buffers and sizes: planned once
        gate.submit("matmul_f32", be.matmul_f32, (a, b, d, N, N, N))  # another output buffer
        gate.submit("matmul_f32", be.matmul_f32, (a, b, d, N // 2, N, N))  # another size
        gate.submit("matmul_f32", be.matmul_f32, (a, b, d, N // 2, N, N))
        assert len(plans) == 3
        gate.sync()
        np.testing.assert_allclose(_read(be, c, N, N), np.full((N, N), 2.0 * N))
        assert gate.queue is not None and gate.queue.ran == 6
        gate.release()
    finally:
        gate.close()


def test_arguments_are_the_same_only_as_the_same_objects_or_equal_ints() -> None:
    from worker.device_time import _same_args

    buf = object()
    assert _same_args((buf, 256, 3), (buf, int("256"), 3))
    assert not _same_args((buf, 1), (object(), 1))
    assert not _same_args((buf, 1), (buf, 1, 2))
    assert not _same_args((memoryview(b"ab"),), (memoryview(b"ab"),))  # equal contents, other memory
    assert not _same_args((1.0,), (1,))  # a float is compared as an object (the plan may close over it)
