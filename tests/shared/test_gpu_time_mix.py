"""The lease board with tenants that differ, on a fake clock: a chatty tenant beside a heavy one,
idle holds, siblings of one tenant, and the steal path's race.

A small event simulation drives worker handles in this process: the heavy
tenant runs 2 ms chunks back to back (its next request 20 us after each), the
chatty one asks for a tiny op, then does ``gap`` of host work (no request),
and again. Device time is what the simulation charges; the clock only moves
forward, by chunks, ops and 10 us polls (a waiter looking again).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared import _atomics
from shared.gpu_time import (_CLAIM_SERVE_DEN, _CLAIM_SERVE_NUM, _GRANT_NS, _HANDOVER_GRACE_NS, _OWNER, _SEQ,
                              _VCLOCK, GpuTimeBoard)
from tests.helpers.ns_clock import FakeClock

pytestmark = pytest.mark.timeout(60)

US = 1_000
MS = 1_000_000
QUANTUM = 5 * MS
#: how long a claim inside the holder's quantum may wait before it is served (its batch's bound)
SERVE = QUANTUM * _CLAIM_SERVE_NUM // _CLAIM_SERVE_DEN


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def board(clock: FakeClock) -> Iterator[GpuTimeBoard]:
    b = GpuTimeBoard.create(0, quantum_s=QUANTUM / 1e9, clock=clock)
    try:
        yield b
    finally:
        b.unlink()
        b.close()


@pytest.fixture
def workers(board: GpuTimeBoard, clock: FakeClock) -> Iterator[list[GpuTimeBoard]]:
    made: list[GpuTimeBoard] = []
    yield made
    for w in made:
        w.close()


def attach(board: GpuTimeBoard, clock: FakeClock, made: list[GpuTimeBoard], tenant: int) -> GpuTimeBoard:
    w = GpuTimeBoard.attach(board.name, tenant_slot=tenant, clock=clock)
    made.append(w)
    return w


def p99(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_mix(board: GpuTimeBoard, clock: FakeClock, made: list[GpuTimeBoard], gap: int, *, chatty_ops: bool,
            span: int = 1000 * MS, op: int = 20 * US, chunk: int = 2 * MS, heavy_gap: int = 20 * US
            ) -> tuple[int, int, list[int]]:
    """(heavy device ns, chatty device ns, chatty waits) over ``span`` of fake time; with
    ``chatty_ops`` False the chatty loop does its host work only (the control)."""
    heavy = attach(board, clock, made, board.add_tenant(1.0))
    chatty = attach(board, clock, made, board.add_tenant(1.0))
    end = clock.t + span
    next_h = next_c = clock.t
    c_asked: int | None = None
    heavy_ns = chatty_ns = 0
    waits: list[int] = []

    def requests() -> None:
        nonlocal c_asked, next_c
        if clock.t >= next_h:
            heavy.want(next_h)
        if chatty_ops and c_asked is None and clock.t >= next_c:
            c_asked = next_c
            chatty.want(c_asked)

    while clock.t < end:
        requests()
        if c_asked is not None and chatty.try_acquire(clock.t):
            waits.append(clock.t - c_asked)
            clock.t += op
            chatty_ns += op
            requests()
            chatty.finish(op)
            c_asked, next_c = None, clock.t + gap
            continue
        if clock.t >= next_h and heavy.try_acquire(clock.t):
            clock.t += chunk
            heavy_ns += chunk
            requests()
            heavy.finish(chunk)
            next_h = clock.t + heavy_gap
            continue
        clock.t += 10 * US
    return heavy_ns, chatty_ns, waits


@pytest.mark.parametrize("gap", [100 * US, 300 * US, 1 * MS])
def test_a_heavy_tenant_keeps_the_device_beside_a_chatty_one(gap: int, clock: FakeClock,
                                                             workers: list[GpuTimeBoard]) -> None:
    """The chatty tenant's host work is not spent holding the device: the heavy tenant keeps >= 0.9x
    of its rate beside a chatty loop that makes no device op, and the chatty op waits < a quantum."""
    rates = {}
    for chatty_ops in (False, True):
        board = GpuTimeBoard.create(0, quantum_s=QUANTUM / 1e9, clock=clock)
        try:
            heavy_ns, chatty_ns, waits = run_mix(board, clock, workers, gap, chatty_ops=chatty_ops)
            rates[chatty_ops] = heavy_ns
            if chatty_ops:
                assert len(waits) > 100
                assert p99(waits) <= QUANTUM
                snap = board.snapshot()
                used = sorted(int(v["used_ns"] or 0) for v in snap.tenants.values())
                assert used == sorted([heavy_ns, chatty_ns])  # charged device time, nothing else
        finally:
            for w in workers:
                w.close()
            workers.clear()
            board.unlink()
            board.close()
    assert rates[True] >= 0.9 * rates[False]


def test_a_holder_with_long_host_gaps_hands_over_at_its_op_end(board: GpuTimeBoard, clock: FakeClock,
                                                               workers: list[GpuTimeBoard]) -> None:
    chatty = attach(board, clock, workers, board.add_tenant())
    other = attach(board, clock, workers, board.add_tenant())
    for _ in range(8):  # its history: an op, then 0.5 ms of host work
        chatty.acquire()
        clock.t += 10 * US
        assert not chatty.finish(10 * US)
        clock.t += 500 * US
    assert chatty.try_acquire(clock.t)
    other.want(clock.t)
    clock.t += 10 * US
    assert chatty.finish(10 * US)  # someone waits: handed over now, not held through host work
    assert other.try_acquire(clock.t)
    assert board.snapshot().handoffs == 1


def test_an_idle_holder_is_stolen_from_after_the_grace(board: GpuTimeBoard, clock: FakeClock,
                                                       workers: list[GpuTimeBoard]) -> None:
    holder = attach(board, clock, workers, board.add_tenant())
    waiter = attach(board, clock, workers, board.add_tenant())
    assert holder.try_acquire(clock.t)
    clock.t += 20 * US
    assert not holder.finish(20 * US)  # a tiny op (its grace: the floor); nobody waits: kept
    waiter.want(clock.t)
    clock.t += _HANDOVER_GRACE_NS // 2
    assert not waiter.try_acquire(clock.t)  # within the grace: the holder's next op may be on its way
    clock.t += _HANDOVER_GRACE_NS // 2
    assert waiter.try_acquire(clock.t)  # idle past it: the device does not wait for host work
    assert board.snapshot().steals == 1


def test_an_idle_hold_while_others_wait_is_charged_to_the_holder(board: GpuTimeBoard, clock: FakeClock,
                                                                 workers: list[GpuTimeBoard]) -> None:
    t = board.add_tenant(2.0)
    holder = attach(board, clock, workers, t)
    waiter = attach(board, clock, workers, board.add_tenant())
    assert holder.try_acquire(clock.t)
    clock.t += MS
    holder.finish(MS)
    pass_before = int(board.snapshot().tenants[t]["pass"] or 0)
    waiter.want(clock.t)  # the waiter sleeps through the grace (a late wake-up): nobody steals
    clock.t += 400 * US
    assert holder.acquire() == 0  # fast path: it still held the device
    snap = board.snapshot()
    assert snap.tenants[t]["pass"] == pass_before + 400 * US // 2  # the idle hold, at weight 2
    assert snap.tenants[t]["used_ns"] == MS  # not device time: the quota is not charged


def test_alone_an_idle_hold_costs_nothing(board: GpuTimeBoard, clock: FakeClock,
                                          workers: list[GpuTimeBoard]) -> None:
    t = board.add_tenant()
    holder = attach(board, clock, workers, t)
    assert holder.try_acquire(clock.t)
    clock.t += MS
    holder.finish(MS)
    clock.t += 5 * MS
    assert holder.acquire() == 0
    assert board.snapshot().tenants[t]["pass"] == MS


def share_by_worker(board: GpuTimeBoard, clock: FakeClock, ws: list[GpuTimeBoard], span: int) -> list[int]:
    """Every worker always wants the device; the holder tries first (the order that favours it)."""
    got = [0] * len(ws)
    end = clock.t + span
    for w in ws:
        w.want(clock.t)
    while clock.t < end:
        order = sorted(range(len(ws)), key=lambda i: not ws[i].holds())
        for i in order:
            if ws[i].try_acquire(clock.t):
                d = 1 * MS
                clock.t += d
                got[i] += d
                ws[i].finish(d)
                clock.t += 5 * US
                for w in ws:
                    if not w.holds():
                        w.want(clock.t)
                break
        else:
            clock.t += 10 * US
    return got


def test_siblings_of_one_tenant_share_its_time(board: GpuTimeBoard, clock: FakeClock,
                                               workers: list[GpuTimeBoard]) -> None:
    """A tie on pass (two instances of one tenant) does not keep the holder for ever."""
    t = board.add_tenant()
    ws = [attach(board, clock, workers, t) for _ in range(2)]
    got = share_by_worker(board, clock, ws, 1000 * MS)
    assert min(got) / sum(got) == pytest.approx(0.5, abs=0.05)


def test_k_instances_against_one_split_by_tenant(board: GpuTimeBoard, clock: FakeClock,
                                                 workers: list[GpuTimeBoard]) -> None:
    a, b = board.add_tenant(), board.add_tenant()
    ws = [attach(board, clock, workers, a) for _ in range(3)] + [attach(board, clock, workers, b)]
    got = share_by_worker(board, clock, ws, 2000 * MS)
    total = sum(got)
    assert got[3] / total == pytest.approx(0.5, abs=0.03)  # 50/50 by tenant, not 75/25 by worker
    for i in range(3):
        assert got[i] / total == pytest.approx(0.5 / 3, abs=0.04)  # and the siblings split theirs


def test_a_steal_that_loses_its_cas_grants_nothing(board: GpuTimeBoard, clock: FakeClock,
                                                   workers: list[GpuTimeBoard]) -> None:
    """The decider picks another waiter and CASes the owner word; the holder retook it meanwhile:
    no grant is counted, and neither the pick's pass nor the virtual clock moves."""
    holder = attach(board, clock, workers, board.add_tenant())
    decider = attach(board, clock, workers, board.add_tenant())
    pick_t = board.add_tenant()
    pick = attach(board, clock, workers, pick_t)
    assert holder.try_acquire(clock.t)
    clock.t += 20 * MS
    holder.finish(20 * MS)
    pick.want(clock.t - MS)  # waiting longer, a smaller pass: the policy's pick
    clock.t += 2 * _HANDOVER_GRACE_NS  # the holder idle past the grace: stealable
    real_pick = decider.pick

    def racing_pick(now: int, **kw: object) -> int | None:
        chosen = real_pick(now, **kw)  # type: ignore[arg-type]
        assert holder.try_acquire(clock.t)  # the holder's next op wins the owner word first
        return chosen

    decider.pick = racing_pick  # type: ignore[method-assign]
    buf = board._buf  # the words the lost race must not touch
    before = (board.snapshot().grants, _atomics.load(buf, _GRANT_NS), _atomics.load(buf, _VCLOCK),
              board.snapshot().tenants[pick_t]["pass"])
    assert not decider.try_acquire(clock.t)
    assert holder.holds()
    after = (board.snapshot().grants, _atomics.load(buf, _GRANT_NS), _atomics.load(buf, _VCLOCK),
             board.snapshot().tenants[pick_t]["pass"])
    assert after == before
    assert board.snapshot().steals == 0


def test_a_worker_that_lent_the_device_takes_it_back_at_a_chunk_boundary(board: GpuTimeBoard, clock: FakeClock,
                                                                        workers: list[GpuTimeBoard]) -> None:
    """Lending (an op-end handover for host work) does not cost the lender its place: its next op
    takes the device back at the borrower's next chunk end while its pass is the smaller, not a
    whole quantum later."""
    lender = attach(board, clock, workers, board.add_tenant())
    borrower = attach(board, clock, workers, board.add_tenant())
    for _ in range(8):  # a history of 0.2 ms host gaps
        lender.acquire()
        clock.t += 10 * US
        lender.finish(10 * US)
        clock.t += 200 * US
    borrower.want(clock.t)
    assert lender.try_acquire(clock.t)
    clock.t += 10 * US
    assert lender.finish(10 * US)  # lent at its op's end
    assert borrower.try_acquire(clock.t)
    clock.t += 200 * US
    lender.want(clock.t)  # its next op, one host gap later
    clock.t += 1 * MS
    assert not borrower.finish(1 * MS, last=False)  # a claim waits for its batch (see below) ...
    assert borrower.try_acquire(clock.t)
    clock.t += 1 * MS
    assert not borrower.finish(1 * MS, last=False)
    assert borrower.try_acquire(clock.t)
    clock.t += 1 * MS
    assert borrower.finish(1 * MS)  # ... and is served at a chunk end, not a quantum later: handed back
    assert lender.try_acquire(clock.t)


def test_a_holder_of_long_ops_keeps_the_device_through_a_short_gap(board: GpuTimeBoard, clock: FakeClock,
                                                                   workers: list[GpuTimeBoard]) -> None:
    """The grace grows with the holder's ops (four times their length, at most half a quantum): a GEMM
    tenant whose next op comes 0.3-1 ms after a 4 ms one is not stolen from - the thief would hold a
    whole chunk for a short idle spell, and weights would no longer decide the shares."""
    holder = attach(board, clock, workers, board.add_tenant())
    waiter = attach(board, clock, workers, board.add_tenant())
    for _ in range(4):
        holder.acquire()
        clock.t += 4 * MS
        holder.finish(4 * MS)
        clock.t += 300 * US
    waiter.want(clock.t)
    clock.t += 300 * US
    assert not waiter.try_acquire(clock.t)  # idle 0.6 ms: within its grace (2.5 ms: half a quantum)
    clock.t += 2 * MS  # idle 2.6 ms: past it, now it is
    assert waiter.try_acquire(clock.t)


def _wakes(board: GpuTimeBoard) -> int:
    """The board's wake sequence: bumped at every wake-up of its waiters."""
    return _atomics.load(board._check(), _SEQ)


def _record_wakes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every futex wake the board makes from now on, as (word offset, wake bits; all: 0xFFFFFFFF)."""
    woken: list[tuple[int, int]] = []

    def wake_bits(buf: object, offset: int, bits: int) -> int:
        woken.append((offset, bits))
        return 0

    def wake(buf: object, offset: int) -> None:  # (every waiter of the word)
        woken.append((offset, 0xFFFFFFFF))

    monkeypatch.setattr(_atomics, "futex_wake_bits", wake_bits, raising=False)
    monkeypatch.setattr(_atomics, "futex_wake", wake)
    return woken


def _bit(worker: GpuTimeBoard) -> int:
    assert worker.worker_slot is not None
    return 1 << (worker.worker_slot % 32)


def test_a_change_of_hands_wakes_only_the_worker_it_names(board: GpuTimeBoard, clock: FakeClock,
                                                          workers: list[GpuTimeBoard],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant wakes its grantee (its driver on the wake sequence, its executor's gated launch on the
    owner word) and nobody else: the other waiters have nothing to take, and each of their wake-ups
    preempted a busy thread on the host's CPUs for nothing. Lends at an op's end and a release alike;
    the sequence still moves at each, so that a waiter between its read of the sequence and its sleep
    looks again."""
    holder = attach(board, clock, workers, board.add_tenant())
    first = attach(board, clock, workers, board.add_tenant())
    other = attach(board, clock, workers, board.add_tenant())
    assert holder.try_acquire(clock.t)
    first.want(clock.t)
    clock.t += 1 * US
    other.want(clock.t)  # waits less long, the same pass: the pick is `first`
    woken = _record_wakes(monkeypatch)
    seq = _wakes(board)
    clock.t += 100 * US
    assert holder.finish(100 * US, idle=True)  # nothing queued: lent at the op's end
    assert first.holds() and _wakes(board) == seq + 1
    assert woken == [(_SEQ, _bit(first)), (_OWNER, _bit(first))]
    woken.clear()
    assert first.try_acquire(clock.t)
    clock.t += 100 * US
    first.finish(100 * US, idle=True)  # lent on to the one still waiting
    assert other.holds()
    assert woken == [(_SEQ, _bit(other)), (_OWNER, _bit(other))]
    woken.clear()
    assert other.try_acquire(clock.t)
    holder.want(clock.t)
    clock.t += 100 * US
    other.finish(100 * US, idle=True)
    other.release()
    assert holder.holds() and woken == [(_SEQ, _bit(holder)), (_OWNER, _bit(holder))]


def test_an_op_end_that_keeps_the_device_idle_wakes_the_waiter_that_would_take_it(
        board: GpuTimeBoard, clock: FakeClock, workers: list[GpuTimeBoard], monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder whose op ends while others wait, and that keeps the device (within its grace), wakes
    the waiter that would take it - the pick, the holder left out: asleep until its next look at a
    busy holder (1 ms at most) it would take an idle device that late; woken, it times its sleep to
    the grace's end. Not every waiter: another one would steal for the pick anyway. A chunk boundary
    inside an op (``last=False``) keeps the device busy and wakes nobody."""
    holder = attach(board, clock, workers, board.add_tenant())
    waiter = attach(board, clock, workers, board.add_tenant())
    later = attach(board, clock, workers, board.add_tenant())
    assert holder.try_acquire(clock.t)
    waiter.want(clock.t)
    clock.t += 1 * US
    later.want(clock.t)
    clock.t += 100 * US
    woken = _record_wakes(monkeypatch)
    seq = _wakes(board)
    assert not holder.finish(100 * US, last=False)  # inside an op: kept, nobody woken
    assert _wakes(board) == seq and not woken
    assert holder.try_acquire(clock.t)
    clock.t += 100 * US
    assert not holder.finish(100 * US, last=True)  # the op's end, kept (no host gap known): idle now
    assert _wakes(board) == seq + 1 and holder.holds()
    assert woken == [(_SEQ, _bit(waiter))]
    later.unwant()
    clock.t += _HANDOVER_GRACE_NS // 2
    assert not waiter.try_acquire(clock.t)  # within the holder's grace
    clock.t += 2 * MS
    assert waiter.try_acquire(clock.t)  # past it: stolen, as before


@pytest.mark.parametrize("idle", [False, True])
def test_an_op_that_ended_at_a_told_boundary_is_ended_on_the_board(board: GpuTimeBoard, clock: FakeClock,
                                                                   workers: list[GpuTimeBoard], idle: bool) -> None:
    """A queued stretch whose last op ended at a chunk boundary it already told (``finish`` with
    ``last=False``, the lease held idle since) tells the board the op's end (``end_op``): while another
    worker waits the device is lent now when nothing is queued behind (``idle``), else the waiters are
    woken to time their sleep to the holder's grace; the next request measures its host gap again
    (the op is no longer open) - and alone, or with no op open, nothing happens."""
    holder = attach(board, clock, workers, board.add_tenant())
    waiter = attach(board, clock, workers, board.add_tenant())
    assert not holder.end_op(idle=idle)  # no op open: nothing
    assert holder.try_acquire(clock.t)
    clock.t += 2 * MS
    assert not holder.finish(2 * MS, last=False)  # a boundary inside the op: held idle after it
    assert not holder.end_op(idle=idle) and holder.holds()  # nobody waits: kept, the op closed
    assert not holder.end_op(idle=idle)  # (once)
    assert holder.try_acquire(clock.t)
    clock.t += 2 * MS
    assert not holder.finish(2 * MS, last=False)
    waiter.want(clock.t)
    seq = _wakes(board)
    assert holder.end_op(idle=idle) is idle
    assert _wakes(board) == seq + 1  # lent (the grant's wake-up) or the waiters woken
    if idle:
        assert waiter.try_acquire(clock.t) and board.snapshot().handoffs == 1
    else:
        assert holder.holds() and not waiter.try_acquire(clock.t)  # within the holder's grace (half a quantum)
        clock.t += QUANTUM
        assert waiter.try_acquire(clock.t)  # idle past it: stolen


# ------------------------------------------------------------------ stretches of queued work


def test_a_stretch_end_lends_the_device_whatever_the_host_gaps(board: GpuTimeBoard, clock: FakeClock,
                                                               workers: list[GpuTimeBoard]) -> None:
    """A worker whose queue ran empty (``idle``) hands the device to a waiter at once, though no host
    gap of its own was ever measured (the gap rule alone would keep it through its quantum)."""
    a = attach(board, clock, workers, board.add_tenant(1.0))
    b = attach(board, clock, workers, board.add_tenant(1.0))
    assert a.try_acquire(clock.t)
    clock.t += 100 * US
    b.want(clock.t)
    clock.t += 100 * US
    assert not a.finish(100 * US, clock.t, last=True)  # no gap known, inside its quantum: kept
    assert a.try_acquire(clock.t)
    clock.t += 100 * US
    assert a.finish(100 * US, clock.t, last=True, idle=True)  # nothing queued behind: lent now
    assert b.try_acquire(clock.t) and b.holds()


def test_a_claim_inside_the_quantum_is_served_in_batches(board: GpuTimeBoard, clock: FakeClock,
                                                         workers: list[GpuTimeBoard]) -> None:
    """A lender (a chatty tenant's queue) waiting for the device takes it back at the holder's last
    chunk boundary before its wait would pass its bound (SERVE, most of a quantum), not at the very next one:
    its ops queue meanwhile and run as one stretch; its wait stays under a quantum."""
    heavy = attach(board, clock, workers, board.add_tenant(1.0))
    chatty = attach(board, clock, workers, board.add_tenant(1.0))
    assert chatty.try_acquire(clock.t)
    heavy.want(clock.t)
    clock.t += 20 * US
    assert chatty.finish(20 * US, clock.t, last=True, idle=True)  # lent to the heavy tenant
    assert heavy.try_acquire(clock.t)
    asked = clock.t + 100 * US
    chatty.want(asked)  # its next op is queued: it claims the device back
    boundaries = []
    while not chatty.holds():
        clock.t += 500 * US  # the heavy tenant's chunks
        assert clock.t - asked < QUANTUM, "the claim was not served within a quantum"
        if heavy.finish(500 * US, clock.t, last=False):
            boundaries.append(clock.t - asked)
            break
        assert heavy.try_acquire(clock.t)
    assert chatty.try_acquire(clock.t)
    # served at the last boundary before the next 0.5 ms chunk would end past the bound
    assert boundaries and SERVE - 500 * US <= boundaries[0] < SERVE


@pytest.mark.parametrize("chunk_us", [200, 500, 1_000, 2_000])
def test_a_claim_is_served_before_the_holders_next_chunk_would_carry_it_past_its_bound(
        board: GpuTimeBoard, clock: FakeClock, workers: list[GpuTimeBoard], chunk_us: int) -> None:
    """The boundary that serves a claim depends on how long the holder's chunks last: the longer they
    are, the earlier the claim is served, so that the wait ends within its bound (most of a quantum)
    whatever the holder runs (a fixed wait before serving plus a 2 ms chunk would end past it)."""
    heavy = attach(board, clock, workers, board.add_tenant(1.0))
    chatty = attach(board, clock, workers, board.add_tenant(1.0))
    assert chatty.try_acquire(clock.t)
    heavy.want(clock.t)
    clock.t += 20 * US
    assert chatty.finish(20 * US, clock.t, last=True, idle=True)
    assert heavy.try_acquire(clock.t)
    asked = clock.t + 10 * US
    chatty.want(asked)
    served = None
    while served is None:
        clock.t += chunk_us * US
        if heavy.finish(chunk_us * US, clock.t, last=False):
            served = clock.t - asked
        else:
            assert heavy.try_acquire(clock.t)
    assert served <= SERVE, "the wait ran past its bound"
    assert served > SERVE - 2 * chunk_us * US, "served earlier than one chunk before the bound"


@pytest.mark.parametrize("spin", [True, False])
def test_a_waiter_yields_the_cpu_in_a_loop_only_where_the_cpu_is_not_the_device(
        board: GpuTimeBoard, clock: FakeClock, workers: list[GpuTimeBoard], monkeypatch: pytest.MonkeyPatch,
        spin: bool) -> None:
    """Next up at a busy holder's quantum end, a waiter yields the CPU in a loop to be running when the
    device passes to it - unless the device is this host's CPU (the stub), where a spinning waiter is a
    runnable thread that takes its share from the holder's device work: it sleeps then."""
    from shared import gpu_time

    heavy, light = board.add_tenant(1.0), board.add_tenant(1.0)
    holder = attach(board, clock, workers, heavy)
    waiter = attach(board, clock, workers, light)
    waiter.spin = spin
    holder.acquire()
    clock.t += 2 * MS
    holder.finish(2 * MS, last=False)  # its pass is ahead of the waiter's ...
    holder.acquire()  # ... a chunk runs (busy) ...
    clock.t += QUANTUM - 3 * MS  # ... and the holder's quantum ends within a chunk: the waiter is next
    yields: list[int] = []
    sleeps: list[int] = []

    def yield_cpu() -> None:
        yields.append(1)
        clock.t += 100 * US

    def sleep(buf: object, offset: int, value: int, ns: int, bits: int) -> None:
        sleeps.append(ns)
        clock.t += ns

    monkeypatch.setattr(gpu_time.os, "sched_yield", yield_cpu)
    monkeypatch.setattr(gpu_time._atomics, "futex_wait_bits", sleep)
    with pytest.raises(TimeoutError):
        waiter.acquire(deadline_ns=clock() + 3 * MS)  # the holder never finishes its chunk here
    if spin:
        assert yields
    else:
        assert not yields and sleeps



def _chunks_until_handover(holder: GpuTimeBoard, clock: FakeClock, chunk: int, *, skip_quiet: bool) -> tuple[int, int]:
    """The holder runs chunks of ``chunk`` ns back to back, as a device thread does: at each boundary
    it tells the board (``finish``) - or, with ``skip_quiet``, only where :meth:`GpuTimeBoard.quiet`
    says the board's last answer no longer holds, naming where its last chunk began. (When the device
    passed on, boundaries told).  Bounded: 20 quanta."""
    told = 0
    quiet_at = 0
    for _ in range(20 * QUANTUM // chunk):
        clock.t += chunk
        if skip_quiet and holder.others_waiting() and holder.quiet():
            quiet_at = clock.t
            continue
        told += 1
        if holder.finish(chunk, clock.t, last=False, chunk_from=quiet_at):
            return clock.t, told
        quiet_at = 0
        assert holder.try_acquire(clock.t)
    raise AssertionError("the device never passed on")


@pytest.mark.parametrize("chunk_us", [300, 500, 1_000])
def test_a_holder_skipping_its_quiet_boundaries_hands_over_when_asking_at_each_would(
        clock: FakeClock, chunk_us: int) -> None:
    """A holder whose last finish passed nothing on inside its quantum is quiet until the board's
    answer could change: the quantum's end (a sibling's turn) or a claim of another tenant falling
    due. Its device thread skips those boundaries (no policy call per GEMM); the device passes on at
    the same boundary as when every boundary asks - for a sibling and for a chatty tenant's claim."""
    for scenario in ("sibling", "claim"):
        got = []
        for skip in (False, True):
            clock.t = 1_000 * MS
            b = GpuTimeBoard.create(0, quantum_s=QUANTUM / 1e9, clock=clock)
            made: list[GpuTimeBoard] = []
            try:
                heavy_t = b.add_tenant(1.0)
                holder = attach(b, clock, made, heavy_t)
                if scenario == "sibling":
                    other = attach(b, clock, made, heavy_t)
                    assert holder.try_acquire(clock.t)
                    other.want(clock.t)
                else:
                    other = attach(b, clock, made, b.add_tenant(1.0))
                    assert other.try_acquire(clock.t)
                    holder.want(clock.t)
                    clock.t += 20 * US
                    assert other.finish(20 * US, clock.t, last=True, idle=True)  # lent to the heavy one
                    assert holder.try_acquire(clock.t)
                    other.want(clock.t + 100 * US)  # its next op: a claim
                at, told = _chunks_until_handover(holder, clock, chunk_us * US, skip_quiet=skip)
                assert other.try_acquire(clock.t)
                got.append((at, told))
            finally:
                for w in made:
                    w.close()
                b.unlink()
                b.close()
        (at_all, told_all), (at_skip, told_skip) = got
        assert at_skip == at_all, scenario
        assert told_skip <= told_all, scenario
        if scenario == "sibling" or chunk_us < 1_000:
            assert told_skip < told_all, scenario  # boundaries were skipped


def test_a_new_waiter_ends_a_holders_quiet(board: GpuTimeBoard, clock: FakeClock,
                                           workers: list[GpuTimeBoard]) -> None:
    """Quiet holds for as many waiters as the finish saw, under its grant: another tenant's worker
    that starts waiting makes the next boundary ask the board (its claim is the policy's to judge)."""
    heavy_t = board.add_tenant(1.0)
    holder, sibling = attach(board, clock, workers, heavy_t), attach(board, clock, workers, heavy_t)
    chatty = attach(board, clock, workers, board.add_tenant(1.0))
    assert holder.try_acquire(clock.t)
    assert not holder.quiet()  # nothing asked yet
    sibling.want(clock.t)
    clock.t += 500 * US
    assert not holder.finish(500 * US, clock.t, last=False)
    assert holder.try_acquire(clock.t)
    assert holder.quiet()
    chatty.want(clock.t)
    assert not holder.quiet()
    chatty.unwant()
    assert not holder.quiet()  # (ended for good: the next finish decides again)
