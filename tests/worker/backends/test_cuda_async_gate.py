"""Queued cuda ops under the gate (worker.device_time with a CudaStretchTimer), on the fake driver's
asynchronous device model: launches advance the stream's device clock, events are stamped with it,
``cuEventQuery`` answers NOT_READY until the test steps the fake device (``FakeDriver.step`` /
``catch_up``), ``cuEventElapsedTime`` is the stamps' difference.

To hold the device thread until every op of a test is queued (one stretch, whatever the host's
load), a test holds the fake driver's lock while it submits: the device thread's first driver
call waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import pytest

from shared.errors import CudaError, KernelTimeout
from shared.gpu_time import GpuTimeBoard
from shared.quota import QuotaBlock
from tests.helpers.fake_cublas import FakeCublas
from tests.helpers.fake_cuda import FakeDriver
from tests.worker.test_async_ops import CountingBoard, WaitedBoard
from worker import device_time
from worker.backends.cuda import CudaBackend, CudaBuffer
from worker.backends.cuda_timing import STRETCH_RING_PAIRS, CudaStretchTimer
from worker.device_time import DeviceGate

LAUNCH_NS = 50_000
N = 1024


@pytest.fixture
def cuda() -> Iterator[tuple[FakeDriver, CudaBackend]]:
    fake = FakeDriver(memory_bytes=1 << 30)
    be = CudaBackend(driver=fake, nvrtc=fake, cublas=FakeCublas(fake))
    try:
        yield fake, be
    finally:
        be.close()


def wait_for(what: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until ``what()`` holds (the event the test means), failing after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < end, "timed out waiting for the condition"
        time.sleep(0.001)


def ready(fake: FakeDriver, be: CudaBackend) -> CudaBuffer:
    """A buffer of N ones, the kernels loaded, the stream idle; then the device model on."""
    x = be.alloc(4 * N)
    be.write(x, 0, memoryview(np.ones(N, np.float32).tobytes()))
    be.scale_f32(x, 1.0, N)  # the op kernels compiled and loaded on this thread
    be.fill_f32(x, 1.0, N)
    be._drv.call("cuStreamSynchronize", be._stream)
    fake.device_clock = True
    fake.launch_ns = LAUNCH_NS
    fake.calls.clear()
    return x


@contextmanager
def device_thread_held(fake: FakeDriver) -> Iterator[None]:
    """The device thread's driver calls wait until the block ends (its ops are all queued by then)."""
    with fake._lock:
        yield


def stretch_timer(gate: DeviceGate) -> CudaStretchTimer:
    timer = gate._qtimer
    assert isinstance(timer, CudaStretchTimer)
    return timer


def deadline() -> int:
    return time.monotonic_ns() + 60 * 10**9


def test_cuda_queues_and_its_device_thread_times_with_a_stretch_timer(cuda: tuple[FakeDriver, CudaBackend],
                                                                      block: QuotaBlock) -> None:
    fake, be = cuda
    assert be.queues_ops
    x = ready(fake, be)
    gate = DeviceGate(block, be)
    try:
        gate.submit("scale_f32", be.scale_f32, (x, 2.0, N), deadline())
        fake.catch_up()
        wait_for(lambda: gate.queue is not None and gate.queue.ran == 1)
        fake.catch_up()
        gate.sync()
        assert gate.queue is not None and gate.queue.overlapped >= 0
        timer = stretch_timer(gate)
        assert timer.capacity == STRETCH_RING_PAIRS and timer.pending == 0
        assert block.gpu_time_ns == LAUNCH_NS
    finally:
        gate.close()
    assert not fake.events  # the ring's events destroyed with the gate


def test_one_settle_per_flush_not_one_synchronise_per_chunk(cuda: tuple[FakeDriver, CudaBackend],
                                                            block: QuotaBlock) -> None:
    """Eight queued chunks: launched without any wait, nothing charged while they are pending and no
    board boundary; one settle (polling, no blocking synchronize) at the stretch's end, one finish;
    the charge is exactly the pairs' sum, and the cost model learned from each pair."""
    fake, be = cuda
    x = ready(fake, be)
    board = CountingBoard(True)
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board))
    try:
        with device_thread_held(fake):
            for _ in range(8):
                gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), deadline())
        wait_for(lambda: fake.calls.count("cuLaunchKernel") == 8 and fake.not_ready_answers > 0)
        assert block.gpu_time_ns == 0 and board.calls["finish"] == 0  # pending: no charge, no boundary
        assert fake.backlog_ns(be._stream) == 8 * LAUNCH_NS
        fake.step(8 * LAUNCH_NS)
        gate.sync()
        timer = stretch_timer(gate)
        assert timer.settles == board.calls["finish"] == 1
        assert timer.pairs_settled == 8
        assert "cuEventSynchronize" not in fake.calls and "cuStreamSynchronize" not in fake.calls
        assert block.gpu_time_ns == gate.run_time_ns == 8 * LAUNCH_NS
        assert gate.costs.factor("scale_f32", cast(Any, _plan(be, x))) > 1  # learned: 50 us, not the model's ns
        np.testing.assert_array_equal(np.frombuffer(be.read(x, 0, 4 * N), np.float32), np.ones(N))
    finally:
        gate.close()


def _plan(be: CudaBackend, x: CudaBuffer) -> object:
    from worker.chunks import plan

    return plan("scale_f32", be, (x, 1.0, N))


def test_a_full_ring_settles_early_without_a_board_boundary(cuda: tuple[FakeDriver, CudaBackend],
                                                            block: QuotaBlock) -> None:
    fake, be = cuda
    x = ready(fake, be)
    board = CountingBoard(True)
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board))
    ops = STRETCH_RING_PAIRS + 4
    try:
        with device_thread_held(fake):
            for _ in range(ops):
                gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), deadline())
        # the ring's 16 pairs are launched, then the device thread waits for them before the 17th
        wait_for(lambda: fake.calls.count("cuLaunchKernel") == STRETCH_RING_PAIRS and fake.not_ready_answers > 0)
        assert board.calls["finish"] == 0
        fake.catch_up()
        wait_for(lambda: fake.calls.count("cuLaunchKernel") == ops)
        fake.catch_up()
        gate.sync()
        assert stretch_timer(gate).settles == 2 and board.calls["finish"] == 1
        assert block.gpu_time_ns == ops * LAUNCH_NS
    finally:
        gate.close()


def test_the_lease_never_moves_while_pairs_are_pending(cuda: tuple[FakeDriver, CudaBackend],
                                                       block: QuotaBlock) -> None:
    fake, be = cuda
    x = ready(fake, be)
    board = GpuTimeBoard.create(0)
    try:
        mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        slot = mine.tenant_slot
        other = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        gate = DeviceGate(block, be, mine)
        try:
            with device_thread_held(fake):
                for _ in range(4):
                    gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), deadline())
            wait_for(lambda: fake.calls.count("cuLaunchKernel") >= 4 and fake.not_ready_answers > 0)
            # the stretch ended (the queue is empty) but its work is pending: the lease stays, uncharged
            assert board.snapshot().holder == mine.worker_slot
            assert board.used_ns(slot) == 0
            with pytest.raises(TimeoutError):
                other.acquire(time.monotonic_ns() + 200_000_000)  # past its grace, and still not taken
            assert board.snapshot().holder == mine.worker_slot
            fake.catch_up()
            gate.sync()
            assert board.used_ns(slot) == block.gpu_time_ns == 4 * LAUNCH_NS
            gate.release()
            other.acquire(deadline())  # now it goes
            assert board.snapshot().holder == other.worker_slot
            other.finish(0)
            other.release()
        finally:
            gate.close()
            mine.close()
            other.close()
    finally:
        board.unlink()
        board.close()


#: the run's deadlines the overrun test tries, shortest first: on a loaded host the device thread may
#: not launch the ops before a short one (they are refused, nothing is pending): then a longer one
OVERRUN_BUDGETS_NS = (200_000_000, 1_000_000_000, 5_000_000_000)


def test_a_deadline_with_work_pending_is_a_queue_overrun(block: QuotaBlock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device never catches up: the settle gives up at the run's deadline plus the grace, the
    worker must exit (the backend's overrun), and the lease stays with the work that may still run."""
    monkeypatch.setattr(device_time, "QUEUE_GRACE_S", 0.05)
    refused = 0
    for budget_ns in OVERRUN_BUDGETS_NS:
        fake = FakeDriver(memory_bytes=1 << 30)
        be = CudaBackend(driver=fake, nvrtc=fake, cublas=FakeCublas(fake))
        board = GpuTimeBoard.create(0)
        try:
            x = ready(fake, be)
            mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
            gate = DeviceGate(block, be, mine)
            try:
                end = time.monotonic_ns() + budget_ns
                gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), end)
                gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), end)
                with pytest.raises(KernelTimeout):
                    gate.sync(end)
                if gate.refused:  # the deadline passed before the launches: not the case under test
                    refused += gate.refused
                    continue
                # the backend marks its overrun before the gate's settle sees it raised: wait for both
                wait_for(lambda: be.queue_overrun and gate.queue_overrun and gate.queue is not None
                         and gate.queue.pending == 0)
                assert time.monotonic_ns() >= end + 50_000_000  # not given up before the deadline plus grace
                assert not gate.release(end)  # the worker must exit
                assert board.snapshot().holder == mine.worker_slot  # never handed over with work pending
                with pytest.raises(KernelTimeout):
                    be.end_run(end / 1e9)
                return
            finally:
                gate.close()
                mine.close()
        finally:
            board.unlink()
            board.close()
            be.close()
    pytest.fail(f"every deadline ({OVERRUN_BUDGETS_NS} ns) passed before the ops launched ({refused} refused)")


def test_a_fault_surfaces_at_the_settle_and_names_its_op(cuda: tuple[FakeDriver, CudaBackend],
                                                         block: QuotaBlock) -> None:
    """A launch that faults on the device: the launch succeeded, the settle's query of its pair finds
    the fault, the pairs before it are charged, the op is named, the next sync raises, and the sticky
    error marks the context lost (the worker exits as for any sticky error)."""
    fake, be = cuda
    x = ready(fake, be)
    bad = CudaBuffer(4 * N, 0x100)  # unmapped: the kernel faults when the device runs it
    gate = DeviceGate(block, be)
    try:
        with device_thread_held(fake):
            gate.submit("fill_f32", be.fill_f32, (x, 3.0, N), deadline())
            gate.submit("add_f32", be.add_f32, (x, x, x, N), deadline())
            gate.submit("scale_f32", be.scale_f32, (bad, 2.0, N), deadline())
            gate.submit("unary_f32", be.unary_f32, (0, x, x, N), deadline())
        wait_for(lambda: fake.calls.count("cuLaunchKernel") == 4 and fake.not_ready_answers > 0)
        assert be.context_lost is None  # every launch went through: nothing failed yet
        fake.catch_up()
        with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            gate.sync()
        assert gate.failed_op == "scale_f32"
        assert be.context_lost == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert block.gpu_time_ns == 2 * LAUNCH_NS  # the two pairs before the fault
        gate.sync()  # raised once
    finally:
        gate.close()


@pytest.mark.parametrize("read", ["sum_f32", "max_f32", "argmax_rows_f32", "read", "free"])
def test_reads_wait_for_the_settle_of_the_queued_work(cuda: tuple[FakeDriver, CudaBackend], block: QuotaBlock,
                                                      read: str) -> None:
    """A read of the device (the guest reads a result, a buffer, or frees one) waits until the queued
    ops' pairs are settled: nothing of it reaches the driver before, and it sees their results."""
    fake, be = cuda
    x = ready(fake, be)
    gate = DeviceGate(block, be)
    out = memoryview(bytearray(4 * 32))

    def do_read() -> object:
        if read == "sum_f32":
            return gate.op("sum_f32", be.sum_f32, (x, N))
        if read == "max_f32":
            gate.op("max_f32", be.max_f32, (x, N, out[:4]))
            return float(np.frombuffer(out[:4], np.float32)[0])
        if read == "argmax_rows_f32":
            gate.op("argmax_rows_f32", be.argmax_rows_f32, (x, 32, 32, out))
            return np.frombuffer(out, np.int32).tolist()
        gate.sync()  # what the WASM host does before a read or a free (worker.wasm.abi.device_sync)
        if read == "read":
            return float(np.frombuffer(be.read(x, 0, 4 * N), np.float32).sum())
        be.free(x)
        return None

    try:
        with device_thread_held(fake):
            for _ in range(3):
                gate.submit("scale_f32", be.scale_f32, (x, 2.0, N), deadline())
        wait_for(lambda: fake.calls.count("cuLaunchKernel") == 3 and fake.not_ready_answers > 0)
        mark, polled = len(fake.calls), fake.not_ready_answers
        got: dict[str, object] = {}
        reader = threading.Thread(target=lambda: got.update(value=do_read()))
        reader.start()
        wait_for(lambda: fake.not_ready_answers >= polled + 3)  # still settling after the read began
        assert reader.is_alive()
        assert set(fake.calls[mark:]) == {"cuEventQuery"}  # nothing of the read reached the driver
        assert block.gpu_time_ns == 0
        fake.catch_up()
        reader.join(30)
        assert not reader.is_alive()
        assert block.gpu_time_ns >= 3 * LAUNCH_NS  # settled and charged first
        expected: dict[str, object] = {"sum_f32": 8.0 * N, "max_f32": 8.0, "argmax_rows_f32": [0] * 32,
                                       "read": 8.0 * N, "free": None}
        assert got["value"] == expected[read]
    finally:
        gate.close()


@contextmanager
def device_keeps_up(fake: FakeDriver) -> Iterator[None]:
    """The fake device runs whatever is launched, soon after (a thread catching it up)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.0005):
            fake.catch_up()

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        yield
    finally:
        stop.set()
        runner.join(10)


@pytest.mark.parametrize("waited", [False, True])
def test_the_flush_follows_the_estimate_of_the_pending_work(cuda: tuple[FakeDriver, CudaBackend],
                                                            block: QuotaBlock, waited: bool) -> None:
    """Launches return at once, so the flush counts device time, not host time: with each op learned
    at 50 us and a 175 us chunk target, twelve queued ops flush every fourth op - and at every op
    (a quarter of the target) while another worker waits for the device. (Targets between the
    multiples of 50 us: an estimate a rounding below one never decides.)"""
    fake, be = cuda
    x = ready(fake, be)
    board = WaitedBoard(True) if waited else CountingBoard(True)
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board), chunk_s=3.5 * LAUNCH_NS / 1e9)
    try:
        with device_keeps_up(fake):
            gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), deadline())  # the cost model learns 50 us
            gate.sync()
            assert gate.costs.predict_ns("scale_f32", cast(Any, _plan(be, x)), N) == pytest.approx(LAUNCH_NS)
            finishes, settles = board.calls["finish"], stretch_timer(gate).settles
            with device_thread_held(fake):
                for _ in range(12):
                    gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), deadline())
            gate.sync()
        flushes = 12 if waited else 3
        assert board.calls["finish"] - finishes == flushes
        assert stretch_timer(gate).settles - settles == flushes
        assert block.gpu_time_ns == 13 * LAUNCH_NS
    finally:
        gate.close()


def test_the_context_is_made_current_once_per_thread(cuda: tuple[FakeDriver, CudaBackend], block: QuotaBlock) -> None:
    """Queued ops on the device thread and synchronous ones on the executor's alternate: neither
    thread pays a cuCtxSetCurrent per switch (the device thread made the context current once)."""
    fake, be = cuda
    x = ready(fake, be)
    fake.device_clock = False
    gate = DeviceGate(block, be)
    try:
        gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), deadline())
        gate.op("sum_f32", be.sum_f32, (x, N))
        made_current = fake.calls.count("cuCtxSetCurrent")
        assert made_current == 1  # the device thread's, once
        for _ in range(5):
            gate.submit("scale_f32", be.scale_f32, (x, 1.0, N), deadline())
            assert gate.op("sum_f32", be.sum_f32, (x, N)) == float(N)
            be.read(x, 0, 4)
        assert fake.calls.count("cuCtxSetCurrent") == made_current
    finally:
        gate.close()
