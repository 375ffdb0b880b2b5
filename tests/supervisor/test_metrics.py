"""Prometheus metrics: the exporter on its own (port 0, fake-free snapshot) and /metrics of a real supervisor."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.errors import GpuMemoryExhausted
from shared.quota import QuotaBlock
from supervisor.metrics import TenantGauges
from supervisor.prometheus import PrometheusMetrics, parse_metrics_addr
from tests.helpers.cluster import instance_pid, supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_parse_metrics_addr() -> None:
    assert parse_metrics_addr("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_metrics_addr(":0") == ("127.0.0.1", 0)
    assert parse_metrics_addr("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", "host:", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_metrics_addr(bad)


def test_exporter_on_port_0_hooks_and_scrape_time_snapshot() -> None:
    with QuotaBlock.create("acme", memory_quota_bytes=64 << 20, gpu_memory_bytes_cap=1 << 20) as block:
        block.consume_gpu_bytes(300_000)
        block.consume_bytes(4096)
        with pytest.raises(GpuMemoryExhausted):
            block.consume_gpu_bytes(1 << 20)
        state = {"up": 2}

        def snapshot() -> dict[str, TenantGauges]:
            free = dataclasses.replace(block.snapshot(), tenant_id="free", bytes_in_use=1, memory_quota_bytes=2,
                                       gpu_memory_bytes_cap=None)
            return {"acme": TenantGauges(block.snapshot(), state["up"], "running"),
                    "free": TenantGauges(free, 0, "failed")}

        metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False)
        try:
            assert metrics.port > 0 and metrics.url == f"http://127.0.0.1:{metrics.port}/metrics"
            before = _scrape(metrics.url)  # nothing bound yet: the counters alone
            assert _get(before, "twt_tenants") == 0
            metrics.bind_source(snapshot)
            metrics.request_done("acme", "alloc", "ok", 0.0004)
            metrics.request_done("acme", "alloc", "ok", 0.003)
            metrics.request_done("acme", "alloc", "gpu_memory_exhausted", 0.0002)
            metrics.worker_exit("acme", "signal")
            metrics.worker_exit(None, "stop")
            metrics.restart("acme")
            s = _scrape(metrics.url)
            assert _get(s, "twt_tenants") == 2
            assert _get(s, "twt_tenant_gpu_bytes_in_use", tenant="acme") == 300_000
            assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="acme") == 1 << 20
            assert _get(s, "twt_tenant_gpu_high_water_bytes", tenant="acme") == 300_000
            assert _get(s, "twt_tenant_cpu_bytes_in_use", tenant="acme") == 4096
            assert _get(s, "twt_tenant_cpu_limit_bytes", tenant="acme") == 64 << 20
            assert _get(s, "twt_tenant_cpu_high_water_bytes", tenant="acme") == 4096
            assert _get(s, "twt_tenant_instances_up", tenant="acme") == 2
            assert _get(s, "twt_tenant_state", tenant="acme", state="running") == 1
            assert _get(s, "twt_tenant_quota_refusals_total", tenant="acme", resource="gpu") == 1
            assert _get(s, "twt_tenant_quota_refusals_total", tenant="acme", resource="cpu") == 0
            assert _get(s, "twt_tenant_quota_underflows_total", tenant="acme", resource="gpu") == 0
            assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="free") == float("inf")  # uncapped
            assert _get(s, "twt_tenant_state", tenant="free", state="failed") == 1
            assert _get(s, "twt_requests_total", tenant="acme", op="alloc", outcome="ok") == 2
            assert _get(s, "twt_requests_total", tenant="acme", op="alloc", outcome="gpu_memory_exhausted") == 1
            assert _get(s, "twt_request_duration_seconds_count", op="alloc") == 3
            assert _get(s, "twt_request_duration_seconds_bucket", op="alloc", le="0.0005") == 2
            assert _get(s, "twt_request_duration_seconds_bucket", op="alloc", le="+Inf") == 3
            assert _get(s, "twt_worker_exits_total", tenant="acme", cause="signal") == 1
            assert _get(s, "twt_worker_exits_total", tenant="", cause="stop") == 1
            assert _get(s, "twt_restarts_total", tenant="acme") == 1
            # gauges are read at scrape time: no hook needed when usage changes
            block.release_gpu_bytes(300_000)
            state["up"] = 1
            s = _scrape(metrics.url)
            assert _get(s, "twt_tenant_gpu_bytes_in_use", tenant="acme") == 0
            assert _get(s, "twt_tenant_gpu_high_water_bytes", tenant="acme") == 300_000
            assert _get(s, "twt_tenant_instances_up", tenant="acme") == 1

            # a snapshot that fails costs the per-tenant series of that scrape, never the exporter
            def broken() -> dict[str, Any]:
                raise RuntimeError("block closed under us")

            metrics.bind_source(broken)
            s = _scrape(metrics.url)
            assert _get(s, "twt_metrics_snapshot_errors_total") == 1 and _get(s, "twt_tenants") == 0
            assert _get(s, "twt_restarts_total", tenant="acme") == 1
        finally:
            metrics.close()
        metrics.close()  # idempotent
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(metrics.url, timeout=2)


def test_busy_address_is_a_clear_error() -> None:
    first = PrometheusMetrics("127.0.0.1:0", process_metrics=False)
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{first.port}"):
            PrometheusMetrics(f"127.0.0.1:{first.port}", process_metrics=False)
    finally:
        first.close()


def test_supervisor_metrics_endpoint_has_the_tenant_series() -> None:
    port = _free_port()
    tenants = [{"name": "acme", "gpu_memory_bytes_cap": "1MiB", "memory_quota_bytes": "64MiB"}, {"name": "beta"}]
    with supervisor(tenants, metrics_addr=f"127.0.0.1:{port}", metrics_tenant_names=True) as sup:
        url = f"http://127.0.0.1:{port}/metrics"
        c = sup.client
        acme = c.tenant_capability(None, "acme")
        c.alloc(acme, 512 << 10)
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(acme, 768 << 10)
        c.ping(acme)
        rec = tenant(c.status(), "acme")
        s = _scrape(url)
        assert _get(s, "twt_tenants") == 2
        assert _get(s, "twt_tenant_gpu_bytes_in_use", tenant="acme") == 512 << 10
        assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="acme") == 1 << 20
        assert _get(s, "twt_tenant_gpu_high_water_bytes", tenant="acme") == 512 << 10
        assert _get(s, "twt_tenant_cpu_bytes_in_use", tenant="acme") == rec["bytes_in_use"]
        assert _get(s, "twt_tenant_cpu_limit_bytes", tenant="acme") == 64 << 20
        assert _get(s, "twt_tenant_quota_refusals_total", tenant="acme", resource="gpu") == 1
        assert _get(s, "twt_tenant_instances_up", tenant="acme") == 1
        assert _get(s, "twt_tenant_state", tenant="acme", state="running") == 1
        assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="beta") == float("inf")
        assert _get(s, "twt_requests_total", tenant="acme", op="alloc", outcome="ok") == 1
        assert _get(s, "twt_requests_total", tenant="acme", op="alloc", outcome="gpu_memory_exhausted") == 1
        assert _get(s, "twt_requests_total", tenant="acme", op="ping", outcome="ok") == 1
        assert _get(s, "twt_request_duration_seconds_count", op="alloc") == 2
        assert _get(s, "process_resident_memory_bytes") > 0  # the supervisor's own process
        assert not any(name == "twt_restarts_total" for name, _ in s)
        # a SIGKILLed worker: counted as an exit by signal and a restart; its GPU bytes come back
        pid = instance_pid(sup, "acme")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: (p := instance_pid(sup, "acme")) is not None and p != pid, what="acme restarted")
        s = _scrape(url)
        assert _get(s, "twt_restarts_total", tenant="acme") == 1
        assert _get(s, "twt_worker_exits_total", tenant="acme", cause="signal") == 1
        assert _get(s, "twt_tenant_gpu_bytes_in_use", tenant="acme") == 0
        assert _get(s, "twt_tenant_gpu_high_water_bytes", tenant="acme") == 512 << 10
        assert _get(s, "twt_tenant_instances_up", tenant="acme") == 1
        c.evict(None, "beta")
        s = _scrape(url)
        assert _get(s, "twt_tenants") == 1
        assert not any(dict(labels).get("tenant") == "beta" and name.startswith("twt_tenant_") for name, labels in s)
    # the supervisor stopped: so did its exporter
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_tenant_labels_are_pseudonyms_unless_names_are_chosen() -> None:
    from supervisor.prometheus import NO_TENANT, TenantLabels

    hidden, shown = TenantLabels(False), TenantLabels(True)
    assert shown("acme") == "acme"
    label = hidden("acme")
    assert label.startswith("t-") and "acme" not in label and hidden("acme") == label
    assert hidden("beta") != label and TenantLabels(False)("acme") != label  # a key per supervisor
    assert hidden("") == shown(None) == NO_TENANT
