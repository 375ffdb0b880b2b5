"""How many tenants a supervisor holds: as many as ``max_tenants`` / ``max_workers`` allow, and past
them a typed refusal (``CapacityExhausted``) that leaves nothing behind.

Each device's GPU-time board (shared.gpu_time) is sized from those settings at start; before, it had a
fixed 64 tenant slots and the 65th registration failed with a SegmentError after its quota block was made.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from shared.errors import CapacityExhausted
from shared.gpu_time import GpuTimeBoard
from shared.spec import TenantSpec
from supervisor.client.launch import launch
from supervisor.routing.placement import Placement
from tests.helpers.cluster import FAST, supervisor, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_more_than_sixty_four_tenants_are_registered_and_each_answers_a_ping() -> None:
    n = 70  # the board used to hold 64 tenants per device
    with launch({"supervisor": {**FAST, "log_level": "warning", "devices": [0]}, "tenant": []},
                start_method="forkserver", ready_timeout_s=300) as sup:
        caps = [sup.client.register(None, TenantSpec(f"t{i:02d}"), timeout_s=120) for i in range(n)]
        status = sup.client.status()
        assert len(status.tenants) == n and all(t.state == "running" for t in status.tenants)
        assert all(t.device == 0 for t in status.tenants)  # all on one device, one board
        assert [sup.client.ping(cap).tenant for cap in caps] == [cap.tenant_id for cap in caps]


def test_a_full_supervisor_refuses_typed_and_leaves_nothing_behind() -> None:
    with supervisor(max_tenants=2, max_workers=3) as sup:
        c = sup.client
        a = c.register(None, TenantSpec("a", instances=2))
        ours = sup.client.status().devices[0].segment.rpartition("-")[0] + "-"  # this supervisor's segments

        def segments() -> set[str]:
            return {n for n in os.listdir("/dev/shm") if n.startswith(ours)}

        before = segments()
        # max_workers: 2 of 3 instances in use
        with pytest.raises(CapacityExhausted) as info:
            c.register(None, TenantSpec("b", instances=2))
        assert info.value.fields() == {"what": "workers", "in_use": 2, "wanted": 2, "limit": 3,
                                       "setting": "max_workers", "retry_after_s": None}
        with pytest.raises(CapacityExhausted, match="max_workers"):
            c.scale(None, "a", 4)
        spec = tenant(c.status(), "a").spec
        assert spec is not None and spec.instances == 2  # nothing changed
        b = c.register(None, TenantSpec("b"))
        # max_tenants: 2 of 2
        with pytest.raises(CapacityExhausted) as info:
            c.register(None, TenantSpec("c"))
        assert info.value.fields() == {"what": "tenants", "in_use": 2, "wanted": 1, "limit": 2,
                                       "setting": "max_tenants", "retry_after_s": None}
        assert "evict a tenant or raise max_tenants" in str(info.value)
        status = c.status()
        assert sorted(t.tenant_id for t in status.tenants) == ["a", "b"]
        # no quota block, no board slot, no state row for the refused ones: one more segment (b's block)
        assert len(segments() - before) == 1
        assert c.ping(a).tenant == "a" and c.ping(b).tenant == "b"
        c.evict(None, "b")
        wait_for(lambda: c.status().tenant("b") is None, what="b evicted")
        assert c.ping(c.register(None, TenantSpec("c"))).tenant == "c"  # room again


def test_a_full_gpu_time_board_refuses_typed_and_a_refusal_changes_nothing() -> None:
    p = Placement.create("stub", ({"index": 0, "total_bytes": 1 << 30},), reserve_bytes=0,
                         gpu_time_tenants=2, gpu_time_workers=4)
    try:
        board = p.boards[0]
        assert (board.tenant_slots, board.worker_slots) == (2, 4)
        p.gpu_time_join(TenantSpec("a"), 0)
        p.gpu_time_join(TenantSpec("b", gpu_time_weight=3), 0)
        assert board.free_tenant_slots() == 0
        with pytest.raises(CapacityExhausted) as info:
            p.gpu_time_join(TenantSpec("c"), 0)
        assert info.value.what == "tenants" and info.value.limit == 2
        assert p.gpu_time_slot("c") is None and sorted(board.snapshot().tenants) == [0, 1]
        p.gpu_time_join(TenantSpec("b", gpu_time_weight=5), 0)  # a held slot is updated, never refused
        slot = p.gpu_time_slot("b")
        assert slot is not None and board.policy(slot[1]) == (5.0, None)
        p.gpu_time_leave("a")
        p.gpu_time_join(TenantSpec("c"), 0)
        assert p.gpu_time_slot("c") == (0, 0)
    finally:
        p.close()


def test_the_boards_are_sized_from_the_config() -> None:
    with supervisor(max_tenants=100, max_workers=300) as sup:
        name = sup.client.status().devices[0].gpu_time["segment"]
        assert isinstance(name, str)
        board = GpuTimeBoard.attach(name, tenant_slot=None)
        try:  # twice each: room for the slots of evicted tenants whose workers still stop
            assert (board.tenant_slots, board.worker_slots) == (200, 600)
        finally:
            board.close()


def test_a_restart_with_lower_limits_restores_every_stored_tenant_and_refuses_new_ones() -> None:
    """The limits gate registrations; restoring what the state holds is never refused (each board
    is sized for the stored tenants too)."""
    run_dir = tempfile.mkdtemp(prefix="twt-c", dir=short_temp_dir())
    try:
        settings = {**FAST, "log_level": "warning"}
        with launch({"supervisor": settings, "tenant": []}, run_dir=run_dir) as sup:
            caps = [sup.client.register(None, TenantSpec(t)) for t in ("a", "b", "c")]
        with launch({"supervisor": {**settings, "max_tenants": 1}, "tenant": []}, run_dir=run_dir) as sup:
            status = sup.client.status()
            assert sorted(t.tenant_id for t in status.tenants) == ["a", "b", "c"]
            assert all(t.state == "running" for t in status.tenants)
            assert [sup.client.ping(cap).tenant for cap in caps] == ["a", "b", "c"]
            with pytest.raises(CapacityExhausted, match="max_tenants"):
                sup.client.register(None, TenantSpec("d"))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
