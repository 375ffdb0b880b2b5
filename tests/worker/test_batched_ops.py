"""Small queued ops go to the device as one launch (worker.device_time ``DeviceGate._queued_batch``):
one lease check, one measurement and one flush decision for a run of them, each op still its own
call in order, its wait observed, its error its own; a batch stays inside the preemption bound; the
cuda backend launches each op alone (its event pairs name the op that faulted).

And the device thread, its queue empty, does not hold the device waiting for the next op of a
worker whose ops come far apart while another worker waits (it would lend at the stretch's end).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest

from shared.errors import CudaError
from shared.gpu_time import GpuTimeBoard
from shared.quota import QuotaBlock
from tests.worker.test_async_ops import WAIT_S, CountingBoard, WaitedBoard, _Slow, make_backend, wait_for
from worker.backends.stub import StubBackend
from worker.backends.timing import ThreadTimer
from worker.chunks import plan
from worker.device_time import _BATCH_DIV, _NOT_SMALL, _SMALL_DIV, DeviceGate, _Item

pytestmark = pytest.mark.timeout(120)


class _CountingTimer(ThreadTimer):
    """The stub's queue timer, counting its measurements (one per launch)."""

    def __init__(self) -> None:
        self.calls = 0

    def time(self, fn: Callable[..., object], *args: object) -> int:
        self.calls += 1
        return super().time(fn, *args)


def _gate(block: QuotaBlock, board: CountingBoard | None = None,
          chunk_s: float = 0.002) -> tuple[DeviceGate, StubBackend, _CountingTimer]:
    be = StubBackend()
    timer = _CountingTimer()
    be.queue_timer = lambda: timer  # type: ignore[method-assign]
    return DeviceGate(block, be, cast(GpuTimeBoard, board) if board is not None else None,
                      chunk_s=chunk_s), be, timer


def _values(be: StubBackend, buf: object, n: int) -> list[float]:
    return [float(v) for v in np.frombuffer(be.read(buf, 0, 4 * n), dtype=np.float32)]  # type: ignore[arg-type]


def test_a_run_of_small_queued_ops_is_one_launch_each_op_still_its_own(block: QuotaBlock) -> None:
    board = CountingBoard(True)
    # the chunk target longer than the test: no boundary falls inside the stretch however slow the host
    gate, be, timer = _gate(block, board, chunk_s=3600.0)
    slow = _Slow()
    try:
        bufs = [be.alloc(64 * 4) for _ in range(30)]
        gate.submit("slow", slow, ())  # an op of no known plan: launched alone
        assert slow.started.wait(WAIT_S)
        for i, buf in enumerate(bufs):  # queued meanwhile: one run of small ops
            gate.submit("fill_f32", be.fill_f32, (buf, float(i), 64))
        slow.go.set()
        gate.sync()
        assert [_values(be, b, 64) for b in bufs] == [[float(i)] * 64 for i in range(30)]  # each op, in order
        assert timer.calls == 2  # the slow op, then the 30 fills as one launch (30 + 1 before)
        assert gate.chunks == 31  # launches are still counted per op
        assert board.calls["acquire"] == 1
        assert block.snapshot().gpu_waits == 31  # every op's wait observed
        assert block.gpu_time_ns == gate.run_time_ns > 0
    finally:
        slow.go.set()
        gate.close()


def test_an_op_failing_inside_a_batch_keeps_the_ops_before_and_drops_the_rest(block: QuotaBlock) -> None:
    slow = _Slow()

    def fault(*_: object) -> None:
        raise CudaError("cuLaunchKernel", "CUDA_ERROR_ILLEGAL_ADDRESS", 700)

    gate, be, timer = _gate(block, chunk_s=3600.0)
    try:
        before, after = be.alloc(64 * 4), be.alloc(64 * 4)
        gate.submit("slow", slow, ())
        assert slow.started.wait(WAIT_S)
        for _ in range(3):
            gate.submit("fill_f32", be.fill_f32, (before, 2.0, 64))
        gate.submit("axpy_f32", fault, (64, 1.0, before, after))  # small too: inside the batch
        for _ in range(2):
            gate.submit("fill_f32", be.fill_f32, (after, 3.0, 64))
        slow.go.set()
        with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
            gate.sync()
        assert timer.calls == 2  # the fault was inside the one launch of the small ops
        assert gate.failed_op == "axpy_f32"
        assert _values(be, before, 64) == [2.0] * 64 and _values(be, after, 64) == [0.0] * 64
        queue = gate.queue
        assert queue is not None and queue.ran == 5 and queue.dropped == 2  # slow, 3 fills, the fault
    finally:
        slow.go.set()
        gate.close()


def test_a_batch_stays_inside_the_preemption_bound(block: QuotaBlock) -> None:
    """Small ops whose estimates add up past the batch's bound go in several launches, in order."""
    gate, be, timer = _gate(block, chunk_s=200e-6)  # a tiny chunk: ~12-24 fills of 1024 floats per launch
    slow = _Slow()
    sizes: list[int] = []
    original = gate._queued_batch

    def record(items: list[_Item]) -> None:
        assert sum(it.est for it in items) <= gate.chunk_ns // _BATCH_DIV
        sizes.append(len(items))
        original(items)

    gate._queued_batch = record  # type: ignore[method-assign]
    try:
        buf = be.alloc(1024 * 4)
        gate.submit("slow", slow, ())
        assert slow.started.wait(WAIT_S)
        for i in range(60):
            gate.submit("fill_f32", be.fill_f32, (buf, float(i), 1024))
        slow.go.set()
        gate.sync()
        assert _values(be, buf, 64) == [59.0] * 64  # in order: the last fill wins
        assert len(sizes) > 1 and sum(sizes) <= 60 and max(sizes) < 60
    finally:
        slow.go.set()
        gate.close()


def test_the_cuda_backend_launches_each_queued_op_alone(block: QuotaBlock) -> None:
    be = make_backend("cuda")
    gate = DeviceGate(block, be)
    try:
        buf = be.alloc(64 * 4)
        items = [_Item("fill_f32", be.fill_f32, (buf, 1.0, 64), None, 256, time.monotonic_ns(), 0)
                 for _ in range(8)]
        assert gate._small_run(items, 0) == 0  # its chunks' times come from event pairs, one per op
        stub = DeviceGate(block, StubBackend())
        sbuf = stub.backend.alloc(64 * 4)
        assert stub._small_run([_Item("fill_f32", stub.backend.fill_f32, (sbuf, 1.0, 64), None, 256,
                                      time.monotonic_ns(), 0)] * 8, 0) == 8
        stub.close()
    finally:
        gate.close()


@pytest.mark.parametrize("chatty", [True, False])
def test_an_empty_queue_lends_at_once_for_a_chatty_worker_while_another_waits(
        block: QuotaBlock, monkeypatch: pytest.MonkeyPatch, chatty: bool) -> None:
    """A worker whose ops come far apart next to their device time does not wait for its next op
    with the device held while another worker waits: the stretch ends (lent) at once. A busy worker
    still waits the linger for its next op (here made endless: it ends only at the next submit)."""
    import worker.device_time as device_time

    monkeypatch.setattr(device_time, "QUEUE_LINGER_S", 3600.0)
    board = WaitedBoard(True)
    gate = DeviceGate(block, StubBackend(), cast(GpuTimeBoard, board), chunk_s=3600.0)
    done = threading.Event()
    try:
        gate._submit_gap_ns, gate._op_dev_ns = (500_000, 1_000) if chatty else (20_000, 10_000)
        gate._submit_at = 0  # the next submit does not move the interval
        gate.submit("op", done.set, ())
        assert done.wait(WAIT_S)
        if chatty:
            wait_for(lambda: board.calls["finish"] == 1)
            assert board.idle == [True]  # lent at the stretch's end
        else:
            # the device thread holds on for the next op: the stretch goes on through it
            wait_for(lambda: gate.queue is not None and gate.queue.ran == 1)
            assert board.calls["finish"] == 0
            again = threading.Event()
            gate.submit("op", again.set, ())
            assert again.wait(WAIT_S)
            assert board.calls["acquire"] == 1
    finally:
        gate.close()


@pytest.mark.parametrize("kind", ["stub", "cuda"])
@pytest.mark.parametrize("chatty", [True, False])
def test_a_chatty_workers_stretch_ends_after_its_pass_while_another_waits(block: QuotaBlock, chatty: bool,
                                                                          kind: str) -> None:
    """Ops a chatty worker's guest queues while its device thread runs a pass do not continue the
    stretch while another worker waits: the stretch ends (lent) after the pass, and the next pass
    asks for the lease again (a trickle of ops held the device pass after pass for a few us of work
    each). A busy worker's stretch goes on through them (one acquire, one finish). On cuda too,
    where small ops launch alone (fake driver)."""
    board = WaitedBoard(True)
    be = make_backend(kind)
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board), chunk_s=3600.0)
    slow = _Slow()

    def slow_fill(buf: object, value: float, n: int) -> None:
        slow()
        be.fill_f32(buf, value, n)  # type: ignore[arg-type]

    try:
        buf = be.alloc(64 * 4)
        # chatty: its ops 10 s apart on average, each ~1 us on the device; busy: back to back
        gate._submit_gap_ns, gate._op_dev_ns = (10**10, 1_000) if chatty else (20_000, 10**9)
        gate._submit_at = 0
        gate.submit("fill_f32", slow_fill, (buf, 0.0, 64))  # a small op (planned as a fill)
        assert slow.started.wait(WAIT_S)
        for i in range(3):  # queued while the first pass runs
            gate._submit_at = 0  # (the test's own pace is no gap)
            gate.submit("fill_f32", be.fill_f32, (buf, float(i + 1), 64))
        slow.go.set()
        gate.sync()
        assert _values(be, buf, 64) == [3.0] * 64  # type: ignore[arg-type]  # every op ran, in order
        if chatty:
            assert board.calls["acquire"] == 2 and board.idle == [True, True]
        else:
            assert board.calls["acquire"] == 1 and board.idle == [False]
    finally:
        slow.go.set()
        gate.close()


def test_ops_queued_while_the_lease_is_awaited_join_the_first_ones_launch(block: QuotaBlock) -> None:
    """The device thread takes the lease before it looks at the queue's ops: what the guest queues
    during the wait goes to the device in the same launch as the op that started the wait."""
    board = GpuTimeBoard.create(0, quantum_s=0.01)
    try:
        mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        other = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        be = StubBackend()
        timer = _CountingTimer()
        be.queue_timer = lambda: timer  # type: ignore[method-assign]
        gate = DeviceGate(block, be, mine, chunk_s=3600.0)
        try:
            other.acquire(time.monotonic_ns() + int(60e9))  # the device is another worker's
            buf = be.alloc(64 * 4)
            gate.submit("fill_f32", be.fill_f32, (buf, 0.0, 64))
            wait_for(lambda: board.snapshot().waiting == 1)  # the device thread waits for the lease
            for i in range(1, 21):
                gate.submit("fill_f32", be.fill_f32, (buf, float(i), 64))
            other.finish(1000)
            other.release()
            gate.sync()
            assert _values(be, buf, 64) == [20.0] * 64
            assert timer.calls == 1 and gate.chunks == 21
            assert block.snapshot().gpu_waits == 21
            gate.release()
        finally:
            gate.close()
            mine.close()
            other.close()
    finally:
        board.unlink()
        board.close()


class _LeaseAfterPlanning(CountingBoard):
    """A board whose lease takes ``wait_s`` to come, noting which chunk the gate had planned when it
    asked (``DeviceGate._chunk``: the op name of the chunk about to launch)."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(True)
        self.wait_s = wait_s
        self.gate: DeviceGate | None = None
        self.planned: list[str] = []

    def acquire(self, deadline_ns: int | None = None, gated: object = None) -> int:
        super().acquire(deadline_ns, gated)  # type: ignore[arg-type]
        assert self.gate is not None
        self.planned.append(self.gate._chunk[0])
        t0 = time.monotonic_ns()
        time.sleep(self.wait_s)  # the lease is another worker's meanwhile
        return time.monotonic_ns() - t0


def test_a_big_op_is_planned_before_the_lease_is_asked_for_and_its_wait_still_counts(block: QuotaBlock) -> None:
    """After a handover the device waits for whatever the grantee's device thread does between its
    grant and its launch (cold, on a core it had to win): an op that is not small has its plan and
    first chunk made before the wait. The lease wait is still every waiting op's wait - the second
    GEMM, queued behind the first during it, waited for the device too (it is not this worker's own
    busy time)."""
    wait_s = 0.05
    board = _LeaseAfterPlanning(wait_s)
    gate, be, _ = _gate(block, board)
    board.gate = gate
    try:
        n = 256
        a, b, c = (be.alloc(4 * n * n) for _ in range(3))
        gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n))
        gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n))
        gate.sync()
        assert board.planned and board.planned[0] == "matmul_f32"  # planned when the lease was asked for
        snap = block.snapshot()
        assert snap.gpu_waits >= 2
        assert snap.gpu_wait_ns >= 2 * wait_s * 1e9 * 0.95  # both GEMMs waited out the lease
    finally:
        gate.close()


def test_a_batchs_end_from_the_submitters_estimates_is_the_walks(block: QuotaBlock) -> None:
    """The device thread finds a batch's end from the estimates the submitting thread recorded
    (``_Item.small_est``: C loops) - the same end as the walk that plans each op itself (an item
    queued unplanned): at a big op, at the batch's bound, at the list's end."""
    gate, be, _ = _gate(block, chunk_s=200e-6)  # ~12-24 fills of 1024 floats per launch
    try:
        n = 256
        fill = (be.alloc(1024 * 4), 1.0, 1024)
        a, b, c = (be.alloc(4 * n * n) for _ in range(3))
        shapes = [["fill_f32"] * 5 + ["matmul_f32"] + ["fill_f32"] * 3, ["fill_f32"] * 60, ["fill_f32"] * 3,
                  ["matmul_f32", "fill_f32"]]
        runs: dict[int, int] = {}
        for names in shapes:
            planned: list[_Item] = []
            for name in names:
                args: tuple[object, ...] = fill if name == "fill_f32" else (a, b, c, n, n, n)
                fn = be.fill_f32 if name == "fill_f32" else be.matmul_f32
                p = plan(name, be, args)
                assert p is not None
                est = int(gate.costs.predict_ns(name, p, p.units))
                small = p.combine is None and 0 <= est <= gate.chunk_ns // _SMALL_DIV
                planned.append(_Item(name, fn, args, None, 0, 0, 0, p, est, True, est if small else _NOT_SMALL))
            walked = [_Item(it.name, it.fn, it.args, None, 0, 0, 0) for it in planned]  # unplanned
            for i in range(len(names)):
                assert gate._small_run(planned, i) == gate._small_run(walked, i), (names, i)
            runs[len(names)] = gate._small_run(planned, 0)
        assert runs[9] == 5 and runs[2] == 0  # a big op ends a batch; a big op first is no batch
        assert 1 < runs[60] < 60  # the bound cuts a long run of small ops
    finally:
        gate.close()
