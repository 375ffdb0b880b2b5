"""A slow or dead client never blocks the others (and, where it can, never grows the supervisor).

Three misbehaving clients, each next to a well-behaved one whose latency is
measured while it happens: one that sends tens of thousands of requests and
never reads a reply; hundreds that disconnect with their request in flight
(or parked); one with a receive high-water mark of 1 that reads big replies
slowly. The supervisor loop never waits for a client (sends are
non-blocking; a full or vanished peer loses its reply), so the bystander
keeps its latency and the supervisor's bookkeeping returns to zero.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.capability import TenantCapability
from supervisor.client.launch import SupervisorHandle
from tests.helpers.cluster import supervisor, tenant, wait_for, wait_for_count
from tests.helpers.raw_client import dealer as _dealer, request as _req
from tests.helpers.timeouts import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
def sup() -> Iterator[SupervisorHandle]:
    tenants: list[dict[str, Any]] = [{"name": "rude", "max_in_flight": 64}, {"name": "polite"}]
    with supervisor(tenants, log_level="error", max_message_bytes="8MiB", metrics_addr="127.0.0.1:0",
                    metrics_tenant_names=True) as handle:
        yield handle


class Bystander(threading.Thread):
    """Pings its own tenant every few ms and records each latency."""

    def __init__(self, sup: SupervisorHandle, cap: TenantCapability) -> None:
        super().__init__(daemon=True)
        self.sup, self.cap = sup, cap
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.sent_at: list[float] = []  # each ping's start, seconds after the thread's
        self.started = 0.0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        self.started = time.monotonic()
        # each ping's timeout is a hang guard, scaled like every other: a ping is slow on a host
        # loaded far past its cores (one core shared by the whole suite's workers) without being starved
        with self.sup.connect(timeout_s=scaled(10)) as c:
            while not self.stop.wait(0.005):
                t0 = time.monotonic()
                try:
                    c.ping(self.cap)
                except Exception as exc:  # noqa: BLE001 - reported by check()
                    self.errors.append(exc)
                self.latencies.append(time.monotonic() - t0)
                self.sent_at.append(t0 - self.started)

    def check(self, what: str) -> None:
        # enough pings to judge (a count of answers, not of time: a loaded machine serves fewer
        # per second); a starved bystander fails here, or on its errors
        wait_for(lambda: len(self.latencies) >= 20 or self.errors or not self.is_alive(), timeout_s=60,
                 what=f"{what}: 20 bystander pings")
        self.stop.set()
        self.join(20)
        lat = sorted(self.latencies)
        slowest = sorted(zip(self.latencies, self.sent_at), reverse=True)[:5]
        seen = (f"{len(lat)} pings, p50 {lat[len(lat) // 2] * 1000:.0f} ms, the slowest (ms, sent at s): "
                f"{[(round(x * 1000), round(t, 1)) for x, t in slowest]}") if lat else "no ping"
        if self.errors or (lat and lat[-1] >= scaled(10)):  # what the bystander's tenant went through
            polite = tenant(self.sup.client.status(), self.cap.tenant_id)
            seen += f"; its tenant: restarts {polite.restarts}, instances {polite.instances}"
        assert not self.errors, (what, self.errors[:3], seen)
        assert len(lat) >= 20, (what, seen)
        # Not starved: every ping answered inside its timeout (a scaled hang guard). Not a latency
        # target (those are `twt bench` figures): it must hold on a loaded machine.
        assert lat[-1] < scaled(10), f"{what}: {seen}"


def _metrics(sup: SupervisorHandle) -> str:
    # a hang guard, scaled: a scrape in the flood's thick on a host loaded past its cores is slow
    with urllib.request.urlopen(sup.client.info["metrics_url"], timeout=scaled(10)) as resp:
        return resp.read().decode()


def _taken_parsed(text: str, tenant_id: str) -> int:
    """:func:`_taken` through prometheus_client's parser (its whole exposition: ~10 ms a page)."""
    return int(sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "twt_requests_total" and s.labels.get("tenant") == tenant_id))


def _taken(sup: SupervisorHandle, tenant_id: str, text: str | None = None) -> int:
    """Requests of ``tenant_id`` the supervisor has taken and finished - answered, refused, or dropped
    unanswered - from its ``twt_requests_total`` (every outcome of every op).

    The samples' lines only: the flood's wait reads the page ten times a second for seconds, and
    prometheus_client's parser of the whole page was most of the test process's CPU (the test checks
    once that both read the same count)."""
    text = _metrics(sup) if text is None else text
    label = f'tenant="{tenant_id}"'
    total = 0.0
    for line in text.splitlines():
        if line.startswith("twt_requests_total{"):
            labels, _, value = line[len("twt_requests_total{"):].rpartition("} ")
            if label in labels.split(","):
                total += float(value)
    return int(total)


def _caps(sup: SupervisorHandle) -> tuple[TenantCapability, TenantCapability]:
    return sup.client.tenant_capability(None, "rude"), sup.client.tenant_capability(None, "polite")


def test_client_that_never_reads_its_replies(sup: SupervisorHandle) -> None:
    rude, polite = _caps(sup)
    proc = psutil.Process(sup.pid)
    rss0 = proc.memory_info().rss
    bystander = Bystander(sup, polite)
    bystander.start()
    greedy = _dealer(sup.run_dir, SNDHWM=0, RCVHWM=100)
    try:
        # 20,000: twice what the supervisor's send queue for the peer (its SOCKET_HWM, 10,000) and the
        # peer's 100 hold, so the supervisor meets a full peer thousands of times and must never wait
        # for it (40,000 cost twice the CPU for the same cover)
        for rid in range(1, 20_001):
            # quota is answered by the supervisor itself, ping by the worker (Overloaded past max_in_flight)
            greedy.send(_req(rid, "quota" if rid % 3 else "ping", rude))
            if rid % 2000 == 0:
                time.sleep(0.01)
        # the flood takes the supervisor seconds to chew through (how many depends on the host and
        # what runs beside it: the wait lasts while the count moves): the bystander pings all along,
        # and every one of the 20,000 is taken before the checks (its in_flight is 0 for an instant
        # many times while the flood still waits in the socket: quota needs no worker)
        wait_for_count(lambda: _taken(sup, "rude"), 20_000, what="requests of the flood processed")
        text = _metrics(sup)
        assert _taken(sup, "rude", text) == _taken_parsed(text, "rude") >= 20_000
        bystander.check("greedy client")
        assert tenant(sup.client.status(), "rude").in_flight <= 64
    finally:
        greedy.close(0)
    wait_for(lambda: tenant(sup.client.status(), "rude").in_flight == 0, what="rude tenant idle")
    assert sup.client.ping(rude).tenant == "rude"  # the tenant itself is fine once its client behaves
    assert proc.memory_info().rss - rss0 < 64 << 20


def test_clients_disconnecting_mid_request(sup: SupervisorHandle) -> None:
    rude, polite = _caps(sup)
    c = sup.client
    proc = psutil.Process(sup.pid)
    handle = c.alloc(rude, 1 << 20)
    c.inject_fault(None, "rude", "slow", ms=5)  # every reply arrives after its client is gone
    fds0 = proc.num_fds()
    bystander = Bystander(sup, polite)
    bystander.start()
    for i in range(300):
        sock = _dealer(sup.run_dir)
        sock.send(_req(1, "read", rude, {"handle": handle, "offset": 0, "nbytes": 1 << 20}))
        sock.send(_req(2, "ping", rude))
        if i % 3 == 0:
            time.sleep(0.002)  # sometimes the request is already with the worker, sometimes still queued
        sock.close(0)
    # parked: no instance is ready (it is restarting) when these clients vanish
    c.inject_fault(None, "rude", "crash")
    for _ in range(20):
        sock = _dealer(sup.run_dir)
        sock.send(_req(1, "ping", rude))
        sock.close(0)
    bystander.check("disconnecting clients")
    wait_for(lambda: (r := tenant(c.status(), "rude")).in_flight == 0 and r.parked == 0 and
             r.state == "running", timeout_s=15, what="nothing in flight or parked for vanished clients")
    wait_for(lambda: proc.num_fds() <= fds0 + 4, what="sockets of vanished clients released")
    assert c.ping(rude).tenant == "rude"


def test_client_with_a_tiny_receive_queue(sup: SupervisorHandle) -> None:
    rude, polite = _caps(sup)
    c = sup.client
    handle = c.alloc(rude, 256 << 10)
    bystander = Bystander(sup, polite)
    bystander.start()
    slow = _dealer(sup.run_dir, RCVHWM=1, RCVBUF=4096)
    got = 0
    try:
        for rid in range(1, 401):
            slow.send(_req(rid, "read", rude, {"handle": handle, "offset": 0, "nbytes": 256 << 10}))
            if rid % 20 == 0:
                if slow.poll(0):
                    slow.recv_multipart()  # a trickle
                    got += 1
                time.sleep(0.02)
        if not got:  # a host slow enough that no reply came while sending: wait for the first one
            assert slow.poll(int(scaled(30) * 1000)), "no reply reached the client with the tiny receive queue"
            slow.recv_multipart()
            got += 1
        bystander.check("tiny receive queue")
    finally:
        slow.close(0)
    assert got >= 1
    wait_for(lambda: tenant(c.status(), "rude").in_flight == 0, what="rude tenant idle")


def test_slow_reader_cannot_grow_supervisor_memory(sup: SupervisorHandle) -> None:
    """A client that asks for 1 MiB reads and never reads them must not cost the supervisor 1 MiB each."""
    rude, _ = _caps(sup)
    handle = sup.client.alloc(rude, 1 << 20)
    proc = psutil.Process(sup.pid)
    rss0 = proc.memory_info().rss
    slow = _dealer(sup.run_dir, RCVHWM=1, RCVBUF=4096)
    try:
        for rid in range(1, 601):
            slow.send(_req(rid, "read", rude, {"handle": handle, "offset": 0, "nbytes": 1 << 20}))
            if rid % 40 == 0:
                time.sleep(0.05)  # stay under max_in_flight: every read is served
        wait_for(lambda: tenant(sup.client.status(), "rude").in_flight == 0, what="all reads served")
        growth = proc.memory_info().rss - rss0
    finally:
        slow.close(0)
    assert growth < 128 << 20, f"supervisor RSS grew {growth >> 20} MiB holding replies for one slow reader"
