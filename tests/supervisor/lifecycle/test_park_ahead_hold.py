"""The park ahead that an activation asks for waits while the woken tenant is served (fake workers,
fake clock): its export and its worker's exit would run across the woken tenant's first requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.lifecycle import parking
from supervisor.store.state import StateStore
from tests.supervisor.lifecycle.test_lifecycle_inprocess import Harness

pytestmark = pytest.mark.timeout(120)


def _step(h: Harness, seconds: float) -> None:
    """Move the clock by ``seconds`` and handle what is due then (timers, housekeeping)."""
    h.clock.advance(seconds)
    h.sup.turn(0.0)
    h.settle(quiet_turns=2)


def _harness(tmp: Path, *, max_active: int) -> Harness:
    """Two running idle tenants (``old``, ``mid``) and ``sleepy`` stored parked, under
    ``max_active`` with two places kept free ahead."""
    state = str(tmp / "state")
    first = Harness(tmp / "first", state_dir=state)
    try:
        for name in ("old", "mid", "sleepy"):
            first.register(name, instances=1, idle_timeout_s=3600.0)
    finally:
        first.close()
    store = StateStore.open(state)
    try:
        store.set_parked_many(["sleepy"], True)
    finally:
        store.close()
    h = Harness(tmp / "second", state_dir=state, max_active=max_active, park_ahead=2)
    h.settle()
    assert h.tenant("sleepy")["state"] == "parked"
    h.until(lambda: all(h.tenant(n)["state"] == "running" for n in ("old", "mid")))
    return h


def _exports(h: Harness) -> list[str]:
    return [w.handle.tenant or "" for w in h.spawner.alive() if "export_buffers" in w.received]


def test_the_park_ahead_of_an_activation_waits_until_the_woken_tenant_is_quiet(tmp_path: Path) -> None:
    h = _harness(tmp_path, max_active=4)
    try:
        cap = h.call("capability", {"tenant": "sleepy"})["capability"]
        h.call("ping", {}, cap)  # wakes it: 3 of 4 places taken, one still free for the next one
        assert h.tenant("sleepy")["state"] == "running"
        assert _exports(h) == [], "no park ahead while the woken tenant is served"
        for _ in range(3):  # its next requests come within the quiet time
            h.call("ping", {}, cap)
            _step(h, parking.ROOM_HOLD_QUIET_S * 0.9)
            assert _exports(h) == []
        _step(h, parking.ROOM_HOLD_QUIET_S)  # a quiet time without a request: the park ahead begins
        _step(h, parking.ROOM_HOLD_QUIET_S)
        h.until(lambda: bool(_exports(h)))
        assert _exports(h) in (["old"], ["mid"])
    finally:
        h.close()


def test_an_activation_that_takes_the_last_place_parks_ahead_at_once(tmp_path: Path) -> None:
    """No place left for the next activation: it would wait for an early park instead."""
    h = _harness(tmp_path, max_active=3)
    try:
        cap = h.call("capability", {"tenant": "sleepy"})["capability"]
        h.call("ping", {}, cap)
        # the clock does not move: no tick, no quiet time's end; two places short of park_ahead
        h.until(lambda: len(_exports(h)) == 2)
        assert sorted(_exports(h)) == ["mid", "old"]
    finally:
        h.close()
