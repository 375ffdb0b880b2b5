"""Admission policy without processes: token buckets per tenant and per
unauthenticated peer, refusals typed with ``retry_after_s``."""

from __future__ import annotations

import pytest

from shared.errors import AdmissionRate, Overloaded, error_from_dict
from shared.spec import TenantSpec
from supervisor.admission.rates import Admission, RefusalUnanswered, TokenBucket, request_burst


def test_token_bucket_refills_at_its_rate_and_says_when_to_come_back() -> None:
    b = TokenBucket(rate=10.0, burst=5.0, now=0.0)
    assert [b.take(1, 0.0) for _ in range(5)] == [0.0] * 5  # the burst
    assert b.take(1, 0.0) == pytest.approx(0.1)  # one token comes back in 1/10 s
    assert b.take(1, 0.1) == 0.0
    assert b.take(3, 100.0) == 0.0 and b.tokens == pytest.approx(2.0)  # never more than the burst saved up
    assert b.take(50, 100.0) == pytest.approx(0.3)  # more than a burst: a full bucket's worth is enough
    assert b.take(50, 100.3) == 0.0 and b.tokens == pytest.approx(0.0)


def test_a_tenant_past_its_requests_per_second_is_refused_with_retry_after() -> None:
    adm = Admission(requests_per_s=1000.0, bytes_per_s=1e9, max_message_bytes=1 << 20)
    slow = TenantSpec("slow", requests_per_s=2.0)
    for _ in range(2):
        adm.admit("slow", slow, 100, 0.0)
    with pytest.raises(Overloaded) as info:
        adm.admit("slow", slow, 100, 0.0, in_flight=3)
    err = info.value
    assert err.retry_after_s == pytest.approx(0.5) and err.in_flight == 3 and err.limit == slow.max_in_flight
    assert "requests_per_s" in str(err) and err.is_retryable()
    back = error_from_dict(err.to_dict())  # typed on the wire, the field included
    assert isinstance(back, AdmissionRate) and back.retry_after_s == pytest.approx(0.5)
    assert (back.cause, back.what, back.rate) == ("rate", "requests", 2.0) and back == err
    adm.admit("other", TenantSpec("other"), 100, 0.0)  # another tenant's bucket is its own
    adm.admit("slow", slow, 100, 0.5)  # and the tenant is served again once a token is back
    assert adm.refused == {("slow", "requests"): 1}
    assert adm.status()["admission_refused"] == 1


def test_a_refusal_a_hair_short_of_a_token_says_retry_later_never_after_zero_seconds() -> None:
    """A bucket a hair short of its next token (a hundred-thousandth of one at 200 a second: a
    wait of 5e-8 s) refuses; its ``retry_after_s`` is rounded up to the microsecond, never to 0 -
    "retry after 0 s" sends a client honouring it straight back into the same refusal (seen on a
    loaded host, where the refill between two reads of the clock is that small)."""
    adm = Admission(requests_per_s=1000.0, bytes_per_s=1e9, max_message_bytes=1 << 20)
    spec = TenantSpec("t", requests_per_s=200.0, max_in_flight=1_000)
    burst = request_burst(200.0)
    for _ in range(int(burst)):
        adm.admit("t", spec, 1, 0.0)
    refill = (1.0 - 1e-5) / 200.0  # the bucket at 0.99999 of a token
    with pytest.raises(AdmissionRate) as info:
        adm.admit("t", spec, 1, refill)
    assert info.value.retry_after_s == pytest.approx(1e-6) and info.value.retry_after_s > 0
    assert "after 0 s" not in str(info.value)
    other = TenantSpec("u", requests_per_s=200.0, max_in_flight=1_000)
    for _ in range(int(burst)):
        adm.admit("u", other, 1, 0.0)
    with pytest.raises(AdmissionRate) as info:  # an ordinary wait keeps its value to the microsecond
        adm.admit("u", other, 1, 0.0025)  # half a token back: 2.5 ms to the next
    assert info.value.retry_after_s == pytest.approx(0.0025, abs=1e-6)


def test_bytes_per_second_and_a_changed_spec_take_effect() -> None:
    adm = Admission(requests_per_s=1e6, bytes_per_s=1e9, max_message_bytes=1000)
    spec = TenantSpec("big", bytes_per_s=2000)
    adm.admit("big", spec, 1500, 0.0)
    with pytest.raises(Overloaded, match="bytes per second") as info:
        adm.admit("big", spec, 1000, 0.0)
    assert info.value.retry_after_s == pytest.approx(0.25)
    assert isinstance(info.value, AdmissionRate) and (info.value.what, info.value.rate) == ("bytes", 2000.0)
    adm.admit("big", spec, 10_000, 1.0)  # bigger than a burst: passes with a full bucket
    wider = TenantSpec("big", bytes_per_s=10**9)  # set-quota / reload: new rates, a full bucket
    adm.admit("big", wider, 10_000, 1.0)
    assert adm.refused == {("big", "bytes"): 1}
    adm.forget("big")
    assert adm.refused == {}


def test_answers_to_rate_refusals_are_metered_past_them_dropped_and_counted() -> None:
    """A tenant that keeps sending after its refusals: a burst of them answered (its
    max_in_flight, or a second's worth of refusals_per_s when that is more), then dropped
    and counted, answered again as the answers' bucket refills; forgotten with the tenant."""
    adm = Admission(refusals_per_s=4.0)
    spec = TenantSpec("flood", requests_per_s=1.0, max_in_flight=6)
    adm.admit("flood", spec, 10, 0.0)  # its one request of the second
    for _ in range(6):  # the burst: max_in_flight (6) > refusals_per_s (4)
        with pytest.raises(AdmissionRate):
            adm.admit("flood", spec, 10, 0.0)
    with pytest.raises(RefusalUnanswered) as info:
        adm.admit("flood", spec, 10, 0.0)
    assert info.value.tenant == "flood" and not isinstance(info.value, Overloaded)  # nothing goes on the wire
    with pytest.raises(AdmissionRate):
        adm.admit("flood", spec, 10, 0.25)  # a quarter second: one answer back (4 a second)
    with pytest.raises(RefusalUnanswered):
        adm.admit("flood", spec, 10, 0.25)
    assert adm.refused == {("flood", "requests"): 9} and adm.unanswered == {"flood": 2}
    status = adm.status()
    assert (status["admission_refused"], status["admission_unanswered"]) == (9, 2)
    adm.admit("other", TenantSpec("other"), 10, 0.25)  # another tenant is not touched
    adm.admit("flood", spec, 10, 1.25)  # a token back: served, never "unanswered"
    adm.forget("flood")
    assert adm.unanswered == {} and adm.status()["admission_unanswered"] == 0


def _answered_then_dropped(adm: Admission, spec: TenantSpec, answered: int, now: float) -> None:
    """Past its rate at ``now``: ``answered`` refusals answered, the next one dropped unanswered."""
    for _ in range(answered):
        with pytest.raises(AdmissionRate):
            adm.admit("t", spec, 0, now)
    with pytest.raises(RefusalUnanswered):
        adm.admit("t", spec, 0, now)


def test_the_answers_burst_follows_a_changed_max_in_flight() -> None:
    adm = Admission(refusals_per_s=1.0)
    spec = TenantSpec("t", requests_per_s=1.0, max_in_flight=2)
    adm.admit("t", spec, 0, 0.0)
    _answered_then_dropped(adm, spec, 2, 0.0)
    wider = spec.with_max_in_flight(50)  # the same rates: the buckets stay, the burst grows
    adm.admit("t", wider, 0, 50.0)
    _answered_then_dropped(adm, wider, 50, 50.0)


def test_unauthenticated_requests_are_metered_per_peer_and_the_table_is_bounded() -> None:
    adm = Admission(unauthenticated_per_s=3.0)
    assert [adm.admit_unauthenticated(b"flood", 0.0) for _ in range(5)] == [True] * 3 + [False] * 2
    assert adm.admit_unauthenticated(b"newcomer", 0.0)  # a peer of its own: a full bucket
    assert adm.admit_unauthenticated(b"flood", 1.0)  # tokens come back
    assert adm.dropped == 2
    for i in range(5000):
        adm.admit_unauthenticated(i.to_bytes(4, "big"), 2.0)
    assert len(adm._peers) <= 4096


def test_the_requests_burst_is_a_second_up_to_a_thousand_then_a_tenth_of_a_second() -> None:
    """A flood starts with a full bucket: a second's worth of burst gave a tenant at 8,000 a
    second twice its rate for the flood's first second."""
    assert [request_burst(r) for r in (0.01, 2.0, 500.0, 1000.0, 8000.0, 20_000.0, 64_000.0)] == [
        1.0, 2.0, 500.0, 1000.0, 1000.0, 2000.0, 6400.0]
    adm = Admission(requests_per_s=8000.0, bytes_per_s=1e12, max_message_bytes=1 << 20)
    spec = TenantSpec("t")
    for _ in range(1000):
        adm.admit("t", spec, 10, 0.0)
    with pytest.raises(AdmissionRate) as info:
        adm.admit("t", spec, 10, 0.0)
    assert info.value.retry_after_s == pytest.approx(1 / 8000)
    for _ in range(8):  # refilled at the rate: 8 a millisecond
        adm.admit("t", spec, 10, 0.001)
