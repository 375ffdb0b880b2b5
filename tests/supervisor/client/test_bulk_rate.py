"""The bulk pipeline and a rate refusal, without processes: a scripted transport answers the first
chunk ``Overloaded`` (cause ``rate``, with ``retry_after_s``) and every other one OK. The pipeline
sends nothing while the tenant waits (the transport fails the test if it does), resends the refused
chunk after the wait, and raises the refusal itself - typed - when the wait outlasts the reply
deadline instead of sleeping through it."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Mapping
from typing import TypeVar, cast

import pytest

from shared import protocol as proto
from shared.errors import AdmissionRate, RequestTimeout
from shared.region import Region, plan_chunks
from supervisor.client.bulk import BulkPath, _Staging

R = TypeVar("R", bound=proto.FromWire)

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 << 10


class ScriptedTransport:
    """SupervisorClient's request primitives as the bulk path uses them; the first request is refused
    for the tenant's rate, and the wait starts when that reply is read (as the client's does)."""

    def __init__(self, retry_after_s: float, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.until = 0.0
        self.sent: list[int] = []  # the chunk positions, in the order sent
        self.ok: list[int] = []
        self._replies: collections.deque[tuple[int, bool, object, bytes | None]] = collections.deque()
        self._rids = itertools.count(1)

    def send(self, op: str, cap: bytes, args: Mapping[str, object]) -> int:
        assert not self.rate_wait_s(cap), "a chunk was sent while the tenant waits out its refusal"
        rid = next(self._rids)
        position = cast(int, args["offset"])
        self.sent.append(position)
        if rid == 1:
            err = AdmissionRate("acme", 1, 64, retry_after_s=self.retry_after_s, what="requests", rate=2.0)
            self._replies.append((rid, False, err.to_dict(), None))
        else:
            self.ok.append(position)
            self._replies.append((rid, True, {}, None))
        return rid

    def _recv_one(self, deadline: float, op: str) -> tuple[int, bool, object, bytes | None]:
        if not self._replies:
            raise RequestTimeout(op, self.timeout_s)
        reply = self._replies.popleft()
        if not reply[1]:
            self.until = time.monotonic() + self.retry_after_s  # read: now the client knows
        return reply

    def rate_wait_s(self, cap: bytes) -> float:
        return max(0.0, self.until - time.monotonic())

    def check_rate_wait(self, cap: bytes) -> None:
        left = self.rate_wait_s(cap)
        if left:
            raise AdmissionRate("acme", 0, 64, retry_after_s=round(left, 6), what="requests", rate=2.0)

    def _request_locked(self, op: str, cap: bytes, args: Mapping[str, object], *,
                        timeout_s: float | None = None) -> tuple[object, bytes | None]:
        raise AssertionError("a transfer of several chunks is pipelined")

    def _invoke_locked(self, cap: bytes, args: proto.WireArgs[R], *, timeout_s: float | None = None) -> R:
        raise AssertionError("not used by the pipeline")


def _pipeline(transport: ScriptedTransport, total: int) -> list[int]:
    bulk = BulkPath(transport, enabled=True)  # (mypy checks the script against the Transport protocol here)
    staging = _Staging(1, cast(Region, None), b"cap")
    chunks = plan_chunks(total, 4 * CHUNK, chunk_bytes=CHUNK)
    done: list[int] = []
    bulk._pipeline(staging, proto.WriteRegion.Args, 7, 0, chunks, before=None, after=lambda c: done.append(c.position))
    return done


def test_a_chunk_refused_for_the_rate_is_sent_again_after_retry_after_and_every_chunk_lands() -> None:
    transport = ScriptedTransport(retry_after_s=0.05, timeout_s=10.0)
    done = _pipeline(transport, 10 * CHUNK)
    positions = [c * CHUNK for c in range(10)]
    assert sorted(done) == positions and sorted(transport.ok) == positions  # each chunk answered OK once
    assert transport.sent.count(0) == 2  # the refused one, and its resend


def test_a_wait_longer_than_the_reply_deadline_is_the_refusal_not_a_sleep() -> None:
    transport = ScriptedTransport(retry_after_s=100.0, timeout_s=2.0)
    with pytest.raises(AdmissionRate) as info:
        _pipeline(transport, 10 * CHUNK)
    assert info.value.retry_after_s is not None and 90 < info.value.retry_after_s <= 100
    assert transport.sent.count(0) == 1  # never resent

