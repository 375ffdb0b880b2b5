"""Queued device ops (worker.device_time): an op that writes device buffers only is queued and the
host call returns; what the guest reads synchronises.

Gate-level tests block the device thread on an event to order things
deterministically (never on a duration); WASM-level tests run a guest loop of
queued ops then a read, on the stub (queued) and on the fake CUDA driver (its
stream is the queue; the gate runs its ops at once), against the result the
synchronous path gives. A worker SIGKILLed with queued work loses its lease.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

from shared.errors import CudaError, KernelTimeout
from shared.gpu_time import GpuTimeBoard
from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from tests.helpers.fake_cublas import FakeCublas
from tests.helpers.fake_cuda import FakeDriver
from tests.helpers.timeouts import scaled
from worker.backends.base import Backend, DeviceBuffer
from worker.backends.cuda import CudaBackend
from worker.backends.stub import StubBackend
from worker.context import TenantContext
from worker.device_time import MAX_QUEUED_OPS, DeviceGate, DeviceQueue, QueueOverrun
from worker.wasm import ErrorCode, WasmHost

pytestmark = pytest.mark.timeout(120)

#: how long a test waits for a state it means (a thread blocked, an op started) before failing
WAIT_S = scaled(30.0)


def wait_for(cond: Callable[[], bool]) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, "the state waited for never came"
        time.sleep(0.001)


class _Slow:
    """An op the test releases: it waits on ``go``, and says it started."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.started = threading.Event()

    def __call__(self, *args: object) -> None:
        self.started.set()
        assert self.go.wait(WAIT_S)


def make_backend(kind: str) -> Backend:
    if kind == "stub":
        return StubBackend()
    fake = FakeDriver(memory_bytes=1 << 30)
    return CudaBackend(driver=fake, nvrtc=fake, cublas=FakeCublas(fake))


# ------------------------------------------------------------------ the gate and its queue


def test_host_work_overlaps_device_work(block: QuotaBlock) -> None:
    """A submit returns while the device thread still runs the op (event order, not speed)."""
    gate = DeviceGate(block, StubBackend())
    events: list[str] = []
    go = threading.Event()
    started = threading.Event()

    def op() -> None:
        started.set()
        assert go.wait(WAIT_S)
        events.append("device op done")

    try:
        gate.submit("op", op, ())
        assert started.wait(WAIT_S)
        events.append("host returned")  # the device is still inside the op: host work overlaps it
        gate.submit("op2", lambda: events.append("second op"), ())
        assert gate.queue is not None and gate.queue.overlapped >= 1
        go.set()
        gate.sync()
        assert events == ["host returned", "device op done", "second op"]
        assert gate.queue.ran == 2 and gate.queue.pending == 0
    finally:
        go.set()
        gate.close()


def test_a_full_queue_makes_the_host_wait_and_memory_stays_bounded(block: QuotaBlock) -> None:
    """A guest submitting far more than the bound waits for room: never more than the bound queued."""
    gate = DeviceGate(block, StubBackend())
    go = threading.Event()
    ran: list[int] = []

    def first() -> None:
        assert go.wait(WAIT_S)

    total = 10 * MAX_QUEUED_OPS
    submitted = threading.Event()

    def host() -> None:
        gate.submit("op", first, ())
        for i in range(total):
            gate.submit("op", ran.append, (i,))
        submitted.set()

    t = threading.Thread(target=host)
    t.start()
    try:
        wait_for(lambda: gate.queue is not None and gate.queue.waited_full > 0)
        assert not submitted.is_set()  # the host is held at the bound, not queueing on
        assert gate.queue is not None and gate.queue.pending <= MAX_QUEUED_OPS + 1
        go.set()
        assert submitted.wait(WAIT_S)
        gate.sync()
        assert ran == list(range(total))  # in order, none lost
        assert gate.queue.peak_ops <= MAX_QUEUED_OPS
    finally:
        go.set()
        t.join(WAIT_S)
        gate.close()


def test_the_queue_is_bounded_in_bytes_too(block: QuotaBlock) -> None:
    """Ops naming more buffer bytes than the bound wait; one op larger than the bound runs alone."""
    gate = DeviceGate(block, StubBackend())
    gate.queue = DeviceQueue(gate._queued_items, gate._end_stretch, max_ops=100, max_bytes=1000)
    be = StubBackend()
    bufs = {n: be.alloc(n) for n in (600, 300, 800, 5000)}
    go = threading.Event()
    try:
        gate.submit("slow", lambda _b: go.wait(WAIT_S), (bufs[600],))
        gate.submit("op", lambda _b: None, (bufs[300],))  # the first is running: 300 queued
        done = threading.Event()

        def more() -> None:
            gate.submit("op", lambda _b: None, (bufs[800],))  # 300 + 800 > 1000: waits until the 300 ran
            gate.submit("op", lambda _b: None, (bufs[5000],))  # alone larger than the bound: an empty queue takes it
            done.set()

        t = threading.Thread(target=more)
        t.start()
        wait_for(lambda: gate.queue is not None and gate.queue.waited_full > 0)
        assert not done.is_set()
        go.set()
        assert done.wait(WAIT_S)
        t.join(WAIT_S)
        gate.sync()
        assert gate.queue.peak_bytes <= 5000 and gate.queue.ran == 4
    finally:
        go.set()
        gate.close()


def test_a_run_longer_than_the_bound_keeps_the_queue_fed_as_its_ops_complete(block: QuotaBlock) -> None:
    """A guest queueing more ops than the bound gets room as the device thread's ops complete, not
    only once every op the device thread took has run: with four ops taken and two of them done, the
    guest's waiting submits go in while the other two still run - the queue never runs dry behind a
    pass (a run's last submits used to wait for the whole pass, the device idle until they came)."""
    gate = DeviceGate(block, StubBackend())
    queue = gate.queue = DeviceQueue(gate._queued_items, gate._end_stretch, max_ops=4)
    slow = [_Slow() for _ in range(5)]
    admitted: list[int] = []
    ran: list[int] = []

    def host() -> None:
        for i in range(1, 8):
            gate.submit("op", slow[i] if i < 5 else ran.append, () if i < 5 else (i,))
            admitted.append(i)

    t = threading.Thread(target=host)
    try:
        gate.submit("op", slow[0], ())
        assert slow[0].started.wait(WAIT_S)  # the first pass: op 0 alone, held
        t.start()
        wait_for(lambda: queue.waited_full > 0)
        assert admitted == [1, 2, 3, 4]  # four queued behind the running op: op 5 waits for room
        slow[0].go.set()  # the next pass takes ops 1-4: op 5 goes in, op 6 waits
        assert slow[1].started.wait(WAIT_S)
        wait_for(lambda: len(admitted) == 5 and queue.waited_full > 1)
        slow[1].go.set()
        slow[2].go.set()
        assert slow[3].started.wait(WAIT_S)
        # ops 3 and 4 of the pass not complete (3 running): room for ops 6 and 7 now, not after op 4
        wait_for(lambda: len(admitted) == 7)
        assert not slow[4].started.is_set()
        assert queue.peak_ops <= 4
        slow[3].go.set()
        slow[4].go.set()
        t.join(WAIT_S)
        gate.sync()
        assert ran == [5, 6, 7] and queue.ran == 8
    finally:
        for op in slow:
            op.go.set()
        if t.ident is not None:
            t.join(WAIT_S)
        gate.close()


def test_a_queued_ops_error_surfaces_at_the_next_sync_and_drops_the_rest(block: QuotaBlock) -> None:
    gate = DeviceGate(block, StubBackend())
    after: list[int] = []
    go = threading.Event()

    def fault() -> None:
        assert go.wait(WAIT_S)
        raise CudaError("cuLaunchKernel", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")

    try:
        gate.submit("bad", fault, ())  # returns: the fault happens later, on the device
        gate.submit("after", after.append, (1,))
        go.set()
        wait_for(lambda: gate.queue is not None and gate.queue.pending == 0)
        gate.submit("after the fault", after.append, (2,))  # dropped too, and raises nothing
        with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
            gate.op("sum_f32", lambda: 1.0, ())  # the next synchronising call
        assert after == []  # dropped behind the fault, as on a CUDA stream
        assert gate.op("sum_f32", lambda: 2.0, ()) == 2.0  # reported once
    finally:
        go.set()
        gate.close()


def test_a_deadline_with_queued_work_ends_in_a_timeout_and_drops_it(block: QuotaBlock) -> None:
    gate = DeviceGate(block, StubBackend())
    slow = _Slow()
    later: list[int] = []
    try:
        # in flight whatever the load (a device thread scheduled late would refuse it unstarted)
        gate.submit("slow", slow, (), time.monotonic_ns() + int(3600e9))
        assert slow.started.wait(WAIT_S)
        deadline = time.monotonic_ns() + 50_000_000
        for i in range(5):
            gate.submit("op", later.append, (i,), deadline)
        wait_for(lambda: time.monotonic_ns() > deadline)
        slow.go.set()  # the op in flight ends past the deadline; the queued ones must not start
        with pytest.raises(KernelTimeout, match="deadline passed with device work queued"):
            gate.sync()  # waits for the refusal itself (a starved device thread is no overrun here)
        assert later == []
        assert gate.refused == 1
    finally:
        slow.go.set()
        gate.close()


class CountingBoard:
    """A board that counts what the gate asks of it (the real board's methods, no device)."""

    name = "twt-test-no-such-board"  # no /dev/shm file: the stub's serialising flock is skipped (logged)
    trace = None  # the handover trace: off
    worker_slot = 0

    def __init__(self, scheduler: bool) -> None:
        self.scheduler = scheduler
        self.calls: dict[str, int] = {"acquire": 0, "finish": 0, "release": 0, "throttled_wait_ns": 0}
        #: the ``idle`` flag of every finish (a stretch's end that lends the device)
        self.idle: list[bool] = []
        #: the ``idle`` flag of every end_op
        self.ended: list[bool] = []

    def acquire(self, deadline_ns: int | None = None, gated: object = None) -> int:
        self.calls["acquire"] += 1
        return 0

    def finish(self, charged_ns: int, now: int | None = None, *, last: bool = True, idle: bool = False,
               chunk_from: int = 0) -> bool:
        self.calls["finish"] += 1
        self.idle.append(idle)
        return False

    def end_op(self, *, idle: bool = False) -> bool:
        """A stretch whose last op ended at a boundary already told (``last=False``)."""
        self.calls["end_op"] = self.calls.get("end_op", 0) + 1
        self.ended.append(idle)
        return False

    def throttled_wait_ns(self) -> int:
        self.calls["throttled_wait_ns"] += 1
        return 0

    def others_waiting(self) -> bool:
        self.calls["others_waiting"] = self.calls.get("others_waiting", 0) + 1
        return False

    def quiet(self) -> bool:
        return False

    def holds(self) -> bool:
        return False  # (the executor's release passes the device on: counted once)

    def release(self) -> None:
        self.calls["release"] += 1

    def close(self) -> None:
        pass


class WaitedBoard(CountingBoard):
    """A counting board on which another worker always waits."""

    def others_waiting(self) -> bool:
        super().others_waiting()
        return True


class QuietBoard(WaitedBoard):
    """A waited board whose last answer always holds (``GpuTimeBoard.quiet``: only siblings wait inside
    the quantum); every finish's charge and ``chunk_from`` recorded."""

    def __init__(self) -> None:
        super().__init__(True)
        self.told: list[tuple[int, int, int]] = []  # (charged ns, chunk_from, when)

    def finish(self, charged_ns: int, now: int | None = None, *, last: bool = True, idle: bool = False,
               chunk_from: int = 0) -> bool:
        self.told.append((charged_ns, chunk_from, time.monotonic_ns()))
        return super().finish(charged_ns, now, last=last, idle=idle, chunk_from=chunk_from)

    def quiet(self) -> bool:
        self.calls["quiet"] = self.calls.get("quiet", 0) + 1
        return True

    def charge(self, charged_ns: int) -> None:
        """The stub's executor: chunks launched before a boundary and done after it, charged without
        a finish (``GpuTimeBoard.charge``) - told too."""
        self.told.append((charged_ns, 0, time.monotonic_ns()))


def test_boundaries_skipped_while_the_board_is_quiet_still_tell_it_all_the_device_time(block: QuotaBlock) -> None:
    """A stretch of big queued ops beside a waiter whose board stays quiet: the gate may skip the
    boundaries between them (no finish), and every op still runs, the board is told all of their
    device time by the stretch's end, and a finish after skipped boundaries names where the last
    chunk began - inside the stretch, before the finish (never a timing: what was told, in order)."""
    board = QuietBoard()
    be = StubBackend()
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board))
    n = 128
    try:
        a, b, c = be.alloc(n * n * 4), be.alloc(n * n * 4), be.alloc(n * n * 4)
        be.fill_f32(a, 1.0, n * n)
        be.fill_f32(b, 1.0, n * n)
        t0 = time.monotonic_ns()
        for _ in range(16):
            gate.submit("matmul_f32", be.matmul_f32, (a, b, c, n, n, n), time.monotonic_ns() + 10**10)
        gate.sync()
        assert be.read(c, 0, 4) == struct.pack("<f", float(n))
        assert gate.queue is not None and gate.queue.ran == 16
        assert sum(ns for ns, _, _ in board.told) == gate.run_time_ns > 0  # all of it told
        for _, chunk_from, when in board.told:
            assert chunk_from == 0 or t0 < chunk_from <= when
        gate.release()
    finally:
        gate.close()


@pytest.mark.parametrize("scheduler", [False, True])
def test_with_the_scheduler_off_the_board_is_never_asked(block: QuotaBlock, scheduler: bool) -> None:
    board = CountingBoard(scheduler)
    be = StubBackend()
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board))
    try:
        buf = be.alloc(4096)
        gate.submit("fill_f32", be.fill_f32, (buf, 1.0, 1024), time.monotonic_ns() + 10**10)
        assert gate.op("sum_f32", be.sum_f32, (buf, 1024), time.monotonic_ns() + 10**10) == 1024.0
        gate.release()
        asked = sum(board.calls.values())
        if scheduler:
            # the queued fill is one stretch (one acquire, told at its end), the sum one more
            assert board.calls["acquire"] == 2 and board.calls["finish"] == 2 and board.calls["release"] == 1
        else:
            assert asked == 0, board.calls
        assert gate.run_time_ns > 0  # timed and charged all the same
    finally:
        gate.close()


def test_with_the_scheduler_off_the_stub_device_still_runs_one_op_at_a_time() -> None:
    """No board call, but two workers' stub ops never overlap (a GPU time-slices its contexts)."""
    board = GpuTimeBoard.create(0, scheduler=False)
    blocks: list[QuotaBlock] = []
    gates: list[DeviceGate] = []
    try:
        with QuotaBlock.create("serial") as owner:
            for _ in range(2):
                blocks.append(QuotaBlock.attach(owner.name, instance=0))
                w = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
                gates.append(DeviceGate(blocks[-1], StubBackend(), w))
            inside = [0]
            most = [0]
            lock = threading.Lock()

            def op() -> None:
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.0005)  # the GIL is released: without the device lock the other op runs now
                with lock:
                    inside[0] -= 1

            for g in gates:
                for _ in range(40):
                    g.submit("op", op, ())
            for g in gates:
                g.sync()
            assert most[0] == 1
            assert board.snapshot().holder != gates[0].board.worker_slot  # type: ignore[union-attr]
            for g in gates:
                g.close()
            gates.clear()
    finally:
        for g in gates:
            g.close()
        for b in blocks:
            b.close()
        board.unlink()
        board.close()


def test_queued_ops_take_the_real_lease_on_the_device_thread(block: QuotaBlock) -> None:
    """With a real board the device thread holds the lease while the queued work runs; release hands it back."""
    board = GpuTimeBoard.create(0)
    try:
        mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        be = StubBackend()
        gate = DeviceGate(block, be, mine)
        try:
            buf = be.alloc(4096)
            for _ in range(10):
                gate.submit("fill_f32", be.fill_f32, (buf, 2.0, 1024), time.monotonic_ns() + 10**10)
            gate.sync()
            assert board.snapshot().holder == mine.worker_slot
            gate.release()
            assert board.snapshot().holder != mine.worker_slot
            assert block.gpu_time_ns > 0
        finally:
            gate.close()
            mine.close()
    finally:
        board.unlink()
        board.close()


class _Charge:
    """A queue timer charging ``factor`` times each op's wall time: 0 for a device left idle (the op is
    the device thread's own host work), 4 for one kept busy whatever the host's load (the stretch's
    hold would have to stall 32x an op's time between ops to look idle)."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def time(self, fn: Callable[..., object], *args: object) -> int:
        t0 = time.monotonic_ns()
        fn(*args)
        return self.factor * (time.monotonic_ns() - t0)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("device_work", [False, True])
def test_a_stretch_holding_an_idle_device_lends_it_to_a_waiter(block: QuotaBlock, monkeypatch: pytest.MonkeyPatch,
                                                               device_work: bool) -> None:
    """While another worker waits, a stretch whose device work is a small part of its hold (a chatty
    tenant whose ops arrive as fast as the device thread's own host work runs them: its queue never
    runs empty) lends the device at an op's end; a stretch of device work keeps it inside its quantum."""
    board = GpuTimeBoard.create(0, quantum_s=1.0)  # the longest: no claim comes due inside the test
    try:
        # the holder's weight keeps its pass from running a quantum ahead of the waiter's, however long a
        # loaded host makes the test: only the lend can hand the device over inside the stretch
        mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1000.0))
        other = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        be = StubBackend()
        monkeypatch.setattr(be, "queue_timer", lambda: _Charge(4 if device_work else 0))
        gate = DeviceGate(block, be, mine)
        got: list[int] = []  # how many of the gate's ops had run when the waiter got the device

        def waiter() -> None:
            other.acquire(time.monotonic_ns() + 10**11)
            queue = gate.queue
            got.append(queue.ran if queue is not None else -1)
            other.finish(1000)
            other.release()

        try:
            slow = _Slow()
            gate.submit("host_paced", slow, (), time.monotonic_ns() + 10**11)
            assert slow.started.wait(WAIT_S)  # the stretch holds the lease, busy
            thread = threading.Thread(target=waiter)
            thread.start()
            wait_for(lambda: board.snapshot().waiting == 1)
            for _ in range(5):
                gate.submit("host_paced", time.sleep, (0.001,), time.monotonic_ns() + 10**11)
            slow.go.set()
            gate.sync()
            ran_all = gate.queue is not None and gate.queue.ran == 6
            gate.release()
            thread.join(WAIT_S)
            assert ran_all and got
            if device_work:
                assert got == [6]  # it waited for the run's end
            else:
                assert got[0] < 6  # lent at an op's end inside the stretch
        finally:
            gate.close()
            mine.close()
            other.close()
    finally:
        board.unlink()
        board.close()


# ------------------------------------------------------------------ through a WASM guest

#: fill y with 1 and x with 2, then ``n`` times y += 0.5 * x and z = y + y (queued), then the sum
#: read z[0] back (synchronises), then the sum of z into memory: the read's code if not OK, else the sum's
GUEST = """(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "fill_f32" (func $fill (param i64 f32 i64) (result i32)))
  (import "tensorwasm" "axpy_f32" (func $axpy (param i64 f32 i64 i64) (result i32)))
  (import "tensorwasm" "add_f32" (func $add (param i64 i64 i64 i64) (result i32)))
  (import "tensorwasm" "sum_f32" (func $sum (param i64 i64 i32) (result i32)))
  (import "tensorwasm" "read" (func $read (param i64 i64 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "run") (param $n i32) (result i32)
    (local $x i64) (local $y i64) (local $z i64) (local $i i32) (local $r i32)
    (local.set $x (call $alloc (i64.const 4096)))
    (local.set $y (call $alloc (i64.const 4096)))
    (local.set $z (call $alloc (i64.const 4096)))
    (drop (call $fill (local.get $x) (f32.const 2) (i64.const 1024)))
    (drop (call $fill (local.get $y) (f32.const 1) (i64.const 1024)))
    (block $done
      (loop $again
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (drop (call $axpy (i64.const 1024) (f32.const 0.5) (local.get $x) (local.get $y)))
        (drop (call $add (local.get $y) (local.get $y) (local.get $z) (i64.const 1024)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $again)))
    (local.set $r (call $read (local.get $z) (i64.const 0) (i32.const 16) (i32.const 4)))
    (if (result i32) (local.get $r)
      (then (local.get $r))
      (else (call $sum (local.get $z) (i64.const 1024) (i32.const 0))))))"""


def run_guest(be: Backend, n: int, *, patch: Callable[[Backend], None] | None = None) -> tuple[int, float, float, Any]:
    spec = TenantSpec.from_dict({"tenant_id": "queued", "memory_quota_bytes": 64 << 20,
                                 "gpu_memory_bytes_cap": 64 << 20})
    with QuotaBlock.create("queued", memory_quota_bytes=64 << 20, gpu_memory_bytes_cap=64 << 20) as owner:
        ctx = TenantContext(spec, 0, 0, QuotaBlock.attach(owner.name, instance=0), be)
        host = WasmHost(ctx)
        ctx.extensions[WasmHost.EXTENSION] = host
        if patch is not None:
            patch(be)
        try:
            reply = host.run(GUEST.encode(), "run", [n], fuel=10**10, timeout_s=60.0)
            queue = ctx.gate.queue
            assert (queue is not None) == be.queues_ops  # cuda: its stream is the queue (see module doc)
            return (int(cast(list[Any], reply["results"])[0]), float(reply["gpu_time_s"]),
                    float(queue.submitted if queue is not None else 0), queue)
        finally:
            ctx.close()


@pytest.mark.parametrize("kind", ["stub", "cuda"])
def test_a_guest_loop_of_queued_ops_then_a_read_equals_the_synchronous_result(kind: str) -> None:
    n = 200
    be = make_backend(kind)
    sums: list[float] = []
    real_sum = be.sum_f32

    def keep_sum(b: Backend) -> None:
        def sum_f32(buf: DeviceBuffer, count: int) -> float:
            got = real_sum(buf, count)
            sums.append(got)
            return got
        b.sum_f32 = sum_f32  # type: ignore[method-assign]

    code, gpu_s, submitted, _ = run_guest(be, n, patch=keep_sum)
    assert code == 0
    # the synchronous result: numpy on the host, the same float32 operations in the same order
    x = np.full(1024, 2.0, np.float32)
    y = np.full(1024, 1.0, np.float32)
    z = np.zeros(1024, np.float32)
    for _ in range(n):
        y = np.float32(0.5) * x + y
        z = y + y
    assert sums and sums[-1] == pytest.approx(float(z.sum(dtype=np.float32)), rel=1e-6)
    if be.queues_ops:
        assert submitted == 2 + 2 * n  # every fill, axpy and add was queued
    assert gpu_s > 0


def test_an_error_of_a_queued_op_surfaces_at_the_guests_next_read() -> None:
    """The add fails on the device after its call returned OK; the read (the next sync) returns BACKEND."""
    be = StubBackend()

    def failing(b: Backend) -> None:
        def add_f32(*args: object) -> None:
            raise CudaError("cuLaunchKernel", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        b.add_f32 = add_f32  # type: ignore[method-assign]

    code, _, _, queue = run_guest(be, 3, patch=failing)
    assert code == int(ErrorCode.BACKEND)  # what the add would have returned synchronously
    assert queue.dropped > 0  # the ops queued behind the fault never ran


def test_read_bytes_are_the_queued_results() -> None:
    """``read`` synchronises: the bytes it copies are what the queued ops wrote."""
    be = StubBackend()
    got: list[bytes] = []
    real = be.read_into

    def keep(b: Backend) -> None:
        def read_into(buf: DeviceBuffer, offset: int, dest: memoryview) -> None:
            real(buf, offset, dest)
            got.append(bytes(dest))
        b.read_into = read_into  # type: ignore[method-assign]

    run_guest(be, 4, patch=keep)
    # y after 4 axpys = 1 + 4 * 0.5 * 2 = 5; z = 10
    assert got == [struct.pack("<f", 10.0)]


# ------------------------------------------------------------------ stretches, overruns, death


def test_queued_work_is_one_stretch_under_the_lease(block: QuotaBlock) -> None:
    """Fifty queued ops acquire the lease once and tell the board once, at the stretch's end (the
    chunk target is longer than the whole stretch here: no boundary falls inside it)."""
    board = CountingBoard(True)
    be = StubBackend()
    gate = DeviceGate(block, be, cast(GpuTimeBoard, board), chunk_s=3600.0)
    slow = _Slow()
    try:
        buf = be.alloc(4096)
        gate.submit("first", slow, ())
        assert slow.started.wait(WAIT_S)
        for _ in range(50):
            gate.submit("fill_f32", be.fill_f32, (buf, 1.0, 1024))
        slow.go.set()
        gate.sync()
        assert board.calls["acquire"] == 1 and board.calls["finish"] == 1
        assert block.snapshot().gpu_waits == 51  # every op's wait observed
        assert gate.chunks == 51 and block.gpu_time_ns == gate.run_time_ns > 0
    finally:
        slow.go.set()
        gate.close()


def test_a_wait_past_the_deadline_and_grace_is_a_typed_queue_overrun(block: QuotaBlock,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Queued work still running past the deadline plus the grace: ``QueueOverrun`` (a
    ``KernelTimeout``) at the sync, and the run-end release reports it (the worker must exit)."""
    import worker.device_time as device_time

    monkeypatch.setattr(device_time, "QUEUE_GRACE_S", 0.05)
    gate = DeviceGate(block, StubBackend())
    slow = _Slow()
    # The op is queued with a deadline it cannot miss before it starts (a device thread scheduled
    # late on a loaded host refuses an op whose deadline passed: it would never start); the
    # deadline that matters is the wait's, set once the op runs, and already past.
    try:
        gate.submit("hung", slow, (), time.monotonic_ns() + int(3600e9))
        assert slow.started.wait(WAIT_S)
        deadline = time.monotonic_ns()
        with pytest.raises(QueueOverrun, match="past the run's deadline"):
            gate.sync(deadline)
        assert gate.release(deadline) is False and gate.queue_overrun
    finally:
        slow.go.set()
        gate.close()


def test_a_full_queue_past_the_deadline_refuses_the_submit_with_a_timeout(block: QuotaBlock) -> None:
    gate = DeviceGate(block, StubBackend())
    gate.queue = DeviceQueue(gate._queued_items, gate._end_stretch, max_ops=2)
    slow = _Slow()
    try:
        gate.submit("hung", slow, (), time.monotonic_ns() + int(3600e9))  # started whatever the load
        assert slow.started.wait(WAIT_S)
        deadline = time.monotonic_ns()  # passed: a full queue refuses at once
        gate.submit("a", lambda: None, (), deadline)
        gate.submit("b", lambda: None, (), deadline)
        with pytest.raises(KernelTimeout, match="room in the device queue"):
            gate.submit("c", lambda: None, (), deadline)
        assert gate.refused == 1
        with pytest.raises(KernelTimeout):  # the run is refused from then on, at once
            gate.submit("d", lambda: None, (), deadline)
    finally:
        slow.go.set()
        gate.close()


def _holder_with_a_queue(board_name: str, slot: int, block_name: str, ready: Any) -> None:
    """A worker (child process) whose device thread holds the lease in a hung op with more queued."""
    with QuotaBlock.attach(block_name, instance=0) as blk:
        mine = GpuTimeBoard.attach(board_name, tenant_slot=slot)
        gate = DeviceGate(blk, StubBackend(), mine)
        hung = threading.Event()
        gate.submit("hung", lambda: (ready.set(), hung.wait()), ())
        for _ in range(5):
            gate.submit("queued", lambda: None, ())
        hung.wait()  # until SIGKILL


def test_sigkill_with_a_non_empty_queue_releases_the_lease() -> None:
    import multiprocessing as mp
    import os
    import signal

    spawn = mp.get_context("spawn")
    board = GpuTimeBoard.create(0)
    try:
        with QuotaBlock.create("killed") as owner:
            ready = spawn.Event()
            slot = board.add_tenant(1.0)
            p = spawn.Process(target=_holder_with_a_queue, args=(board.name, slot, owner.name, ready))
            p.start()
            try:
                assert ready.wait(WAIT_S)
                snap = board.snapshot()
                assert snap.holder is not None and snap.holder_pid == p.pid and snap.busy
                os.kill(p.pid, signal.SIGKILL)
                p.join(WAIT_S)
                (reclaimed,) = board.reclaim_dead()
                assert reclaimed[1:] == (p.pid, True)
                assert board.snapshot().holder is None  # nobody waits: the device is free
                # its op never finished: the reclaim charged the chunk it was running (<= a quantum)
                assert 0 < board.used_ns(slot) <= board.quantum_ns
            finally:
                if p.is_alive():
                    p.kill()
                p.join(WAIT_S)
    finally:
        board.unlink()
        board.close()


@pytest.mark.parametrize("gap_us, op_us, lends", [(500, 5, True), (500, 400, False), (50, 1, False)])
def test_a_stretch_end_lends_only_for_a_mostly_idle_worker(block: QuotaBlock, gap_us: int, op_us: int,
                                                            lends: bool) -> None:
    """A chatty worker (ops far apart next to their device time) lends the device when its queue runs
    empty; a busy one (a GEMM loop whose guest thread came late) keeps it within its grace - lending
    at every empty queue turned a 7:3 split into 58:42 end to end."""
    board = CountingBoard(True)
    gate = DeviceGate(block, StubBackend(), cast(GpuTimeBoard, board), chunk_s=3600.0)
    try:
        gate.submit("op", lambda: None, ())
        gate.sync()
        assert board.idle == [False]  # one op: no interval known yet, nothing lent
        gate._submit_gap_ns, gate._op_dev_ns = gap_us * 1000, op_us * 1000
        gate._held_since, gate._held_board = time.monotonic_ns(), True  # a stretch in progress
        gate._end_stretch()
        assert board.idle[-1] is lends
    finally:
        gate.close()


def test_the_runs_last_stretch_passes_the_device_on_from_the_device_thread(block: QuotaBlock) -> None:
    """At a run's end (``release``) the device thread whose queue drains passes the device on itself
    (the board's ``release``), not the executor thread after it woke from its wait; the executor's own
    release then finds nothing held. Ordered by an event the op waits for, never by durations."""
    board = GpuTimeBoard.create(0, quantum_s=0.005)
    mine = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    released_by: list[str] = []
    real_release = mine.release

    def release() -> None:
        released_by.append(threading.current_thread().name)
        real_release()

    mine.release = release  # type: ignore[method-assign]
    be = StubBackend()
    gate = DeviceGate(block, be, mine)
    go = threading.Event()
    try:
        buf = be.alloc(4096)
        gate.submit("fill_f32", lambda *args: (go.wait(30), be.fill_f32(*args)), (buf, 1.0, 1024))
        ender = threading.Thread(target=gate.release)
        ender.start()
        deadline = time.monotonic() + 30
        while not (gate.queue is not None and gate.queue._syncing):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        go.set()
        ender.join(30)
        assert not ender.is_alive()
        assert released_by[0] == "twt-device", released_by
        assert not mine.holds()
        assert be.read(buf, 0, 4) == struct.pack("<f", 1.0)
    finally:
        go.set()
        gate.close()
        board.unlink()
        board.close()
