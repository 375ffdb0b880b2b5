"""The two local sockets: ``small.ipc`` (frames of at most ``small_frame_bytes``) and ``frontend.ipc``
(frames of any size, not read while its tenant waits for its rate) - docs/PROTOCOL.md "The two local
sockets". Correctness only: what is answered, by which socket, in which order; never how fast."""

from __future__ import annotations

import os
import urllib.request
from typing import Any

import zmq

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.spec import TenantSpec
from supervisor.admission.frontend import SMALL_FRAME_BYTES
from supervisor.client.api import SupervisorClient
from tests.helpers.cluster import supervisor

_MIB = 1 << 20


def _dealer(run_dir: str, name: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("ipc://" + os.path.join(run_dir, name))
    return sock


def _reply(sock: zmq.Socket[Any], timeout_ms: int = 30_000) -> tuple[int, bool, Any, list[zmq.Frame]]:
    assert sock.poll(timeout_ms), "no reply"
    frames = sock.recv_multipart(copy=False)
    rid, ok, payload = proto.decode_reply(frames[0].bytes)
    return rid, ok, payload, frames[1:]


def _write(rid: int, cap: TenantCapability, handle: int, offset: int = 0) -> bytes:
    return proto.encode_request(rid, "write", cap.to_bytes(), {"handle": handle, "offset": offset})


def test_supervisor_json_names_the_small_socket() -> None:
    with supervisor(log_level="error") as sup:
        assert sup.info["small_frontend"] == "ipc://" + os.path.join(sup.run_dir, "small.ipc")
        assert sup.info["small_frame_bytes"] == SMALL_FRAME_BYTES
        assert os.stat(os.path.join(sup.run_dir, "small.ipc")).st_mode & 0o077 == 0


def test_a_frame_above_the_limit_on_small_ipc_is_never_read_and_the_socket_keeps_serving() -> None:
    """libzmq drops the connection at the frame's size: no answer, the write not done; the DEALER
    reconnects and its next request is answered, and another client on small.ipc is served."""
    with supervisor(log_level="error") as sup:
        cap = sup.client.register(sup.admin_capability, TenantSpec("t"))
        handle = sup.client.alloc(cap, 2 * SMALL_FRAME_BYTES)
        sock = _dealer(sup.run_dir, "small.ipc")
        try:
            sock.send_multipart([_write(1, cap, handle), b"\x07" * (SMALL_FRAME_BYTES + 1)])
            assert not sock.poll(1000)  # dropped before it was read: never answered
            sock.send(proto.encode_request(2, "ping", cap.to_bytes(), {}))
            rid, ok, _, _ = _reply(sock)
            assert (rid, ok) == (2, True)
            # the write was never done: the buffer is still zero
            assert bytes(sup.client.read(cap, handle, 16)) == bytes(16)
            # a frame of exactly the limit is taken
            sock.send_multipart([_write(3, cap, handle), b"\x05" * SMALL_FRAME_BYTES])
            rid, ok, _, _ = _reply(sock)
            assert (rid, ok) == (3, True)
            assert bytes(sup.client.read(cap, handle, 4)) == b"\x05" * 4
        finally:
            sock.close(0)


def test_a_client_that_knows_only_frontend_ipc_keeps_working() -> None:
    """A raw client written before small.ipc: big and small requests on frontend.ipc, answered there."""
    with supervisor(log_level="error") as sup:
        cap = sup.client.register(sup.admin_capability, TenantSpec("t"))
        handle = sup.client.alloc(cap, _MIB)
        sock = _dealer(sup.run_dir, "frontend.ipc")
        try:
            sock.send_multipart([_write(1, cap, handle), b"\x09" * _MIB])
            sock.send(proto.encode_request(2, "read", cap.to_bytes(), {"handle": handle, "nbytes": 8}))
            rid, ok, _, _ = _reply(sock)
            assert (rid, ok) == (1, True)
            rid, ok, _, body = _reply(sock)
            assert (rid, ok) == (2, True) and body[0].bytes == b"\x09" * 8
        finally:
            sock.close(0)


def test_the_client_sends_big_frames_to_frontend_ipc_and_small_ones_to_small_ipc() -> None:
    """SupervisorClient: requests on small.ipc, a body above its limit on frontend.ipc; every call
    gets its own reply, whichever socket it came back on, and the bytes are the ones written."""
    with supervisor(log_level="error") as sup:
        cap = sup.client.register(sup.admin_capability, TenantSpec("t"))
        handle = sup.client.alloc(cap, 4 * _MIB)
        with SupervisorClient(sup.run_dir, regions=False) as c:
            assert c.endpoint.endswith("/small.ipc")
            for i in range(4):
                data = bytes([i + 1]) * (SMALL_FRAME_BYTES + 1 + i)
                c.write(cap, handle, data, offset=i * _MIB)
                assert bytes(c.read(cap, handle, len(data), offset=i * _MIB)) == data
                c.write(cap, handle, b"\xfe" * 100, offset=i * _MIB)  # a small one after a big one
                assert bytes(c.read(cap, handle, 101, offset=i * _MIB)) == b"\xfe" * 100 + bytes([i + 1])
            assert c._big is not None  # the big frames went there
            # pipelined: one socket (frontend.ipc), so a small write sent after a big one on the same
            # bytes lands after it, and every rid is answered once
            rids = [c.send("write", cap, {"handle": handle, "offset": 0}, b"\x01" * (SMALL_FRAME_BYTES + 8)),
                    c.send("write", cap, {"handle": handle, "offset": 0}, b"\x02" * 64), c.send("ping", cap)]
            assert c._big_pending == set(rids)
            got = [c.recv() for _ in rids]
            assert sorted(r[0] for r in got) == sorted(rids) and all(r[1] for r in got)
            assert not c._big_pending
            assert bytes(c.read(cap, handle, 65)) == b"\x02" * 64 + b"\x01"
            # a waited-for call made while a pipelined request is unanswered goes where that one went;
            # with nothing unanswered there, by small.ipc
            first = c.send("ping", cap)
            second = c._send("ping", cap, None, None, pipelined=False)
            assert c._big_pending == {first, second}
            assert sorted(c.recv()[0] for _ in range(2)) == [first, second] and not c._big_pending
            third = c._send("ping", cap, None, None, pipelined=False)
            assert not c._big_pending and c.recv()[0] == third


def test_a_tenant_past_its_byte_rate_on_frontend_ipc_loses_nothing_and_keeps_its_order() -> None:
    """frontend.ipc is not read while its tenant waits for its bucket: every request sent there is
    answered exactly once (OK or the typed rate refusal), the OK ones in the order sent; a request
    of another tenant on small.ipc is answered meanwhile. Each pause is counted: ``rate_pauses`` in
    the status and ``twt_rate_pauses_total`` on /metrics."""
    # (a byte bucket saves up max(its rate, max_message_bytes): 4 MiB here, so that 100 MiB overflow it)
    with supervisor(log_level="error", tenant_refusals_per_s=1e6, max_message_bytes=4 * _MIB,
                    metrics_addr="127.0.0.1:0") as sup:
        assert sup.client.status().supervisor.rate_pauses == 0
        cap = sup.client.register(sup.admin_capability, TenantSpec("bulk", bytes_per_s=8 * _MIB, max_in_flight=1024))
        other = sup.client.register(sup.admin_capability, TenantSpec("other"))
        handle = sup.client.alloc(cap, _MIB)
        sock = _dealer(sup.run_dir, "frontend.ipc")
        body = b"\x03" * (512 << 10)
        try:
            n = 200
            for rid in range(1, n + 1):
                sock.send_multipart([_write(rid, cap, handle), body], copy=False)
            assert sup.client.ping(other).tenant == "other"  # on small.ipc, during the burst
            answers: dict[int, tuple[bool, Any]] = {}
            order: list[int] = []
            while len(answers) < n:
                rid, ok, payload, _ = _reply(sock)
                assert rid not in answers, f"rid {rid} answered twice"
                answers[rid] = (ok, payload)
                if ok:
                    order.append(rid)
            assert not sock.poll(200)  # nothing more
            refused = [p for ok, p in answers.values() if not ok]
            assert all(p["code"] == "overloaded" and p["fields"]["cause"] == "rate" for p in refused)
            assert order == sorted(order) and len(order) >= 1
            assert refused  # the rate bound (8 MiB/s against 100 MiB sent at once)
            # whether the socket paused is the scheduler's say (no pause within IPC_LIGHT_S of a request
            # served within its rate there): the count is exported either way, never taken back
            pauses = sup.client.status().supervisor.rate_pauses
            assert isinstance(pauses, int) and pauses >= 0
            with urllib.request.urlopen(sup.client.info["metrics_url"], timeout=10) as resp:
                metrics = {line.split()[0]: float(line.split()[1]) for line in resp.read().decode().splitlines()
                           if line.startswith("twt_rate_pauses")}
            assert metrics["twt_rate_pauses_total"] >= pauses
        finally:
            sock.close(0)
