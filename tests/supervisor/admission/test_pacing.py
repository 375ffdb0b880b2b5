"""The TCP frontend's pacer (supervisor.admission.pacing): pure policy with a hand-driven clock,
and the admission defaults that scale with the host's CPUs (shared.config)."""

from __future__ import annotations

import pytest

import shared.config
from shared.config import BYTES_PER_S_PER_CPU, REQUESTS_PER_S_PER_CPU, SupervisorConfig, load_config
from supervisor.admission.pacing import MAX_PAUSE_S, PAUSE_BURST, Pacer

pytestmark = pytest.mark.timeout(30)


def test_drops_within_the_burst_never_pause_and_past_it_the_pause_pays_the_excess_back() -> None:
    p = Pacer(drops_per_s=1000.0, burst=64.0, max_pause_s=0.005)
    assert p.dropped(64, 0.0) == 0.0  # the burst itself
    assert p.dropped(2, 0.0) == pytest.approx(0.002)  # 2 past it, paid back at 1000 a second
    assert p.dropped(1, 0.002) == pytest.approx(0.001)  # paid back meanwhile: 1 past it again
    assert p.dropped(0, 0.002) == 0.0  # nothing dropped: nothing to decide


def test_the_debt_is_paid_back_over_time() -> None:
    p = Pacer(drops_per_s=100.0, burst=10.0, max_pause_s=1.0)
    assert p.dropped(15, 0.0) == pytest.approx(0.05)
    assert p.dropped(1, 10.0) == 0.0  # 10 s later the 15 are long paid: 1 owed, within the burst


def test_a_pause_never_grows_past_the_longest_however_long_the_flood() -> None:
    p = Pacer(drops_per_s=1000.0, burst=64.0, max_pause_s=0.005)
    now = 0.0
    assert p.dropped(64, now) == 0.0
    for _ in range(10_000):
        pause = p.dropped(16, now)
        assert 0.0 < pause <= 0.005
        now += pause  # the caller reads again once the pause is over
    # the excess past one pause was forgiven: after one longest pause and the burst's worth, clear
    assert p.dropped(1, now + 0.005 + 64 / 1000) == 0.0


def test_pauses_are_counted_as_the_caller_makes_them() -> None:
    p = Pacer(drops_per_s=1000.0)
    assert (p.pauses, p.paused_s) == (0, 0.0)
    pause = p.dropped(int(PAUSE_BURST) + 100, 0.0)
    assert pause == MAX_PAUSE_S
    p.paused(pause)
    p.dropped(5, 0.001)  # dropped while paused: more debt, no second pause counted
    assert (p.pauses, p.paused_s) == (1, MAX_PAUSE_S)


def test_zero_drops_per_second_never_pauses() -> None:
    p = Pacer(drops_per_s=0.0)
    assert p.dropped(1_000_000, 0.0) == 0.0


def test_tcp_drops_per_s_is_a_setting_of_its_own() -> None:
    assert SupervisorConfig().tcp_drops_per_s == 1000.0
    assert load_config(environ={"TWT_TCP_DROPS_PER_S": "0"}).tcp_drops_per_s == 0.0
    assert load_config(overrides={"tcp_drops_per_s": 250}).tcp_drops_per_s == 250.0
    for bad in (-1, float("inf"), "many", True):
        with pytest.raises(ValueError, match="tcp_drops_per_s"):
            SupervisorConfig(tcp_drops_per_s=bad)  # type: ignore[arg-type]


def test_the_admission_defaults_are_a_share_of_the_cpus_the_supervisor_may_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared.config, "usable_cpus", lambda: 2)
    two = SupervisorConfig()
    assert (two.tenant_requests_per_s, two.tenant_bytes_per_s) == (8000.0, 256 << 20)
    monkeypatch.setattr(shared.config, "usable_cpus", lambda: 16)
    sixteen = SupervisorConfig()
    assert (sixteen.tenant_requests_per_s, sixteen.tenant_bytes_per_s) == (
        16 * REQUESTS_PER_S_PER_CPU, 16 * BYTES_PER_S_PER_CPU)
    # a setting wins over the share, as before
    assert SupervisorConfig(tenant_requests_per_s=5.0, tenant_bytes_per_s=1 << 20).tenant_requests_per_s == 5.0
    assert load_config(environ={"TWT_TENANT_BYTES_PER_S": "1GiB"}).tenant_bytes_per_s == 1 << 30


def test_usable_cpus_is_this_process_affinity() -> None:
    import os

    assert shared.config.usable_cpus() == len(os.sched_getaffinity(0)) >= 1
