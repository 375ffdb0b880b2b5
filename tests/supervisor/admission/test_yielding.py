"""Yielding (supervisor.admission.yielding) as pure policy with a hand-driven clock, the fair
queue's held tenants (supervisor.admission.fairness): held requests keep their place, are
never served while held, and none is lost - and, against a real supervisor, its holds counted."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
import zmq

from shared import protocol as proto
from supervisor.admission.fairness import FairTurn
from supervisor.admission.yielding import Yielding
from tests.helpers.cluster import supervisor, wait_for

pytestmark = pytest.mark.timeout(30)


def test_a_tenant_refused_for_its_rate_is_over_it_for_the_window_on_the_sockets_it_sent_on() -> None:
    y = Yielding(window_s=0.1)
    assert y.over_rate(0.0) == set() and not y.tracking
    assert y.refused(b"\x01", "flooder", 0.0) is True  # newly over its rate
    assert y.tracking
    assert y.refused(b"\x01", "flooder", 0.01) is False  # still
    assert y.over_rate(0.05) == {"flooder"} and y.sources_of("flooder") == [b"\x01"]
    assert y.sources_of("victim") == []
    assert y.over_rate(0.2) == set()  # past the window: forgotten, its sockets too
    assert y.sources_of("flooder") == [] and not y.tracking


def test_the_contended_budget_is_a_share_of_the_rate_and_past_it_the_tenant_stays_over() -> None:
    y = Yielding(window_s=0.1, contended_share=0.5, contended_burst=4.0)
    y.refused(b"\x00", "flooder", 0.0)
    waits = [y.charge("flooder", 1000.0, 0.0) for _ in range(5)]
    assert waits[:4] == [0.0] * 4  # the burst
    assert waits[4] == pytest.approx(1 / 500)  # one past it, paid back at half of 1,000 a second
    # past its budget it is still over its rate, after the window that began at its refusal
    assert y.over_rate(0.09) == {"flooder"} and y.over_rate(0.15) == set()
    y.refused(b"\x00", "flooder", 0.2)
    assert y.charge("flooder", 1000.0, 1.0) == 0.0  # a second later the budget is back
    y.forget("flooder")
    assert y.over_rate(0.2) == set() and y.sources_of("flooder") == []


def test_yielding_off_keeps_no_tenant_over_its_rate() -> None:
    y = Yielding(max_hold_s=0.0, contended_share=1.0)
    assert not y.enabled
    assert y.refused(b"\x00", "flooder", 0.0) is False
    assert y.over_rate(0.0) == set() and not y.tracking


def test_held_tenants_keep_their_place_and_lose_nothing() -> None:
    turn: FairTurn[str] = FairTurn(per_tenant_per_turn=16, quantum_s=1.0)
    for i in range(4):
        turn.add(True, "flooder", f"f{i}")
    turn.add(True, "victim", "v0")
    turn.held = frozenset({"flooder"})
    assert turn.backlog == 1 and turn.queued == 5  # the held ones are not waiting for a turn
    served: list[str] = []
    assert turn.run_turn(served.append, lambda: 0.0) == 1 and served == ["v0"]
    assert turn.run_turn(served.append, lambda: 0.0) == 0 and turn.backlog == 0
    turn.add(True, "flooder", "f4")  # read while held: behind the others
    turn.held = frozenset()
    assert turn.backlog == 5
    served.clear()
    assert turn.run_turn(served.append, lambda: 0.0) == 5 and served == ["f0", "f1", "f2", "f3", "f4"]
    assert turn.queued == 0


def test_a_tenant_held_in_the_middle_of_a_turn_is_served_no_further() -> None:
    turn: FairTurn[str] = FairTurn(per_tenant_per_turn=16, quantum_s=1.0)
    for i in range(3):
        turn.add(True, "flooder", f"f{i}")
    turn.add(True, "victim", "v0")
    served: list[str] = []

    def serve(item: str) -> None:  # the victim's request in flight holds the flooder
        served.append(item)
        if item == "v0":
            turn.held = frozenset({"flooder"})

    turn.run_turn(serve, lambda: 0.0)
    assert served == ["v0"]  # the victim's first (it had nothing waiting), then none of the held
    turn.held = frozenset()
    turn.run_turn(serve, lambda: 0.0)
    assert served == ["v0", "f0", "f1", "f2"]


def test_take_skips_the_held_and_keeps_them() -> None:
    turn: FairTurn[str] = FairTurn(per_tenant_per_turn=2)
    for i in range(3):
        turn.add(True, "a", f"a{i}")
        turn.add(True, "b", f"b{i}")
    turn.held = frozenset({"a"})
    assert turn.take() == ["b0", "b1"]
    assert turn.take() == ["b2"]
    assert turn.take() == [] and turn.queued == 3
    turn.held = frozenset()
    assert turn.take() == ["a0", "a1"] and turn.take() == ["a2"]


def test_a_budget_hold_is_short_whatever_the_rate() -> None:
    """A tenant with a tiny rate owes seconds past its budget; the socket it sends on is left unread
    for at most ``max_budget_hold_s`` at a time (a bystander's first request waits no longer)."""
    y = Yielding(contended_share=0.5, contended_burst=1.0, max_budget_hold_s=0.002)
    y.refused(b"\x01", "slow", 0.0)
    assert y.charge("slow", 1.0, 0.0) == 0.0
    assert y.charge("slow", 1.0, 0.0) == 0.002  # owes 2 s at half of 1 a second: held 2 ms


@pytest.mark.timeout(180)
def test_a_held_flood_shows_in_the_status_and_metrics_counters() -> None:
    """A tenant over its rate on the TCP frontend while a local tenant within its rate pings: it
    is held (its socket unread while the other's request is at a worker, and past its contended
    budget), and each kind of hold is counted in ``status.supervisor`` and on /metrics. Nothing
    of the flood is lost: every request sent is answered or counted as dropped unanswered."""
    tenants = [{"name": "flooder", "requests_per_s": 20}, {"name": "victim"}]
    with supervisor(tenants, listen=["tcp://127.0.0.1:0"], log_level="error", metrics_addr="127.0.0.1:0") as sup:
        c = sup.client
        before = c.status().supervisor
        assert (before.yield_holds, before.yield_full_holds, before.yield_budget_holds) == (0, 0, 0)
        victim = c.tenant_capability(None, "victim")
        ping = proto.encode_request(1, "ping", c.tenant_capability(None, "flooder").to_bytes(), {})
        ctx: zmq.Context[Any] = zmq.Context()
        s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.curve_serverkey = str(sup.info["server_public_key"]).encode()
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        s.connect(str(sup.info["listen"][0]))
        sent = answered = 0

        def read() -> None:
            nonlocal answered
            while s.poll(0):
                s.recv_multipart()
                answered += 1

        def held() -> bool:  # the flood goes on (over its rate) while the victim pings
            nonlocal sent
            for _ in range(50):
                s.send(ping)
            sent += 50
            read()
            assert c.ping(victim).tenant == "victim"
            status = c.status().supervisor
            return status.yield_holds >= 1 and status.yield_budget_holds >= 1

        try:
            wait_for(held, timeout_s=60, what="a hold and a budget hold counted")

            def all_taken() -> bool:
                read()
                status = c.status().supervisor
                return answered + status.admission_unanswered >= sent

            wait_for(all_taken, timeout_s=60, what="every flood request answered or dropped")
        finally:
            s.close(0)
            ctx.destroy(0)
        status = c.status().supervisor
        assert answered + status.admission_unanswered == sent  # held, never lost
        assert status.yield_full_holds <= status.yield_holds
        with urllib.request.urlopen(c.info["metrics_url"], timeout=10) as resp:
            text = resp.read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("twt_yield_")}
        assert values["twt_yield_holds_total"] >= status.yield_holds >= 1
        assert values["twt_yield_budget_holds_total"] >= 1
        assert "twt_yield_full_holds_total" in values
        assert c.status().supervisor.internal_errors == 0


@pytest.mark.timeout(180)
def test_an_over_rate_tenant_on_the_victims_own_socket_waits_in_the_fair_queue_in_order() -> None:
    """A tenant over its rate on ``small.ipc``, the socket a tenant within its rate pings on too:
    the socket is still read (the other's next request is never behind an unread socket), but the
    over-rate tenant's requests read meanwhile wait in the fair queue while the other's request is
    at a worker (a hold) and past its contended budget (a budget hold). Every request of its is
    answered exactly once or counted unanswered, the answered ones in the order sent, each refusal
    the typed rate refusal with its ``retry_after_s``."""
    # its in-flight bound out of reach: on a loaded host its admitted pings wait at the worker, and
    # past 64 of them a refusal would be the in-flight one (also typed), not the rate's under test
    tenants = [{"name": "flooder", "requests_per_s": 200, "max_in_flight": 1_000_000}, {"name": "victim"}]
    with supervisor(tenants, log_level="error", tenant_refusals_per_s=1e6) as sup:
        c = sup.client
        before = c.status().supervisor
        assert (before.yield_holds, before.yield_budget_holds) == (0, 0)
        victim = c.tenant_capability(None, "victim")
        assert c.endpoint.endswith("/small.ipc")
        flooder = c.tenant_capability(None, "flooder").to_bytes()
        ctx: zmq.Context[Any] = zmq.Context()
        s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(str(sup.info["small_frontend"]))
        sent = 0
        answers: dict[int, tuple[bool, Any]] = {}
        order: list[int] = []

        def read() -> None:
            while s.poll(0):
                rid, ok, payload = proto.decode_reply(s.recv_multipart()[0])
                assert rid not in answers, f"rid {rid} answered twice"
                answers[rid] = (ok, payload)
                if ok:
                    order.append(rid)

        def held() -> bool:  # the flood goes on (over its rate) while the victim pings
            nonlocal sent
            for _ in range(50):
                sent += 1
                s.send(proto.encode_request(sent, "ping", flooder, {}))
            read()
            assert c.ping(victim).tenant == "victim"
            status = c.status().supervisor
            return status.yield_holds >= 1 and status.yield_budget_holds >= 1

        try:
            wait_for(held, timeout_s=60, what="a hold and a budget hold on the shared socket counted")

            def all_taken() -> bool:
                read()
                return len(answers) + c.status().supervisor.admission_unanswered >= sent

            wait_for(all_taken, timeout_s=60, what="every flood request answered or dropped")
        finally:
            s.close(0)
            ctx.destroy(0)
        status = c.status().supervisor
        tally = (f"sent {sent}, answered {len(answers)} ({len(order)} served), unanswered "
                 f"{status.admission_unanswered}")
        assert len(answers) + status.admission_unanswered == sent, tally  # held, never lost
        late = [(a, b) for a, b in zip(order, order[1:]) if b < a]
        assert order and not late, f"{tally}; served out of order: {late[:5]}"  # in the order sent
        refused = [p for ok, p in answers.values() if not ok]
        odd = [p for p in refused if not (p["code"] == "overloaded" and p["fields"]["cause"] == "rate"
                                           and p["fields"]["retry_after_s"] > 0)]
        assert refused and not odd, f"{tally}; refusals other than the rate's: {odd[:3]}"
        assert status.internal_errors == 0
