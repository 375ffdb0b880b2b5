"""The room rule of ``max_active`` in isolation: which tenant workers take room for an activation.

A :class:`~supervisor.lifecycle.parking.Parking` over hand-built tenants and worker handles (no
process, no socket): the answer of ``_make_room`` is a pure function of the phases and states.
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
from supervisor.runtime.tenants import InstanceSlot, ParkPhase, ParkRecord, TenantRuntime, TenantState
from supervisor.runtime.workers import WorkerHandle, WorkerState

pytestmark = pytest.mark.timeout(30)


def _gate() -> QuietGate:
    """The worker set's quiet gate, on the fakes' fixed clock (nothing out: held work runs at once)."""
    return QuietGate(Timers(lambda: 100.0), lambda: 100.0)


def _tenant(name: str, phase: ParkPhase | None) -> TenantRuntime:
    rt = TenantRuntime(TenantSpec(name), None, 1)  # type: ignore[arg-type]  # no block: never read here
    rt.slots = (InstanceSlot(0),)
    rt.park = ParkRecord(phase, 0.0) if phase is not None else None
    rt.state = TenantState.RUNNING if phase is None else TenantState.PARKED
    return rt


def _worker(rt: TenantRuntime, state: WorkerState, *, expected_exit: bool) -> WorkerHandle:
    w = WorkerHandle(f"w-{rt.tenant_id}", "t", None, 1, -1, 0.0)  # type: ignore[arg-type]  # never a process
    w.tenant, w.instance, w.state, w.expected_exit = rt.tenant_id, 0, state, expected_exit
    rt.slots[0].worker = w
    return w


def _parking(tenants: list[TenantRuntime], workers: list[WorkerHandle], **kw: Any) -> Parking:
    fake_set: Any = SimpleNamespace(workers={w.worker_id: w for w in workers}, quiet=_gate())
    return Parking(tenants={t.tenant_id: t for t in tenants}, workers=fake_set, events=EventBus(None),
                   signals=TenantSignals(stopping=lambda: False), clock=lambda: 100.0, **kw)


def test_a_stopping_worker_whose_copy_is_whole_takes_no_room_in_max_active() -> None:
    """The victim's buffers are in host memory and its worker is exiting: the activation goes on
    now, without waiting for the process to end (max_active counts workers in use)."""
    leaving, wanted = _tenant("leaving", ParkPhase.STOPPING), _tenant("wanted", ParkPhase.PARKED)
    w = _worker(leaving, WorkerState.STOPPING, expected_exit=True)
    parking = _parking([leaving, wanted], [w], max_active=1)
    assert parking._make_room(wanted) is True
    assert parking._alive() == (0, {0: 1})  # still one on the device: its context is there until it exits


def test_a_device_bound_still_waits_for_the_stopping_worker_to_exit() -> None:
    leaving, wanted = _tenant("leaving", ParkPhase.STOPPING), _tenant("wanted", ParkPhase.PARKED)
    w = _worker(leaving, WorkerState.STOPPING, expected_exit=True)
    parking = _parking([leaving, wanted], [w], device_bounds={0: 1})
    assert parking._make_room(wanted) is False  # waits for the exit (the park in progress frees it)


@pytest.mark.parametrize("phase", [ParkPhase.EXPORTING, None])
def test_a_worker_still_in_use_takes_room(phase: ParkPhase | None) -> None:
    """A park still copying (its worker holds the only copy of the buffers), or an active tenant's
    worker being stopped for another reason: the worker counts until it is gone."""
    other, wanted = _tenant("other", phase), _tenant("wanted", ParkPhase.PARKED)
    w = _worker(other, WorkerState.STOPPING if phase is None else WorkerState.READY, expected_exit=phase is None)
    parking = _parking([other, wanted], [w], max_active=1)
    assert parking._alive()[0] == 1
    assert parking._make_room(wanted) is not True


class _Untouchable:
    """A registered tenant without a worker (parked, stopped) that the loop's periodic looks must
    not read: any attribute of it fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a tenant without a worker was looked at ({name})")


def _idle(name: str, sent: list[tuple[str, str]]) -> tuple[TenantRuntime, WorkerHandle]:
    rt = TenantRuntime(TenantSpec(name, idle_timeout_s=1.0), SimpleNamespace(closed=False), 0)  # type: ignore[arg-type]
    rt.slots = (InstanceSlot(0),)
    rt.state, rt.last_request = TenantState.RUNNING, 10.0
    return rt, _worker(rt, WorkerState.READY, expected_exit=False)


def _parking_over_many(rts: list[TenantRuntime], workers: list[WorkerHandle], sent: list[tuple[str, str]],
                       **kw: Any) -> Parking:
    """A Parking whose registry holds ``rts`` and 1,000 tenants without a worker it must not read."""
    tenants: dict[str, Any] = {f"p{i:04d}": _Untouchable() for i in range(1000)}
    tenants.update({t.tenant_id: t for t in rts})

    def send_request(worker: WorkerHandle, op: str, *_: Any) -> None:
        sent.append((str(worker.tenant), op))

    fake_set: Any = SimpleNamespace(workers={w.worker_id: w for w in workers}, send_request=send_request,
                                     quiet=_gate())
    return Parking(tenants=tenants, workers=fake_set, events=EventBus(None),
                   signals=TenantSignals(stopping=lambda: False), clock=lambda: 100.0, **kw)


def test_idle_parks_and_room_look_only_at_the_tenants_a_worker_serves() -> None:
    """Housekeeping (every 50 ms) and each activation's room look at the tenants some worker
    serves, never at every registered one: at 10,000 parked tenants a pass over all of them held
    the loop - and the requests waiting on it - ~10 ms each time. The idle tenant is still parked,
    and the activation waits for its export."""
    sent: list[tuple[str, str]] = []
    idle, w = _idle("idle", sent)
    wanted = _tenant("wanted", ParkPhase.PARKED)
    parking = _parking_over_many([idle, wanted], [w], sent, max_active=1)
    parking.check_idle(100.0)
    assert idle.park is not None and idle.park.phase is ParkPhase.EXPORTING
    assert sent == [("idle", "export_buffers")]
    assert parking._make_room(wanted) is False  # waits for the export in progress, parks nothing more
    assert sent == [("idle", "export_buffers")]


def test_park_ahead_looks_only_at_the_tenants_a_worker_serves() -> None:
    sent: list[tuple[str, str]] = []
    idle, w = _idle("idle", sent)
    idle.spec = TenantSpec("idle", idle_timeout_s=3600.0)  # not idle long enough: parked ahead only
    parking = _parking_over_many([idle], [w], sent, max_active=1, park_ahead=1)
    parking._keep_room()
    assert parking.ahead_parks == 1 and sent == [("idle", "export_buffers")]


class _CountedBlock:
    """A quota block stand-in that counts the looks at it (the real one's is a syscall)."""

    def __init__(self, looks: list[str], name: str) -> None:
        self._looks, self._name = looks, name

    @property
    def closed(self) -> bool:
        self._looks.append(self._name)
        return False


@pytest.mark.parametrize("how", ["ahead", "room"])
def test_an_early_park_looks_at_the_least_recently_used_tenants_only_until_it_has_its_victim(how: str) -> None:
    """After each activation at the bound the loop picks the least recently used idle tenant to park:
    it asks whether a tenant is parkable (its quota block's look included) in that order and stops
    at the victim, instead of asking every active tenant first (~60 looks at max_active 64, ~1 ms
    of the loop each time). The victim is still the least recently used parkable one."""
    sent: list[tuple[str, str]] = []
    looks: list[str] = []
    idle: list[TenantRuntime] = []
    workers: list[WorkerHandle] = []
    for i in range(20):
        rt, w = _idle(f"t{i:02d}", sent)
        rt.block = _CountedBlock(looks, rt.tenant_id)  # type: ignore[assignment]
        rt.last_request = 50.0 - i  # t19 is the least recently used ...
        idle.append(rt)
        workers.append(w)
    idle[19].in_flight = 1  # ... but serving a request: not parkable, t18 is the victim
    idle[0].spec = TenantSpec("t00")  # no idle_timeout_s: never parked early, never looked at
    if how == "ahead":
        parking = _parking_over_many(idle, workers, sent, max_active=20, park_ahead=1)
        parking._keep_room()
    else:
        wanted = _tenant("wanted", ParkPhase.PARKED)
        parking = _parking_over_many([*idle, wanted], workers, sent, max_active=20)
        assert parking._make_room(wanted) is False  # waits for the export of its victim
    assert sent == [("t18", "export_buffers")]
    assert looks == ["t18"]


class _CountedWorkers(dict[str, WorkerHandle]):
    """The worker table, counting the passes over it."""

    passes = 0

    def values(self) -> Any:
        type(self).passes += 1
        return super().values()


def test_a_housekeeping_look_passes_over_the_workers_once() -> None:
    """Every 50 ms (and after each activation) the loop counts the room taken and the tenants a
    worker serves: one pass over the worker table for both, not one for each (three a tick before,
    with the idle parks' own). What it finds is the same: the idle tenant is parked, the busy one
    not, and the count of room agrees with a fresh look."""
    sent: list[tuple[str, str]] = []
    idle, w1 = _idle("idle", sent)
    busy, w2 = _idle("busy", sent)
    busy.last_request = 99.9  # not idle for its 1 s
    gone = WorkerHandle("w-gone", "t", None, 1, -1, 0.0)  # type: ignore[arg-type]  # its tenant evicted
    gone.tenant, gone.state = "evicted", WorkerState.STOPPING
    parking = _parking_over_many([idle, busy], [w1, w2, gone], sent, max_active=8, park_ahead=1)
    table = _CountedWorkers(parking.workers.workers)
    parking.workers.workers = table  # type: ignore[misc]
    _CountedWorkers.passes = 0
    parking.check_idle(100.0)
    assert _CountedWorkers.passes == 1
    assert sent == [("idle", "export_buffers")]
    assert parking._census() == (3, {0: 2}, [idle, busy])  # the evicted tenant's worker takes room
    assert parking._alive() == (3, {0: 2})
