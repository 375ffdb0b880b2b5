"""5 x 10^4 hostile frames at the frontend, pipelined as fast as one raw DEALER sends them.

Random bytes, truncated and oversized msgpack, deep nesting, huge declared
lengths, wrong types, forged capabilities, wrong frame counts. The
supervisor must answer what it can answer with a typed error, drop the
rest, keep serving a well-behaved client while it happens, and not grow:
its RSS and open file descriptors after the flood stay within a small bound
of what they were after a warm-up flood.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import psutil
import pytest
import zmq

from shared import protocol as proto
from shared.spec import TenantSpec
from supervisor.client.launch import SupervisorHandle
from tests.helpers.cluster import supervisor
from tests.helpers.timeouts import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: frames in the measured flood: a leak of a few hundred bytes a frame shows against the bound below
#: (one of 400 B a frame, injected into the frontend's decode, failed it), and every frame costs CPU
#: on both sides (10^5 took twice the CPU; the growth measured was ~1 MiB either way)
FRAMES = 50_000
#: the flood before the baseline is read: caches, allocator arenas and socket buffers at their working
#: size. Every frame family comes up hundreds of times in 10,000; the RSS after it and after 30,000
#: differed by under 1 MiB (the bound below is 16 MiB), and each frame costs CPU on both sides
WARM_UP = 10_000
MARKER = 7_777_777_777
MAX_HEADER = 4096  # the supervisor's max_header_bytes here: oversized is cheap to build
RSS_GROWTH = 16 << 20
OPS = sorted(proto.TENANT_OPS | proto.ADMIN_OPS)


def _packb(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


class Fuzzer:
    """Seeded hostile frames, one family at a time (``families`` counts what was sent)."""

    def __init__(self, seed: int, tenant_cap: bytes) -> None:
        self.rng = random.Random(seed)
        self.cap = tenant_cap
        self.families: Counter[str] = Counter()

    def rid(self) -> object:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.randrange(1, 1 << 40)
        return self.rng.choice([-1, 1 << 63, (1 << 64) - 1, "7", 1.5, None, True, b"\x01", [1], {"r": 1}])

    def header(self) -> bytes:
        """A plausible header with one thing wrong (or a forged capability)."""
        rng = self.rng
        fields: list[object] = [proto.PROTOCOL_VERSION, self.rid(), rng.choice(OPS), None, {}]
        flaw = rng.randrange(7)
        if flaw == 0:
            fields[0] = rng.choice([0, 2, 99, -1, "1", None])
        elif flaw == 1:
            fields[2] = rng.choice(["", "x" * 300, 5, None, b"ping", ["alloc"]])
        elif flaw == 2:
            cap = bytearray(self.cap)
            cap[rng.randrange(len(cap))] ^= 1 << rng.randrange(8)
            fields[3] = bytes(cap)  # forged: one bit off
        elif flaw == 3:
            fields[3] = rng.choice([rng.randbytes(rng.randrange(0, 200)), 42, "cap", [b"x"], {"k": b"v"}])
        elif flaw == 4:
            fields[4] = rng.choice([[], "args", 3, None, {1: 2}, {"nbytes": "lots"}, {"handle": -1},
                                    {"nbytes": (1 << 64) - 1}, {"spec": {"tenant_id": "../../etc"}}])
        elif flaw == 5:
            fields = fields[: rng.randrange(5)] if rng.random() < 0.5 else [*fields, b"extra"]
        else:
            fields[3] = rng.randbytes(rng.randrange(64, 100))  # right size, random bytes
            fields[2] = rng.choice(sorted(proto.TENANT_OPS))
        return _packb(fields)

    def huge_length(self) -> bytes:
        """A header whose capability (or args) declares 4 GiB that never come."""
        prefix = _packb(proto.PROTOCOL_VERSION) + _packb(self.rng.randrange(1, 1 << 30)) + _packb("ping")
        lie = self.rng.choice([b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                               b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01"])
        return b"\x95" + prefix + lie + self.rng.randbytes(self.rng.randrange(0, 16))

    def frames(self) -> list[bytes]:
        rng = self.rng
        family = rng.choices(["random", "truncated", "oversized", "nested", "huge_length", "wrong_types",
                              "frame_count", "ext"], [20, 15, 1, 3, 10, 40, 8, 3])[0]
        self.families[family] += 1
        if family == "random":
            return [rng.randbytes(rng.randrange(0, 300))]
        if family == "truncated":
            h = self.header()
            return [h[: rng.randrange(len(h))]]
        if family == "oversized":
            h = _packb([proto.PROTOCOL_VERSION, rng.randrange(1, 1 << 30), "ping", None,
                        {"pad": "x" * rng.randrange(MAX_HEADER, 4 * MAX_HEADER)}])
            return [h]
        if family == "nested":
            depth = rng.randrange(100, 20_000)
            opener = rng.choice([b"\x91", b"\x81\xa1k"])
            return [b"\x95\x01\x01\xa4ping\xc0" + opener * depth + b"\xc0"]
        if family == "huge_length":
            return [self.huge_length()]
        if family == "wrong_types":
            return [self.header()]
        if family == "ext":
            return [_packb([proto.PROTOCOL_VERSION, msgpack.ExtType(rng.randrange(0, 128), rng.randbytes(8)),
                            "ping", None, {}]) if rng.random() < 0.5
                    else b"\x95\x01\xd7\xff" + rng.randbytes(8) + b"\xa4ping\xc0\x80"]
        n = rng.choice([2, 3, 4, 6])  # header + a body frame is fine; more is not
        return [self.header(), *(rng.randbytes(rng.randrange(0, 64)) for _ in range(n - 1))]


@pytest.fixture
def sup() -> Iterator[SupervisorHandle]:
    # the per-peer rate of unauthenticated requests would drop most of the fuzz unanswered
    # (supervisor.admission.rates; tests/supervisor/admission/test_hardening.py checks it): this test is about decoding
    with supervisor(max_message_bytes="1MiB", max_header_bytes=MAX_HEADER, log_level="error",
                    unauthenticated_requests_per_s=1e9) as handle:
        yield handle


def _flood(sup: SupervisorHandle, fuzz: Fuzzer, count: int) -> tuple[int, Counter[str]]:
    """Send ``count`` fuzzed messages pipelined, draining replies as they come; then a marker."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect("ipc://" + os.path.join(sup.run_dir, "frontend.ipc"))
    codes: Counter[str] = Counter()
    replies = 0

    def drain(timeout_ms: int = 0) -> bool:
        nonlocal replies
        seen_marker = False
        while sock.poll(timeout_ms):
            rid, ok, payload = proto.decode_reply(sock.recv_multipart()[0])
            # nothing here carries a valid capability: only hello without one is answered ok, and then
            # with the protocol version and readiness alone
            assert not ok or set(payload) == {"protocol", "ready"}, (rid, payload)
            codes["ok (hello)" if ok else str(payload.get("code"))] += 1
            replies += 1
            seen_marker = seen_marker or rid == MARKER
            timeout_ms = 0
        return seen_marker

    try:
        for i in range(count):
            sock.send_multipart(fuzz.frames())
            if i % 512 == 0:
                drain()
        # The flood emptied this peer's unauthenticated bucket (supervisor.admission.rates): what it
        # sends past it is dropped, the marker too, until tokens come back - so resend it.
        deadline = time.monotonic() + scaled(60)  # the backlog read, then the bucket refilled
        while True:
            sock.send(_packb([proto.PROTOCOL_VERSION, MARKER, "hello", None, {}]))
            if drain(1000):
                break
            assert time.monotonic() < deadline, "the marker sent after the flood was never answered"
    finally:
        sock.close(0)
    return replies, codes


def test_fifty_thousand_fuzzed_frames_no_crash_bounded_memory(sup: SupervisorHandle) -> None:
    c = sup.client
    cap = c.register(None, TenantSpec("acme"))
    proc = psutil.Process(sup.pid)
    _flood(sup, Fuzzer(1, cap.to_bytes()), WARM_UP)
    rss0, fds0 = proc.memory_info().rss, proc.num_fds()

    # a well-behaved client keeps being served during the flood
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[BaseException] = []

    def bystander() -> None:
        with sup.connect(timeout_s=10) as other:
            while not stop.wait(0.01):
                t0 = time.monotonic()
                try:
                    other.ping(cap)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                latencies.append(time.monotonic() - t0)

    thread = threading.Thread(target=bystander, daemon=True)
    thread.start()
    fuzz = Fuzzer(2, cap.to_bytes())
    t0 = time.monotonic()
    try:
        replies, codes = _flood(sup, fuzz, FRAMES)
    finally:
        stop.set()
        thread.join(15)
    elapsed = time.monotonic() - t0
    rss1, fds1 = proc.memory_info().rss, proc.num_fds()

    assert sup.process.poll() is None, "the supervisor died"
    assert not errors, errors[:3]
    # served, never starved: every ping answered inside its 10 s timeout (no latency target: a
    # loaded 2-core machine may stall one for seconds)
    assert len(latencies) >= 10 and max(latencies) < 10.0, (len(latencies), max(latencies, default=None))
    assert set(codes) <= {"protocol_error", "isolation_violation", "capability_revoked", "invalid_argument",
                          "ok (hello)"}, codes
    assert replies > FRAMES // 3, (replies, fuzz.families)  # most are answerable (readable rid)
    assert rss1 - rss0 < RSS_GROWTH, f"supervisor RSS grew {(rss1 - rss0) >> 20} MiB over {FRAMES} frames"
    assert fds1 - fds0 <= 4, (fds0, fds1)
    assert set(fuzz.families) == {"random", "truncated", "oversized", "nested", "huge_length", "wrong_types",
                                  "frame_count", "ext"}
    # and it still does real work
    h = c.alloc(cap, 4096)
    c.write(cap, h, b"still here")
    assert c.read(cap, h, 10) == b"still here"
    print(f"{FRAMES} frames in {elapsed:.1f} s, {replies} typed answers {dict(codes)}, "
          f"RSS {rss0 >> 20} -> {rss1 >> 20} MiB, bystander p_max {max(latencies) * 1000:.0f} ms")
