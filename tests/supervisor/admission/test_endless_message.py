"""A message that never ends: a peer that sends frames with the MORE flag and never a last one.

libzmq hands a message to the application only once complete, and bounds a frame
(``MAXMSGSIZE``), not a message: without the memory guard the supervisor read such a
peer's frames into memory without end (~1 GiB/s over one ipc connection). With it
(``frontend_memory_bytes``, low here so the test stays small), the connection is shed
once memory passes the bound, memory comes back under it, a client connected before
(idle) is served again (libzmq reconnects it) and a bystander tenant keeps being served.
"""

from __future__ import annotations

import ctypes.util
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
import zmq

from supervisor.client.api import SupervisorClient
from supervisor.client.launch import launch
from tests.helpers.cluster import FAST, supervisor, wait_for
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
#: the bound the supervisor is given
BOUND = 64 * MiB

#: a raw ZMTP 3.0 NULL client (READY as a DEALER) on argv[1] that sends 64 KiB frames, each with
#: the MORE flag, until argv[2] bytes are sent or the supervisor closes the connection; prints
#: the bytes sent and whether it was shed. With argv[3] ("primed"), one complete message first
_ENDLESS = r"""
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(sys.argv[1])
ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32) + bytes([4, len(ready)]) + ready)
def take(n):
    got = b""
    while len(got) < n:
        got += s.recv(n - len(got)) or sys.exit("closed in the handshake")
    return got
take(64)  # its greeting, then its READY: a frame before that is a protocol error (closed)
take(take(2)[1])
if sys.argv[3:]:
    s.sendall(b"\x00\x01x")  # a message, complete (the frontend drops it: no capability)
frame = b"\x03" + struct.pack(">Q", 65536) + b"x" * 65536
sent, limit, shed = 0, int(sys.argv[2]), ""
try:
    while sent < limit:
        s.sendall(frame)
        sent += len(frame)
except OSError as exc:
    shed = repr(exc).replace(" ", "")
print(sent, int(bool(shed)), shed, flush=True)
"""


#: the same over the CURVE TCP frontend: a raw CurveZMQ client (libsodium through ctypes: a DEALER's
#: libzmq keeps an incomplete message's parts until its last one) with a fresh key, no allow-list;
#: argv: host, port, the server's public key (Z85), the bytes to send
_CURVE_ENDLESS = r"""
import ctypes, ctypes.util, os, socket, struct, sys
import zmq.utils.z85 as z85
na = ctypes.CDLL(ctypes.util.find_library("sodium")); na.sodium_init()
def keypair():
    pk, sk = ctypes.create_string_buffer(32), ctypes.create_string_buffer(32)
    na.crypto_box_keypair(pk, sk); return pk.raw, sk.raw
def box(m, n, pk, sk):
    c = ctypes.create_string_buffer(len(m) + 16)
    assert na.crypto_box_easy(c, m, ctypes.c_ulonglong(len(m)), n, pk, sk) == 0; return c.raw
def unbox(c, n, pk, sk):
    m = ctypes.create_string_buffer(len(c) - 16)
    assert na.crypto_box_open_easy(m, c, ctypes.c_ulonglong(len(c)), n, pk, sk) == 0, "bad box"; return m.raw
def recv_exact(s, n):
    b = b""
    while len(b) < n:
        x = s.recv(n - len(b))
        if not x: raise ConnectionError("closed")
        b += x
    return b
def recv_frame(s):
    flags = recv_exact(s, 1)[0]
    size = struct.unpack(">Q", recv_exact(s, 8))[0] if flags & 2 else recv_exact(s, 1)[0]
    return flags, recv_exact(s, size)
def frame(body, flags):
    return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body if len(body) > 255 else bytes([flags, len(body)]) + body
host, port, server_z85, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
S = z85.decode(server_z85.encode())
C, c = keypair(); Cp, cp = keypair()
s = socket.create_connection((host, port), timeout=30)
s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + bytes(31))
recv_exact(s, 64)
nonce = 1
hello = b"\x05HELLO" + b"\x01\x00" + bytes(72) + Cp + struct.pack(">Q", nonce) + box(bytes(64), b"CurveZMQHELLO---" + struct.pack(">Q", nonce), S, cp)
s.sendall(frame(hello, 4))
_, welcome = recv_frame(s)
assert welcome[:8] == b"\x07WELCOME", welcome[:8]
plain = unbox(welcome[24:], b"WELCOME-" + welcome[8:24], S, cp)
Sp, cookie = plain[:32], plain[32:]
vn = os.urandom(16)
vouch = vn + box(Cp + S, b"VOUCH---" + vn, Sp, c)
meta = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
nonce += 1
initiate = b"\x08INITIATE" + cookie + struct.pack(">Q", nonce) + box(C + vouch + meta, b"CurveZMQINITIATE" + struct.pack(">Q", nonce), Sp, cp)
s.sendall(frame(initiate, 4))
_, ready = recv_frame(s)
assert ready[:6] == b"\x05READY", ready[:8]
k = ctypes.create_string_buffer(32); na.crypto_box_beforenm(k, Sp, cp)
payload = b"\x01" + b"x" * 65536
out = ctypes.create_string_buffer(len(payload) + 16)
sent, shed = 0, ""
try:
    while sent < limit:
        nonce += 1
        n = b"CurveZMQMESSAGEC" + struct.pack(">Q", nonce)
        na.crypto_box_easy_afternm(out, payload, ctypes.c_ulonglong(len(payload)), n, k)
        s.sendall(frame(b"\x07MESSAGE" + struct.pack(">Q", nonce) + out.raw, 0))
        sent += len(payload)
except OSError as exc:
    shed = repr(exc).replace(" ", "")
print(sent, int(bool(shed)), shed, flush=True)
"""


def _attack(args: list[str], limit: int, script: str = _ENDLESS, *more: str) -> tuple[int, str]:
    """The bytes sent and how the connection ended ("": not closed)."""
    out = subprocess.run([sys.executable, "-c", script, *args, str(limit), *more], capture_output=True, text=True,
                         timeout=scaled(60), check=True).stdout.split()
    return int(out[0]), out[2] if int(out[1]) else ""


@pytest.mark.parametrize(("socket_name", "primed"), [("frontend.ipc", False), ("small.ipc", False),
                                                     ("frontend.ipc", True)])
def test_a_message_that_never_ends_is_shed_and_memory_comes_back(tmp_path: Any, socket_name: str,
                                                                 primed: bool) -> None:
    """``primed``: the attacker completes one message just before its endless one (shed by the first
    pass or, when that message came after the last calm sample, by the second)."""
    run_dir = str(tmp_path / "run")
    config = {"supervisor": {**FAST, "frontend_memory_bytes": BOUND}, "tenant": [{"name": "bystander"}]}
    with launch(config, run_dir=run_dir, log_level="warning") as sup:
        c = sup.client
        cap = c.tenant_capability(None, "bystander")
        assert c.ping(cap).tenant == "bystander"
        idle = SupervisorClient(run_dir, timeout_s=scaled(30))  # connected before the attack, then idle
        try:
            assert idle.ping(cap).tenant == "bystander"
            proc = psutil.Process(sup.pid)
            before = proc.memory_info().rss
            # primed: a sample (~130 MiB at this host's rate) may pass between the two passes
            limit = (8 if primed else 4) * BOUND
            sent, shed = _attack([os.path.join(run_dir, socket_name)], limit, _ENDLESS, *(["primed"] if primed else []))
            assert sup.process.poll() is None
            assert shed and sent < limit, f"not shed after {sent >> 20} MiB"
            st = wait_for(lambda: (s := c.status().supervisor).connections_shed_by.get("memory") and s,
                          timeout_s=scaled(10), what=f"the memory shed counted (the attacker: {sent} bytes, {shed})")
            assert st and st.connections_shed >= st.connections_shed_by["memory"] >= 1
            assert c.ping(cap).tenant == "bystander"  # the bystander is served
            assert idle.ping(cap).tenant == "bystander"  # shed with the attacker or not: served again
            wait_for(lambda: proc.memory_info().rss < before + BOUND, timeout_s=scaled(10),
                     what="memory back under the bound")
        finally:
            idle.close()


@pytest.mark.skipif(ctypes.util.find_library("sodium") is None, reason="needs libsodium for a raw CURVE client")
def test_a_message_that_never_ends_over_curve_tcp_is_shed() -> None:
    """The CURVE TCP frontend without an allow-list: any key completes the handshake, then sends
    MORE frames forever. Shed the same way; a remote and a local client are served after."""
    with supervisor([{"name": "bystander"}], listen=["tcp://127.0.0.1:0"], frontend_memory_bytes=BOUND,
                    log_level="warning") as sup:
        c = sup.client
        cap = c.tenant_capability(None, "bystander")
        proc = psutil.Process(sup.pid)
        before = proc.memory_info().rss
        host, _, port = str(sup.info["listen"][0]).removeprefix("tcp://").rpartition(":")
        sent, shed = _attack([host, port, str(sup.info["server_public_key"])], 4 * BOUND, _CURVE_ENDLESS)
        assert sup.process.poll() is None
        assert shed and sent < 4 * BOUND, f"not shed after {sent >> 20} MiB"
        st = wait_for(lambda: (s := c.status().supervisor).connections_shed_by.get("memory") and s,
                      timeout_s=scaled(10), what=f"the memory shed counted (the attacker: {sent} bytes, {shed})")
        assert st and st.connections_shed_by["memory"] >= 1
        assert c.ping(cap).tenant == "bystander"
        with SupervisorClient.remote(str(sup.info["listen"][0]), str(sup.info["server_public_key"]),
                                     timeout_s=scaled(30)) as remote:
            assert remote.ping(cap).tenant == "bystander"
        wait_for(lambda: proc.memory_info().rss < before + BOUND, timeout_s=scaled(10),
                 what="memory back under the bound")


def _zmtp_peer(path: str, body: bytes | None) -> socket.socket:
    """A raw ZMTP 3.0 NULL DEALER on ``path``; sends one complete one-frame message ``body``."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(scaled(10))
    s.connect(path)
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32) + bytes([4, len(ready)]) + ready)
    def take(n: int) -> bytes:
        got = b""
        while len(got) < n:
            more = s.recv(n - len(got))
            assert more, "closed in the handshake"
            got += more
        return got

    take(64)  # its greeting, then its READY: a message before that is a protocol error (closed)
    take(take(2)[1])
    if body is not None:
        s.sendall(bytes([0, len(body)]) + body)
    return s


def _closed(s: socket.socket) -> bool:
    """True once the supervisor's side shut ``s`` down (EOF; its greeting read past)."""
    s.settimeout(0.05)
    try:
        while True:
            if not s.recv(4096):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


@contextmanager
def _guarded_router(path: str, memory_bytes: int) -> Iterator[tuple[zmq.Socket[Any], Any]]:
    """A ROUTER bound at ``path`` with the frontend's connection bookkeeping and its guard thread
    (memory bound ``memory_bytes``, no pausing), as the guard tests drive it alone; closed, and its
    context ended, afterwards."""
    import supervisor.admission.connections as connections

    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    conns = connections.FrontendConnections(router, path, memory_bytes=memory_bytes, pause=False)
    router.bind("ipc://" + path)
    try:
        yield router, conns
    finally:
        conns.close()
        router.close(0)
        ctx.term()


def test_the_guard_sheds_stale_connections_first_and_in_flight_ones_only_as_memory_grows(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard alone, its memory readings set by the test: past the bound it sheds the connection
    that completed nothing and the idle one, keeps the active one, the one with a request in flight
    and the one that completed a message just before (after the last calm sample); memory past the
    bound but not growing sheds nothing more; grown another quarter of the bound, those that
    completed nothing since the first shed go too. Never the active one."""
    import supervisor.admission.fd_guard as fd_guard

    level = [100 * MiB]
    monkeypatch.setattr(fd_guard, "rss_bytes", lambda: level[0])
    path = str(tmp_path / "f.ipc")
    peers: dict[bytes, socket.socket] = {}
    with _guarded_router(path, BOUND) as (router, conns):
        try:
            for name in (b"active", b"idle", b"in-flight", b"primed"):
                peers[name] = _zmtp_peer(path, name)
            peers[b"silent"] = _zmtp_peer(path, None)
            frames: dict[bytes, tuple[int, zmq.Frame]] = {}
            router.setsockopt(zmq.RCVTIMEO, int(scaled(10) * 1000))
            while len(frames) < 4:
                rid = router.recv(copy=False)
                frames[router.recv()] = (int(rid.get(zmq.SRCFD)), rid)
            conns.guard.busy = lambda: {b"\0" + frames[b"in-flight"][1].bytes}

            def complete(*names: bytes) -> None:
                for name in names:
                    fd, rid = frames[name]
                    conns.completed(fd, time.monotonic(), b"\0", rid)

            def sampled() -> None:  # two more samples taken (the second one wholly after this call)
                n = conns.guard.samples
                wait_for(lambda: conns.guard.samples >= n + 2, interval_s=0.01, what="two samples")

            complete(b"idle", b"in-flight")
            completed_at = time.monotonic()
            wait_for(lambda: conns.guard.calm_at > completed_at, interval_s=0.01, what="a calm sample after those")
            level[0] += BOUND * 3 // 4  # past half the bound: no longer calm, not past it
            sampled()
            complete(b"active", b"primed")  # primed: one message just before its endless one
            level[0] += BOUND // 2  # past the bound
            wait_for(lambda: _closed(peers[b"silent"]) and _closed(peers[b"idle"]), what="the stale ones shed")
            wait_for(lambda: conns.guard.memory_shed >= 2, what="counted")  # (just after the shutdowns)
            assert conns.status()["connections_shed_by"]["memory"] == 2, (conns.guard.memory_shed, [_closed(p) for p in peers.values()])
            sampled()  # past the bound, not growing: nothing more
            assert not _closed(peers[b"in-flight"]) and not _closed(peers[b"primed"]) and conns.guard.memory_shed == 2
            complete(b"active")
            level[0] += BOUND // 4 + MiB  # grown another quarter
            wait_for(lambda: _closed(peers[b"in-flight"]) and _closed(peers[b"primed"]), what="the second pass")
            wait_for(lambda: conns.guard.memory_shed >= 4, what="counted")
            assert conns.guard.memory_shed == 4 and not _closed(peers[b"active"])
        finally:
            for s in peers.values():
                s.close()


def test_the_bound_defaults_to_max_held_bytes_plus_a_gib_and_takes_sizes() -> None:
    from shared.config import SupervisorConfig

    assert SupervisorConfig().frontend_memory_bytes == SupervisorConfig().max_held_bytes + (1 << 30)
    assert SupervisorConfig(max_held_bytes="1GiB").frontend_memory_bytes == 2 << 30
    assert SupervisorConfig(frontend_memory_bytes="512MiB").frontend_memory_bytes == 512 * MiB
    assert SupervisorConfig(frontend_memory_bytes=0).frontend_memory_bytes == 0  # no bound
    with pytest.raises(ValueError, match="frontend_memory_bytes"):
        SupervisorConfig(frontend_memory_bytes=-1)


def test_the_guard_samples_memory_far_below_the_bound_only_as_often_as_growth_could_reach_it(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Far below a large bound the guard waits as long as growth at ``MEMORY_GROWTH_BPS`` would take to
    bring memory within a short sample of it (an idle supervisor's guard woke ten times a second);
    near the bound, and for a small bound, it samples every ``MEMORY_SAMPLE_S`` as before, so an
    attack up to that rate passes the bound by no more than it did."""
    import supervisor.admission.fd_guard as fd_guard

    big = 3 << 30  # the default: max_held_bytes + 1 GiB
    rate, short, most = fd_guard.MEMORY_GROWTH_BPS, fd_guard.MEMORY_SAMPLE_S, fd_guard.MEMORY_SAMPLE_MAX_S
    assert fd_guard.memory_sample_delay(big, 0) == pytest.approx(big / rate) and big / rate > 5 * short
    assert fd_guard.memory_sample_delay(BOUND, 0) == short  # the tests' bound: every sample as before
    assert fd_guard.memory_sample_delay(1 << 40, 0) == most
    for grown in range(-big, 2 * big, big // 97):  # the next sample comes before growth at `rate` passes it
        delay = fd_guard.memory_sample_delay(big, grown)
        assert short <= delay <= most
        assert delay == short or grown + rate * delay <= big, grown

    sampled_at: list[float] = []

    def rss() -> int:
        sampled_at.append(time.monotonic())
        return 100 * MiB

    monkeypatch.setattr(fd_guard, "rss_bytes", rss)
    with _guarded_router(str(tmp_path / "f.ipc"), big) as (_router, conns):
        wait_for(lambda: conns.guard.samples >= 3, interval_s=0.05, what="three samples")
        # the baseline, then samples: the waits between them never shorter than the delay (a slow host
        # only makes them longer), where a sample every MEMORY_SAMPLE_S took 0.1 s
        gaps = [b - a for a, b in zip(sampled_at[1:], sampled_at[2:], strict=False)]
        assert gaps and min(gaps) >= big / rate - 0.01, gaps
