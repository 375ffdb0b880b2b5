"""What a tenant without a worker holds: no shared-memory segment, no descriptor, no mapping - and
its quota counters and GPU time exactly, across park/activate round trips and kill -9 in each phase.

Real supervisors on the stub backend; every wait is for an event or a state.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator

import pytest

from shared.errors import GpuMemoryExhausted
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.client.launch import launch
from tests.helpers.cluster import FAST, supervisor, tenant, wait_for
from tests.helpers.tmp import short_temp_dir
from tests.helpers.events import event_cursor, pattern, wait_event
from tests.supervisor.lifecycle.test_parking import _park_soon, _ready_pid

pytestmark = pytest.mark.timeout(180)

#: a tenant quota segment's name (``twt-<namespace>-<per-start hex>-<slot>``): devices' and GPU-time
#: boards' end in dev<i> / gt<i>, regions' in r<hex>
_QUOTA_SEGMENT = re.compile(r"twt-ns[0-9a-f]{12}-[0-9a-f]+-[0-9]+\Z")


def _held(pid: int) -> set[str]:
    """The tenant quota segments process ``pid`` holds: by an open descriptor or a mapping."""
    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        names.add(os.path.basename(target))
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
            names.add(os.path.basename(path.removesuffix(" (deleted)")))
    return {n for n in names if _QUOTA_SEGMENT.match(n)}


def _in_dev_shm(prefix: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix) and _QUOTA_SEGMENT.match(n)}


def _prefix(segment: str) -> str:
    return segment.rsplit("-", 1)[0] + "-"


def test_parked_and_never_started_tenants_hold_no_segment_descriptor_or_mapping() -> None:
    n_parked = 5
    tenants = [{"name": f"p{i}"} for i in range(n_parked)] + [{"name": "busy"}, {"name": "idle0", "instances": 0}]
    with supervisor(tenants) as sup:
        c = sup.client
        busy_seg = tenant(c.status(), "busy").quota.name
        assert busy_seg, "an active tenant has its segment"
        prefix = _prefix(busy_seg)
        # a registered tenant with no instance never had a segment
        assert tenant(c.status(), "idle0").quota.name == ""
        old: dict[str, str] = {}
        for i in range(n_parked):
            cap = c.tenant_capability(None, f"p{i}")
            c.write(cap, c.alloc(cap, 4096), pattern(4096, i))
            old[f"p{i}"] = tenant(c.status(), f"p{i}").quota.name
        assert _held(sup.pid) >= set(old.values()) | {busy_seg}
        for i in range(n_parked):
            _park_soon(c, f"p{i}")
        # each park ends with its last worker's death, and the segment goes right after it
        wait_for(lambda: not (_held(sup.pid) & set(old.values())), what="the parked tenants' segments released")
        for i in range(n_parked):
            assert tenant(c.status(), f"p{i}").state == "parked"
            assert tenant(c.status(), f"p{i}").quota.name == ""
        # the supervisor holds exactly the segments of tenants with a worker; /dev/shm has no more
        assert _held(sup.pid) == {busy_seg}
        assert _in_dev_shm(prefix) == {busy_seg}
        # registered now, never started: nothing either
        c.register(None, TenantSpec("late", instances=0))
        assert tenant(c.status(), "late").quota.name == ""
        assert _held(sup.pid) == {busy_seg} and _in_dev_shm(prefix) == {busy_seg}
        # activation makes a fresh segment before the first request is served
        cap = c.tenant_capability(None, "p0")
        c.set_quota(None, "p0", idle_timeout_s=None)  # stays active once woken
        assert c.read(cap, next(iter(c.buffers(cap))), 4096) == pattern(4096, 0)
        seg = tenant(c.status(), "p0").quota.name
        assert seg and seg != old["p0"]
        assert _held(sup.pid) == {busy_seg, seg} and _in_dev_shm(prefix) == {busy_seg, seg}


def test_quota_counters_and_gpu_time_are_equal_across_park_and_activate_round_trips() -> None:
    with supervisor([{"name": "keeper", "gpu_memory_bytes_cap": "1MiB"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "keeper")
        h = c.alloc(cap, 256 << 10)
        c.write(cap, h, pattern(256 << 10, 4))
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(cap, 2 << 20)  # a refusal counted in the block
        c.free(cap, c.alloc(cap, 512 << 10))  # a high-water mark above what is held
        before = c.quota(cap)
        assert before.gpu_refusals == 1 and before.gpu_high_water == (256 + 512) << 10
        for round_trip in range(3):
            _park_soon(c, "keeper")
            wait_for(lambda: tenant(c.status(), "keeper").quota.name == "", what="the segment released")
            parked = c.quota(cap)
            assert parked.name == ""
            # the buffer moved to the supervisor's host copy; every mark and count is the same
            assert parked.gpu_bytes_in_use == 0 and parked.bytes_in_use == before.bytes_in_use + (256 << 10)
            for key in ("gpu_high_water", "gpu_refusals", "cpu_refusals", "gpu_underflows", "cpu_underflows",
                        "gpu_time_ns", "gpu_ops", "gpu_waits", "gpu_wait_ns", "gpu_wait_bins", "generation",
                        "memory_quota_bytes", "gpu_memory_bytes_cap"):
                assert getattr(parked, key) == getattr(before, key), (round_trip, key)
            # Active once woken, until the next round parks it: with the tiny idle time left on,
            # the next park could begin before the snapshot below, and a park charges the host
            # copy while the workers still hold the GPU bytes (by design: no request is served
            # then), which is not the state this round means.
            c.set_quota(None, "keeper", idle_timeout_s=None)
            mark = event_cursor(c)
            with SupervisorClient(sup.run_dir, regions=False) as own:
                assert own.read(cap, h, 256 << 10) == pattern(256 << 10, 4)
            wait_event(c, "activate", "keeper", mark)
            # the read was served: the host copy's charge went before it was sent, so the bytes
            # are in one place (never charged twice while serving), every mark and count the
            # same; GPU time only ever grows
            after = c.quota(cap)
            assert tenant(c.status(), "keeper").state == "running"
            assert after.bytes_in_use == before.bytes_in_use and after.gpu_bytes_in_use == before.gpu_bytes_in_use
            for key in ("gpu_high_water", "gpu_refusals", "cpu_refusals", "gpu_underflows", "cpu_underflows",
                        "generation", "memory_quota_bytes", "gpu_memory_bytes_cap"):
                assert getattr(after, key) == getattr(before, key), (round_trip, key)
            assert after.gpu_time_ns >= before.gpu_time_ns and after.gpu_ops >= before.gpu_ops


def test_kill_9_while_activating_keeps_every_counter() -> None:
    """The worker bound for an activation dies (its segment was made from the record): the record's
    counters are in the new segment and stay there through the restart; nothing is charged twice."""
    with supervisor([{"name": "phoenix", "gpu_memory_bytes_cap": "4MiB"}], pool_size=1) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "phoenix")
        n = 1 << 20
        h = c.alloc(cap, n)
        c.write(cap, h, pattern(n, 7))
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(cap, 8 << 20)
        _park_soon(c, "phoenix")
        wait_for(lambda: tenant(c.status(), "phoenix").quota.name == "", what="the segment released")
        parked = c.quota(cap)
        pool = wait_for(lambda: c.status().supervisor.pool.pids, what="a warm pool worker")
        victim = pool[0]
        os.kill(victim, signal.SIGSTOP)  # bound for the activation but cannot finish it
        got: list[bytes] = []
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                with SupervisorClient(sup.run_dir, regions=False) as own:
                    got.append(own.read(cap, h, n))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        t = threading.Thread(target=reader)
        mark = event_cursor(c)
        t.start()
        try:
            wait_for(lambda: tenant(c.status(), "phoenix").instances[0].pid == victim,
                     what="the pool worker taken for the activation")
            mid = c.quota(cap)  # the segment exists now, made from the record
            assert mid.name and mid.gpu_refusals == parked.gpu_refusals == 1
            assert mid.gpu_high_water == parked.gpu_high_water and mid.bytes_in_use >= parked.bytes_in_use
        finally:
            os.kill(victim, signal.SIGKILL)
        t.join(120)
        assert not errors and got == [pattern(n, 7)]
        wait_event(c, "activate", "phoenix", mark)
        c.set_quota(None, "phoenix", idle_timeout_s=None)

        def settled() -> bool:
            q = c.quota(cap)
            return (tenant(c.status(), "phoenix").state in ("running", "parked")
                    and q.bytes_in_use + q.gpu_bytes_in_use == parked.bytes_in_use + parked.gpu_bytes_in_use)

        wait_for(settled, what="the bytes in one place")
        q = c.quota(cap)
        assert q.gpu_refusals == 1 and q.gpu_high_water == parked.gpu_high_water
        assert q.cpu_underflows == 0 and q.gpu_underflows == 0  # nothing released twice


def test_a_tenant_stopped_or_failed_gives_its_segment_back_and_keeps_its_counters() -> None:
    with supervisor([{"name": "s"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "s")
        with pytest.raises(GpuMemoryExhausted):
            c.set_quota(None, "s", gpu_memory_bytes_cap=1024)
            c.alloc(cap, 4096)
        seg = tenant(c.status(), "s").quota.name
        before = c.quota(cap)
        pid = _ready_pid(c, "s")
        assert pid is not None and seg in _held(sup.pid)
        c.scale(None, "s", 0)
        wait_for(lambda: tenant(c.status(), "s").quota.name == "", what="the stopped tenant's segment released")
        assert seg not in _held(sup.pid) and not os.path.exists(f"/dev/shm/{seg}")
        stopped = c.quota(cap)
        assert stopped.gpu_refusals == before.gpu_refusals == 1
        assert stopped.gpu_memory_bytes_cap == 1024
        c.set_quota(None, "s", gpu_memory_bytes_cap=8192)  # a live change on the record
        c.scale(None, "s", 1)
        wait_for(lambda: tenant(c.status(), "s").state == "running", what="running again")
        c.alloc(cap, 8192)
        q = c.quota(cap)
        assert q.name and q.gpu_refusals == 1 and q.gpu_memory_bytes_cap == 8192 and q.gpu_bytes_in_use == 8192


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="twt-pf", dir=short_temp_dir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_restart_brings_parked_and_stopped_tenants_back_without_a_segment(run_dir: str) -> None:
    config = {"supervisor": {**FAST, "log_level": "warning"}, "tenant": []}
    with launch(config, run_dir=run_dir) as sup:
        c = sup.client
        c.register(None, TenantSpec("dormant"))
        c.register(None, TenantSpec("off", instances=0))
        c.register(None, TenantSpec("awake"))
        _park_soon(c, "dormant")
    with launch(config, run_dir=run_dir) as sup:
        c = sup.client
        assert tenant(c.status(), "dormant").state == "parked" and tenant(c.status(), "off").state == "stopped"
        awake = tenant(c.status(), "awake").quota.name
        assert tenant(c.status(), "dormant").quota.name == "" and tenant(c.status(), "off").quota.name == ""
        assert _held(sup.pid) == {awake} and _in_dev_shm(_prefix(awake)) == {awake}
        assert c.ping(c.tenant_capability(None, "dormant")).tenant == "dormant"  # woken: a segment again
        assert tenant(c.status(), "dormant").quota.name in _held(sup.pid)
