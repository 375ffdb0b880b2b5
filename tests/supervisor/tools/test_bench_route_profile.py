"""``twt bench route --profile``'s probes: each stage gets its own time, not its callees', and
the functions are given back as they were."""

from __future__ import annotations

import threading
import time

import pytest

from supervisor.admission.frontend import Frontend
from supervisor.tools.bench import route_profile

pytestmark = pytest.mark.timeout(60)


def _spin(cpu_ns: int) -> None:
    end = time.thread_time_ns() + cpu_ns
    while time.thread_time_ns() < end:
        pass


def test_a_stage_is_charged_its_own_time_not_its_callees() -> None:
    probes = route_profile._Probes()
    inner = probes.wrap(lambda: _spin(20_000_000), "inner")
    outer = probes.wrap(lambda: inner(), "outer")
    probes.thread = None  # another thread's calls are not counted
    outer()
    assert not probes.calls
    probes.thread = threading.get_ident()
    outer()
    outer()
    assert probes.calls == {"inner": 2, "outer": 2}
    assert probes.ns["inner"] >= 40_000_000
    assert probes.ns["outer"] < probes.ns["inner"] / 4  # the spin is the inner stage's alone


def test_the_probes_are_put_back() -> None:
    before = {(owner, name): owner.__dict__[name] for owner, name, _ in route_profile.STAGES}
    probes = route_profile._Probes()
    with probes.installed():
        assert Frontend.__dict__["decode"] is not before[(Frontend, "decode")]
    assert {(owner, name): owner.__dict__[name] for owner, name, _ in route_profile.STAGES} == before
    assert route_profile.probe_cost_ns(1000) >= 0.0
