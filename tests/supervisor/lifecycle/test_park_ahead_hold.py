"""The park ahead that an activation asks for: at once when the activation took the last place (fake
workers, fake clock). That it otherwise waits while a woken request is out: test_quiet_gate."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.lifecycle import quiet
from supervisor.store.state import StateStore
from tests.supervisor.lifecycle.test_lifecycle_inprocess import Harness

pytestmark = pytest.mark.timeout(120)


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


def test_an_activation_that_takes_the_last_place_parks_ahead_at_once(tmp_path: Path) -> None:
    """No place left for the next activation: it would wait for an early park instead."""
    h = _harness(tmp_path, max_active=3)
    try:
        cap = h.call("capability", {"tenant": "sleepy"})["capability"]
        h.call("ping", {}, cap)
        # the clock does not move: no tick; the place owed for the next activation is made at once
        h.until(lambda: len(_exports(h)) == 1)
        assert len(_exports(h)) == 1, "the rest of park_ahead waits while sleepy may send its next request"
        # that park's export answered before the clock moves (a fake worker's manifest is not usable:
        # the park is abandoned and its tenant's idle clock restarts now). Answered after the move,
        # it made that tenant the most recently used, and the held look parked sleepy in its place
        assert h.sup.parts is not None
        parking = h.sup.parts.parking
        h.until(lambda: all(parking.tenants[n].park is None for n in ("old", "mid")))
        h.clock.advance(quiet.FOLLOW_S * 1.2)  # it sent none
        h.sup.turn(0.0)
        h.until(lambda: len(_exports(h)) == 2)
        assert sorted(_exports(h)) == ["mid", "old"]
    finally:
        h.close()
