"""The GPU-time series of the Prometheus exporter, the share window of status, reload of the policy."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.quota import QuotaBlock
from supervisor.observe.gpu_share import GpuShareWindow
from supervisor.observe.metrics import TenantGauges
from supervisor.observe.prometheus import PrometheusMetrics
from supervisor.lifecycle.reload import LIVE_FIELDS, SpecChange
from shared.spec import TenantSpec

pytestmark = pytest.mark.timeout(60)


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_gpu_time_counter_wait_histogram_throttles_and_policy() -> None:
    with QuotaBlock.create("acme") as block:
        block.charge_gpu_time(1_500_000_000, ops=3)
        for wait_ns in (0, 300_000, 3_000_000, 7_000_000_000):
            block.observe_gpu_wait(wait_ns)
        block.count_gpu_throttled()
        metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False)
        try:
            metrics.bind_source(lambda: {"acme": TenantGauges(block.snapshot(), 1, "running",
                                                              gpu_time_weight=7.0, gpu_time_cap=None)})
            s = _scrape(metrics.url)
            who = (("tenant", "acme"),)
            assert s[("twt_tenant_gpu_time_seconds_total", who)] == 1.5
            assert s[("twt_tenant_gpu_throttled_total", who)] == 1
            assert s[("twt_tenant_gpu_wait_seconds_count", who)] == 4
            assert s[("twt_tenant_gpu_wait_seconds_sum", who)] == pytest.approx(7.0033)
            bucket = "twt_tenant_gpu_wait_seconds_bucket"
            assert s[(bucket, (("le", "0.0005"), *who))] == 2  # 0 and 0.3 ms
            assert s[(bucket, (("le", "0.005"), *who))] == 3
            assert s[(bucket, (("le", "5.0"), *who))] == 3
            assert s[(bucket, (("le", "+Inf"), *who))] == 4
            assert s[("twt_tenant_gpu_time_weight", who)] == 7.0
            assert s[("twt_tenant_gpu_time_cap", who)] == float("inf")
        finally:
            metrics.close()


def test_share_window() -> None:
    w = GpuShareWindow(window_s=10.0)
    assert w.share("a", 100.0, 0) is None  # one sample: no rate yet
    assert w.share("a", 101.0, 700_000_000) == pytest.approx(0.7)
    for t in range(2, 30):
        w.observe("a", 100.0 + t, 700_000_000 + (t - 1) * 250_000_000)
    # only the last ~10 s count: 0.25 device-s per s there
    assert w.share("a", 130.0, 700_000_000 + 29 * 250_000_000) == pytest.approx(0.25, abs=0.01)
    w.forget("a")
    assert w.share("a", 131.0, 5) is None


def test_reload_applies_the_policy_live_without_a_restart() -> None:
    change = SpecChange(TenantSpec("a"), TenantSpec("a").with_gpu_time(weight=3, cap=0.5))
    assert change.fields == ("gpu_time_weight", "gpu_time_cap")
    assert not change.needs_restart and not change.needs_placement
    assert {"gpu_time_weight", "gpu_time_cap"} <= LIVE_FIELDS


def test_bench_share_helpers() -> None:
    from supervisor.tools.bench.share import Tenant, _jain, one_s_windows

    t = Tenant("a", None, "", None)  # type: ignore[arg-type]
    t.runs += [(0.0, 2.0, 100), (2.0, 3.0, 10)]
    assert t.work_between(0.0, 1.0) == pytest.approx(50)  # a run's count spread over its span
    assert t.work_between(1.5, 2.5) == pytest.approx(25 + 5)
    assert one_s_windows(10.0, 12.5) == [(10.0, 11.0), (11.0, 12.0)]
    assert _jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert _jain([1.0, 0.0]) == pytest.approx(0.5)
