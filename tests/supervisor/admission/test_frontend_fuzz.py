"""Hostile input at the frontend: typed errors or silent drops, and the supervisor keeps serving."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import error_from_dict
from shared.spec import TenantSpec
from supervisor.client.launch import SupervisorHandle
from tests.helpers.cluster import supervisor
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sup() -> Iterator[SupervisorHandle]:
    # the per-peer meter off: these tests check each refusal, not the meter (forged capabilities
    # are unauthenticated requests; a fast run would have some dropped, unanswered)
    with supervisor(max_message_bytes="1MiB", unauthenticated_requests_per_s=1e9) as handle:
        yield handle


@pytest.fixture(scope="module")
def acme(sup: SupervisorHandle) -> TenantCapability:
    return sup.client.register(None, TenantSpec("acme"))


@pytest.fixture(scope="module")
def raw(sup: SupervisorHandle) -> Iterator[RawClient]:
    client = RawClient(sup.run_dir)
    yield client
    client.close()


class RawClient:
    def __init__(self, run_dir: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("ipc://" + os.path.join(run_dir, "frontend.ipc"))

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def replies(self, wait_ms: int = 300) -> list[tuple[int, bool, Any]]:
        """Replies until none came for ``wait_ms`` (20 ms after the first): only for what no reply is
        asserted of; what must be answered is read by :meth:`replies_for`."""
        out = []
        while self.sock.poll(wait_ms):
            frames = self.sock.recv_multipart()
            out.append(proto.decode_reply(frames[0]))
            wait_ms = 20
        return out

    def replies_for(self, rids: set[int]) -> list[tuple[int, bool, Any]]:
        """Replies until one came for each of ``rids`` (a hang guard, scaled, fails if one never does),
        then any others already here: a loaded host answers late, never a missing answer."""
        out: list[tuple[int, bool, Any]] = []
        missing = set(rids)
        while missing:
            assert self.sock.poll(int(scaled(30.0) * 1000)), f"no reply for rids {sorted(missing)}"
            reply = proto.decode_reply(self.sock.recv_multipart()[0])
            out.append(reply)
            missing.discard(reply[0])
        return out + self.replies(wait_ms=20)

    def replies_until(self, rid: int, timeout_ms: int = 5000) -> list[tuple[int, bool, Any]]:
        """Replies up to and including the one for ``rid`` (fails if it never comes)."""
        out = []
        while True:
            assert self.sock.poll(timeout_ms), f"no reply for rid {rid}"
            reply = proto.decode_reply(self.sock.recv_multipart()[0])
            out.append(reply)
            if reply[0] == rid:
                return out

    def close(self) -> None:
        self.sock.close(0)


def _healthy(sup: SupervisorHandle, cap: TenantCapability) -> None:
    assert sup.client.ping(cap).tenant == "acme"
    assert sup.process.poll() is None


def _header(rid: Any, op: Any, cap: Any, args: Any, version: Any = proto.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, rid, op, cap, args], use_bin_type=True)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(frames=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_random_frames(raw: RawClient, frames: list[bytes]) -> None:
    raw.send(frames)
    raw.send([_header(424242, "status", None, {})])  # a marker: its answer (a refusal) ends this example
    for _rid, ok, payload in raw.replies_until(424242):
        assert not ok
        assert error_from_dict(payload).code in ("protocol_error", "isolation_violation", "invalid_argument")


@_FUZZ
@given(rid=st.integers(0, 2**40), op=st.one_of(st.sampled_from(sorted(proto.TENANT_OPS | proto.ADMIN_OPS)), st.text(max_size=10), scalars),
       cap=st.one_of(st.none(), st.binary(max_size=100), scalars), args=values)
@example(rid=7, op="hello", cap=None, args={})  # the one ok answer: once failed a run when hypothesis drew it
def test_wrong_types_and_forged_capabilities(raw: RawClient, rid: int, op: Any, cap: Any, args: Any) -> None:
    raw.send([_header(rid, op, cap, args)])
    replies = raw.replies_until(rid)
    assert len(replies) == 1  # a readable rid is always answered
    got_rid, ok, payload = replies[0]
    assert got_rid == rid and isinstance(payload, dict)
    if ok:  # no valid capability, so never ok - except hello without one, which says only this much
        assert op == "hello" and cap is None and set(payload) == {"protocol", "ready"}
    else:
        assert isinstance(payload.get("code"), str)


def test_still_serving_after_fuzz(sup: SupervisorHandle, acme: TenantCapability) -> None:
    _healthy(sup, acme)


def test_malformed_and_oversized_inputs_keep_serving(sup: SupervisorHandle, acme: TenantCapability) -> None:
    capb = acme.to_bytes()
    hostile = [
        [b"\x91" * 50_000],  # deep nesting
        [b"\x95\x01\x07\xa4ping\xc6\xff\xff\xff\xff"],  # huge declared bin length
        [b"\xdd\xff\xff\xff\xff"],  # array of 4G elements declared
        [_header(1, "ping", capb, {})[:-2]],  # truncated
        [_header(2, "ping", capb, {}) + b"\x00"],  # trailing bytes
        [_header(3, "ping", capb, {}, version=99)],  # wrong version
        [_header(4, "launch_missiles", capb, {})],  # unknown op
        [_header(5, "alloc", capb, {"nbytes": "lots"})],  # wrong arg type
        [_header(6, "alloc", capb, {"nbytes": -5})],
        [_header(7, "write", capb, {"handle": True})],
        [_header(8, "ping", capb, {}), b"body", b"extra"],  # too many frames
        [msgpack.packb({"not": "an array"})],
        [_header(9, "ping", capb, {1: 2})],  # non-str map key
        [b"\xc1"],  # never-used msgpack byte
    ]
    raw = RawClient(sup.run_dir)
    try:
        for frames in hostile:
            raw.send(frames)
        replies = raw.replies_for({2, 3, 4, 5, 6, 7, 8, 9})
        assert all(not ok for _, ok, _ in replies)
        answered = {rid for rid, _, _ in replies}
        assert {2, 3, 4, 5, 6, 7, 8, 9} <= answered
        codes = {rid: payload["code"] for rid, _, payload in replies}
        assert codes[3] == "protocol_error" and codes[4] == "protocol_error"
        assert codes[5] == "invalid_argument" and codes[6] == "invalid_argument"
    finally:
        raw.close()
    # an oversized message makes libzmq drop that peer; nobody else notices
    big = RawClient(sup.run_dir)
    try:
        big.send([_header(10, "write", capb, {"handle": 1}), b"\0" * (2 << 20)])
        assert big.replies(wait_ms=300) == []
    finally:
        big.close()
    _healthy(sup, acme)


def test_foreign_and_revoked_capabilities(sup: SupervisorHandle, acme: TenantCapability) -> None:
    from supervisor.store.registry import TenantRegistry

    other, admin = TenantRegistry.new()
    with other:
        foreign = other.register_with_capability(admin, TenantSpec("acme"))
        raw = RawClient(sup.run_dir)
        try:
            raw.send([_header(1, "ping", foreign.to_bytes(), {})])
            raw.send([_header(2, "status", admin.to_bytes(), {})])
            codes = {rid: p["code"] for rid, _, p in raw.replies_for({1, 2})}
            assert codes == {1: "isolation_violation", 2: "isolation_violation"}
        finally:
            raw.close()
    c = sup.client
    temp = c.register(None, TenantSpec("temp"))
    c.evict(None, "temp")
    with pytest.raises(Exception) as exc:
        c.ping(temp)
    assert getattr(exc.value, "code", "") == "capability_revoked"
    _healthy(sup, acme)
