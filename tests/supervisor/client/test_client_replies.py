"""The client decodes every reply the system may produce, and reports one it cannot
decode as a typed error, never as silence (the client side).

A fake supervisor (a ROUTER on ``frontend.ipc`` in a run dir we own) answers
with what we choose.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from shared import protocol as proto
from shared.errors import ProtocolError
from shared.records import PoolRecord, StatusRecord, SupervisorRecord, TenantRecord
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from tests.helpers import timeouts

Answer = Callable[[int], list[bytes]]


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Callable[[Answer], SupervisorClient]]:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "supervisor.json").write_text(json.dumps({"pid": os.getpid()}))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("ipc://" + str(run / "frontend.ipc"))
    stop = threading.Event()
    answers: list[Answer] = []

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, header, *_ = sock.recv_multipart()
            rid = proto.decode_client_header(header)[0]
            sock.send_multipart([ident, *answers[0](rid)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    clients: list[SupervisorClient] = []

    def make(answer: Answer) -> SupervisorClient:
        answers[:] = [answer]
        c = SupervisorClient(str(run), timeout_s=timeouts.scaled(10))  # a hang guard, not a speed bound
        clients.append(c)
        return c

    try:
        yield make
    finally:
        stop.set()
        t.join(5)
        for c in clients:
            c.close()
        sock.close(0)


def test_an_undecodable_reply_is_a_typed_error_not_a_timeout(fake: Callable[[Answer], SupervisorClient]) -> None:
    # [VERSION, rid, ...] then garbage: the rid is readable, the rest is not
    c = fake(lambda rid: [msgpack.packb([proto.PROTOCOL_VERSION, rid]) + b"\xc1\xc1"])
    with pytest.raises(ProtocolError, match="could not be decoded"):
        c.call("ping", b"cap")
    c2 = fake(lambda rid: [b"\xc1 not msgpack at all"])  # no rid: still an error for the waiting call
    with pytest.raises(ProtocolError, match="ping: .*could not be decoded"):
        c2.call("ping", b"cap")


def test_large_replies_the_supervisor_produces_decode(fake: Callable[[Answer], SupervisorClient]) -> None:
    # a status of 5,000 tenants (> 1 MiB, > 4,096 items) and a merged buffers list of 200,000 buffers
    head = SupervisorRecord(pid=1, registry_id="r", backend="stub", backend_reason="", start_method="spawn",
                            protocol=proto.PROTOCOL_VERSION, uptime_s=0.0, run_dir="/run", pool=PoolRecord(0, 0, 0),
                            workers=0, internal_errors=0)
    tenants = [TenantRecord(f"t{i}", "running", 1, pids=(i,), spec=TenantSpec(f"t{i}")) for i in range(5000)]
    status = StatusRecord(head, tuple(tenants)).to_wire()
    c = fake(lambda rid: [proto.encode_reply(rid, True, status)])
    got = c.status(b"admin")  # type: ignore[arg-type]
    assert len(got.tenants) == 5000 and len(proto.encode_reply(1, True, status)) > 1 << 20
    assert got.tenants[4999].spec == TenantSpec("t4999") and got.tenant("t7") == tenants[7]
    buffers = [[h, 4096] for h in range(200_000)]
    c2 = fake(lambda rid: [proto.encode_reply(rid, True, {"buffers": buffers, "bytes": 4096 * len(buffers)})])
    assert len(c2.buffers(b"cap")) == 200_000  # type: ignore[arg-type]


def test_a_reply_beyond_the_client_limits_is_a_typed_error(fake: Callable[[Answer], SupervisorClient]) -> None:
    too_many = list(range(proto.MAX_CLIENT_REPLY_ITEMS + 1))
    c = fake(lambda rid: [proto.encode_reply(rid, True, {"buffers": too_many})])
    with pytest.raises(ProtocolError, match="could not be decoded"):
        c.call("buffers", b"cap")


def test_worker_replies_within_the_buffer_cap_decode() -> None:
    listing = [[h, 1 << 20] for h in range(proto.MAX_BUFFERS_PER_INSTANCE)]
    rid, ok, payload = proto.decode_worker_reply(proto.encode_worker_reply(7, True, {"buffers": listing}))
    assert (rid, ok, len(payload["buffers"])) == (7, True, proto.MAX_BUFFERS_PER_INSTANCE)


@pytest.mark.timeout(120)
def test_buffers_with_more_than_4096_buffers_works_end_to_end() -> None:
    """Before: the worker's reply broke the supervisor's 4,096-item decoder limit, the
    worker was killed as "malformed reply" and the client saw nothing until its timeout."""
    from shared.spec import TenantSpec
    from tests.helpers.cluster import supervisor, tenant

    with supervisor() as sup:
        c = sup.client
        # 10,000 allocs pipelined as fast as this host goes: past the default rate on a small host
        # (a share of its CPUs, supervisor.admission.rates), which is not what this test is about
        cap = c.register(None, TenantSpec("many", requests_per_s=1e6).with_instances(2).with_max_in_flight(256))
        n = 10_000  # ~5,000 per instance: past the old 4,096 limit in each worker reply and merged
        sent = 0
        handles: list[int] = []
        while len(handles) < n:
            while sent - len(handles) < 200 and sent < n:
                c.send("alloc", cap, {"nbytes": 1})
                sent += 1
            _, ok, payload, _ = c.recv()
            assert ok, payload
            handles.append(int(payload["handle"]))
        listing = c.buffers(cap)
        assert len(listing) == n and set(listing) == set(handles)
        assert tenant(c.status(), "many").restarts == 0


class _Pages:
    """A PageSource that hands out the given ``events`` replies in turn (the last one again)."""

    def __init__(self, *pages: object) -> None:
        self.pages: list[object] = list(pages)
        self.asked: list[int | None] = []

    def events_page(self, cap: object, after: int | None = None, **_: object) -> object:
        self.asked.append(after)
        return self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]


def test_event_pages_are_checked_records_and_gaps_are_reported() -> None:
    from supervisor.client.event_follow import follow

    first = {"events": [{"event": "ready", "tenant": "acme", "seq": 1}], "next": 1, "missed": 0, "more": True, "log": "a"}
    restarted = {"events": [], "next": 3, "missed": 2, "more": False, "log": "b"}
    pages = _Pages(first, restarted)
    got = list(follow(pages, None, timeout_s=0.0, poll_s=0.0))  # type: ignore[arg-type]
    assert got[0] == {"event": "ready", "tenant": "acme", "seq": 1}
    assert [(e["event"], e["missed"]) for e in got[1:]] == [("missed", None), ("missed", 2)]
    assert "event log a -> b" in str(got[1]["reason"])
    assert pages.asked == [None, 1]  # the second page asked after the first page's position


@pytest.mark.parametrize("page", [
    "not a map",
    {"events": "x", "next": 1, "missed": 0, "more": False, "log": "a"},
    {"events": [], "next": "1", "missed": 0, "more": False, "log": "a"},
    {"events": [], "next": 1, "missed": 0, "more": 0, "log": "a"},
    {"events": [], "next": 1, "missed": 0, "more": False},
])
def test_a_malformed_event_page_is_a_protocol_error(page: object) -> None:
    from supervisor.client.event_follow import follow

    with pytest.raises(ProtocolError):
        list(follow(_Pages(page), None, timeout_s=0.0, poll_s=0.0))  # type: ignore[arg-type]
