"""Policies of the supervisor's bounds, without processes (issue 12): bytes held,
error replies to unauthenticated peers, connections past the fd budget."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from shared.errors import Overloaded
from supervisor.budgets import HeldBytes
from supervisor.peers import ConnectionGate, UnreadErrors, shed, short


def test_held_bytes_per_tenant_and_total() -> None:
    held = HeldBytes(per_tenant=100, total=150)
    held.reserve("a", "replies", 60)
    held.reserve("a", "parked", 40)
    with pytest.raises(Overloaded, match="this tenant"):
        held.reserve("a", "modules", 1)
    held.reserve("b", "replies", 50)
    with pytest.raises(Overloaded, match="all tenants together"):
        held.reserve("c", "parked", 1)
    assert held.refused == 2 and held.held() == 150 and held.held("a") == 100
    held.release("a", "replies", 1000)  # clamped to what this kind holds
    assert held.held("a") == 40 and held.held("a", "parked") == 40
    held.reserve("c", "parked", 50)
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
    assert [gate.accepted() for _ in range(4)] == [False, False, True, True]
    gate.disconnected()
    gate.disconnected()
    assert gate.connected == 2 and gate.shed == 2
    assert gate.accepted() is True


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
    from supervisor.fairness import FairTurn

    turn: FairTurn[str] = FairTurn(unauthenticated_per_turn=3, backlog_max=5, backlog_bytes_max=50,
                                   size_of=lambda item: 10)
    msgs = [(True, "flood", f"f{i}") for i in range(5)] + [(True, "bystander", "b0")]
    msgs += [(False, b"peer1", f"x{i}") for i in range(10)] + [(False, b"new", "n0")]
    msgs.insert(2, (False, b"peer1", "x-early"))
    order = turn.order(msgs)
    assert order[:2] == ["f0", "b0"]  # the bystander's one request is served second, not sixth
    assert order[2:6] == ["f1", "f2", "f3", "f4"]
    assert order[6:] == ["x-early", "n0", "x0"]  # one per peer in turn, three in all
    assert len(turn.backlog) == 5 and turn.backlog_full and turn.dropped == 4  # 9 left: 50 bytes wait, 4 dropped
    assert turn.order([(True, "t", "a"), (False, b"peer2", "y")]) == ["a", "x1", "y", "x2"]
    assert [item for _, item in turn.backlog] == ["x3", "x4", "x5"]


def test_fair_turn_count_bound_throttles_reading_but_drops_nothing_small() -> None:
    from supervisor.fairness import FairTurn

    turn: FairTurn[str] = FairTurn(unauthenticated_per_turn=3, backlog_max=2)
    turn.order([(False, b"p", f"m{i}") for i in range(10)])
    assert turn.backlog_full and len(turn.backlog) == 7 and turn.dropped == 0
    served = []
    while turn.backlog:
        served += turn.order([])
    assert served == [f"m{i}" for i in range(3, 10)]  # every one, in order
