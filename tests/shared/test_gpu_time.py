"""The GPU-time lease board's policy on a fake clock: no processes, no sleeping.

A small discrete simulation drives worker handles attached in this process:
each step, the first worker (in rotating order) whose ``try_acquire`` wins
runs a chunk of a drawn length, the clock advances by it, and ``finish``
charges it. Shares, caps, idle skipping, live changes and death are checked
against the policy's promises (docs/GPU-QUOTAS.md).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from shared.errors import InvalidArgument
from shared.gpu_time import GpuTimeBoard, check_gpu_time_cap, check_gpu_time_weight
from shared.spec import TenantSpec
from tests.helpers.ns_clock import FakeClock

pytestmark = pytest.mark.timeout(60)

MS = 1_000_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def board(clock: FakeClock) -> Iterator[GpuTimeBoard]:
    b = GpuTimeBoard.create(0, quantum_s=0.005, clock=clock)
    try:
        yield b
    finally:
        b.unlink()
        b.close()


class Sim:
    """Workers on one board; ``busy`` ones always want the device."""

    def __init__(self, board: GpuTimeBoard, clock: FakeClock, seed: int = 1) -> None:
        self.board = board
        self.clock = clock
        self.rng = random.Random(seed)
        self.workers: list[GpuTimeBoard] = []
        self.busy: list[bool] = []
        self.used: list[int] = []
        self.turn = 0

    def worker(self, tenant: int, busy: bool = True) -> int:
        w = GpuTimeBoard.attach(self.board.name, tenant_slot=tenant, clock=self.clock)
        self.workers.append(w)
        self.busy.append(busy)
        self.used.append(0)
        if busy:
            w.want(self.clock.t)
        return len(self.workers) - 1

    def set_busy(self, i: int, busy: bool) -> None:
        self.busy[i] = busy
        w = self.workers[i]
        if busy:
            w.want(self.clock.t)
        else:
            w.release()  # its run ended

    def step(self, chunk: tuple[int, int] = (MS // 2, 5 * MS // 2), gap: int = 20_000) -> int | None:
        """One chunk by whoever gets the device (None: nobody could, the clock moved 100 us)."""
        n = len(self.workers)
        for k in range(n):
            i = (self.turn + k) % n
            if self.busy[i] and self.workers[i].try_acquire(self.clock.t):
                self.turn = i + 1
                w = self.workers[i]
                w.unwant()
                d = self.rng.randint(*chunk)
                self.clock.t += d
                self.used[i] += d
                w.finish(d)
                self.clock.t += self.rng.randint(0, gap)
                for j, other in enumerate(self.workers):
                    if self.busy[j] and not other.holds():
                        other.want(self.clock.t)
                return i
        self.clock.t += 100_000
        return None

    def run_for(self, ns: int, **kw: int | tuple[int, int]) -> list[int]:
        """Chunks until ``ns`` of fake time passed; the device ns each worker got meanwhile."""
        before = list(self.used)
        end = self.clock.t + ns
        while self.clock.t < end:
            self.step(**kw)  # type: ignore[arg-type]
        return [u - b for u, b in zip(self.used, before)]

    def close(self) -> None:
        for w in self.workers:
            w.close()


@pytest.fixture
def sim(board: GpuTimeBoard, clock: FakeClock) -> Iterator[Sim]:
    s = Sim(board, clock)
    try:
        yield s
    finally:
        s.close()


def shares(used: list[int]) -> list[float]:
    total = sum(used)
    return [u / total for u in used]


# ------------------------------------------------------------------ policy


def test_weights_split_device_time_exactly(board: GpuTimeBoard, sim: Sim) -> None:
    a, b = board.add_tenant(7.0), board.add_tenant(3.0)
    sim.worker(a)
    sim.worker(b)
    got = shares(sim.run_for(20_000 * MS))
    assert got[0] == pytest.approx(0.7, abs=0.01)
    snap = board.snapshot()
    assert snap.tenants[a]["used_ns"] + snap.tenants[b]["used_ns"] == sum(sim.used)
    assert snap.handoffs > 100  # it alternates by quanta, not once


def test_every_one_second_window_is_within_two_points(board: GpuTimeBoard, sim: Sim) -> None:
    a, b = board.add_tenant(7.0), board.add_tenant(3.0)
    sim.worker(a)
    sim.worker(b)
    for _ in range(10):
        assert shares(sim.run_for(1000 * MS))[0] == pytest.approx(0.7, abs=0.02)


def test_instances_of_one_tenant_share_its_weight(board: GpuTimeBoard, sim: Sim) -> None:
    a, b = board.add_tenant(1.0), board.add_tenant(1.0)
    sim.worker(a)
    sim.worker(a)
    sim.worker(b)
    got = sim.run_for(10_000 * MS)
    assert (got[0] + got[1]) / sum(got) == pytest.approx(0.5, abs=0.02)


def test_eight_equal_tenants_are_fair(board: GpuTimeBoard, sim: Sim) -> None:
    for _ in range(8):
        sim.worker(board.add_tenant(1.0))
    got = sim.run_for(20_000 * MS)
    jain = sum(got) ** 2 / (len(got) * sum(u * u for u in got))
    assert jain >= 0.99


def test_alone_the_device_is_kept_without_handoffs(board: GpuTimeBoard, sim: Sim, clock: FakeClock) -> None:
    sim.worker(board.add_tenant(5.0))
    got = sim.run_for(1000 * MS, gap=0)
    assert got[0] >= 0.99 * 1000 * MS
    snap = board.snapshot()
    assert snap.grants == 1 and snap.handoffs == 0 and snap.steals == 0


def test_idle_time_is_not_banked(board: GpuTimeBoard, sim: Sim) -> None:
    """A tenant back from a long idle spell catches up at most about one quantum."""
    a, b = board.add_tenant(1.0), board.add_tenant(1.0)
    sim.worker(a)
    sim.worker(b)
    sim.run_for(1000 * MS)
    sim.set_busy(1, False)
    sim.run_for(5000 * MS)  # a alone: 5 s of device time it does not owe anyone
    sim.set_busy(1, True)
    got = sim.run_for(1000 * MS)
    assert shares(got)[1] < 0.6  # not the 5 s it was idle: equal shares again, give or take a quantum


def test_the_idle_tenants_time_goes_to_the_busy_one(board: GpuTimeBoard, sim: Sim, clock: FakeClock) -> None:
    a, b = board.add_tenant(7.0), board.add_tenant(3.0)
    sim.worker(a)
    sim.worker(b)
    sim.run_for(1000 * MS)
    sim.set_busy(0, False)  # the heavy one goes idle: the light one gets all of it at once
    got = sim.run_for(1000 * MS, gap=0)
    assert got[1] >= 0.99 * 1000 * MS - 3 * MS


def test_a_waiter_gets_the_device_within_a_quantum_and_a_chunk(board: GpuTimeBoard, sim: Sim,
                                                              clock: FakeClock) -> None:
    hog, light = board.add_tenant(1.0), board.add_tenant(1.0)
    sim.worker(hog)
    w = GpuTimeBoard.attach(board.name, tenant_slot=light, clock=clock)
    try:
        waits = []
        for _ in range(50):
            sim.run_for(7 * MS)
            asked = clock.t
            w.want(asked)
            while not w.try_acquire(clock.t):
                assert sim.step(chunk=(2 * MS, 2 * MS), gap=0) is not None
            waits.append(clock.t - asked)
            w.unwant()
            clock.t += MS // 10
            w.finish(MS // 10)
            w.release()
        assert max(waits) <= 5 * MS + 2 * MS  # one quantum and one chunk
    finally:
        w.close()


def test_cap_alone_gets_its_fraction(board: GpuTimeBoard, sim: Sim, clock: FakeClock) -> None:
    t = board.add_tenant(1.0, cap=0.25)
    sim.worker(t)
    start = clock.t
    got = sim.run_for(10_000 * MS, chunk=(MS, 2 * MS))
    assert got[0] / (clock.t - start) == pytest.approx(0.25, abs=0.01)
    assert board.snapshot().tenants[t]["throttled"] > 100


def test_cap_and_weight_together(board: GpuTimeBoard, sim: Sim, clock: FakeClock) -> None:
    a, b = board.add_tenant(3.0, cap=0.2), board.add_tenant(1.0)
    sim.worker(a)
    sim.worker(b)
    start = clock.t
    got = sim.run_for(10_000 * MS)
    elapsed = clock.t - start
    assert got[0] / elapsed == pytest.approx(0.2, abs=0.01)  # its weight would give it 75 %
    assert got[1] / elapsed >= 0.78  # the rest goes to b: work-conserving around the cap


def test_weight_changed_live(board: GpuTimeBoard, sim: Sim) -> None:
    a, b = board.add_tenant(1.0), board.add_tenant(1.0)
    sim.worker(a)
    sim.worker(b)
    assert shares(sim.run_for(3000 * MS))[0] == pytest.approx(0.5, abs=0.02)
    board.set_policy(a, weight=4.0)
    assert shares(sim.run_for(5000 * MS))[0] == pytest.approx(0.8, abs=0.02)
    board.set_policy(b, cap=0.1)
    assert board.policy(b) == (1.0, 0.1)
    board.set_policy(b, cap=None)
    assert board.policy(b) == (1.0, None)


def test_scheduler_off_is_round_robin_time_slicing(clock: FakeClock) -> None:
    """Off: the same serial device and quanta, but weights and caps are ignored (the driver's own
    time-slicing of contexts, the benchmark's baseline); time is still accounted."""
    board = GpuTimeBoard.create(0, scheduler=False, clock=clock)
    sim = Sim(board, clock)
    try:
        a, b = board.add_tenant(9.0), board.add_tenant(1.0, cap=0.1)
        sim.worker(a)
        sim.worker(b)
        got = shares(sim.run_for(5000 * MS))
        assert got[0] == pytest.approx(0.5, abs=0.03)
        assert board.snapshot().tenants[a]["used_ns"] == sim.used[0]
        assert not board.snapshot().scheduler
    finally:
        sim.close()
        board.unlink()
        board.close()


def test_a_dead_holders_lease_passes_on(board: GpuTimeBoard, clock: FakeClock) -> None:
    a, b = board.add_tenant(1.0), board.add_tenant(1.0)
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wb = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    try:
        assert wa.try_acquire(clock.t)  # a holds the device, busy (as if killed mid-op)
        wb.want(clock.t)
        assert not wb.try_acquire(clock.t + 100 * MS)  # busy: no steal, however long
        # a's process "dies": its slot now names a pid that has exited
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        from shared import _atomics
        from shared.gpu_time import _W_PID

        assert wa.worker_slot is not None
        _atomics.store(board._buf, board._w_off(wa.worker_slot) + _W_PID, dead.pid)
        found = board.reclaim_dead()
        assert [(w, held) for w, _, held in found] == [(wa.worker_slot, True)]
        assert wb.holds()  # handed straight to the waiter
        assert wb.try_acquire(clock.t)
        assert board.reclaim_dead() == []
    finally:
        wb.close()
        wa._worker = None  # its slot was freed by the reclaim
        wa.close()


def _dies(board: GpuTimeBoard, handle: GpuTimeBoard) -> None:
    """Make ``handle``'s worker slot name a pid that has exited (its process "died")."""
    from shared import _atomics
    from shared.gpu_time import _W_PID

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert handle.worker_slot is not None
    _atomics.store(board._buf, board._w_off(handle.worker_slot) + _W_PID, dead.pid)


def test_a_reclaim_by_pid_reads_only_that_pids_proc_entry_and_passes_its_lease_on(
        board: GpuTimeBoard, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor reclaims a worker it saw die by its pid: only that pid's ``/proc`` entry is
    read (a full scan reads one per live worker), its slot is freed and a lease it held passes on;
    the other slots - even ones naming pids that are gone - wait for the periodic full scan."""
    from tests.helpers.proc_reads import count_proc_reads

    a, b = board.add_tenant(1.0), board.add_tenant(1.0)
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wb = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    wc = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    try:
        assert wa.try_acquire(clock.t)  # a holds the device, busy
        wb.want(clock.t)
        _dies(board, wa)
        _dies(board, wc)  # gone too, but not the death being reclaimed
        from shared import _atomics
        from shared.gpu_time import _W_PID

        assert wa.worker_slot is not None
        dead = _atomics.load(board._buf, board._w_off(wa.worker_slot) + _W_PID)
        reads = count_proc_reads(monkeypatch)
        assert board.reclaim_pid(os.getpid()) == []  # wb lives: kept
        reads.clear()
        assert board.reclaim_pid(dead) == [(wa.worker_slot, dead, True)]
        assert reads == [dead]
        assert wb.holds() and wb.try_acquire(clock.t)  # the lease passed on at once
        reads.clear()
        assert board.reclaim_pid(dead) == [] and board.reclaim_pid(0) == []
        assert reads == []
        assert [w for w, _, _ in board.reclaim_dead()] == [wc.worker_slot]  # the net
    finally:
        wb.close()
        wa._worker = wc._worker = None  # their slots were freed by the reclaims
        wa.close()
        wc.close()


@pytest.mark.parametrize("ran_ms, charged_ms", [(3, 3), (40, 5)])
def test_a_holder_killed_mid_chunk_is_charged_its_chunk(board: GpuTimeBoard, clock: FakeClock, ran_ms: int,
                                                        charged_ms: int) -> None:
    """A holder killed mid-chunk never finishes that chunk: the reclaim charges its tenant the time
    from the chunk's start to the reclaim, at most one quantum (5 ms here) - pass and used time,
    as ``finish`` would; the time charged before the kill is kept, the waiter's tenant pays nothing."""
    a, b = board.add_tenant(2.0), board.add_tenant(1.0)
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wb = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    try:
        assert wa.try_acquire(clock.t)
        clock.t += 2 * MS
        wa.finish(2 * MS, last=True)  # a chunk before the kill, charged by the holder itself
        clock.t += MS  # host work between ops
        assert wa.acquire() == 0  # the chunk that is running when it dies
        pass_before = int(board.snapshot().tenants[a]["pass"] or 0)
        wb.want(clock.t)
        clock.t += ran_ms * MS
        _dies(board, wa)
        found = board.reclaim_dead()
        assert [(w, held) for w, _, held in found] == [(wa.worker_slot, True)]
        snap = board.snapshot()
        assert snap.tenants[a]["used_ns"] == 2 * MS + charged_ms * MS
        assert snap.tenants[a]["pass"] == pass_before + charged_ms * MS // 2  # weight 2
        assert snap.tenants[b]["used_ns"] == 0
        assert wb.holds() and wb.try_acquire(clock.t)
    finally:
        wb.close()
        wa._worker = None  # its slot was freed by the reclaim
        wa.close()


def test_a_holder_killed_between_chunks_is_charged_nothing_more(board: GpuTimeBoard, clock: FakeClock) -> None:
    """Killed while holding the device idle (guest code, no chunk running): no device work was in
    flight, so the reclaim charges nothing beyond what it finished; a capped tenant's bucket is
    charged with the in-flight chunk like any chunk."""
    a = board.add_tenant(1.0)
    c = board.add_tenant(1.0, cap=0.5)
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wc = GpuTimeBoard.attach(board.name, tenant_slot=c, clock=clock)
    try:
        assert wa.try_acquire(clock.t)
        clock.t += MS
        wa.finish(MS, last=True)
        clock.t += 30 * MS
        _dies(board, wa)
        assert [held for _, _, held in board.reclaim_dead()] == [True]
        assert board.used_ns(a) == MS
        assert board.snapshot().holder is None
        # the capped tenant: its bucket (4 quanta = 20 ms) loses the killed chunk's 5 ms (one quantum)
        assert wc.try_acquire(clock.t)
        clock.t += 5 * MS
        wc.finish(5 * MS, last=False)  # 15 ms of credit left
        assert wc.acquire() == 0
        clock.t += 9 * MS  # its bucket refills by 4.5 ms meanwhile (cap 0.5)
        _dies(board, wc)
        board.reclaim_dead()
        assert board.used_ns(c) == 10 * MS
        assert wc.throttled_wait_ns() == 0
        from shared import _atomics
        from shared.gpu_time import _BIAS, _T_CREDIT, _t_off

        assert _atomics.load(board._buf, _t_off(c) + _T_CREDIT) - _BIAS == 15 * MS + 9 * MS // 2 - 5 * MS
    finally:
        for h in (wa, wc):
            h._worker = None
            h.close()


def test_close_gives_the_device_back(board: GpuTimeBoard, clock: FakeClock) -> None:
    t = board.add_tenant()
    w = GpuTimeBoard.attach(board.name, tenant_slot=t, clock=clock)
    assert w.acquire() == 0
    w.finish(MS)
    assert w.holds()
    w.close()
    assert board.snapshot().holder is None


class TickingClock(FakeClock):
    """Advances 0.5 ms per reading: a blocking acquire sees time pass."""

    def __call__(self) -> int:
        self.t += MS // 2
        return self.t


def test_acquire_gives_up_at_the_deadline(board: GpuTimeBoard) -> None:
    clock = TickingClock()
    a, b = board.add_tenant(), board.add_tenant()
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wb = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    try:
        assert wa.try_acquire(clock.t)  # busy and never finishing (a hung op)
        with pytest.raises(TimeoutError):
            wb.acquire(deadline_ns=clock.t + MS)
        assert board.snapshot().waiting == 0  # nothing left behind
    finally:
        wa.close()
        wb.close()


# -------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, math.inf, 2e6, True, "1", None, [1]])
def test_bad_weights_are_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="gpu_time_weight"):
        check_gpu_time_weight(bad)
    with pytest.raises(InvalidArgument, match="gpu_time_weight"):
        TenantSpec("acme", gpu_time_weight=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -0.5, 1.01, 2, math.nan, math.inf, False, "0.5", [0.5]])
def test_bad_caps_are_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="gpu_time_cap"):
        check_gpu_time_cap(bad)
    with pytest.raises(InvalidArgument, match="gpu_time_cap"):
        TenantSpec.from_dict({"tenant_id": "acme", "gpu_time_cap": bad})


def test_good_policies_and_defaults() -> None:
    spec = TenantSpec("acme")
    assert spec.gpu_time_weight == 1.0 and spec.gpu_time_cap is None
    spec = spec.with_gpu_time(weight=7, cap=1)
    assert spec.gpu_time_weight == 7.0 and spec.gpu_time_cap == 1.0
    assert spec.with_gpu_time(cap=None).gpu_time_cap is None
    assert TenantSpec.from_dict(spec.to_dict()) == spec


def test_tenants_toml_takes_the_policy_and_names_a_bad_key(tmp_path: Any) -> None:
    from shared.config import ConfigError, read_config_file

    good = tmp_path / "good.toml"
    good.write_text('[supervisor]\ngpu_time_quantum_s = 0.005\n\n'
                    '[[tenant]]\nname = "acme"\ngpu_time_weight = 7\ngpu_time_cap = 0.5\n')
    fields = read_config_file(good)
    (spec,) = fields["tenants"]
    assert (spec.gpu_time_weight, spec.gpu_time_cap) == (7.0, 0.5)
    assert fields["gpu_time_quantum_s"] == 0.005
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tenant]]\nname = "acme"\ngpu_time_weight = 0\n\n[[tenant]]\nname = "beta"\ngpu_time_cap = true\n')
    with pytest.raises(ConfigError) as info:
        read_config_file(bad)
    assert "gpu_time_weight" in str(info.value) and "gpu_time_cap" in str(info.value)



def test_a_slot_is_not_reused_while_a_stopping_worker_names_it(board: GpuTimeBoard, clock: FakeClock) -> None:
    old = board.add_tenant()
    w = GpuTimeBoard.attach(board.name, tenant_slot=old, clock=clock)
    try:
        board.remove_tenant(old)  # evicted; its worker has not exited yet
        fresh = board.add_tenant()
        assert fresh != old
    finally:
        w.close()
    assert board.add_tenant() == old  # free again once the worker is gone


def test_the_atomics_behind_the_board() -> None:
    import threading
    import time

    from shared import _atomics

    buf = memoryview(bytearray(64))
    assert _atomics.compare_exchange(buf, 8, 0, 5) and not _atomics.compare_exchange(buf, 8, 0, 7)
    assert _atomics.load(buf, 8) == 5
    t0 = time.monotonic()
    _atomics.futex_wait(buf, 8, 4, 30 * 10**9)  # the value differs: returns at once
    assert time.monotonic() - t0 < 15  # not its 30 s timeout (a loaded host may stall it a while)
    woke = threading.Event()

    def sleeper() -> None:
        _atomics.futex_wait(buf, 16, 0, 30 * 10**9)  # until woken (or 30 s)
        woke.set()

    th = threading.Thread(target=sleeper)
    th.start()
    while not woke.is_set():  # the sleeper may not be waiting yet: wake until it is woken
        _atomics.futex_wake(buf, 16)
        woke.wait(0.05)
    th.join(10)
    with pytest.raises(ValueError):
        _atomics.compare_exchange(buf, 60, 0, 1)  # past the buffer's end


def test_workers_of_a_slot_that_was_left_are_still_served(board: GpuTimeBoard, clock: FakeClock) -> None:
    """A tenant moved to another device (reload) or evicted: its old workers finish their runs."""
    a, b = board.add_tenant(), board.add_tenant()
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wb = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    try:
        assert wb.try_acquire(clock.t)
        board.remove_tenant(a)
        wa.want(clock.t)
        clock.t += 20 * MS
        wb.finish(20 * MS)
        wb.release()
        assert wa.holds()
    finally:
        wa.close()
        wb.close()


def test_a_board_has_the_capacity_its_creator_gives_and_workers_read_it(clock: FakeClock) -> None:
    """Sized from the supervisor's max_tenants / max_workers (it was a fixed 64 / 256)."""
    from shared.errors import SegmentError
    from shared.gpu_time import segment_bytes

    big = GpuTimeBoard.create(1, tenants=5000, workers=9000, clock=clock)
    try:
        assert (big.tenant_slots, big.worker_slots) == (5000, 9000)
        assert len(big._buf) >= segment_bytes(5000, 9000) > segment_bytes()
        slots = [big.add_tenant() for _ in range(4100)]
        assert slots == list(range(4100))
        workers = [GpuTimeBoard.attach(big.name, tenant_slot=t, clock=clock) for t in (0, 4099)]
        try:
            assert [(w.tenant_slots, w.worker_slots) for w in workers] == [(5000, 9000)] * 2
            a, b = workers
            assert a.try_acquire(clock.t)  # the highest slots work like the first ones
            b.want(clock.t)
            clock.t += 20 * MS
            assert a.finish(20 * MS)  # quantum over, a waiter: handed to slot 4099's worker
            assert b.holds()
            assert big.used_ns(0) == 20 * MS
        finally:
            for w in workers:
                w.close()
        for t in slots[2:]:
            big.remove_tenant(t)
        assert sorted(big.snapshot().tenants) == [0, 1]
        assert big.free_tenant_slots() == 4998
        assert big.add_tenant() == 2  # freed slots are reused first
        with pytest.raises(ValueError, match=r"0\.\.4999"):
            big.policy(5000)
    finally:
        big.unlink()
        big.close()
    small = GpuTimeBoard.create(2, tenants=2, workers=1, clock=clock)
    try:
        assert [small.add_tenant(), small.add_tenant()] == [0, 1]
        with pytest.raises(SegmentError, match="all 2 tenant slots of device 2 are taken"):
            small.add_tenant()
        w = GpuTimeBoard.attach(small.name, tenant_slot=0, clock=clock)
        try:
            with pytest.raises(SegmentError, match="all 1 worker slots are held"):
                GpuTimeBoard.attach(small.name, tenant_slot=1, clock=clock)
            with pytest.raises(ValueError, match=r"out of range 0\.\.1"):
                GpuTimeBoard.attach(small.name, tenant_slot=2, clock=clock)
        finally:
            w.close()
    finally:
        small.unlink()
        small.close()


def test_tenant_lines_get_their_memory_in_chunks_as_they_are_used(clock: FakeClock,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A board sized for 2 x max_tenants (32,768 slots at the default) reserves /dev/shm for the
    header, the worker lines and one chunk of tenant lines at its start, and the next chunk only when
    a tenant slot reaches it; a full /dev/shm then refuses the slot (SegmentError, nothing changed)."""
    import os

    from shared import _shm
    from shared.errors import SegmentError
    from shared.gpu_time import TENANT_RESERVE_CHUNK, segment_bytes

    board = GpuTimeBoard.create(0, tenants=32_768, workers=8192, clock=clock)
    try:
        allocated = os.stat(os.path.join(_shm.SHM_DIR, board.name)).st_blocks * 512
        assert allocated < segment_bytes(32_768, 8192) // 3  # 584 KiB of 2.5 MiB
        assert board.reserved_tenants == TENANT_RESERVE_CHUNK
        slots = [board.add_tenant() for _ in range(TENANT_RESERVE_CHUNK)]
        assert board.reserved_tenants == TENANT_RESERVE_CHUNK  # the last slot of the chunk needs no more

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(_shm, "_reserve", full)
        with pytest.raises(SegmentError, match="no room in /dev/shm"):
            board.add_tenant()
        assert board.reserved_tenants == TENANT_RESERVE_CHUNK
        assert board.free_tenant_slots() == 32_768 - TENANT_RESERVE_CHUNK  # the refused slot was not taken
        monkeypatch.undo()
        assert board.add_tenant() == TENANT_RESERVE_CHUNK
        assert board.reserved_tenants == 2 * TENANT_RESERVE_CHUNK
        grown = os.stat(os.path.join(_shm.SHM_DIR, board.name)).st_blocks * 512
        assert grown >= allocated + TENANT_RESERVE_CHUNK * 64
        board.remove_tenant(slots[5])
        assert board.add_tenant() == 5  # a freed slot below the reserved ones is reused, no reservation
    finally:
        board.unlink()
        board.close()


@pytest.mark.parametrize("bad", [{"tenants": 0}, {"workers": 0}, {"tenants": 1 << 20}, {"workers": True}])
def test_a_board_of_a_bad_size_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        GpuTimeBoard.create(0, **bad)


def test_a_board_of_another_layout_is_refused(board: GpuTimeBoard) -> None:
    """A worker of another build (an in-place upgrade under a running supervisor) must not attach to a
    board whose lines sit at other offsets: refused, naming the layout, nothing claimed."""
    from shared import _atomics
    from shared.errors import SegmentError
    from shared.gpu_time import _LAYOUT_MARK

    t = board.add_tenant(1.0)
    good = _atomics.load(board._buf, _LAYOUT_MARK)
    _atomics.store(board._buf, _LAYOUT_MARK, 1_000_000)  # what a board of the older layout has there
    try:
        with pytest.raises(SegmentError, match="layout does not match"):
            GpuTimeBoard.attach(board.name, tenant_slot=t)
    finally:
        _atomics.store(board._buf, _LAYOUT_MARK, good)
    GpuTimeBoard.attach(board.name, tenant_slot=t).close()


def test_the_handover_gap_is_the_device_idle_from_a_grant_to_the_grantees_first_chunk(
        board: GpuTimeBoard, clock: FakeClock) -> None:
    """What a handover costs the device, summed on the board: from the grant another worker made to
    the grantee's first chunk. A worker taking a free device (its own grant) and a holder renewing
    its quantum add nothing."""
    a, b = board.add_tenant(1.0), board.add_tenant(1.0)
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wb = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    try:
        assert wa.try_acquire(clock.t)  # a free device: its own grant
        clock.t += 6 * MS
        assert not wa.finish(6 * MS, last=False)  # quantum over, nobody waits: kept
        assert wa.acquire() == 0
        clock.t += MS
        assert wa.finish(MS, last=False) is False
        assert board.handover_gap() == (0, 0, 0)
        wb.want(clock.t)
        clock.t += 5 * MS
        assert wa.acquire() == 0
        clock.t += MS
        assert wa.finish(MS, last=False)  # a's quantum is over and b's pass is smaller: handed to b
        clock.t += 300_000  # b wakes up
        assert wb.try_acquire(clock.t)
        assert board.handover_gap() == (300_000, 1, 0)
        clock.t += MS
        wb.finish(MS, last=True)
        assert wb.acquire() == 0  # b's next chunk: the same grant, no new gap
        assert board.handover_gap() == (300_000, 1, 0)
        clock.t += MS
        wb.finish(MS, last=True)
        wa.want(clock.t)
        clock.t += 3 * MS  # b holds the device idle (guest code) past its grace: a steals it
        assert wa.try_acquire(clock.t)
        assert board.handover_gap() == (300_000, 1, 3 * MS)  # a's own grant: no gap; b's idle hold counted
    finally:
        wa.close()
        wb.close()


def test_a_reclaim_wakes_the_grantee_a_dead_giver_may_not_have_woken(
        board: GpuTimeBoard, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change of hands wakes only its grantee, in a step after its CAS: a giver killed between the
    two leaves the grantee asleep with an idle grant. The reclaim of any dead worker that held nothing
    wakes the worker an idle owner word names (and every waiter of a free device), so no wake-up is
    lost to a death (tests/helpers/gated_launch_model.py: ``reclaim_wakes_nobody``)."""
    from shared import _atomics
    from shared.gpu_time import _OWNER, _SEQ

    a, b = board.add_tenant(1.0), board.add_tenant(1.0)
    wa = GpuTimeBoard.attach(board.name, tenant_slot=a, clock=clock)
    wb = GpuTimeBoard.attach(board.name, tenant_slot=b, clock=clock)
    try:
        assert wa.try_acquire(clock.t)
        wb.want(clock.t)
        clock.t += MS
        wa.finish(MS, idle=True)  # lent to wb: its wake sent (this process's own: not lost here)
        assert wb.holds() and wb.worker_slot is not None
        woken: list[tuple[int, int]] = []

        def wake_bits(buf: object, offset: int, bits: int) -> int:
            woken.append((offset, bits))
            return 0

        monkeypatch.setattr(_atomics, "futex_wake_bits", wake_bits, raising=False)
        monkeypatch.setattr(_atomics, "futex_wake", lambda buf, offset: woken.append((offset, 0xFFFFFFFF)))
        _dies(board, wa)  # ... as if killed before that wake
        assert [(w, held) for w, _, held in board.reclaim_dead()] == [(wa.worker_slot, False)]
        bit = 1 << (wb.worker_slot % 32)
        assert woken == [(_SEQ, bit), (_OWNER, bit)]
        assert wb.try_acquire(clock.t)
    finally:
        wb.close()
        wa._worker = None  # its slot was freed by the reclaim
        wa.close()


def test_a_wake_names_whom_it_wakes() -> None:
    """``futex_wake_bits`` wakes the sleepers whose bits it names, and no other (it says how many it
    woke): the board wakes a grant's grantee alone; ``futex_wake`` still wakes every one."""
    import threading
    import time

    from shared import _atomics

    buf = memoryview(bytearray(64))
    with pytest.raises(ValueError):
        _atomics.futex_wake_bits(buf, 16, 0)
    t0 = time.monotonic()
    _atomics.futex_wait_bits(buf, 8, 4, 30 * 10**9, 1)  # the value differs: returns at once
    assert time.monotonic() - t0 < 15
    tids: list[int] = []
    woke = threading.Event()

    def sleeper() -> None:
        tids.append(threading.get_native_id())
        _atomics.futex_wait_bits(buf, 16, 0, 30 * 10**9, 1 << 5)  # until woken (or 30 s)
        woke.set()

    th = threading.Thread(target=sleeper)
    th.start()
    try:
        while not tids:
            time.sleep(0.001)
        deadline = time.monotonic() + 20
        # asleep once its state reads S (the futex, or the GIL on its way there: then nothing is woken
        # either, and the wake with its bit below still must reach it)
        while _thread_state(tids[0]) != "S":
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert _atomics.futex_wake_bits(buf, 16, 1 << 6) == 0  # another worker's bit: still asleep
        assert not woke.is_set()
        while not woke.is_set():
            if _atomics.futex_wake_bits(buf, 16, 1 << 5 | 1 << 6):
                break
        assert woke.wait(10)
    finally:
        _atomics.futex_wake(buf, 16)
        th.join(10)


def _thread_state(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
