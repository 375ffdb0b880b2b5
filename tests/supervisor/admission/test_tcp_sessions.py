"""TCP sessions that hold a slot and send nothing: the idle rule and the eviction at
``max_tcp_peers`` (supervisor.admission.peers), and the remote client's reconnect before
a request on an idle link (supervisor.client.api).

The end-to-end tests run a real supervisor on 127.0.0.1 with small bounds; each waits
for the event it means (a status counter, a handshake on a monitor), never for a duration.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import zmq

from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.errors import InvalidArgument
from shared.zmq_monitor import recv_monitor_event
from supervisor.admission.peers import EVICT_MIN_IDLE_S, ConnectionGate
from supervisor.client.api import SupervisorClient
from tests.helpers.cluster import supervisor, wait_for

pytestmark = pytest.mark.timeout(180)

LOOPBACK = "tcp://127.0.0.1:0"
TCP = b"\x01"


def _remote(info: dict[str, Any], **kw: Any) -> SupervisorClient:
    return SupervisorClient.remote(str(info["listen"][0]), str(info["server_public_key"]), **kw)


def _shed(sup: Any, reason: str) -> int:
    return int(sup.client.status().supervisor.connections_shed_by.get(reason, 0))


def _squatter(ctx: zmq.Context[Any], info: dict[str, Any]) -> zmq.Socket[Any]:
    """A CURVE session with any key (no allow-list) that completes its handshake and then
    sends nothing, and never reconnects once dropped: the finding's slot holder."""
    s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, -1)
    s.curve_serverkey = str(info["server_public_key"]).encode()
    s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    addr = f"inproc://squatter-{id(s):x}"
    s.monitor(addr, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    mon: zmq.Socket[Any] = ctx.socket(zmq.PAIR)
    mon.connect(addr)
    try:
        s.connect(str(info["listen"][0]))
        assert mon.poll(60_000), "no handshake result within 60 s"
        event, _ = recv_monitor_event(mon)
        assert event == zmq.EVENT_HANDSHAKE_SUCCEEDED, f"the squatter's handshake failed ({event})"
    finally:
        s.monitor(None, 0)
        mon.close(0)
    return s


def test_idle_completed_sessions_cannot_lock_a_remote_client_out() -> None:
    """Before: any key completes the handshake, a completed session never expired, and with
    every ``max_tcp_peers`` slot held a legitimate remote client got HandshakeFailed for as
    long as they stayed. Now a new connection at the cap evicts the longest idle anonymous
    session, and a tenant's session is not evicted while anonymous ones remain."""
    peers = 12
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], log_level="error", max_tcp_peers=peers,
                    max_tcp_peers_per_source=64, tcp_idle_timeout_s=600.0) as sup:
        cap = sup.client.tenant_capability(None, "acme")
        ctx: zmq.Context[Any] = zmq.Context()
        with ExitStack() as stack:
            stack.callback(ctx.destroy, 0)
            for _ in range(peers):
                stack.callback(_squatter(ctx, sup.info).close, 0)
            wait_for(lambda: sup.client.status().supervisor.tcp_connections == peers, what="every slot held")
            assert _shed(sup, "evicted") == 0
            rc = stack.enter_context(_remote(sup.info, timeout_s=60, idle_reconnect_s=None))
            assert rc.ping(cap).tenant == "acme"  # before: HandshakeFailed (max_tcp_peers)
            assert _shed(sup, "evicted") == 1
            # more anonymous handshakes at the cap evict anonymous sessions, not the tenant's
            for _ in range(4):
                stack.callback(_squatter(ctx, sup.info).close, 0)
            wait_for(lambda: _shed(sup, "evicted") == 5, what="an eviction per new handshake")
            assert rc.ping(cap).tenant == "acme"
            assert rc.link_drops == 0
            st = sup.client.status().supervisor
            assert st.tcp_connections <= peers and st.internal_errors == 0


def test_a_remote_client_idle_past_the_timeout_is_served_without_an_error() -> None:
    """A session idle for ``tcp_idle_timeout_s`` is closed by the supervisor (before: never);
    the client's next request is answered, on a new connection made before it is sent
    (``idle_reconnect_s``) or on the one libzmq made by itself after the drop (None)."""
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], log_level="error", tcp_idle_timeout_s=1.0) as sup:
        cap = sup.client.tenant_capability(None, "acme")
        with _remote(sup.info, timeout_s=60, idle_reconnect_s=0.25) as rc:
            assert rc.ping(cap).tenant == "acme"
            wait_for(lambda: _shed(sup, "idle") >= 1, what="the idle session closed")
            assert rc.ping(cap).tenant == "acme"  # no error surfaced: a new link, then the request
            assert rc.reconnects >= 1
        before = _shed(sup, "idle")
        with _remote(sup.info, timeout_s=60, idle_reconnect_s=None) as rc:
            assert rc.ping(cap).tenant == "acme"
            wait_for(lambda: rc.link_drops >= 1, what="the client seeing its idle link closed")
            assert _shed(sup, "idle") > before
            assert rc.ping(cap).tenant == "acme"  # libzmq reconnected: the request goes on the new link
            assert rc.reconnects == 0


def test_a_raw_client_with_its_own_routing_id_is_answered_after_its_idle_drop() -> None:
    """A raw client that sets ZMQ_ROUTING_ID comes back with the same client key after the idle
    drop: its requests on the new connection are served (only the old connection's are not)."""
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], log_level="error", tcp_idle_timeout_s=1.0) as sup:
        ctx: zmq.Context[Any] = zmq.Context()
        with ExitStack() as stack:
            stack.callback(ctx.destroy, 0)
            s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
            stack.callback(s.close, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, b"api-1")
            s.curve_serverkey = str(sup.info["server_public_key"]).encode()
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            stack.callback(mon.close, 0)
            s.connect(str(sup.info["listen"][0]))

            def hello(rid: int) -> None:
                s.send(proto.encode_request(rid, "hello", None, {}))
                assert s.poll(60_000), f"no answer to hello {rid}"
                got, ok, _ = proto.decode_reply(s.recv())
                assert (got, ok) == (rid, True)

            hello(1)
            dropped = reconnected = False
            while not reconnected:  # the idle drop, then libzmq's reconnect
                assert mon.poll(60_000), f"no drop and reconnect seen (dropped: {dropped})"
                event, _ = recv_monitor_event(mon)
                dropped = dropped or event == zmq.EVENT_DISCONNECTED
                reconnected = dropped and event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert _shed(sup, "idle") >= 1
            hello(2)  # the same routing id on the new connection: answered


def test_a_session_with_a_request_in_flight_is_not_idle() -> None:
    """A request that takes longer than ``tcp_idle_timeout_s`` keeps its session: the reply
    comes on it (a drop while it waits would be SupervisorUnavailable)."""
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], log_level="error", tcp_idle_timeout_s=1.0) as sup:
        cap = sup.client.tenant_capability(None, "acme")
        sup.client.inject_fault(None, "acme", "slow", ms=2500)
        with _remote(sup.info, timeout_s=60, idle_reconnect_s=0.5) as rc:
            assert rc.ping(cap).tenant == "acme"  # 2.5 s in flight, past the 1 s idle timeout


# ------------------------------------------------------------ the gate's rules (pure)


def _gate(max_tcp: int = 4) -> ConnectionGate:
    return ConnectionGate(budget=100, max_tcp=max_tcp, max_per_source=100)


def test_idle_sessions_expire_unless_a_request_is_in_flight() -> None:
    gate = _gate()
    for fd in (10, 11, 12):
        assert gate.accepted(fd, tcp=True, source="a", peer=("a", fd), now=0.0) is None
    assert gate.seen(12, TCP + b"r12", 1.0) == "ok"
    assert gate.seen(11, TCP + b"r11", 5.0) == "ok"
    assert gate.expire(9.0, 10.0, lambda: ()) == []
    # fd 10 idle since its accept, fd 12 since 1.0 but busy (counts as active now), fd 11 active at 5.0
    dropped = gate.expire(11.5, 10.0, lambda: {TCP + b"r12"})
    assert dropped == [(10, ("a", 10))]
    assert gate.tcp == 2 and gate.shed_by == {"idle": 1}
    assert gate.expire(16.0, 10.0, lambda: ()) == [(11, ("a", 11))]  # 12 was refreshed at 11.5
    gate.disconnected(10, tcp=True)  # the dropped connection's late event: already counted out
    assert gate.tcp == 1 and gate.sources() == 1


def test_a_dropped_sessions_requests_are_never_served_and_a_reused_fd_is_new() -> None:
    gate = _gate()
    gate.accepted(10, tcp=True, source="a", now=0.0)
    assert gate.seen(10, TCP + b"old", 0.0) == "ok"
    gate.drop(10, "idle")
    assert gate.seen(10, TCP + b"old", 1.0) == "dropped" and gate.dropped(TCP + b"old")
    assert gate.seen(10, TCP + b"never-seen", 1.0) == "dropped"  # its first request, read late
    assert gate.seen(99, TCP + b"new", 1.0) == "unknown"  # no ACCEPTED read yet
    gate.accepted(10, tcp=True, source="a", now=2.0)  # fd 10 reused by a new connection
    assert gate.seen(10, TCP + b"new", 2.0) == "ok"
    assert gate.seen(10, TCP + b"old", 2.0) == "dropped"


def test_a_client_with_its_own_routing_id_is_served_again_after_its_session_was_dropped() -> None:
    gate = _gate()
    mine = TCP + b"api-1"  # ZMQ_ROUTING_ID set by the client: the same key on every connection
    gate.accepted(10, tcp=True, source="a", now=0.0)
    gate.seen(10, mine, 0.0)
    gate.drop(10, "idle")
    assert gate.seen(10, mine, 1.0) == "dropped" and gate.dropped(mine)
    gate.accepted(11, tcp=True, source="a", now=2.0)  # it reconnected, on another fd
    assert gate.seen(11, mine, 2.0) == "ok" and not gate.dropped(mine)
    gate.drop(11, "idle")
    gate.accepted(11, tcp=True, source="a", now=3.0)  # and again, on the same fd number
    assert gate.seen(11, mine, 3.0) == "ok"


def test_eviction_takes_the_longest_idle_anonymous_session_then_an_idle_tenant() -> None:
    gate = _gate(max_tcp=3)
    for fd in (10, 11, 12):
        gate.accepted(fd, tcp=True, source="a", peer=("a", fd), now=0.0)
    for fd in (10, 11, 12):
        gate.seen(fd, TCP + bytes([fd]), 1.0 + fd / 100)
    gate.verified(TCP + bytes([10]))  # a tenant's session, the longest idle of all
    assert gate.full_for("a")
    assert gate.victim(2.0, lambda: ()) == (11, ("a", 11))  # anonymous first, the longest idle
    gate.drop(11, "evicted")
    gate.drop(12, "evicted")
    # only the tenant's session is left: evicted only once idle EVICT_MIN_IDLE_S, and not while busy
    assert gate.victim(1.1 + EVICT_MIN_IDLE_S / 2, lambda: ()) is None
    late = 1.1 + EVICT_MIN_IDLE_S
    assert gate.victim(late, lambda: {TCP + bytes([10])}) is None
    assert gate.victim(late, lambda: ()) == (10, ("a", 10))
    assert gate.shed_by == {"evicted": 2} and gate.tcp == 1


def test_tcp_idle_timeout_is_a_validated_setting() -> None:
    assert SupervisorConfig().tcp_idle_timeout_s == 60.0
    assert SupervisorConfig(tcp_idle_timeout_s=5).tcp_idle_timeout_s == 5.0
    for bad in (0, -1, float("inf"), "60", True):
        with pytest.raises(ValueError, match="tcp_idle_timeout_s"):
            SupervisorConfig(tcp_idle_timeout_s=bad)  # type: ignore[arg-type]


def test_idle_reconnect_s_is_checked() -> None:
    key = zmq.curve_keypair()[0]
    for bad in (0, -1.0, float("nan"), "30", True):
        with pytest.raises(InvalidArgument, match="idle_reconnect_s"):
            SupervisorClient.remote("tcp://127.0.0.1:9", key, idle_reconnect_s=bad)  # type: ignore[arg-type]
