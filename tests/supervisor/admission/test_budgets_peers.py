"""Policies of the supervisor's bounds, without processes: bytes held,
error replies to unauthenticated peers, connections past the fd budget."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from shared.errors import HeldBytesLimit, Overloaded, error_from_dict
from supervisor.routing.budgets import HeldBytes
from supervisor.admission.peers import TRACK_EVERY, ConnectionGate, UnreadErrors, shed, short


def test_held_bytes_per_tenant_and_total() -> None:
    held = HeldBytes(per_tenant=100, total=150)
    load = {"in_flight": 3, "max_in_flight": 64}  # the tenant's requests, which every Overloaded carries
    held.reserve("a", "replies", 60, **load)
    held.reserve("a", "parked", 40, **load)
    with pytest.raises(Overloaded, match="this tenant") as info:
        held.reserve("a", "modules", 1, **load)
    err = info.value
    assert isinstance(err, HeldBytesLimit) and err.cause == "held_bytes"
    assert (err.scope, err.held, err.requested, err.budget) == ("tenant", 100, 1, 100)
    assert (err.tenant_id, err.in_flight, err.limit) == ("a", 3, 64)
    assert error_from_dict(err.to_dict()) == err  # the cause's class and its fields, over the wire
    held.reserve("b", "replies", 50, **load)
    with pytest.raises(HeldBytesLimit, match="all tenants together") as info:
        held.reserve("c", "parked", 1, **load)
    assert (info.value.scope, info.value.held, info.value.budget) == ("total", 150, 150)
    assert held.refused == 2 and held.held() == 150 and held.held("a") == 100
    held.release("a", "replies", 1000)  # clamped to what this kind holds
    assert held.held("a") == 40 and held.held("a", "parked") == 40
    held.reserve("c", "parked", 50, **load)
    assert held.forget("a") == 40 and held.held() == 100
    assert held.snapshot() == {"total": 100, "refused": 2, "replies": 50, "parked": 50, "modules": 0}
    held.release("b", "parked", 10)  # not held under this kind: nothing
    assert held.held("b") == 50


class _Tracker:
    def __init__(self) -> None:
        self.done = False


def test_unread_errors_are_bounded_per_peer_and_peers_are_bounded() -> None:
    errors = UnreadErrors(max_unread=3, max_peers=2)
    trackers = []
    for _ in range(3):
        assert errors.allow(b"p")
        trackers.append(_Tracker())
        errors.sent(b"p", trackers[-1])
    assert not errors.allow(b"p") and errors.dropped == 1  # three unread: no more
    trackers[0].done = True  # the peer read one
    assert errors.allow(b"p")
    errors.allow(b"q")
    errors.allow(b"r")
    assert len(errors) == 2  # the least recently seen peer was forgotten


def test_short_never_echoes_unbounded_input() -> None:
    assert short("x" * 10) == "x" * 10
    assert len(short("unknown op " + "y" * 32768)) == 200


def test_connection_gate_sheds_past_the_budget() -> None:
    gate = ConnectionGate(budget=2)
    assert [gate.accepted(fd) for fd in range(4)] == [None, None, "fd_budget", "fd_budget"]
    gate.disconnected(0)
    gate.disconnected(1)
    gate.disconnected(1)  # a repeated or lost event never drifts the count
    assert gate.connected == 0 and gate.shed == 2
    assert gate.accepted(5) is None and gate.accepted(5) is None  # fd 5 reused: its DISCONNECTED was lost
    assert gate.connected == 1


def test_connection_gate_counts_tcp_in_the_same_budget_with_per_source_and_peer_caps() -> None:
    gate = ConnectionGate(budget=10, max_tcp=4, max_per_source=3, tcp_slack=1)
    assert gate.accepted(1) is None  # ipc
    assert [gate.accepted(fd, tcp=True, source="10.0.0.1") for fd in (2, 3, 4, 5)] == [None, None, None, "per_source"]
    assert gate.accepted(6, tcp=True, source="10.0.0.2") is None
    assert gate.accepted(7, tcp=True, source="10.0.0.3") is None  # 5 = max_tcp + slack: ZAP refuses it, typed
    assert gate.accepted(8, tcp=True, source="10.0.0.4") == "max_tcp_peers"
    assert gate.tcp == 5 and gate.connected == 6 and gate.sources() == 3
    assert gate.shed_by == {"per_source": 1, "max_tcp_peers": 1}
    gate.disconnected(2, tcp=True)
    gate.disconnected(2)  # an ipc fd 2 was never counted: the TCP one is kept apart
    assert gate.accepted(9, tcp=True, source="10.0.0.1") is None and gate.tcp == 5
    for fd in range(20, 30):  # ipc fills the shared budget: TCP is shed too
        gate.accepted(fd)
    assert gate.accepted(40, tcp=True, source="10.0.0.9") == "fd_budget"
    tcp_only = ConnectionGate(budget=8)  # TCP alone takes at most 3/4 of it: ipc clients still get in
    assert [tcp_only.accepted(fd, tcp=True, source=str(fd)) for fd in range(7)] == [None] * 6 + ["fd_budget"]
    assert tcp_only.accepted(100) is None and tcp_only.accepted(101) is None and tcp_only.accepted(102) == "fd_budget"


def test_source_key_groups_ipv6_by_its_64_and_unmaps_ipv4() -> None:
    from supervisor.admission.peers import source_key

    assert source_key("192.0.2.7") == "192.0.2.7"
    assert source_key("2001:db8:1:2:aaaa::1") == source_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:3::1") != source_key("2001:db8:1:2::1")
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert source_key("fe80::1%eth0") == "fe80::/64"


def test_shed_tcp_shuts_down_only_an_accepted_connection_of_that_port() -> None:
    from supervisor.admission.peers import shed_tcp, tcp_peer

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    port = lst.getsockname()[1]
    cli = socket.socket()
    cli.connect(("127.0.0.1", port))
    conn, _ = lst.accept()
    other = socket.socketpair()
    try:
        assert tcp_peer(conn.fileno(), {port}) == "127.0.0.1"
        assert tcp_peer(other[0].fileno(), {port}) is None and tcp_peer(conn.fileno(), {port + 1}) is None
        assert shed_tcp(lst.fileno(), {port}) is False  # the listener itself: never
        assert shed_tcp(other[0].fileno(), {port}) is False and shed_tcp(10**6, {port}) is False
        assert shed_tcp(conn.fileno(), {port}) is True
        assert cli.recv(1) == b""  # the peer sees the connection closed
    finally:
        for s in (lst, cli, conn, *other):
            s.close()


def test_shed_shuts_down_only_a_connection_of_that_path() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.ipc")
        lst = socket.socket(socket.AF_UNIX)
        lst.bind(path)
        lst.listen()
        cli = socket.socket(socket.AF_UNIX)
        cli.connect(path)
        conn, _ = lst.accept()
        other = socket.socketpair()
        try:
            assert shed(other[0].fileno(), path) is False  # not one of ours: untouched
            assert shed(10**6, path) is False  # no such fd
            assert shed(conn.fileno(), path) is True
            assert cli.recv(1) == b""  # the peer sees the connection closed
            other[1].send(b"x")
            assert other[0].recv(1) == b"x"
        finally:
            for s in (lst, cli, conn, *other):
                s.close()


def test_fair_turn_round_robin_tenants_first_unauthenticated_last_and_budgeted() -> None:
    from supervisor.admission.fairness import FairTurn

    turn: FairTurn[str] = FairTurn(unauthenticated_per_turn=3, backlog_max=8, backlog_bytes_max=150,
                                   per_tenant_per_turn=3, size_of=lambda item: 10)
    msgs = [(True, "flood", f"f{i}") for i in range(5)] + [(True, "bystander", "b0"), (False, b"new", "n0")]
    msgs += [(False, b"peer1", f"x{i}") for i in range(10)]
    msgs.insert(2, (False, b"peer1", "x-early"))
    order = turn.order(msgs)
    assert order[:2] == ["b0", "f0"]  # the bystander's one request is served first, not sixth
    assert order[2:4] == ["f1", "f2"]  # the flooder's share of the turn: three
    assert order[4:] == ["x-early", "n0", "x0"]  # one per peer in turn, three in all
    # 150 bytes were queued: the last three unauthenticated ones went past the byte bound (dropped)
    assert turn.dropped == 3 and turn.backlog == 8 and turn.backlog_full
    assert turn.order([(True, "t", "a")]) == ["a", "f3", "f4", "x1", "x2", "x3"]
    assert turn.backlog == 3 and not turn.backlog_full


def test_fair_turn_bounds_each_tenant_per_turn_and_serves_everything_in_order() -> None:
    from supervisor.admission.fairness import FairTurn

    turn: FairTurn[str] = FairTurn(unauthenticated_per_turn=3, backlog_max=2, per_tenant_per_turn=4)
    turn.order([(False, b"p", f"m{i}") for i in range(10)])
    assert turn.backlog_full and turn.backlog == 7 and turn.dropped == 0
    served = []
    while turn.backlog:
        served += turn.take()
    assert served == [f"m{i}" for i in range(3, 10)]  # every one, in order
    for i in range(10):
        turn.add(True, "busy", f"b{i}")
    turn.add(True, "quiet", "q0")
    first = turn.take()
    assert first == ["q0", "b0", "b1", "b2", "b3"] and turn.take() == ["b4", "b5", "b6", "b7"]
    turn.add(True, "quiet", "q1")
    assert turn.take() == ["q1", "b8", "b9"]  # a tenant with nothing waiting goes first
    assert turn.take() == [] and turn.backlog == 0


def test_fair_turn_bounds_each_tenant_by_the_time_its_requests_take() -> None:
    """Deficit round robin on measured cost: a tenant whose requests are dear gets
    fewer a turn; a debt carries over; unspent credit does not; every item is served once, in order."""
    from supervisor.admission.fairness import FairTurn

    now = [0.0]
    cost = {"dear": 0.0001, "cheap": 0.00001, "huge": 0.0005}

    def clock() -> float:
        return now[0]

    served: list[str] = []

    def serve(item: str) -> None:
        served.append(item)
        now[0] += cost[item.split("-")[0]]

    turn: FairTurn[str] = FairTurn(per_tenant_per_turn=16, quantum_s=0.0002)
    for i in range(8):
        turn.add(True, "a", f"dear-{i}")
        turn.add(True, "b", f"cheap-{i}")
    assert turn.run_turn(serve, clock) == 10
    # a's credit of 200 us pays for two 100 us requests; b's for all eight 10 us ones
    assert sorted(served) == sorted(["dear-0", "dear-1", *(f"cheap-{i}" for i in range(8))])
    served.clear()
    turn.add(True, "c", "huge-0")
    turn.add(True, "c", "huge-1")
    assert turn.run_turn(serve, clock) == 3 and served == ["huge-0", "dear-2", "dear-3"]
    served.clear()
    # c owes 300 us: skipped for a turn (200 us of new credit leaves it at -100 us), then served
    assert turn.run_turn(serve, clock) == 2 and served == ["dear-4", "dear-5"]
    served.clear()
    assert turn.run_turn(serve, clock) == 3 and served == ["huge-1", "dear-6", "dear-7"]
    assert turn.backlog == 0 and turn.run_turn(serve, clock) == 0
    # the unauthenticated still get their budget of items after the tenants
    turn.add(False, b"p", "cheap-x")
    turn.add(True, "b", "cheap-y")
    served.clear()
    assert turn.run_turn(serve, clock) == 2 and served == ["cheap-y", "cheap-x"]


def test_a_full_queue_reads_what_the_last_turn_served_up_to_a_hard_ceiling() -> None:
    """A turn bounded by time may serve fewer than a wake-up reads: while the queue is full, a
    socket reads only what the last turn served (at least 2, so a bystander's request behind a
    flood is still read), and nothing once the queue is ``backlogged`` past its bound."""
    from supervisor.admission.fairness import FairTurn

    turn: FairTurn[str] = FairTurn(backlog_max=4, per_tenant_per_turn=16, quantum_s=1.0)
    assert turn.read_budget(16, 8) == 16
    for i in range(4):
        turn.add(True, "a", f"a{i}")
    assert turn.backlog_full and turn.read_budget(16, 8) == 2  # nothing served yet: the floor
    now = [0.0]

    def serve(item: str) -> None:
        now[0] += 0.3  # four items exhaust a 1 s quantum

    assert turn.run_turn(serve, lambda: now[0]) == 4
    for i in range(4, 10):
        turn.add(True, "a", f"a{i}")
    assert turn.backlog_full and turn.read_budget(16, 8) == 4  # what the turn served
    for i in range(10, 12):
        turn.add(True, "a", f"a{i}")
    assert turn.backlog == 8 and turn.read_budget(16, 8) == 4
    for i in range(12, 16):
        turn.add(True, "a", f"a{i}")
    assert turn.backlog == 12 and turn.read_budget(16, 8) == 0  # 4 + 8: the hard ceiling


def test_unread_errors_track_one_reply_in_track_every_and_count_the_rest_until_it_is_done() -> None:
    errors = UnreadErrors(max_unread=3 * TRACK_EVERY)
    trackers: list[_Tracker] = []

    def send() -> None:
        assert errors.allow(b"p")
        if errors.track(b"p"):
            trackers.append(_Tracker())
            errors.sent(b"p", trackers[-1])
        else:
            errors.sent(b"p", True)  # sent untracked

    for _ in range(3 * TRACK_EVERY):
        send()
    assert len(trackers) == 3  # every TRACK_EVERY-th
    errors.sent(b"p", False)  # not queued: not counted
    assert not errors.allow(b"p")  # every reply counts as unread, the untracked ones too
    trackers[0].done = True  # libzmq let go of the first tracked reply: of every one sent before it too
    for _ in range(TRACK_EVERY):
        send()
    assert len(trackers) == 4 and not errors.allow(b"p")
    for t in trackers:
        t.done = True
    assert errors.allow(b"p") and errors.dropped == 2
