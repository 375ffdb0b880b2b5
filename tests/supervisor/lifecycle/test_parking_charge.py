"""The host copy's charge and the requests that wake a tenant: the charge is gone before any of
them is sent (a tenant is never charged twice while it serves: a spurious quota refusal could
follow), whether the activation completes or a request cancels a park still copying.

A :class:`~supervisor.lifecycle.parking.Parking` over a hand-built tenant whose quota block
records what is charged; ``on_active`` (where the waiting requests are sent) records what the
block held when it was called.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from shared.spec import TenantSpec
from supervisor.lifecycle.parking import Parking
from supervisor.lifecycle.quiet import QuietGate
from supervisor.lifecycle.signals import TenantSignals
from supervisor.observe.events import EventBus
from supervisor.runtime.loop import Timers
from supervisor.runtime.tenants import InstanceSlot, ParkedBuffer, ParkPhase, ParkRecord, TenantRuntime

pytestmark = pytest.mark.timeout(30)


def _gate() -> QuietGate:
    """The worker set's quiet gate, on the fakes' fixed clock (nothing out: held work runs at once)."""
    return QuietGate(Timers(lambda: 100.0), lambda: 100.0)

COPY = 256 << 10


class _Block:
    """The supervisor's share of a tenant's quota block, as parking uses it."""

    def __init__(self, bytes_in_use: int) -> None:
        self.bytes_in_use = bytes_in_use
        self.closed = False

    def release_bytes(self, n: int) -> None:
        self.bytes_in_use -= n


def _parked(phase: ParkPhase) -> tuple[Parking, TenantRuntime, ParkRecord, list[int]]:
    block = _Block(COPY)  # the host copy's charge, nothing else
    rt = TenantRuntime(TenantSpec("keeper"), block, 1)  # type: ignore[arg-type]  # the block's parking side
    rt.slots = (InstanceSlot(0),)
    rec = ParkRecord(phase, 0.0)
    rec.charged = COPY
    rec.buffers[0] = [ParkedBuffer(1, bytearray(COPY))]
    rt.park = rec
    fake_set: Any = SimpleNamespace(workers={}, quiet=_gate())
    parking = Parking(tenants={"keeper": rt}, workers=fake_set, events=EventBus(None),
                      signals=TenantSignals(stopping=lambda: False), clock=lambda: 100.0)
    seen: list[int] = []
    parking.on_active = lambda r: seen.append(block.bytes_in_use)
    return parking, rt, rec, seen


def test_an_activation_releases_the_host_copy_before_the_waiting_requests_are_sent() -> None:
    parking, rt, rec, seen = _parked(ParkPhase.ACTIVATING)
    parking._activated(rt, rec)
    assert seen == [0] and rec.charged == 0 and rt.park is None


def test_a_request_that_cancels_a_park_is_sent_after_the_copy_charge_is_released() -> None:
    parking, rt, rec, seen = _parked(ParkPhase.EXPORTING)
    parking.wake(rt)  # a request came while the buffers were being copied out
    assert seen == [0] and rec.charged == 0 and rt.park is None and not rec.buffers
