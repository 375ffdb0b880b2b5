"""The work trace (``shared.gpu_time.WorkTrace``): when a worker had device work and when the device
ran it, the intervals ``twt bench share --mix`` unions across workers into "the device busy while
any tenant has work".

Through the real gate, its device thread and a real lease board, on the stub (and the fake CUDA
driver for the pending timer's placement): an op queued behind another tenant's lease is work the
whole time it waits, a worker with an op queued behind a running one never shows a gap, and every
busy span lies inside the worker's work. Ordered by events (the board's waiting count, an op the test
releases), never by durations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.gpu_time import WORK_TRACE_ENV, GpuTimeBoard, WorkTrace, read_work_trace
from shared.quota import QuotaBlock
from supervisor.tools.bench.share import busy_while_work, covered, union
from tests.helpers.fake_cublas import FakeCublas
from tests.helpers.fake_cuda import FakeDriver
from worker.backends.base import Backend
from worker.backends.cuda import CudaBackend
from worker.backends.stub import StubBackend
from worker.device_time import DeviceGate

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0
W, B, L = WorkTrace.WORK, WorkTrace.BUSY, WorkTrace.LAUNCH


def wait_for(cond: Callable[[], bool]) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, "the state waited for never came"
        time.sleep(0.001)


@pytest.fixture
def board() -> Iterator[GpuTimeBoard]:
    b = GpuTimeBoard.create(0, quantum_s=0.005)
    try:
        yield b
    finally:
        b.unlink()
        b.close()


def _inside(inner: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(s <= inner[0] and inner[1] <= e for s, e in spans)


def test_the_work_trace_is_off_by_default(board: GpuTimeBoard, block: QuotaBlock, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORK_TRACE_ENV, raising=False)
    mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    be = StubBackend()
    gate = DeviceGate(block, be, mine)
    try:
        assert mine.work is None and gate._work is None
        buf = be.alloc(4096)
        gate.submit("fill_f32", be.fill_f32, (buf, 1.0, 1024))
        gate.op("scale_f32", be.scale_f32, (buf, 2.0, 1024))
        gate.release()
    finally:
        gate.close()
        mine.close()


def test_a_queued_op_waiting_for_anothers_lease_is_work_the_whole_wait(
        board: GpuTimeBoard, block: QuotaBlock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORK_TRACE_ENV, str(tmp_path))
    holder = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    be = StubBackend()
    gate = DeviceGate(block, be, mine)
    try:
        assert mine.work is not None
        buf = be.alloc(4096)
        assert holder.try_acquire(time.monotonic_ns())  # another tenant's chunk runs: the op must wait
        before = time.monotonic_ns()
        gate.submit("fill_f32", be.fill_f32, (buf, 1.0, 1024))
        wait_for(lambda: board.snapshot().waiting > 0)  # the device thread waits for the lease
        waiting_at = time.monotonic_ns()
        assert holder.finish(20_000, last=True, idle=True)  # lent to it
        granted_at = time.monotonic_ns()
        gate.sync()
        after = time.monotonic_ns()
        gate.release()  # the run's end writes its rows
        rows = read_work_trace(str(tmp_path))
        work, busy = union(rows[W]), union(rows[B])
        assert len(work) == 1 and before <= work[0][0] <= waiting_at and granted_at <= work[0][1] <= after
        assert busy and all(_inside(b, work) for b in busy) and busy[0][0] >= waiting_at
        assert all(_inside(b, union(rows[L])) for b in busy)
        # so the wait counts against the device: work all through the window, busy only after the grant
        got = busy_while_work(rows, [(before, after)])
        assert got["busy"] is not None and got["busy"] < 1.0
        assert covered(work, before, after) >= waiting_at - work[0][0]
    finally:
        gate.close()
        mine.close()
        holder.close()


def test_an_op_queued_behind_a_running_one_leaves_no_gap_in_the_work(
        board: GpuTimeBoard, block: QuotaBlock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORK_TRACE_ENV, str(tmp_path))
    mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    be = StubBackend()
    gate = DeviceGate(block, be, mine)
    go, started = threading.Event(), threading.Event()

    def slow(*_: object) -> None:
        started.set()
        assert go.wait(WAIT_S)

    try:
        buf = be.alloc(4096)
        gate.submit("slow", slow, ())
        assert started.wait(WAIT_S)
        gate.submit("fill_f32", be.fill_f32, (buf, 1.0, 1024))  # queued behind the running op
        mid = time.monotonic_ns()
        go.set()
        gate.sync()
        gate.release()
        # a second stretch, after the queue ran empty: its own interval
        gate.submit("fill_f32", be.fill_f32, (buf, 2.0, 1024))
        gate.sync()
        gate.release()
        rows = read_work_trace(str(tmp_path))
        assert len(rows[W]) == 2, rows[W]  # one per stretch of queued work, however many ops
        first, second = sorted(map(tuple, rows[W].tolist()))
        assert first[0] < mid < first[1] <= second[0]
        assert all(_inside(b, union(rows[W])) for b in union(rows[B]))
    finally:
        go.set()
        gate.close()
        mine.close()


def test_a_synchronous_op_is_work_from_its_call_to_its_return(
        board: GpuTimeBoard, block: QuotaBlock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORK_TRACE_ENV, str(tmp_path))
    mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    be = StubBackend()
    gate = DeviceGate(block, be, mine, chunk_s=1e-9)  # in many chunks: a busy and a launch row each
    try:
        buf = be.alloc(4 * 64)
        t0 = time.monotonic_ns()
        gate.op("scale_f32", be.scale_f32, (buf, 2.0, 64))
        t1 = time.monotonic_ns()
        gate.release()
        rows = read_work_trace(str(tmp_path))
        assert len(rows[W]) == 1 and t0 <= rows[W][0][0] and rows[W][0][1] <= t1
        assert len(rows[L]) == gate.chunks > 3
        assert all(_inside(b, rows[L]) for b in rows[B]) and all(_inside(x, rows[W]) for x in rows[L])
    finally:
        gate.close()
        mine.close()


def test_cuda_chunks_settled_later_are_placed_one_after_another_inside_the_work(
        board: GpuTimeBoard, block: QuotaBlock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORK_TRACE_ENV, str(tmp_path))
    mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    fake = FakeDriver(memory_bytes=1 << 30)
    be: Backend = CudaBackend(driver=fake, nvrtc=fake, cublas=FakeCublas(fake))
    gate = DeviceGate(block, be, mine)
    try:
        buf = be.alloc(4 * 4096)
        for _ in range(20):
            gate.submit("fill_f32", be.fill_f32, (buf, 1.0, 4096))
        gate.sync()
        gate.release()
        rows = read_work_trace(str(tmp_path))
        busy = [tuple(b) for b in rows[B].tolist()]
        assert busy and not len(rows[L])  # asynchronous launches have no wall span of their own
        assert all(b[1] <= c[0] for b, c in zip(busy, busy[1:]))  # serial on the stream, in order
        assert all(_inside(b, union(rows[W])) for b in busy)
    finally:
        gate.close()
        be.close()
        mine.close()
