"""The quiet gate: while a woken tenant's requests are out, pool refills, parks ahead and idle parks
wait - each no longer than its bound - and run as the last of them is answered; a park owed for
room and a pool without a warm worker do not wait (fake workers, fake clock)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
import time
from pathlib import Path
from typing import Any


import pytest

from shared import protocol as proto
from supervisor.lifecycle import parking, quiet, workerset
from supervisor.lifecycle.quiet import QuietGate
from supervisor.runtime.loop import Timers
from supervisor.store.state import StateStore
from tests.helpers.fake_workers import FakeWorker
from tests.supervisor.lifecycle.test_lifecycle_inprocess import Harness

pytestmark = pytest.mark.timeout(120)


class _Catch:
    """Requests the fake workers take in and do not answer until the test says so: those for which
    ``self.when(worker, op)`` holds when they arrive."""

    def __init__(self) -> None:
        self.when: Callable[[FakeWorker, str], bool] = lambda _w, _op: False
        self.caught: list[tuple[FakeWorker, int, str]] = []

    def attach(self, worker: FakeWorker) -> None:
        plain = worker.requests

        def requests() -> Iterator[tuple[int, str, Any, list[bytes]]]:
            for rid, op, args, frames in plain():
                if self.when(worker, op):
                    self.caught.append((worker, rid, op))
                    continue
                yield rid, op, args, frames

        worker.requests = requests  # type: ignore[method-assign]

    def answer_all(self) -> None:
        """Answer every caught request (as the fake would have)."""
        for worker, rid, _op in self.caught:
            worker.data.send(proto.encode_worker_reply(rid, True, {"pid": worker.process.pid}))
        self.caught.clear()


def _harness(tmp: Path, *, running: tuple[str, ...] = (), parked: tuple[str, ...], catch: _Catch,
             idle_timeout_s: float = 3600.0, **cfg: Any) -> Harness:
    """A supervisor restarted on a state where ``running`` are active tenants and ``parked`` are
    stored parked (one instance each, no buffers); every fake worker's requests go through ``catch``."""
    state = str(tmp / "state")
    first = Harness(tmp / "first", state_dir=state)
    try:
        for name in running + parked:
            first.register(name, instances=1, idle_timeout_s=idle_timeout_s if name in running else 3600.0)
    finally:
        first.close()
    store = StateStore.open(state)
    try:
        store.set_parked_many(list(parked), True)
    finally:
        store.close()
    h = Harness(tmp / "second", state_dir=state, **cfg)
    for worker in h.spawner.workers:
        catch.attach(worker)
    h.spawner.on_spawn.append(catch.attach)
    h.settle()
    h.until(lambda: all(h.tenant(n)["state"] == "running" for n in running))
    assert all(h.tenant(n)["state"] == "parked" for n in parked)
    return h


def _step(h: Harness, seconds: float) -> None:
    """Move the clock by ``seconds`` and handle what is due then (timers, housekeeping)."""
    h.clock.advance(seconds)
    h.sup.turn(0.0)
    h.settle(quiet_turns=2)


def _answered(h: Harness, rids: list[int]) -> None:
    """Every one of ``rids`` is answered, successfully, in whatever order the answers come."""
    left = set(rids)
    deadline = time.monotonic() + 30.0
    while left:
        assert time.monotonic() < deadline, f"no answer to {sorted(left)}"
        h.turn()
        while h.client.poll(0):
            rid, ok, payload = proto.decode_reply(h.client.recv_multipart()[0])
            assert ok and rid in left, (rid, payload)
            left.discard(rid)


def _exports(h: Harness) -> list[str]:
    return [w.handle.tenant or "" for w in h.spawner.workers if "export_buffers" in w.received]


def test_a_pool_refill_waits_while_another_tenants_woken_request_is_out_and_starts_as_it_is_answered(
        tmp_path: Path) -> None:
    """``a`` is woken and answered; while ``b``'s woken request is out, no pool worker starts -
    neither ``a``'s replacement nor ``b``'s - until it is answered and no next request of ``b``'s
    came within FOLLOW_S (each tenant's own quiet time let ``a``'s start run across ``b``'s
    activation)."""
    catch = _Catch()
    h = _harness(tmp_path, parked=("a", "b"), catch=catch, pool_size=3)
    try:
        ws = h.sup.parts.workers
        h.until(lambda: len(ws.pool) == 3 and ws.pool_starting == 0)
        cap_a = h.call("capability", {"tenant": "a"})["capability"]
        cap_b = h.call("capability", {"tenant": "b"})["capability"]
        h.call("ping", {}, cap_a)
        _step(h, quiet.FOLLOW_S * 1.2)  # no next request of a's: its replacement started
        before = len(h.spawner.workers)
        catch.when = lambda w, op: op == "ping" and w.tenant == "b"
        rid = h.send("ping", {}, cap_b)
        h.until(lambda: bool(catch.caught))
        for _ in range(4):  # 20 ms on the clock: past any tenant's quiet time, within the hold's bound
            _step(h, 0.005)
            assert len(h.spawner.workers) == before, "no pool start while b's woken request is out"
        assert ws.quiet.held("pool")
        catch.answer_all()
        ok, _ = h.answer(rid)
        assert ok
        _step(h, quiet.FOLLOW_S * 1.2)  # and no next request of b's came
        assert len(h.spawner.workers) > before, "the held refill starts as b's request is answered"
        h.until(lambda: len(ws.pool) == 3 and ws.pool_starting == 0)
    finally:
        h.close()


def test_a_held_refill_starts_at_its_bound_one_at_a_time_while_an_activation_is_still_out(
        tmp_path: Path) -> None:
    catch = _Catch()
    h = _harness(tmp_path, parked=("a", "b"), catch=catch, pool_size=3)
    try:
        ws = h.sup.parts.workers
        h.until(lambda: len(ws.pool) == 3 and ws.pool_starting == 0)
        h.spawner.on_spawn.append(lambda w: setattr(w, "say_hello", lambda: None))  # new ones stay starting
        caps = [h.call("capability", {"tenant": n})["capability"] for n in ("a", "b")]
        catch.when = lambda _w, op: op == "ping"
        rids = [h.send("ping", {}, cap) for cap in caps]  # two takes: two pool workers short
        h.until(lambda: len(catch.caught) == 2)
        spawned = len(h.spawner.workers)
        _step(h, workerset.POOL_HOLD_MAX_S * 0.8)
        assert len(h.spawner.workers) == spawned
        _step(h, workerset.POOL_HOLD_MAX_S * 0.4)  # past the bound, both requests still out
        assert len(h.spawner.workers) == spawned + 1 and ws.pool_starting == workerset.POOL_STARTS_WHILE_OUT == 1
        catch.answer_all()
        _answered(h, rids)
        _step(h, quiet.FOLLOW_S * 1.2)  # no next request of a's or b's
        assert len(h.spawner.workers) == spawned + 2 and ws.pool_starting == 2  # the gate open: the rest
    finally:
        h.close()


def test_a_take_that_leaves_the_pool_without_a_warm_worker_starts_the_held_refill_at_once(
        tmp_path: Path) -> None:
    """Not held: the next activation would find no warm worker. One start, while the woken
    requests are out; the rest as they are answered."""
    catch = _Catch()
    h = _harness(tmp_path, parked=("a", "b"), catch=catch, pool_size=2)
    try:
        ws = h.sup.parts.workers
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)
        h.spawner.on_spawn.append(lambda w: setattr(w, "say_hello", lambda: None))
        caps = [h.call("capability", {"tenant": n})["capability"] for n in ("a", "b")]
        spawned = len(h.spawner.workers)
        catch.when = lambda _w, op: op == "ping"
        rids = [h.send("ping", {}, caps[0])]
        h.until(lambda: len(catch.caught) == 1)
        assert len(h.spawner.workers) == spawned and len(ws.pool) == 1  # held: one warm left
        rids.append(h.send("ping", {}, caps[1]))  # takes the last warm one
        h.until(lambda: len(catch.caught) == 2)
        assert len(h.spawner.workers) == spawned + 1 and ws.pool_starting == 1, "one start at once"
        catch.answer_all()
        _answered(h, rids)
        _step(h, quiet.FOLLOW_S * 1.2)
        assert len(h.spawner.workers) == spawned + 2
    finally:
        h.close()


def test_a_park_ahead_waits_while_another_activation_restores_and_begins_as_its_request_is_answered(
        tmp_path: Path) -> None:
    """``s1`` woken and answered; ``s2``'s activation is out (its import not answered): the park
    ahead that ``s1`` asked for does not begin while it is (``s1`` alone being quiet is not
    enough), nor ``s2``'s own; both look again as ``s2``'s request is answered."""
    catch = _Catch()
    h = _harness(tmp_path, running=("old", "mid"), parked=("s1", "s2"), catch=catch, max_active=5, park_ahead=3)
    try:
        caps = [h.call("capability", {"tenant": n})["capability"] for n in ("s1", "s2")]
        h.call("ping", {}, caps[0])
        _step(h, quiet.FOLLOW_S * 1.2)  # no next request of s1's
        began = _exports(h)
        catch.when = lambda w, op: op == "import_buffer" and w.tenant == "s2"
        rid = h.send("ping", {}, caps[1])
        h.until(lambda: bool(catch.caught))
        for _ in range(4):
            _step(h, 0.005)
            assert _exports(h) == began, "no park ahead begins while s2's activation is out"
        catch.when = lambda _w, _op: False
        catch.answer_all()
        assert h.answer(rid)[0]
        _step(h, quiet.FOLLOW_S * 1.2)
        assert len(_exports(h)) > len(began)
    finally:
        h.close()


def test_a_park_owed_for_room_begins_at_once_and_a_held_one_at_its_bound(tmp_path: Path) -> None:
    """``s1``'s activation is out and stays out. ``s2``'s takes the last place: a place for the
    next activation is owed now (its park begins without the clock moving); the rest of
    ``park_ahead`` waits for the gate, and begins at ROOM_HOLD_MAX_S with ``s1`` still out."""
    catch = _Catch()
    h = _harness(tmp_path, running=("old", "mid"), parked=("s1", "s2"), catch=catch, max_active=4, park_ahead=2)
    try:
        caps = [h.call("capability", {"tenant": n})["capability"] for n in ("s1", "s2")]
        catch.when = lambda w, op: op == "import_buffer" and w.tenant == "s1"
        h.send("ping", {}, caps[0])
        h.until(lambda: bool(catch.caught))
        h.call("ping", {}, caps[1])  # served: its activation did not wait for s1's
        h.settle()
        assert len(_exports(h)) == 1, "the park owed for room began at once"
        assert h.sup.parts.parking.quiet.held("room")
        _step(h, parking.ROOM_HOLD_MAX_S * 1.2)
        assert len(_exports(h)) >= 2, "the held park ahead began at its bound, s1 still out"
        assert h.tenant("s1")["state"] != "running"
    finally:
        h.close()


def test_an_idle_park_waits_while_an_activation_is_out(tmp_path: Path) -> None:
    catch = _Catch()
    h = _harness(tmp_path, running=("idle",), parked=("s1",), catch=catch, idle_timeout_s=1.0)
    try:
        cap = h.call("capability", {"tenant": "s1"})["capability"]
        _step(h, 0.9)
        assert _exports(h) == []
        catch.when = lambda w, op: op == "ping" and w.tenant == "s1"
        rid = h.send("ping", {}, cap)
        h.until(lambda: bool(catch.caught))
        _step(h, 0.15)  # past idle's timeout, within the idle park's hold
        assert _exports(h) == [], "no idle park while s1's woken request is out"
        catch.answer_all()
        assert h.answer(rid)[0]
        _step(h, quiet.FOLLOW_S * 1.2)
        assert _exports(h) == ["idle"]
    finally:
        h.close()


def test_the_gate_counts_an_activation_out_until_its_requests_are_answered_or_it_ends() -> None:
    now = [100.0]
    timers = Timers(lambda: now[0])
    gate = QuietGate(timers, lambda: now[0])
    ran: list[str] = []
    assert gate.hold("x", lambda: ran.append("x"), 0.05) and ran == []  # quiet: the caller runs it
    gate.out("a")
    gate.out("b")
    assert not gate.hold("x", lambda: ran.append("x"), 0.05)
    assert not gate.hold("x", lambda: ran.append("again"), 0.05)  # held already: one run
    gate.sent("a", {1, 2})
    assert not gate.answered("a", 1) and ran == []
    assert gate.answered("a", 2) and ran == []  # a's answered; b still out
    assert not gate.next_sent("z", 9)  # another tenant's request: a is in
    gate.sent("b", set())  # nothing was sent for b: in at once
    assert ran == ["x"] and gate.quiet and gate.released == 1
    gate.out("c")
    assert not gate.hold("y", lambda: ran.append("y"), 0.05)
    now[0] += 0.06
    for timer in list(timers._heap):
        if timer.when <= now[0] and not timer.cancelled:
            timer.fn()
    assert ran == ["x", "y"] and gate.forced == 1 and not gate.quiet
    now[0] += 1.0  # an activation out past OUT_MAX_S no longer counts
    assert gate.quiet


def test_a_woken_tenants_replacement_waits_for_its_next_request_and_starts_as_that_is_answered(
        tmp_path: Path) -> None:
    """``a`` is woken by a ping and answered: its taken worker's replacement does not start then,
    nor while ``a``'s next request (the work it was woken for) is out, but as that is answered."""
    catch = _Catch()
    h = _harness(tmp_path, parked=("a",), catch=catch, pool_size=3)
    try:
        ws = h.sup.parts.workers
        h.until(lambda: len(ws.pool) == 3 and ws.pool_starting == 0)
        cap = h.call("capability", {"tenant": "a"})["capability"]
        before = len(h.spawner.workers)
        assert h.call("ping", {}, cap) is not None
        h.settle()
        assert len(h.spawner.workers) == before, "no start at the waking request's answer"
        catch.when = lambda w, op: op == "ping" and w.tenant == "a"
        rid = h.send("ping", {}, cap)
        h.until(lambda: bool(catch.caught))
        _step(h, quiet.FOLLOW_S * 2)  # past the window for it to come: it came, and is out
        assert len(h.spawner.workers) == before, "no start while a's next request is out"
        catch.when = lambda _w, _op: False
        catch.answer_all()
        assert h.answer(rid)[0]
        h.settle()
        assert len(h.spawner.workers) > before, "the held replacement starts as it is answered"
        h.until(lambda: len(ws.pool) == 3 and ws.pool_starting == 0)
    finally:
        h.close()


def test_a_woken_tenant_is_in_when_no_next_request_comes_within_the_bound_or_another_tenants_comes_first(
        ) -> None:
    now = [100.0]
    timers = Timers(lambda: now[0])
    gate = QuietGate(timers, lambda: now[0])
    ran: list[str] = []

    def due() -> None:
        for timer in list(timers._heap):
            if timer.when <= now[0] and not timer.cancelled:
                timer.cancelled = True
                timer.fn()

    gate.out("a")
    assert not gate.hold("x", lambda: ran.append("x"), 0.05)
    gate.sent("a", {1})
    assert gate.answered("a", 1) and not gate.quiet and ran == []  # out for its next request
    now[0] += quiet.FOLLOW_S * 1.2
    due()
    assert ran == ["x"] and gate.quiet  # none came within the bound
    gate.out("b")
    assert not gate.hold("y", lambda: ran.append("y"), 0.05)
    gate.sent("b", {2})
    assert gate.answered("b", 2) and not gate.quiet
    assert not gate.next_sent("c", 3)  # another tenant's request first: b is in
    assert ran == ["x", "y"] and gate.quiet
    gate.out("d")
    gate.sent("d", {4})
    assert gate.answered("d", 4)
    assert gate.next_sent("d", 5) and not gate.quiet  # its next request: out until answered
    now[0] += quiet.FOLLOW_S * 2
    due()
    assert not gate.quiet
    assert gate.answered("d", 5) and gate.quiet


def test_another_activation_ends_a_woken_tenants_wait_for_its_next_request_before_it_counts_out() -> None:
    """The work held through ``a``'s activation runs as ``b``'s begins (as it would have at
    ``a``'s answer), not after ``b``'s requests are answered too."""
    now = [100.0]
    timers = Timers(lambda: now[0])
    gate = QuietGate(timers, lambda: now[0])
    ran: list[str] = []
    gate.out("a")
    assert not gate.hold("x", lambda: ran.append("x"), 0.05)
    gate.sent("a", {1})
    assert gate.answered("a", 1) and ran == []
    gate.out("b")
    assert ran == ["x"] and not gate.quiet and gate.released == 1
