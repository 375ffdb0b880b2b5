"""``max_active`` and the adaptive warm pool: an activation past the bound parks the least recently
used idle tenant early, or is refused with ``CapacityExhausted`` and ``retry_after_s``; the pool
grows with the demand up to ``pool_max``.

Real supervisors on the stub backend; every wait is for an event or a state, never a duration.
"""

from __future__ import annotations


import pytest

from shared.errors import CapacityExhausted
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.lifecycle.parking import RETRY_AFTER_UNKNOWN_S
from tests.helpers.cluster import supervisor, tenant, wait_for
from tests.helpers.events import event_cursor, wait_event

pytestmark = pytest.mark.timeout(180)

IDLE = 0.3
#: an idle time no test reaches: the tenant parks only when room is wanted
LONG = 3600.0






def _park(c: SupervisorClient, tid: str, then_idle_s: float | None) -> None:
    """Park ``tid`` now (a tiny idle time), then give it ``then_idle_s`` (it stays parked)."""
    mark = event_cursor(c)
    c.set_quota(None, tid, idle_timeout_s=IDLE)
    wait_event(c, "park", tid, mark)
    c.set_quota(None, tid, idle_timeout_s=then_idle_s)


def _alive(c: SupervisorClient) -> int:
    return sum(len(t.pids) for t in c.status().tenants)


def test_past_max_active_the_least_recently_used_idle_tenant_parks_early() -> None:
    with supervisor([{"name": "old"}, {"name": "recent"}, {"name": "wanted"}], max_active=2) as sup:
        c = sup.client
        caps = {t: c.tenant_capability(None, t) for t in ("old", "recent", "wanted")}
        buf = c.alloc(caps["old"], 4096)
        c.write(caps["old"], buf, bytes(range(256)) * 16)
        for tid in ("old", "recent", "wanted"):
            _park(c, tid, LONG)
        c.ping(caps["old"])  # activated: 1 alive
        c.ping(caps["recent"])  # activated: 2 alive, "old" the least recently used
        assert tenant(c.status(), "old").state == "running" and tenant(c.status(), "recent").state == "running"
        mark = event_cursor(c)
        assert c.ping(caps["wanted"]).tenant == "wanted"  # waits for "old" to park, then is served
        early = wait_event(c, "park", "old", mark)
        assert early["early"] is True
        # its activation began only once that park made room: the wait is its own figure, outside
        # activate_ms (a bench reading activate_ms alone missed it)
        assert wait_event(c, "activate", "wanted", mark)["waited_ms"] > 0
        assert tenant(c.status(), "old").state == "parked"
        assert tenant(c.status(), "recent").state == "running"
        wait_for(lambda: _alive(c) <= 2, what="at most max_active workers alive")
        # the early-parked tenant's buffers come back whole on its next request (parking "recent")
        assert c.read(caps["old"], buf, 4096) == bytes(range(256)) * 16


def test_park_ahead_keeps_a_place_free_so_the_next_activation_waits_for_no_park() -> None:
    """With ``park_ahead = 1`` under ``max_active = 3``, the activation that takes the last place is
    followed by a park of the least recently used idle tenant; the next parked tenant's activation
    then finds a free place and parks nobody."""
    names = ("old", "mid", "new", "next")
    with supervisor([{"name": t} for t in names], max_active=3, park_ahead=1) as sup:
        c = sup.client
        caps = {t: c.tenant_capability(None, t) for t in names}
        for tid in names:
            _park(c, tid, LONG)
        c.ping(caps["old"])
        c.ping(caps["mid"])  # 2 alive: one place free, nothing parked ahead
        assert tenant(c.status(), "old").state == "running"
        mark = event_cursor(c)
        c.ping(caps["new"])  # the last place: "old", the least recently used, is parked ahead
        ahead = wait_event(c, "park", "old", mark)
        assert ahead["early"] is True and ahead["ahead"] is True
        assert tenant(c.status(), "mid").state == "running" and tenant(c.status(), "new").state == "running"
        mark = event_cursor(c)
        c.ping(caps["next"])  # a free place: activated without a park made for it ...
        assert wait_event(c, "activate", "next", mark)["waited_ms"] == 0.0  # it began at once
        wait_event(c, "park", "mid", mark)  # ... and the place it took is made again ahead
        parks = c.events_page(None, mark, kinds=["park"])["events"]
        assert isinstance(parks, list) and parks
        # every park since was one ahead of an activation, none one an activation waited for
        assert all(e["ahead"] is True for e in parks if isinstance(e, dict)), parks
        wait_for(lambda: _alive(c) <= 3, what="at most max_active workers alive")


def test_an_activation_with_no_room_and_nothing_parkable_is_refused_with_retry_after() -> None:
    with supervisor([{"name": "sleeper"}, {"name": "busy"}], max_active=1) as sup:
        c = sup.client
        sleeper = c.tenant_capability(None, "sleeper")
        _park(c, "sleeper", None)  # parked, and never parks by itself again
        mark = event_cursor(c)
        with pytest.raises(CapacityExhausted) as info:
            c.ping(sleeper)  # "busy" holds the one worker and has no idle_timeout_s: it cannot park
        err = info.value
        assert err.setting == "max_active" and err.limit == 1 and err.in_use == 1 and err.wanted == 1
        assert err.retry_after_s == RETRY_AFTER_UNKNOWN_S  # no active tenant parks by itself
        wait_event(c, "activation_refused", "sleeper", mark)
        assert tenant(c.status(), "sleeper").state == "parked"
        # once "busy" can park, the room is made and the request served
        c.set_quota(None, "busy", idle_timeout_s=LONG)
        assert c.ping(sleeper).tenant == "sleeper"
        assert tenant(c.status(), "busy").state == "parked"
        assert tenant(c.status(), "sleeper").state == "running"


def test_only_workers_alive_count_against_max_active_not_registrations_or_the_pool() -> None:
    """Tenants registered without a worker (instances = 0), parked tenants and warm pool workers
    take no room: with one tenant worker allowed, a parked tenant is activated at once beside
    forty such registrations and two idle pool workers - no early park, no refusal."""
    with supervisor([{"name": "sleeper"}, {"name": "napper"}], max_active=1, pool_size=2) as sup:
        c = sup.client
        for i in range(40):
            c.register(None, TenantSpec(f"idle{i:02d}", instances=0))
        _park(c, "napper", LONG)
        _park(c, "sleeper", LONG)
        wait_for(lambda: _alive(c) == 0, what="no tenant worker alive")
        wait_for(lambda: len(c.status().supervisor.pool.pids) == 2, what="two warm pool workers")
        c.register(None, TenantSpec("late", instances=0))  # registered with max_active reached by nobody
        mark = event_cursor(c)
        assert c.ping(c.tenant_capability(None, "sleeper")).tenant == "sleeper"
        wait_event(c, "activate", "sleeper", mark)
        refused = c.events_page(None, mark, kinds=["activation_refused"])["events"]
        early = [e for e in c.events_page(None, mark, kinds=["park"])["events"]
                 if isinstance(e, dict) and e.get("early")]
        assert refused == [] and early == []
        assert tenant(c.status(), "napper").state == "parked"  # not parked early: it already was
        assert _alive(c) == 1 and c.status().summary is not None and c.status().summary.tenants == 43
        # now the one worker is taken: the next activation makes room (sleeper, the least recently
        # used idle tenant, parks early for napper)
        mark = event_cursor(c)
        assert c.ping(c.tenant_capability(None, "napper")).tenant == "napper"
        assert wait_event(c, "park", "sleeper", mark)["early"] is True
        assert _alive(c) == 1


def test_max_active_and_pool_max_are_validated() -> None:
    from shared.config import SupervisorConfig

    with pytest.raises(ValueError, match="max_active"):
        SupervisorConfig(max_active=0)
    with pytest.raises(ValueError, match="pool_max must be at least pool_size"):
        SupervisorConfig(pool_size=4, pool_max=2)
    assert SupervisorConfig().max_active is None and SupervisorConfig().pool_max is None
    with pytest.raises(ValueError, match="park_ahead must be below max_active"):
        SupervisorConfig(max_active=4, park_ahead=4)
    with pytest.raises(ValueError, match="park_ahead"):
        SupervisorConfig(max_active=4, park_ahead=-1)
    assert SupervisorConfig(max_active=4, park_ahead=3).park_ahead == 3


def test_the_warm_pool_grows_with_the_demand_up_to_pool_max() -> None:
    names = [f"t{i}" for i in range(3)]
    with supervisor([{"name": n} for n in names], pool_size=0, pool_max=2) as sup:
        c = sup.client
        # three instances started: recent demand keeps a worker warm (pool_size alone: none)
        pool = wait_for(lambda: (p := c.status().supervisor.pool).idle >= 1 and p, what="a warm pool worker")
        assert 1 <= pool.size <= 2 and pool.idle + pool.starting <= 2
        # activations take from it; it refills, never past pool_max
        for n in names:
            _park(c, n, None)
        for n in names:
            assert c.ping(c.tenant_capability(None, n)).tenant == n
        wait_for(lambda: c.status().supervisor.pool.idle >= 1, what="the pool refilled")
        pool = c.status().supervisor.pool
        assert 1 <= pool.size <= 2 and pool.idle + pool.starting <= 2


def test_a_waiting_activation_is_refused_when_the_park_making_room_is_refused() -> None:
    tenants = [{"name": "sleeper"}, {"name": "tight", "memory_quota_bytes": "1MiB"}]
    with supervisor(tenants, max_active=1) as sup:
        c = sup.client
        sleeper = c.tenant_capability(None, "sleeper")
        tight = c.tenant_capability(None, "tight")
        h = c.alloc(tight, 2 << 20)  # GPU bytes whose host copy does not fit the 1 MiB memory quota
        _park(c, "sleeper", None)
        c.set_quota(None, "tight", idle_timeout_s=LONG)
        mark = event_cursor(c)
        with pytest.raises(CapacityExhausted) as info:
            c.ping(sleeper)  # waits for "tight" to park; its park is refused: answered, not queued on
        assert info.value.setting == "max_active"
        assert wait_event(c, "park_refused", "tight", mark)["error"]["code"] == "memory_exhausted"
        assert tenant(c.status(), "tight").state == "running" and c.buffers(tight) == {h: 2 << 20}
        assert tenant(c.status(), "sleeper").state == "parked"


def test_each_cuda_device_is_bounded_by_its_budget_over_one_context() -> None:
    from types import SimpleNamespace
    from typing import cast

    from shared.device_budget import DeviceBudget
    from supervisor.routing.placement import Placement, _Device

    def dev(index: int, limit: int, context: int | None) -> _Device:
        budget = cast(DeviceBudget, SimpleNamespace(limit_bytes=limit))
        return _Device(index, f"gpu{index}", limit, limit, budget, context)

    gib, mib = 1 << 30, 1 << 20
    placement = Placement("cuda", [dev(0, 80 * gib, 512 * mib), dev(1, 100 * mib, 512 * mib), dev(2, gib, None)])
    # 160 contexts fit device 0; device 1 cannot hold one but still gets one worker; no cost known: no bound
    assert placement.context_bounds() == {0: 160, 1: 1}
