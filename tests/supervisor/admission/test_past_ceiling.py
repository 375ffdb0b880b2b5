"""The fair queue at its hard ceiling, full of a held tenant's requests (supervisor.admission.fairness,
supervisor.admission.yielding): another tenant's next request on the same socket is still read and
served, the held tenant's messages read with it refused for its rate, its queued ones kept.

In process, fake workers and a fake clock that does not move: a hold and a budget hold end only on
their timers, so on a socket read only when a turn makes room the other tenant's request would
wait for as long as the clock stands still."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared import protocol as proto
from supervisor.admission.fairness import FairTurn
from tests.supervisor.lifecycle.test_lifecycle_inprocess import Harness

pytestmark = pytest.mark.timeout(120)

#: the fair queue's soft bound in these tests (its hard ceiling is this plus BATCH_BACKLOGGED)
BACKLOG = 4


def test_past_the_ceiling_only_a_socket_beside_held_items_reads_and_only_so_far() -> None:
    fair: FairTurn[int] = FairTurn(backlog_max=BACKLOG, past_ceiling_max=3)
    for i in range(BACKLOG + 2):
        fair.add(True, "flooder", i)
    assert fair.read_budget(16, 2) == 0  # the hard ceiling (BACKLOG + 2)
    assert fair.past_ceiling(2) == 0  # nothing held: the turns make room
    fair.held = frozenset({"flooder"})
    assert fair.past_ceiling(2) == 2
    for i in range(3):
        fair.add(True, "victim", i)
    assert fair.past_ceiling(2) == 0  # past_ceiling_max items past the ceiling: no further


def _dealer(endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    return sock


def _answers(sock: zmq.Socket[Any]) -> Iterator[tuple[int, bool, Any]]:
    while sock.poll(0):
        yield proto.decode_reply(sock.recv_multipart()[0])


def test_a_tenant_within_its_rate_is_read_beside_a_full_queue_of_held_requests(tmp_path: Path) -> None:
    h = Harness(tmp_path, tenant_refusals_per_s=1e6)
    flooder_sock = victim_sock = None
    try:
        flooder = h.register("flooder", requests_per_s=1.0, max_in_flight=1_000_000)
        victim = h.register("victim")
        h.call("ping", {}, victim)  # its worker up and bound
        h.until(lambda: bool(h.spawner.of("victim")))
        for worker in h.spawner.of("victim"):
            worker.hang_ops.add("ping")  # its pings stay in flight: the flooder is held meanwhile
        parts = h.sup.parts
        assert parts is not None
        fair = parts.frontend.guard.fair
        fair.backlog_max = BACKLOG
        small = h.sup.rundir.endpoint("small")
        flooder_sock, victim_sock = _dealer(small), _dealer(small)
        answers: dict[int, tuple[bool, Any]] = {}

        def read_flooder() -> None:
            for rid, ok, payload in _answers(flooder_sock):
                assert rid not in answers, f"rid {rid} answered twice"
                answers[rid] = (ok, payload)

        rid = 0

        def flood(n: int) -> None:
            nonlocal rid
            for _ in range(n):
                rid += 1
                flooder_sock.send(proto.encode_request(rid, "ping", flooder, {}))

        flood(20)  # past its bucket (the clock stands still): refused for its rate, over it

        def refused_for_rate() -> bool:
            read_flooder()
            return any(not ok and p["fields"]["cause"] == "rate" for ok, p in answers.values())

        h.until(refused_for_rate)
        victim_sock.send(proto.encode_request(1, "ping", victim, {}))  # in flight, never answered: a hold
        h.until(lambda: sum(w.received.count("ping") for w in h.spawner.of("victim")) == 2)
        assert fair.held == {"flooder"}
        answered_before = len(answers)
        flood(60)  # read into the fair queue, held, up to its hard ceiling; the rest waits in the socket
        h.until(lambda: fair.queued >= BACKLOG + 8)
        assert fair.backlog == 0  # all of it held

        victim_sock.send(proto.encode_request(2, "ping", victim, {}))  # the victim's next request
        h.until(lambda: sum(w.received.count("ping") for w in h.spawner.of("victim")) == 3)

        def refused_past_ceiling() -> list[Any]:
            read_flooder()
            return [p for r, (ok, p) in answers.items() if r > 20 and not ok]

        h.until(lambda: bool(refused_past_ceiling()))  # (the answers cross real sockets)
        past = refused_past_ceiling()
        assert all(p["code"] == "overloaded" and p["fields"]["cause"] == "rate"
                            and p["fields"]["retry_after_s"] > 0 for p in past)
        assert len(answers) - answered_before == len(past)  # none of the held requests served
        assert fair.queued >= BACKLOG + 8 and fair.held == {"flooder"}  # still queued, in their place
        assert parts.frontend.guard.admission.status()["admission_refused"] >= len(past)
    finally:
        for sock in (flooder_sock, victim_sock):
            if sock is not None:
                sock.close(0)
        h.close()
