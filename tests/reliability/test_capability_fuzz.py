"""Capability fuzzing: no altered, truncated, extended, swapped or stale token ever gets through.

Systematic rather than random: every single-bit flip, every truncation and
a range of extensions of a real tenant token and of the admin token, each
tenant op with the admin token and each admin op with a tenant token, a
revoked token patched to the new generation, and one tenant's buffer
handles used with another tenant's token. The genuine token is sent between
the forgeries, so the verified-token cache is exercised too.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from shared import protocol as proto
from shared.errors import InvalidArgument
from shared.spec import TenantSpec
from supervisor.client.launch import SupervisorHandle
from tests.helpers.cluster import supervisor, tenant

pytestmark = pytest.mark.timeout(90)

REFUSED = {"isolation_violation", "capability_revoked", "protocol_error"}
GENERATION_OFFSET = 18  # version, kind, registry id (16): then the generation, 8 bytes big-endian


@pytest.fixture
def sup() -> Iterator[SupervisorHandle]:
    # refusals are what this module checks: the per-peer meter of unauthenticated requests (which
    # drops a flood unanswered, tests/supervisor/admission/test_hardening.py) is out of the way here
    with supervisor(log_level="error", unauthenticated_requests_per_s=1e9) as handle:
        yield handle


class Pipeline:
    """Pipelined raw requests; ``run`` sends them all, then returns rid -> (ok, code)."""

    def __init__(self, run_dir: str) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect("ipc://" + os.path.join(run_dir, "frontend.ipc"))
        self.sent: dict[int, str] = {}

    def send(self, label: str, op: str, cap: bytes | None, args: dict[str, Any] | None = None) -> None:
        rid = len(self.sent) + 1
        self.sent[rid] = label
        self.sock.send(msgpack.packb([proto.PROTOCOL_VERSION, rid, op, cap, args or {}], use_bin_type=True))

    def run(self) -> dict[str, Counter[str]]:
        by_label: dict[str, Counter[str]] = {}
        for _ in range(len(self.sent)):
            assert self.sock.poll(10_000), "a request got no answer"
            rid, ok, payload = proto.decode_reply(self.sock.recv_multipart()[0])
            code = "ok" if ok else str(payload["code"])
            by_label.setdefault(self.sent[rid], Counter())[code] += 1
        self.sock.close(0)
        return by_label


def _variants(token: bytes, rng: random.Random) -> Iterator[bytes]:
    for i in range(len(token) * 8):
        flipped = bytearray(token)
        flipped[i // 8] ^= 1 << (i % 8)
        yield bytes(flipped)
    for n in range(len(token)):
        yield token[:n]
    for n in range(1, 9):
        yield token + rng.randbytes(n)
        yield rng.randbytes(n) + token
    for _ in range(64):  # the right length, random content
        yield rng.randbytes(len(token))


def test_altered_tokens_are_always_refused(sup: SupervisorHandle) -> None:
    c = sup.client
    cap = c.register(None, TenantSpec("alpha")).to_bytes()
    admin = sup.admin_capability.to_bytes()
    rng = random.Random(5)
    p = Pipeline(sup.run_dir)
    genuine = forged_tenant = 0
    for n, forged in enumerate(_variants(cap, rng)):
        p.send("forged tenant", "ping", forged)
        forged_tenant += 1
        if n % 25 == 0:
            p.send("genuine tenant", "ping", cap)  # interleaved: the cache must not let a neighbour in
            genuine += 1
    for forged in _variants(admin, rng):
        p.send("forged admin", "status", forged)
    for op in sorted(proto.ADMIN_OPS):
        p.send("tenant token on admin op", op, cap, {"tenant": "alpha"})
    for op in sorted(op for op in proto.TENANT_OPS if not proto.OPS[op].any_capability):  # events: either
        p.send("admin token on tenant op", op, admin, {"nbytes": 16, "handle": 1})
    kind_swapped = bytearray(cap)
    kind_swapped[1] = 1  # claims to be an admin token
    p.send("kind swapped", "status", bytes(kind_swapped))
    p.send("kind swapped", "ping", bytes(kind_swapped))
    p.send("no token", "ping", None)
    p.send("no token", "status", None)
    got = p.run()
    assert got.pop("genuine tenant") == Counter({"ok": genuine})
    for label, codes in got.items():
        assert set(codes) <= REFUSED, (label, codes)
    assert sum(got["forged tenant"].values()) == forged_tenant == len(cap) * 8 + len(cap) + 16 + 64
    assert tenant(c.status(), "alpha").state == "running"


def test_revoked_token_cannot_be_revived(sup: SupervisorHandle) -> None:
    c = sup.client
    old = c.register(None, TenantSpec("beta")).to_bytes()
    c.evict(None, "beta")
    new = c.register(None, TenantSpec("beta")).to_bytes()
    generation = int.from_bytes(new[GENERATION_OFFSET:GENERATION_OFFSET + 8], "big")
    assert generation == int.from_bytes(old[GENERATION_OFFSET:GENERATION_OFFSET + 8], "big") + 1
    patched = old[:GENERATION_OFFSET] + new[GENERATION_OFFSET:GENERATION_OFFSET + 8] + old[GENERATION_OFFSET + 8:]
    p = Pipeline(sup.run_dir)
    for _ in range(20):
        p.send("old", "ping", old)
        p.send("patched", "ping", patched)
        p.send("new", "ping", new)
    got = p.run()
    assert got == {"old": Counter({"capability_revoked": 20}), "patched": Counter({"isolation_violation": 20}),
                   "new": Counter({"ok": 20})}


def test_one_tenant_cannot_reach_another_tenants_buffers(sup: SupervisorHandle) -> None:
    c = sup.client
    a = c.register(None, TenantSpec("alpha").with_gpu_memory_bytes_cap("1MiB"))
    b = c.register(None, TenantSpec("beta").with_gpu_memory_bytes_cap("1MiB"))
    first_a, hb = c.alloc(a, 1024), c.alloc(b, 4096)
    # handles name buffers inside one tenant's worker: the same number in two tenants is two buffers
    assert first_a == hb
    c.write(a, first_a, b"alpha")
    c.write(b, hb, b"beta!")
    assert c.read(b, hb, 5) == b"beta!" and c.read(a, first_a, 5) == b"alpha"
    c.free(a, first_a)
    ha = c.alloc(a, 65536)  # a number beta's worker never issued
    c.write(a, ha, b"alpha's secret")
    before = tenant(c.status(), "alpha").quota
    attempts: list[Callable[[], object]] = [
        lambda: c.read(b, ha, 14),
        lambda: c.write(b, ha, b"overwrite"),
        lambda: c.free(b, ha),
        lambda: c.run_wasm(b, b"(module (func (export \"f\") (param i64)))", "f", [{"handle": ha}]),
        lambda: c.read(b, proto.make_handle(7, 1, 1), 1),  # an instance beta does not run
        lambda: c.run_wasm(b, b"(module (func (export \"f\") (param i64 i64)))", "f",
                           [{"handle": hb}, {"handle": proto.make_handle(3, 1, 1)}]),
    ]
    for attempt in attempts:
        with pytest.raises(InvalidArgument):
            attempt()
    assert c.read(a, ha, 14) == b"alpha's secret"
    after = tenant(c.status(), "alpha").quota
    assert after.gpu_bytes_in_use == before.gpu_bytes_in_use == 65536
    assert tenant(c.status(), "beta").gpu_bytes_in_use == 4096
    assert c.buffers(b) == {hb: 4096} and c.buffers(a) == {ha: 65536}
