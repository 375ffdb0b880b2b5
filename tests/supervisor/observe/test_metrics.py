"""Prometheus metrics: the exporter on its own (port 0, fake-free snapshot) and /metrics of a real supervisor."""

from __future__ import annotations

import dataclasses
import os
import platform
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.errors import GpuMemoryExhausted
from shared.protocol import PROTOCOL_VERSION
from shared.quota import QuotaBlock
from supervisor.observe.health import Health
from supervisor.observe.metrics import DeviceGauges, MetricsSnapshot, TenantGauges, build_version
from supervisor.observe.prometheus import TENANT_STATES, PrometheusMetrics, parse_metrics_addr
from supervisor.store.rundir import RunDirLocked
from tests.helpers.cluster import instance_pid, supervisor, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
#: a render per scrape: these tests change what they read between scrapes (the rate bound has tests of its own)
EVERY_SCRAPE = 1e9


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

        metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False, renders_per_s=EVERY_SCRAPE)
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
            assert _get(s, "twt_tenant_gpu_in_use_bytes", tenant="acme") == 300_000
            assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="acme") == 1 << 20
            assert _get(s, "twt_tenant_gpu_high_water_bytes", tenant="acme") == 300_000
            assert _get(s, "twt_tenant_host_in_use_bytes", tenant="acme") == 4096
            assert _get(s, "twt_tenant_host_limit_bytes", tenant="acme") == 64 << 20
            assert _get(s, "twt_tenant_host_high_water_bytes", tenant="acme") == 4096
            assert _get(s, "twt_tenant_instances_up", tenant="acme") == 2
            assert _get(s, "twt_tenant_state", tenant="acme", state="running") == 1
            assert _get(s, "twt_tenant_quota_refusals_total", tenant="acme", resource="gpu") == 1
            assert _get(s, "twt_tenant_quota_refusals_total", tenant="acme", resource="host") == 0
            assert _get(s, "twt_tenant_quota_underflows_total", tenant="acme", resource="gpu") == 0
            assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="free") == float("inf")  # uncapped
            assert _get(s, "twt_tenant_state", tenant="free", state="failed") == 1
            # one series per state: 0 for every state the tenant is not in
            assert {dict(lb)["state"]: v for (n, lb), v in s.items()
                    if n == "twt_tenant_state" and dict(lb)["tenant"] == "acme"} == {
                **{st: 0.0 for st in TENANT_STATES}, "running": 1.0}
            assert not any(n.endswith("_created") for n, _ in s)  # disable_created_metrics()
            assert _get(s, "twt_build_info", version=build_version(), python=platform.python_version(),
                        protocol=str(PROTOCOL_VERSION)) == 1
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
            assert _get(s, "twt_tenant_gpu_in_use_bytes", tenant="acme") == 0
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
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{first.port}: the port is in use"):
            PrometheusMetrics(f"127.0.0.1:{first.port}", process_metrics=False)
    finally:
        first.close()


def test_supervisor_metrics_endpoint_has_the_tenant_series() -> None:
    port = _free_port()
    tenants = [{"name": "acme", "gpu_memory_bytes_cap": "1MiB", "memory_quota_bytes": "64MiB"}, {"name": "beta"}]
    # a render per scrape (at most 1,000 a second): each scrape below follows a change
    with supervisor(tenants, metrics_addr=f"127.0.0.1:{port}", metrics_tenant_names=True,
                    metrics_renders_per_s=1000) as sup:
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
        assert _get(s, "twt_tenant_gpu_in_use_bytes", tenant="acme") == 512 << 10
        assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="acme") == 1 << 20
        assert _get(s, "twt_tenant_gpu_high_water_bytes", tenant="acme") == 512 << 10
        assert _get(s, "twt_tenant_host_in_use_bytes", tenant="acme") == rec.bytes_in_use
        assert _get(s, "twt_tenant_host_limit_bytes", tenant="acme") == 64 << 20
        assert _get(s, "twt_tenant_quota_refusals_total", tenant="acme", resource="gpu") == 1
        assert _get(s, "twt_tenant_instances_up", tenant="acme") == 1
        assert _get(s, "twt_tenant_state", tenant="acme", state="running") == 1
        assert _get(s, "twt_tenant_gpu_limit_bytes", tenant="beta") == float("inf")
        assert _get(s, "twt_requests_total", tenant="acme", op="alloc", outcome="ok") == 1
        assert _get(s, "twt_requests_total", tenant="acme", op="alloc", outcome="gpu_memory_exhausted") == 1
        assert _get(s, "twt_requests_total", tenant="acme", op="ping", outcome="ok") == 1
        assert _get(s, "twt_request_duration_seconds_count", op="alloc") == 2
        assert _get(s, "process_resident_memory_bytes") > 0  # the supervisor's own process
        # the loop's full snapshot: wanted instances, the warm pool, the device budget; the probes
        assert _get(s, "twt_tenant_instances_wanted", tenant="acme") == 1
        assert _get(s, "twt_pool_size_workers") == sup.client.status().supervisor.pool.size
        assert ("twt_pool_workers", (("state", "idle"),)) in s
        assert _get(s, "twt_device_budget_used_bytes", device="0") >= 512 << 10
        base = f"http://127.0.0.1:{port}"
        assert _probe(base + "/healthz") == (200, "ok\n")
        wait_for(lambda: _probe(base + "/readyz") == (200, "ready\n"), what="/readyz: ready once the pool filled")
        assert not any(name == "twt_restarts_total" for name, _ in s)
        # a SIGKILLed worker: counted as an exit by signal and a restart; its GPU bytes come back
        pid = instance_pid(sup, "acme")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: (p := instance_pid(sup, "acme")) is not None and p != pid, what="acme restarted")
        s = _scrape(url)
        assert _get(s, "twt_restarts_total", tenant="acme") == 1
        assert _get(s, "twt_worker_exits_total", tenant="acme", cause="signal") == 1
        assert _get(s, "twt_tenant_gpu_in_use_bytes", tenant="acme") == 0
        assert _get(s, "twt_tenant_gpu_high_water_bytes", tenant="acme") == 512 << 10
        assert _get(s, "twt_tenant_instances_up", tenant="acme") == 1
        c.evict(None, "beta")
        s = _scrape(url)
        assert _get(s, "twt_tenants") == 1
        assert not any(dict(labels).get("tenant") == "beta" and name.startswith("twt_tenant_") for name, labels in s)
    # the supervisor stopped: so did its exporter
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def _probe(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode()


class _Clock:
    """An injectable monotonic clock: the health policy is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_health_policy_live_ready_and_stall() -> None:
    clock = _Clock()
    health = Health(stall_after_s=10.0, clock=clock)
    assert not health.live().ok and "starting" in health.live().reason
    snap = MetricsSnapshot(tenants={}, pool_idle=0, pool_size=2)
    health.observe(snap)
    assert health.live().ok and health.live().body == b"ok\n"
    assert not health.ready().ok and "starting" in health.ready().reason
    health.mark_ready()
    assert health.ready().reason == "not ready: warm pool 0/2 idle"
    health.observe(MetricsSnapshot(pool_idle=2, pool_size=2))
    assert health.ready().ok and health.ready().body == b"ready\n"
    health.observe(MetricsSnapshot(pool_idle=0, pool_size=2))  # a burst of registrations drained it: still ready
    assert health.ready().ok
    # the same object again is no sign of life: the loop did not publish anything new
    latest = MetricsSnapshot(pool_idle=1, pool_size=2)
    health.observe(latest)
    clock.now += 11
    health.observe(latest)
    live = health.live()
    assert not live.ok and live.status.startswith("503") and "nothing for 11 s" in live.reason
    assert not health.ready().ok and health.ready().reason.startswith("not ready: stalled")
    health.observe({})  # a plain {tenant: TenantGauges} mapping counts too
    assert health.live().ok
    with pytest.raises(ValueError):
        Health(stall_after_s=0)


def test_exporter_probes_pool_devices_and_wanted_instances() -> None:
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=1 << 20) as block:
        pool = {"idle": 0}

        def snapshot() -> MetricsSnapshot:  # a new object per call, as the loop builds them
            return MetricsSnapshot(
                tenants={"acme": TenantGauges(block.snapshot(), 1, "degraded", wanted=2),
                         "quiet": TenantGauges(block.snapshot(), 3, "running")},
                pool_idle=pool["idle"], pool_starting=2 - pool["idle"], pool_size=2, backend="stub",
                devices=(DeviceGauges(0, budget_limit_bytes=8 << 30, budget_used_bytes=4096, budget_refusals=3),),
            )

        metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False, renders_per_s=EVERY_SCRAPE)
        base = f"http://127.0.0.1:{metrics.port}"
        try:
            assert _probe(base + "/healthz") == (503, "starting: the supervisor loop has not published a snapshot yet\n")
            metrics.bind_source(snapshot)
            assert _probe(base + "/healthz") == (200, "ok\n")
            assert _probe(base + "/readyz")[0] == 503
            metrics.mark_ready()
            assert _probe(base + "/readyz") == (503, "not ready: warm pool 0/2 idle\n")
            pool["idle"] = 2
            assert _probe(base + "/readyz") == (200, "ready\n")
            code, body = _probe(base + "/other")
            assert code == 404 and "/healthz" in body
            s = _scrape(base + "/metrics")
            assert _get(s, "twt_tenant_instances_wanted", tenant="acme") == 2
            assert _get(s, "twt_tenant_instances_up", tenant="acme") == 1
            assert _get(s, "twt_tenant_state", tenant="acme", state="degraded") == 1
            assert _get(s, "twt_tenant_state", tenant="acme", state="running") == 0
            # a record that does not say how many instances are wanted has no such series
            assert _get(s, "twt_tenant_instances_up", tenant="quiet") == 3
            assert _get(s, "twt_tenant_state", tenant="quiet", state="running") == 1
            assert ("twt_tenant_instances_wanted", (("tenant", "quiet"),)) not in s
            assert _get(s, "twt_pool_workers", state="idle") == 2
            assert _get(s, "twt_pool_workers", state="starting") == 0
            assert _get(s, "twt_pool_size_workers") == 2
            assert _get(s, "twt_device_budget_limit_bytes", device="0") == 8 << 30
            assert _get(s, "twt_device_budget_used_bytes", device="0") == 4096
            assert _get(s, "twt_device_budget_refusals_total", device="0") == 3
            assert not any(n.endswith("_created") for n, _ in s)
        finally:
            metrics.close()


def test_second_supervisor_on_the_same_run_dir_and_port_reports_the_lock(tmp_path: Path) -> None:
    """Start-up order: the run dir is locked before the metrics port is bound."""
    import sys

    from tests.helpers import zygote

    port = _free_port()
    with supervisor([], metrics_addr=f"127.0.0.1:{port}") as sup:
        base = f"http://127.0.0.1:{port}"
        assert _probe(base + "/healthz") == (200, "ok\n")
        wait_for(lambda: _probe(base + "/readyz") == (200, "ready\n"), what="/readyz ready")
        proc = zygote.run(
            [sys.executable, "-m", "supervisor", "supervise", "--run-dir", sup.run_dir, "--backend", "stub",
             "--metrics-addr", f"127.0.0.1:{port}", "--pool-size", "0"],
            timeout=60,
        )
        assert proc.returncode == 1
        assert f"RunDirLocked: another supervisor (pid {sup.pid}) is running on {sup.run_dir}" in proc.stderr
        assert "Address already in use" not in proc.stderr and RunDirLocked.code == "run_dir_locked"
        assert _probe(base + "/healthz") == (200, "ok\n")  # the first one is untouched
        # and on another run dir, the busy port is named in one sentence
        other = zygote.run(
            [sys.executable, "-m", "supervisor", "supervise", "--run-dir", str(tmp_path / "rd"), "--backend", "stub",
             "--metrics-addr", f"127.0.0.1:{port}", "--pool-size", "0"],
            timeout=60,
        )
        assert other.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{port}: the port is in use" in other.stderr
        assert "[Errno" not in other.stderr
        assert not os.path.exists(tmp_path / "rd" / "supervisor.lock")  # released on the way out


def test_tenant_labels_are_pseudonyms_unless_names_are_chosen() -> None:
    from supervisor.observe.prometheus import NO_TENANT, TenantLabels

    hidden, shown = TenantLabels(False), TenantLabels(True)
    assert shown("acme") == "acme"
    label = hidden("acme")
    assert label.startswith("t-") and "acme" not in label and hidden("acme") == label
    assert hidden("beta") != label and TenantLabels(False)("acme") != label  # a key per supervisor
    assert hidden("") == shown(None) == NO_TENANT


def test_tenant_label_pseudonyms_survive_a_restart_and_map_back_in_status(tmp_path: Path) -> None:
    """The label key lives in the state database: after a restart a tenant has the same label (one
    series, not one per start), and `twt status --json` maps each label back to its tenant."""
    import tempfile

    from supervisor.client.launch import launch
    from supervisor.observe.metrics import LABEL_KEY_NAME, TenantLabels, tenant_label_key
    from tests.helpers.cluster import FAST

    run_dir = tempfile.mkdtemp(prefix="twt-", dir=short_temp_dir())  # short: ipc paths are limited
    labels: list[str] = []
    try:
        for _ in range(2):
            port = _free_port()
            config = {"supervisor": {**FAST, "metrics_addr": f"127.0.0.1:{port}"}, "tenant": [{"name": "acme"}]}
            with launch(config, run_dir=run_dir) as sup:
                rec = tenant(sup.client.status(), "acme")
                label = rec.metrics_label
                assert label.startswith("t-") and "acme" not in label
                samples = _scrape(f"http://127.0.0.1:{port}/metrics")
                assert _get(samples, "twt_tenant_instances_up", tenant=label) == 1
                assert not any(("tenant", "acme") in key for _, key in samples)
                labels.append(label)
        assert labels[0] == labels[1]
        # and the store: made once, read after
        from supervisor.store.state import StateStore

        with StateStore.open(str(tmp_path / "state")) as store:
            key = tenant_label_key(store)
            assert store.get_key(LABEL_KEY_NAME) == key and tenant_label_key(store) == key
        assert TenantLabels(False, key)("acme") == TenantLabels(False, key)("acme") != TenantLabels(False)("acme")
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    # names instead, when the operator chose so: the record says so too
    with supervisor([{"name": "acme"}], metrics_tenant_names=True) as sup:
        assert tenant(sup.client.status(), "acme").metrics_label == "acme"
