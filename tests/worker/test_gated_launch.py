"""A stretch's first GEMM launched before its driver waits for the lease, started by the stub's executor
the moment a grant names its worker (worker._stubexec's gated launch, shared.gpu_time.GatedLaunch,
worker.device_time._GatedChunk), on a real board: the executor takes the lease busy with its own CAS
and runs the chunk; a grant to another worker runs nothing; a refused wait cancels the chunk; a
grantee killed while its chunk is gated never runs it. The interleavings of these steps are checked
exhaustively in tests/shared/test_gated_launch_model.py. Never a timing."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared import _atomics
from shared.gpu_time import _BUSY_SINCE, _OWNER, GpuTimeBoard
from shared.quota import QuotaBlock
from tests.helpers import timeouts
from worker.backends import stub_executor
from worker.backends.stub import StubBackend, StubBuffer
from worker.device_time import DeviceGate, _GatedChunk

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not stub_executor.available(), reason="worker._stubexec is not built")]

ROOT = Path(__file__).resolve().parents[2]
N = 32


@pytest.fixture
def board() -> Iterator[GpuTimeBoard]:
    b = GpuTimeBoard.create(0, quantum_s=0.01)
    try:
        yield b
    finally:
        b.close()
        b.unlink()


def _gemm(be: StubBackend, seed: int, n: int = N) -> tuple[tuple[StubBuffer, StubBuffer, StubBuffer, int, int, int],
                                                          bytes]:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    ba, bb, bc = be.alloc(a.nbytes), be.alloc(b.nbytes), be.alloc(4 * n * n)
    be.write(ba, 0, memoryview(a.tobytes()))
    be.write(bb, 0, memoryview(b.tobytes()))
    return (ba, bb, bc, n, n, n), np.matmul(a, b).tobytes()


def _owner(board: GpuTimeBoard) -> int:
    return _atomics.load(board._buf, _OWNER)


def _mine(w: GpuTimeBoard) -> int:
    assert w.worker_slot is not None
    return (w.worker_slot + 1) << 1


def _wait_for(cond: Any, what: str) -> None:
    end = time.monotonic() + timeouts.scaled(30)
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.001)


def test_a_gated_gemm_starts_at_the_grant_with_the_executors_own_cas(board: GpuTimeBoard) -> None:
    """Worker A holds the device; B's executor has a GEMM gated on B's lease and B's driver is not
    looking at the board at all. A's release grants B: the executor takes the owner word busy itself,
    stamps "busy since" and runs the GEMM - nothing of B's Python between the grant and the kernel."""
    ta, tb = board.add_tenant(), board.add_tenant()
    a = GpuTimeBoard.attach(board.name, tenant_slot=ta)
    b = GpuTimeBoard.attach(board.name, tenant_slot=tb)
    be = StubBackend()
    args, want = _gemm(be, 1)
    timer = stub_executor.make()
    assert timer is not None
    try:
        a.acquire()
        assert timer.launch_gated("matmul_f32", args, b._buf, _OWNER, _BUSY_SINCE, _mine(b))
        assert timer.running == 1 and _owner(board) == _mine(a) | 1  # A's: the chunk waits
        b.want(time.monotonic_ns())  # B waits (its driver would, inside acquire)
        a.finish(1000)
        before = time.monotonic_ns()
        a.release()  # the pick: B - the owner word names it, idle
        timer.drain()  # the executor ran it: its own CAS took the word
        assert _owner(board) == _mine(b) | 1
        assert _atomics.load(board._buf, _BUSY_SINCE) >= before
        assert timer.gated == (1, 1, 0)
        assert timer.resolve(cancel=False)  # the driver, back from its wait: it holds the lease, busy
        times, _ = timer.settle(None)
        assert len(times) == 1 and be.read(args[2], 0, 4 * N * N) == want
        assert b.try_acquire(time.monotonic_ns())  # B's driver's look: busy and its own
        b.unwant()
    finally:
        timer.close()
        a.close()
        b.close()


def _thread_state(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_gated_executor_sleeps_with_its_workers_wake_bit(board: GpuTimeBoard) -> None:
    """An armed executor sleeps on the owner word with its worker's wake bit: a change of hands to
    another worker (its bit) wakes nobody of B's; a wake with B's bit reaches it. Before, every armed
    executor on the board woke at every change of hands, each a wake-up on the device's core."""
    ta, tb = board.add_tenant(), board.add_tenant()
    a = GpuTimeBoard.attach(board.name, tenant_slot=ta)
    b = GpuTimeBoard.attach(board.name, tenant_slot=tb)
    be = StubBackend()
    args, _ = _gemm(be, 5)
    timer = stub_executor.make()
    assert timer is not None and a.worker_slot is not None and b.worker_slot is not None
    mine, other = 1 << (b.worker_slot % 32), 1 << (a.worker_slot % 32)
    assert mine != other
    try:
        a.acquire()  # A's, busy: B's gated GEMM waits, its executor asleep on the owner word
        assert timer.launch_gated("matmul_f32", args, b._buf, _OWNER, _BUSY_SINCE, _mine(b))
        tid = timer.thread_id
        assert tid is not None
        # its own bit reaches it once it sleeps there (it looks again, and sleeps again: not its own)
        _wait_for(lambda: _atomics.futex_wake_bits(board._buf, _OWNER, mine) == 1, "the executor asleep")
        for _ in range(3):
            _wait_for(lambda: _thread_state(tid) == "S", "the executor asleep again")
            assert _atomics.futex_wake_bits(board._buf, _OWNER, other) == 0  # A's bit: nobody of B's
        assert timer.running == 1
        assert not timer.resolve(cancel=True)  # B's wait refused: taken out, never run
    finally:
        timer.close()
        a.close()
        b.close()


def test_a_grant_to_another_worker_runs_nothing_and_the_refused_wait_cancels_it(board: GpuTimeBoard) -> None:
    """B's GEMM is gated while A holds; the device goes to C instead (the owner word never names B):
    the executor runs nothing, and B's wait, refused at its deadline, takes the chunk out."""
    ta, tb, tc = board.add_tenant(), board.add_tenant(), board.add_tenant()
    a = GpuTimeBoard.attach(board.name, tenant_slot=ta)
    b = GpuTimeBoard.attach(board.name, tenant_slot=tb)
    c = GpuTimeBoard.attach(board.name, tenant_slot=tc)
    be = StubBackend()
    args, _ = _gemm(be, 2)
    zeros = be.read(args[2], 0, 4 * N * N)
    timer = stub_executor.make()
    assert timer is not None
    try:
        a.acquire()
        c.want(time.monotonic_ns())
        a.finish(1000)
        a.release()  # to C, the only waiter
        assert _owner(board) == _mine(c)
        c.acquire()  # C starts its own chunk: busy, C's
        gated = _GatedChunk(timer, "matmul_f32", args)
        refused: list[BaseException] = []

        def wait_b() -> None:
            try:
                b.acquire(time.monotonic_ns() + 50_000_000, gated)
            except TimeoutError as exc:
                refused.append(exc)

        thread = threading.Thread(target=wait_b)
        thread.start()
        thread.join(timeouts.scaled(30))
        assert refused and gated.armed and not gated.runs
        assert timer.gated == (1, 0, 1) and timer.pending == 0 and timer.running == 0
        assert be.read(args[2], 0, 4 * N * N) == zeros
        assert _owner(board) == _mine(c) | 1  # untouched by B
    finally:
        timer.close()
        for w in (a, b, c):
            w.close()


def test_a_gate_whose_stretch_waits_for_a_handover_runs_its_gemms_under_its_own_lease(board: GpuTimeBoard) -> None:
    """Through the gate: a worker whose lease another worker holds queues GEMMs; its first is gated
    (launched before the wait), started at the handover, and every result equals numpy's; the board
    charged the worker's tenant."""
    ta, tb = board.add_tenant(), board.add_tenant()
    a = GpuTimeBoard.attach(board.name, tenant_slot=ta)
    owner = QuotaBlock.create("gated")
    blk = QuotaBlock.attach(owner.name, instance=0)
    be = StubBackend()
    gate = DeviceGate(blk, be, GpuTimeBoard.attach(board.name, tenant_slot=tb))
    try:
        a.acquire()
        ops = [_gemm(be, 10 + i, 192) for i in range(4)]  # (not small: each its own launch)
        for args, _ in ops:
            gate.submit("matmul_f32", be.matmul_f32, args)
        _wait_for(lambda: gate._executor is not None and gate._executor.gated[0] == 1, "the first GEMM gated")
        assert gate._executor is not None and gate._executor.running == 1
        a.finish(1000)
        a.release()
        gate.sync()
        assert gate._executor.gated[0] == 1 and gate._executor.gated[2] == 0
        for args, want in ops:
            assert be.read(args[2], 0, len(want)) == want
        gate.release()
        assert board.snapshot().tenants[tb]["used_ns"] > 0
    finally:
        gate.close()
        a.close()
        blk.close()
        owner.unlink()
        owner.close()


_KILLED = """
import mmap, sys, time
import numpy as np
from shared.gpu_time import _BUSY_SINCE, _OWNER, GpuTimeBoard
from worker.backends import stub_executor
b = GpuTimeBoard.attach(sys.argv[1], tenant_slot=int(sys.argv[2]))
n = 32
out = mmap.mmap(int(sys.argv[3]), 4 * n * n)
x = bytearray(np.ones(n * n, np.float32).tobytes())
timer = stub_executor.make()
b.want(time.monotonic_ns())
assert timer._ex.sgemm_gated(x, x, out, n, n, n, b._buf, _OWNER, _BUSY_SINCE, (b.worker_slot + 1) << 1)
print(b.worker_slot, flush=True)
time.sleep(600)
"""


def test_a_grantee_killed_with_its_gemm_gated_never_runs_it(board: GpuTimeBoard) -> None:
    """A worker process gates a GEMM on its lease (its output in memory shared with this test) and
    is SIGKILLed while A holds the device; A's release then grants the dead worker's slot, and the
    supervisor's reclaim passes the device on: the output is never written."""
    ta, tb, tc = board.add_tenant(), board.add_tenant(), board.add_tenant()
    a = GpuTimeBoard.attach(board.name, tenant_slot=ta)
    c = GpuTimeBoard.attach(board.name, tenant_slot=tc)
    fd = os.memfd_create("twt-gated-out")
    os.ftruncate(fd, 4 * N * N)
    out = mmap.mmap(fd, 4 * N * N)
    a.acquire()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, board.name, str(tb), str(fd)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, pass_fds=(fd,),
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None
        slot = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=timeouts.scaled(30)) == -signal.SIGKILL
        a.finish(1000)
        a.release()  # the dead worker still waits on the board: granted to it, idle
        assert _owner(board) == (slot + 1) << 1
        c.want(time.monotonic_ns())
        freed = board.reclaim_pid(proc.pid)
        assert [(w, held) for w, _, held in freed] == [(slot, True)]
        assert _owner(board) == _mine(c)  # passed on, never taken busy by the dead worker
        assert out[:] == bytes(4 * N * N)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        out.close()
        os.close(fd)
        a.close()
        c.close()


@pytest.mark.parametrize("run_end", [False, True])
def test_the_runs_end_sync_passes_the_device_on_as_the_queue_drains(board: GpuTimeBoard, run_end: bool) -> None:
    """The guest returned (the host's end-of-call sync, ``run_end``): the device thread that drains the
    queue passes the device on itself (the board's ``release``) before the sync returns - not the
    guest's thread once it has woken and reached the run's ``release``. A sync inside the run (the
    guest reads a result) keeps the lease, idle within the holder's grace: more GEMMs may follow."""
    ta = board.add_tenant()
    owner = QuotaBlock.create("runend")
    blk = QuotaBlock.attach(owner.name, instance=0)
    be = StubBackend()
    mine = GpuTimeBoard.attach(board.name, tenant_slot=ta)
    released_by: list[str] = []
    release = mine.release

    def spy() -> None:
        released_by.append(threading.current_thread().name)
        release()

    mine.release = spy  # type: ignore[method-assign]
    gate = DeviceGate(blk, be, mine)
    try:
        ops = [_gemm(be, 20 + i, 192) for i in range(4)]
        for args, _ in ops:
            gate.submit("matmul_f32", be.matmul_f32, args)
        gate.sync(run_end=run_end)
        for args, want in ops:
            assert be.read(args[2], 0, len(want)) == want
        if run_end:
            assert released_by == ["twt-device"] and _owner(board) == 0  # passed on (freed: nobody waits)
        else:
            assert released_by == [] and _owner(board) == _mine(mine)  # kept, idle: the run goes on
        gate.release()
        assert _owner(board) == 0
    finally:
        gate.close()
        blk.close()
        owner.unlink()
        owner.close()


def test_the_runs_end_passes_the_device_on_only_once_its_launched_chunks_ran(board: GpuTimeBoard) -> None:
    """At the run's end (the end-of-call sync) the device thread passes the device on once the stretch's
    launched chunks have run, not while they still run on the device: a grantee's gated GEMM, started
    at that grant, would share the device's core with them (twt bench share's "7:3 together vs one
    tenant alone" fell under its line with it)."""
    ta = board.add_tenant()
    owner = QuotaBlock.create("runend2")
    blk = QuotaBlock.attach(owner.name, instance=0)
    be = StubBackend()
    mine = GpuTimeBoard.attach(board.name, tenant_slot=ta)
    running_at_release: list[int] = []
    release = mine.release
    gate: DeviceGate | None = None

    def spy() -> None:
        executor = gate._executor if gate is not None else None
        running_at_release.append(-1 if executor is None else executor.running)
        release()

    mine.release = spy  # type: ignore[method-assign]
    gate = DeviceGate(blk, be, mine)
    try:
        ops = [_gemm(be, 40 + i, 512) for i in range(3)]  # each longer than the driver's run-ahead
        for args, _ in ops:
            gate.submit("matmul_f32", be.matmul_f32, args)
        gate.sync(run_end=True)
        assert running_at_release == [0] and _owner(board) == 0
        for args, want in ops:
            assert np.allclose(np.frombuffer(be.read(args[2], 0, len(want)), np.float32),
                               np.frombuffer(want, np.float32), rtol=1e-4, atol=1e-3)
        gate.release()
    finally:
        gate.close()
        blk.close()
        owner.unlink()
        owner.close()
