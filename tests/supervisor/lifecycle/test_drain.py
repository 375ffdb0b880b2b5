"""Draining on SIGTERM: nothing accepted is lost, nothing new is admitted, then the supervisor exits.

A request in flight at SIGTERM (a long ``run_wasm``) finishes and is answered, where
the supervisor used to stop its workers at once and answer it ``WorkerLost ... killed
by signal 9 (shutdown)``; a new request meanwhile gets the retryable ``Draining``.
"""

from __future__ import annotations

import signal
import socket
import urllib.error
import urllib.request

import pytest

from shared.errors import Draining, error_from_dict
from supervisor.client.api import SupervisorClient
from supervisor.lifecycle.drain import MIN_RETRY_AFTER_S, Drain
from supervisor.tools.demo import guest_path
from tests.helpers.cluster import supervisor, tenant, wait_for


def test_the_drain_is_over_when_nothing_is_in_flight_at_its_timeout_or_when_hurried() -> None:
    drain = Drain(10.0, 4.0)
    assert not drain.active and not drain.over(0.0, 0)
    assert drain.begin(100.0) and not drain.begin(101.0)  # a second signal does not restart it
    assert not drain.over(105.0, 2)
    assert drain.over(105.0, 0)
    assert drain.over(110.0, 2)  # its time is up, whatever is left
    refusal = drain.refusal(103.0)
    assert isinstance(refusal, Draining) and refusal.is_retryable()
    assert refusal.retry_after_s == pytest.approx(7.0 + 4.0) and refusal.drain_timeout_s == 10.0
    assert drain.refusal(1000.0).retry_after_s == max(MIN_RETRY_AFTER_S, 4.0)
    hurried = Drain(10.0, 0.0)
    hurried.begin(0.0)
    hurried.hurry()
    assert hurried.over(0.1, 5)
    assert Drain(0.0, 0.0).refusal(0.0).retry_after_s == MIN_RETRY_AFTER_S
    with pytest.raises(ValueError):
        Drain(float("inf"), 1.0)


def _draining(client: SupervisorClient, cap: object) -> Draining | None:
    """The Draining refusal of a request sent now, or None while the supervisor still admits it."""
    try:
        client.quota(cap)  # type: ignore[arg-type]
    except Draining as exc:
        return exc
    return None


def _readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_sigterm_lets_a_long_run_in_flight_finish_refuses_new_work_then_exits() -> None:
    # the worker's stop would come after stop_timeout_s (1 s here): the run takes longer than that
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a 10 s heartbeat window: the run lasts 12 s, and a worker starved of CPU for 2.3 s beside four
    # burners was once killed for missed heartbeats (this test is about the drain, not liveness)
    with supervisor([{"name": "acme"}], drain_timeout_s=60.0, stop_timeout_s=1.0, heartbeat_liveness=50,
                    metrics_addr=f"127.0.0.1:{port}") as sup:
        c = sup.client
        cap = c.tenant_capability(None, "acme")
        # every request waits 12 s in the worker first: long enough for the checks below on a loaded host
        c.inject_fault(None, "acme", "slow", ms=12000)
        rid = c.send("run_wasm", cap, {"export": "add", "args": [2, 3]}, guest_path("probe").read_bytes())
        with sup.connect() as watcher:
            wait_for(lambda: tenant(watcher.status(), "acme").in_flight == 1, what="the run in flight")
            sup.process.send_signal(signal.SIGTERM)
            refusal = wait_for(lambda: _draining(watcher, cap), what="a new request refused Draining")
            assert refusal.is_retryable() and refusal.retry_after_s >= MIN_RETRY_AFTER_S
            assert refusal.drain_timeout_s == 60.0
            # the read-only ops still answer while draining: the operator sees the drain
            assert tenant(watcher.status(), "acme").in_flight == 1
            code, body = _readyz(port)
            assert code == 503 and "draining" in body
        got, ok, payload, _ = c.recv(timeout_s=60)
        assert got == rid
        assert ok, error_from_dict(payload)
        assert isinstance(payload, dict) and list(payload["results"]) == [5]
        assert sup.process.wait(60) == 0  # and then it stopped, on its own


def test_a_second_sigterm_ends_the_drain() -> None:
    with supervisor([{"name": "acme"}], drain_timeout_s=600.0, stop_timeout_s=1.0) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "acme")
        c.inject_fault(None, "acme", "hang")
        rid = c.send("ping", cap)
        with sup.connect() as watcher:
            wait_for(lambda: tenant(watcher.status(), "acme").in_flight == 1, what="the ping in flight")
            sup.process.send_signal(signal.SIGTERM)
            wait_for(lambda: _draining(watcher, cap), what="draining")
        sup.process.send_signal(signal.SIGTERM)
        got, ok, payload, _ = c.recv(timeout_s=60)
        assert got == rid and not ok  # answered (the worker was stopped), not left hanging
        assert sup.process.wait(60) == 0


def test_drain_and_fault_injection_settings_are_checked() -> None:
    from shared.config import SupervisorConfig, load_config

    assert SupervisorConfig().drain_timeout_s >= 35.0  # at least the default request deadline and its grace
    for bad in (-1, float("nan"), float("inf"), "soon", True):
        with pytest.raises(ValueError, match="drain_timeout_s"):
            SupervisorConfig(drain_timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fault_injection"):
        SupervisorConfig(fault_injection="maybe")  # type: ignore[arg-type]
    env = load_config(None, environ={"TWT_DRAIN_TIMEOUT_S": "90", "TWT_FAULT_INJECTION": "false"})
    assert env.drain_timeout_s == 90.0 and env.fault_injection is False


def test_readiness_ends_with_the_drain() -> None:
    from supervisor.observe.health import Health
    from supervisor.observe.metrics import MetricsSnapshot

    now = [0.0]
    health = Health(stall_after_s=5.0, clock=lambda: now[0])
    health.observe(MetricsSnapshot())
    health.mark_ready()
    assert health.ready().ok
    health.mark_draining()
    verdict = health.ready()
    assert not verdict.ok and "draining" in verdict.reason
    assert health.live().ok  # still alive: the kubelet must not restart a draining pod
