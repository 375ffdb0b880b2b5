"""A holder that will lend the device after the chunk it launches wakes its grantee ahead
(``GpuTimeBoard.hand_over_soon``): the grantee stays on a CPU - no futex sleep - until the grant or
the bound, then sleeps as before. A real board on the real clock, the waiter on another thread;
ordered by the board's own words and the waiter's futex calls, never by durations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from shared import _atomics
from shared.gpu_time import _SEQ, _SOON_MAX_NS, _SOON_UNTIL, _SOON_W, _T_PASS, GpuTimeBoard, _t_off

pytestmark = pytest.mark.timeout(60)

WAIT_S = 30.0


@pytest.fixture
def board() -> Iterator[GpuTimeBoard]:
    b = GpuTimeBoard.create(0, quantum_s=0.5)  # a long quantum: no steal or quantum end meanwhile
    try:
        yield b
    finally:
        b.unlink()
        b.close()


class _Futex:
    """Records each thread's ``futex_wait`` calls (the board's sleeps): when, and the wake sequence
    value it sleeps on (a call on a value older than the board's returns at once)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        real = _atomics.futex_wait

        def wait(buf: memoryview, offset: int, expected: int, timeout_ns: int) -> object:
            self.calls.append((threading.get_ident(), time.monotonic_ns(), expected))
            return real(buf, offset, expected, timeout_ns)

        monkeypatch.setattr(_atomics, "futex_wait", wait)

    def after(self, ident: int, at: int) -> int:
        return sum(1 for who, t, _ in self.calls if who == ident and t > at)

    def on(self, ident: int, seq: int) -> int:
        """Sleeps of ``ident`` on wake sequence ``seq`` (the current one: real sleeps)."""
        return sum(1 for who, _, expected in self.calls if who == ident and expected == seq)


def _until(cond: Callable[[], object]) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, "the state waited for never came"
        time.sleep(0.0005)


def test_nobody_waiting_wakes_nobody(board: GpuTimeBoard) -> None:
    w = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    try:
        assert w.try_acquire(time.monotonic_ns())
        assert w.hand_over_soon(100_000) is None
        assert _atomics.load(board._check(), _SOON_W) == 0
    finally:
        w.close()


def test_the_grantee_stays_on_a_cpu_from_the_early_wake_to_its_grant(
        board: GpuTimeBoard, monkeypatch: pytest.MonkeyPatch) -> None:
    futex = _Futex(monkeypatch)
    holder = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    soon_at = time.monotonic_ns()
    # the waiter's clock stands still inside the bound: however late this host runs its thread,
    # the grant comes inside the bound, and the test sees the loop, not the host's scheduling
    waiter = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(), clock=lambda: soon_at)
    ident: list[int] = []
    looks: list[int] = []
    got = threading.Event()
    real_try = waiter.try_acquire

    def counted_try(now: int) -> bool:
        looks.append(now)
        return real_try(now)

    monkeypatch.setattr(waiter, "try_acquire", counted_try)

    def wait() -> None:
        ident.append(threading.get_ident())
        waiter.acquire()
        got.set()

    th = threading.Thread(target=wait)
    try:
        assert holder.try_acquire(time.monotonic_ns())  # busy: the waiter sleeps
        th.start()
        _until(lambda: ident and futex.after(ident[0], 0) > 0)  # asleep in the board's futex
        # 10 s asked: the bound holds it to _SOON_MAX_NS
        assert holder.hand_over_soon(10**10, now=soon_at) == waiter.worker_slot
        assert waiter.worker_slot is not None
        until = _atomics.load(board._check(), _SOON_UNTIL)
        assert soon_at < until <= soon_at + _SOON_MAX_NS
        seq = _atomics.load(board._check(), _SEQ) & 0xFFFFFFFF
        seen = len(looks)
        _until(lambda: len(looks) > seen + 50 or futex.on(ident[0], seq))  # it looked again, many times
        assert futex.on(ident[0], seq) == 0  # and never went back to sleep
        assert holder.finish(20_000, last=True, idle=True)  # the lend
        assert got.wait(WAIT_S)
        th.join(WAIT_S)
    finally:
        if th.is_alive():
            holder.release()
            th.join(WAIT_S)
        waiter.close()
        holder.close()


def test_past_the_bound_the_grantee_sleeps_again(board: GpuTimeBoard, monkeypatch: pytest.MonkeyPatch) -> None:
    futex = _Futex(monkeypatch)
    holder = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    waiter = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    ident: list[int] = []
    got = threading.Event()

    def wait() -> None:
        ident.append(threading.get_ident())
        waiter.acquire()
        got.set()

    th = threading.Thread(target=wait)
    try:
        assert holder.try_acquire(time.monotonic_ns())
        th.start()
        _until(lambda: ident and futex.after(ident[0], 0) > 0)
        soon_at = time.monotonic_ns()
        assert holder.hand_over_soon(50_000, now=soon_at) == waiter.worker_slot
        # the bound passes with no grant: the waiter goes back to its futex (no CPU burnt past it)
        _until(lambda: futex.after(ident[0], soon_at + 50_000) > 0)
        assert not got.is_set()
        assert holder.finish(20_000, last=True, idle=True)
        assert got.wait(WAIT_S)
        th.join(WAIT_S)
    finally:
        if th.is_alive():
            holder.release()
            th.join(WAIT_S)
        waiter.close()
        holder.close()


def test_the_early_wake_goes_to_the_waiter_the_lend_will_pick(board: GpuTimeBoard) -> None:
    holder = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    behind = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    ahead = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    try:
        assert holder.try_acquire(time.monotonic_ns())
        now = time.monotonic_ns()
        assert ahead.tenant_slot is not None and ahead.worker_slot is not None
        behind.want(now)
        ahead.want(now)
        # the tenant that ran more has the larger pass: the other is the pick
        buf = board._check()
        assert behind.tenant_slot is not None
        _atomics.store(buf, _t_off(behind.tenant_slot) + _T_PASS,
                                _atomics.load(buf, _t_off(ahead.tenant_slot) + _T_PASS) + 10**9)
        nxt = holder.pick(now, prefer_tenant=holder.tenant_slot)
        assert nxt == ahead.worker_slot
        assert holder.hand_over_soon(100_000, now=now) == ahead.worker_slot
        assert _atomics.load(buf, _SOON_W) == ahead.worker_slot + 1
    finally:
        ahead.unwant()
        behind.unwant()
        ahead.close()
        behind.close()
        holder.close()
