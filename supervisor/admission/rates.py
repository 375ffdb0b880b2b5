"""Admission: how many requests and bytes per second each sender may have served.

``max_in_flight`` bounds what a tenant has *outstanding*; it does not bound
what a tenant may make the supervisor's loop do: a client that sends cheap
requests the frontend answers itself (``quota``, ``events``, pings past
``max_in_flight``) never has many outstanding, and used to take most of the
loop from everyone else (a victim's ping was 42x slower during a
``quota`` flood). So every request a tenant's capability carries - every op,
those the frontend answers included - first takes a token from two buckets
of its tenant:

* requests per second (``requests_per_s`` in the spec, else the supervisor's
  ``tenant_requests_per_s``), a burst of one second's worth up to 1,000
  requests, a tenth of a second's worth past that (:func:`request_burst`);
* request bytes per second (header and body; ``bytes_per_s`` /
  ``tenant_bytes_per_s``), a burst of one second's worth or one largest
  message, whichever is more (so any admissible message can pass).

Past either, the request is answered :class:`~shared.errors.Overloaded` with
``retry_after_s``: when enough tokens will be back. The defaults are ceilings
that normal use never reaches and a flood does; operators set a tenant's own.

The answers to those refusals are metered too (``tenant_refusals_per_s``, a
burst of one second's worth or the tenant's ``max_in_flight``, whichever is
more); past them a refused request is dropped unanswered and counted
(:class:`RefusalUnanswered`). Why: a refusal told the client when to come
back; a client that keeps sending regardless made every answer cost the
supervisor, its I/O thread and the host a reply each - the part of a flood
that admission did not reach (with the flooder held to 8,000
requests/s, the victim's p99 during a ping flood 13.7x its quiet p50, 7.9-8.2x
with the refusals' answers metered). A client that honours ``retry_after_s``
(ours does: :class:`supervisor.client.api.SupervisorClient`) has at most its
pipelined requests refused at once, and the burst answers them all.

Requests without a verified capability (garbage, forged or foreign tokens, a
client's very first request) are charged to their *peer* instead: a smaller
bucket per connection (``unauthenticated_requests_per_s``), past which they
are dropped unanswered and counted - they have no tenant to answer to, and
answering a flood is what the flood wants. The peer table is bounded (least
recently seen forgotten). Admin requests are not metered (the operator's own).

Pure policy with an injected clock: no sockets, no threads. Loop thread only.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NoReturn, TypedDict

from shared.config import SupervisorConfig
from shared.errors import AdmissionRate
from shared.spec import TenantSpec

__all__ = ["BURST_REQUESTS", "Admission", "AdmissionStatus", "RefusalUnanswered", "TokenBucket", "request_burst"]


class AdmissionStatus(TypedDict):
    """Admission's counters in a status (fields of ``shared.records.SupervisorRecord``)."""

    admission_refused: int
    admission_refused_by: dict[str, int]
    admission_unanswered: int
    unauthenticated_rate_dropped: int


class RefusalUnanswered(Exception):
    """A request refused for its tenant's rate, past the tenant's answers to such refusals:
    the caller drops it without a reply (it is counted in :attr:`Admission.unanswered`).
    Not a wire error: nothing is sent. ``retry_after_s``: when its bucket would admit it."""

    def __init__(self, tenant: str, retry_after_s: float = 0.0) -> None:
        super().__init__(tenant)
        self.tenant = tenant
        self.retry_after_s = retry_after_s


#: peers whose unauthenticated buckets are remembered (least recently seen forgotten)
MAX_PEERS = 4096


#: requests a tenant's bucket saves up at most before its burst is cut to a tenth of a second
BURST_REQUESTS = 1000.0


def request_burst(rate: float) -> float:
    """The burst of a requests bucket: one second's worth up to :data:`BURST_REQUESTS`, past
    that a tenth of a second's worth (at least :data:`BURST_REQUESTS`).

    Why not a second's worth throughout: a flood starts with a full bucket, so for its
    first second a tenant had twice its rate - at 8,000 a second, another tenant's ping p99
    was 12-15x its quiet p50 during that second and 5-6x after it. A client
    that keeps to its rate never has more than its ``max_in_flight`` outstanding, and a
    thousand requests at once cover any of the defaults' (64)."""
    if rate <= BURST_REQUESTS:
        return max(rate, 1.0)
    return max(BURST_REQUESTS, rate / 10.0)


def retry_after(wait: float) -> float:
    """``wait`` (seconds) as the ``retry_after_s`` a refusal carries: rounded *up* to the
    microsecond. A refusal always has a wait > 0 (a bucket a hair short of a token), and rounded to
    the nearest microsecond that hair - a refill of 1e-4 tokens at 200 a second is 0.5 us - said
    "retry after 0 s": a client honouring it comes back at once and is refused again."""
    if wait <= 0.0:
        return 0.0
    return math.ceil(wait * 1e6) / 1e6


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; starts full."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def take(self, n: float, now: float) -> float:
        """Take ``n`` tokens (at most a full bucket's worth); 0.0 when taken, else the
        seconds until they will be there (nothing taken)."""
        tokens = self.tokens + (now - self.stamp) * self.rate
        if tokens > self.burst:
            tokens = self.burst
        self.stamp = now
        need = n if n < self.burst else self.burst
        if tokens + 1e-9 >= need:  # (float rounding of the refill)
            self.tokens = tokens - need if tokens > need else 0.0
            return 0.0
        self.tokens = tokens
        return (need - tokens) / self.rate


@dataclass(slots=True)
class _TenantBuckets:
    spec: TenantSpec  # the spec they were made for (a changed spec is a new object: new buckets)
    requests: TokenBucket
    data: TokenBucket
    answers: TokenBucket  # answers to the requests refused for the two above


@dataclass
class Admission:
    """Per-tenant request and byte buckets, and per-peer buckets for the unauthenticated."""

    requests_per_s: float = 20_000.0
    bytes_per_s: float = float(4 << 30)
    #: the largest message a socket accepts: a byte bucket holds at least this
    max_message_bytes: int = 256 << 20
    unauthenticated_per_s: float = 200.0
    #: answers per second to a tenant's refused requests (burst: this or its max_in_flight)
    refusals_per_s: float = 100.0
    #: refusals by tenant and by what was exceeded ("requests" / "bytes")
    refused: dict[tuple[str, str], int] = field(default_factory=dict, init=False)
    #: of those, dropped unanswered (past the tenant's answers), by tenant
    unanswered: dict[str, int] = field(default_factory=dict, init=False)
    #: unauthenticated requests dropped for their peer's bucket
    dropped: int = field(default=0, init=False)
    _tenants: dict[str, _TenantBuckets] = field(default_factory=dict, init=False)
    _peers: OrderedDict[bytes, TokenBucket] = field(default_factory=OrderedDict, init=False)

    @classmethod
    def from_config(cls, config: SupervisorConfig) -> Admission:
        return cls(config.tenant_requests_per_s, float(config.tenant_bytes_per_s), config.max_message_bytes,
                   config.unauthenticated_requests_per_s, config.tenant_refusals_per_s)

    def _buckets(self, tenant: str, spec: TenantSpec, now: float) -> _TenantBuckets:
        rps = spec.requests_per_s if spec.requests_per_s is not None else self.requests_per_s
        bps = float(spec.bytes_per_s) if spec.bytes_per_s is not None else self.bytes_per_s
        answers_burst = max(self.refusals_per_s, float(spec.max_in_flight), 1.0)
        old = self._tenants.get(tenant)
        if old is not None and old.requests.rate == rps and old.data.rate == bps:
            old.spec = spec  # another spec object, the same rates: keep what was saved up
            old.answers.burst = answers_burst
            return old
        b = self._tenants[tenant] = _TenantBuckets(
            spec, TokenBucket(rps, request_burst(rps), now),
            TokenBucket(bps, max(bps, float(self.max_message_bytes)), now),
            TokenBucket(self.refusals_per_s, answers_burst, now))
        return b

    def admit(self, tenant: str, spec: TenantSpec, nbytes: int, now: float, *, in_flight: int = 0) -> None:
        """Charge one request of ``nbytes`` to ``tenant``; raises :class:`AdmissionRate` (with
        ``retry_after_s``) past its requests or bytes per second, or :class:`RefusalUnanswered`
        instead once the answers to such refusals are spent (drop the request)."""
        b = self._tenants.get(tenant)
        if b is None or b.spec is not spec:  # the hot path: the same spec object as last time
            b = self._buckets(tenant, spec, now)
        wait = b.requests.take(1.0, now)
        if wait:
            what, rate = "requests", b.requests.rate
        else:
            if not nbytes:
                return
            wait = b.data.take(float(nbytes), now)
            if not wait:
                return
            b.requests.tokens += 1.0  # not served: the request token goes back
            what, rate = "bytes", b.data.rate
        self._refuse(b, tenant, what, wait, rate, now, in_flight)

    def refuse(self, tenant: str, spec: TenantSpec, now: float, *, in_flight: int = 0) -> None:
        """Refuse one request of ``tenant`` for its rate without charging it (a held tenant's
        request read past the fair queue's ceiling, supervisor.admission.yielding): raises
        :class:`AdmissionRate` (retry after one request's worth of its rate), or
        :class:`RefusalUnanswered` once the answers to refusals are spent - counted as any
        refusal for its rate."""
        b = self._tenants.get(tenant)
        if b is None or b.spec is not spec:
            b = self._buckets(tenant, spec, now)
        rate = b.requests.rate
        self._refuse(b, tenant, "requests", 1.0 / rate if 0.0 < rate < float("inf") else 0.0, rate, now, in_flight)

    def _refuse(self, b: _TenantBuckets, tenant: str, what: str, wait: float, rate: float, now: float,
                in_flight: int) -> NoReturn:
        """Count a refusal of ``tenant`` for ``what`` and raise it: :class:`AdmissionRate`, or
        :class:`RefusalUnanswered` once its answers to refusals are spent."""
        key = (tenant, what)
        self.refused[key] = self.refused.get(key, 0) + 1
        if b.answers.take(1.0, now):
            self.unanswered[tenant] = self.unanswered.get(tenant, 0) + 1
            raise RefusalUnanswered(tenant, wait)
        raise AdmissionRate(tenant, in_flight, b.spec.max_in_flight, retry_after_s=retry_after(wait), what=what,
                            rate=rate)

    def admit_unauthenticated(self, peer: bytes, now: float) -> bool:
        """One request without a verified capability from ``peer``: False when its bucket
        is empty (drop it, counted in :attr:`dropped`)."""
        bucket = self._peers.pop(peer, None)
        if bucket is None:
            rate = self.unauthenticated_per_s
            bucket = TokenBucket(rate, max(rate, 1.0), now)
            while len(self._peers) >= MAX_PEERS:
                self._peers.popitem(last=False)
        self._peers[peer] = bucket
        if bucket.take(1.0, now):
            self.dropped += 1
            return False
        return True

    def forget(self, tenant: str) -> None:
        """An evicted tenant's buckets and counts go with it (a new registration starts
        full; the counts stay bounded by the tenants registered now)."""
        self._tenants.pop(tenant, None)
        self.unanswered.pop(tenant, None)
        for what in ("requests", "bytes"):
            self.refused.pop((tenant, what), None)

    def status(self) -> AdmissionStatus:
        refused: dict[str, int] = {}
        for (_, what), n in self.refused.items():
            refused[what] = refused.get(what, 0) + n
        return {"admission_refused": sum(refused.values()), "admission_refused_by": refused,
                "admission_unanswered": sum(self.unanswered.values()),
                "unauthenticated_rate_dropped": self.dropped}
