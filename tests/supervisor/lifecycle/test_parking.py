"""Parking: an idle tenant's workers exit, its buffers wait in the supervisor and come back with
the same handles on its next request; refusals, kill -9 in each phase, and a restart.

Real supervisors on the stub backend. Every wait is for an event (the supervisor's event log) or
a state, never for a duration; ``idle_timeout_s`` is tiny so the tests park at once.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import sqlite3
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import BufferLost, InvalidArgument, TensorWasmError
from shared.records import InstanceRecord
from shared.region import Region
from shared.spec import TenantSpec
from supervisor.cli import main
from supervisor.client.api import SupervisorClient
from supervisor.client.launch import SupervisorHandle, launch
from supervisor.lifecycle.parking import PARK_CHUNK_BYTES
from supervisor.tools.demo import guest_path
from tests.helpers.cluster import FAST, supervisor, tenant, wait_for
from tests.helpers.events import event_cursor, pattern, wait_event
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(180)

IDLE = 0.3






def _park_soon(c: SupervisorClient, tid: str) -> dict[str, Any]:
    """Give ``tid`` the tiny idle time now (set up first, then parked: no race with the set-up)
    and wait for its park."""
    mark = event_cursor(c)
    c.set_quota(None, tid, idle_timeout_s=IDLE)
    return wait_event(c, "park", tid, mark)




def _ready_pid(c: SupervisorClient, tid: str) -> int | None:
    inst = tenant(c.status(), tid).instances[0]
    return inst.pid if inst.state == "ready" else None


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_idle_tenant_parks_and_its_buffers_come_back_with_the_same_handles() -> None:
    big = PARK_CHUNK_BYTES + 12345  # more than one chunk each way
    with supervisor([{"name": "sleepy"}, {"name": "busy"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "sleepy")
        small = c.alloc(cap, 4096)
        large = c.alloc(cap, big)
        c.write(cap, small, pattern(4096, 1))
        c.write(cap, large, pattern(big, 2))
        before = c.quota(cap)
        old_pid = _ready_pid(c, "sleepy")
        assert old_pid is not None and before.gpu_bytes_in_use == 4096 + big
        park = _park_soon(c, "sleepy")
        assert park["buffers"] == 2 and park["host_bytes"] == 4096 + big
        rec = tenant(c.status(), "sleepy")
        assert rec.state == "parked" and rec.pids == ()
        wait_for(lambda: _gone(old_pid), what="the parked worker gone")
        assert tenant(c.status(), "busy").state == "running"  # no idle_timeout_s: never parks
        # quota kept exactly: the bytes moved from the device to the supervisor's host copy
        parked = c.quota(cap)
        assert parked.gpu_bytes_in_use == 0
        assert parked.bytes_in_use == before.bytes_in_use + 4096 + big
        assert parked.gpu_high_water == before.gpu_high_water
        assert parked.gpu_refusals == before.gpu_refusals and parked.cpu_refusals == before.cpu_refusals
        # the listing is answered from the host copy: no activation
        assert c.buffers(cap) == {small: 4096, large: big}
        assert tenant(c.status(), "sleepy").state == "parked"
        # a read activates it: same handles, same bytes, a new process
        mark = event_cursor(c)
        assert c.read(cap, large, big) == pattern(big, 2)
        activated = wait_event(c, "activate", "sleepy", mark)
        assert activated["buffers"] == 2
        # its phases: the worker got (warm from the pool, a pool worker starting, or spawned) and
        # bound, then the buffers imported; together the whole activation
        assert sum(activated["workers"].values()) == 1 and set(activated["workers"]) <= {"warm", "starting", "spawned"}
        assert activated["bind_ms"] >= 0 and activated["restore_ms"] >= 0
        assert abs(activated["bind_ms"] + activated["restore_ms"] - activated["activate_ms"]) < 0.01
        assert activated["waited_ms"] == 0.0  # no max_active: it began at the read
        assert c.read(cap, small, 4096) == pattern(4096, 1)
        new_pid = _ready_pid(c, "sleepy")
        assert new_pid is not None and new_pid != old_pid
        rec = tenant(c.status(), "sleepy")
        assert rec.state in ("running", "parked")  # it may park again at once: idle_timeout_s is tiny
        # its buffers counted once: on the device (active), or on both while a new park copies
        # them (the host copy charged before a byte is taken), or in the host copy (parked again)
        active = c.quota(cap)
        need = 4096 + big
        assert (active.bytes_in_use, active.gpu_bytes_in_use) in {
            (before.bytes_in_use, need), (before.bytes_in_use + need, need), (before.bytes_in_use + need, 0)}
        # handles go on after the old ones: a new buffer never takes a freed or restored one's name
        c.free(cap, small)
        fresh = c.alloc(cap, 64)
        assert proto.handle_seq(fresh) > max(proto.handle_seq(small), proto.handle_seq(large))
        assert proto.handle_incarnation(fresh) == proto.handle_incarnation(large)
        with pytest.raises(InvalidArgument, match="unknown buffer handle"):
            c.read(cap, small, 16)


def test_a_parked_instances_buffers_wait_in_one_file_of_the_run_dir_that_the_activation_removes() -> None:
    """The one-copy restore's file: the buffers end to end in handle order, no descriptor held
    while parked, gone once the activation is done."""
    with supervisor([{"name": "filed"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "filed")
        sizes = (PARK_CHUNK_BYTES + 3, 5000)
        handles = [c.alloc(cap, n) for n in sizes]
        for k, (h, n) in enumerate(zip(handles, sizes)):
            c.write(cap, h, pattern(n, 40 + k))
        _park_soon(c, "filed")
        (path,) = glob.glob(os.path.join(sup.run_dir, "parked", "p*"))
        with open(path, "rb") as f:
            held = f.read()
        by_handle = sorted(zip(handles, sizes, range(2)))
        assert held == b"".join(pattern(n, 40 + k) for _, n, k in by_handle)
        assert path not in {f.path for f in psutil.Process(sup.pid).open_files()}  # no descriptor held
        mark = event_cursor(c)
        assert c.read(cap, handles[0], sizes[0]) == pattern(sizes[0], 40)
        assert wait_event(c, "activate", "filed", mark)["buffers"] == 2
        assert c.read(cap, handles[1], sizes[1]) == pattern(sizes[1], 41)
        wait_for(lambda: not os.path.exists(path), what="the parked file removed")


def test_where_no_parked_file_can_be_made_the_copy_waits_in_memory_and_comes_back_in_chunks() -> None:
    with supervisor([{"name": "nofile"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "nofile")
        big = PARK_CHUNK_BYTES * 2 + 7  # three chunks back
        h = c.alloc(cap, big)
        c.write(cap, h, pattern(big, 77))
        with open(os.path.join(sup.run_dir, "parked"), "w"):  # where the directory would be
            pass
        park = _park_soon(c, "nofile")
        assert park["host_bytes"] == big
        mark = event_cursor(c)
        assert c.read(cap, h, big) == pattern(big, 77)
        assert wait_event(c, "activate", "nofile", mark)["buffers"] == 1


def test_each_kind_of_request_activates_a_parked_tenant() -> None:
    probe = guest_path("probe").read_bytes()
    with supervisor([{"name": "lazy"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "lazy")
        buf = c.alloc(cap, 8192)
        c.write(cap, buf, pattern(8192, 3))
        seen = [event_cursor(c)]  # the last activate event's number: the next park comes after it
        c.set_quota(None, "lazy", idle_timeout_s=IDLE)

        def parked_then(call: Any) -> Any:
            wait_event(c, "park", "lazy", seen[0])
            assert tenant(c.status(), "lazy").state == "parked"
            mark = event_cursor(c)
            result = call()
            seen[0] = wait_event(c, "activate", "lazy", mark)["seq"]
            return result

        # a plain tenant op
        assert parked_then(lambda: c.ping(cap)).tenant == "lazy"
        # run_wasm
        assert parked_then(lambda: c.run_wasm(cap, probe, "add", [1, 2])).results == (3,)
        # a region op (write_region: region bytes into the restored buffer)
        grant = c.region_create(cap, 65536)  # answered by the supervisor: no worker needed
        region = Region.attach(grant.name)
        try:
            region.span(0, 8192)[:] = pattern(8192, 9)
            assert parked_then(lambda: c.write_region(cap, buf, grant.region, 8192)) == 8192
        finally:
            region.close()
            c.region_release(cap, grant.region)
        assert parked_then(lambda: c.read(cap, buf, 8192)) == pattern(8192, 9)
        # requests that come together during an activation wait in order and are all served
        wait_event(c, "park", "lazy", seen[0])
        results: list[bytes] = []
        errors: list[BaseException] = []

        def reader(k: int) -> None:
            try:
                with SupervisorClient(sup.run_dir) as own:
                    results.append(own.read(cap, buf, 8192))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and results == [pattern(8192, 9)] * 4


def test_park_refused_when_the_buffers_do_not_fit_the_memory_quota() -> None:
    with supervisor([{"name": "tight", "idle_timeout_s": IDLE, "memory_quota_bytes": "1MiB"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "tight")
        h = c.alloc(cap, 2 << 20)  # GPU bytes: not bounded by the host quota
        c.write(cap, h, pattern(2 << 20, 5))
        pid = _ready_pid(c, "tight")
        before = c.quota(cap)
        refused = wait_event(c, "park_refused", "tight", 0)
        err = refused["error"]
        assert isinstance(err, dict) and err["code"] == "memory_exhausted", err
        assert "was not parked" in str(err["message"])
        # the tenant stays active: same worker, same buffer, counters untouched
        rec = tenant(c.status(), "tight")
        assert rec.state == "running" and _ready_pid(c, "tight") == pid
        after = c.quota(cap)
        assert after.bytes_in_use == before.bytes_in_use and after.cpu_refusals == before.cpu_refusals
        assert c.read(cap, h, 2 << 20) == pattern(2 << 20, 5)
        # raising the quota lets it park
        mark = event_cursor(c)
        c.set_quota(None, "tight", memory_quota_bytes=64 << 20)
        wait_event(c, "park", "tight", mark)
        assert c.read(cap, h, 2 << 20) == pattern(2 << 20, 5)


def test_idle_timeout_is_validated_and_changes_live() -> None:
    with pytest.raises(ValueError, match="idle_timeout_s"):
        TenantSpec("x", idle_timeout_s=0)
    with pytest.raises(TypeError, match="idle_timeout_s"):
        TenantSpec("x", idle_timeout_s="soon")  # type: ignore[arg-type]
    assert TenantSpec("x").idle_timeout_s is None
    with supervisor([{"name": "later"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "later")
        with pytest.raises(InvalidArgument, match="idle_timeout_s"):
            c.set_quota(None, "later", idle_timeout_s=-1.0)
        mark = event_cursor(c)
        rec = c.set_quota(None, "later", idle_timeout_s=IDLE)
        assert rec.spec.idle_timeout_s == IDLE
        wait_event(c, "park", "later", mark)
        assert c.ping(cap).tenant == "later"
        c.set_quota(None, "later", idle_timeout_s=None)  # never parks again
        assert tenant(c.status(), "later").spec.idle_timeout_s is None


def test_kill_9_of_the_worker_while_parking_loses_no_quota() -> None:
    """The worker dies while its buffers are copied out: the park is abandoned, the copy's charge
    released, and the death is an ordinary crash (restarted; its buffers went with it)."""
    with supervisor([{"name": "victim"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "victim")
        h = c.alloc(cap, 1 << 20)
        base = c.quota(cap)
        pid = _ready_pid(c, "victim")
        assert pid is not None
        c.inject_fault(None, "victim", "slow", ms=3000)  # each reply of the copy waits 3 s
        c.set_quota(None, "victim", idle_timeout_s=IDLE)
        try:
            # the manifest came (the copy is charged to the memory quota); a chunk is being copied
            wait_for(lambda: c.quota(cap).bytes_in_use == base.bytes_in_use + (1 << 20),
                     what="the park's copy charged")
            assert tenant(c.status(), "victim").instances[0].in_flight >= 1
        finally:
            # before the kill: the restarted worker holds nothing and may park before the next line runs
            mark = event_cursor(c)
            os.kill(pid, signal.SIGKILL)
        # restarted (it may park again at once: it holds nothing now)
        wait_for(lambda: (r := tenant(c.status(), "victim")).restarts == 1 and r.state in ("running", "parked"),
                 what="the restarted worker")
        q = c.quota(cap)
        assert q.bytes_in_use == base.bytes_in_use  # the host copy's charge released
        assert q.gpu_bytes_in_use == 0  # the dead worker's share reclaimed
        with pytest.raises(BufferLost):
            c.read(cap, h, 16)
        # and the tenant parks cleanly afterwards
        wait_event(c, "park", "victim", mark)


def test_kill_9_of_the_worker_while_activating_loses_no_bytes() -> None:
    """The pool worker taken for the activation is killed before the import is confirmed: the host
    copy is kept, a new worker is bound with the same incarnation and the buffers come back whole."""
    with supervisor([{"name": "phoenix"}], pool_size=1) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "phoenix")
        n = 3 * PARK_CHUNK_BYTES // 2
        h = c.alloc(cap, n)
        c.write(cap, h, pattern(n, 7))
        base = c.quota(cap).bytes_in_use  # the client's staging region, if it used one
        _park_soon(c, "phoenix")
        pool = wait_for(lambda: c.status().supervisor.pool.pids, what="a warm pool worker")
        victim = pool[0]
        os.kill(victim, signal.SIGSTOP)  # it is bound for the activation but cannot finish it
        got: list[bytes] = []
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                with SupervisorClient(sup.run_dir, regions=False) as own:  # no region charged to the quota
                    got.append(own.read(cap, h, n))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        t = threading.Thread(target=reader)
        mark = event_cursor(c)
        t.start()
        try:
            wait_for(lambda: tenant(c.status(), "phoenix").instances[0].pid == victim,
                     what="the pool worker taken for the activation")
        finally:
            os.kill(victim, signal.SIGKILL)
        t.join(120)
        assert not errors, errors
        assert got == [pattern(n, 7)]
        wait_event(c, "activate", "phoenix", mark)
        c.set_quota(None, "phoenix", idle_timeout_s=None)  # no more parks (one under way ends first)

        def settled() -> bool:
            q = c.quota(cap)  # active (n on the device), or parked again (n in the supervisor's copy)
            return (tenant(c.status(), "phoenix").state in ("running", "parked")
                    and q.bytes_in_use + q.gpu_bytes_in_use == base + n)  # nothing lost, nothing charged twice

        wait_for(settled, what="the bytes in one place")


def test_kill_9_of_an_instance_already_restored_while_another_still_imports_loses_no_bytes() -> None:
    """Instance 0's buffers are back and confirmed while instance 1 still imports; instance 0's new
    worker is killed then. Its replacement keeps the incarnation (the client's handles), so it must
    get the buffers from the host copy again: the bytes come back and the quota counts them."""
    with supervisor([{"name": "pair", "instances": 2}], pool_size=2, pool_max=2) as sup:  # no third warm one
        c = sup.client
        cap = c.tenant_capability(None, "pair")
        h0 = c.alloc(cap, 3000, instance=0)
        h1 = c.alloc(cap, 5000, instance=1)
        c.write(cap, h0, pattern(3000, 21))
        c.write(cap, h1, pattern(5000, 22))
        _park_soon(c, "pair")
        c.set_quota(None, "pair", idle_timeout_s=None)  # parked now; no second park after the activation
        pool: tuple[int, ...] = wait_for(lambda: tuple(c.status().supervisor.pool.pids) if
                                         len(c.status().supervisor.pool.pids) >= 2 else (), what="two warm workers")
        for pid in pool:
            os.kill(pid, signal.SIGSTOP)  # bound for the activation, neither can answer yet
        got: list[bytes] = []
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                with SupervisorClient(sup.run_dir, regions=False) as own:
                    got.append(own.read(cap, h1, 5000))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        stopped = set(pool)
        try:
            def bound() -> tuple[InstanceRecord, ...]:
                insts = tenant(c.status(), "pair").instances
                return insts if all(x.pid in stopped for x in insts) else ()

            insts = wait_for(bound, what="both pool workers bound")
            first, second = insts[0].pid, insts[1].pid
            assert first is not None and second is not None
            os.kill(first, signal.SIGCONT)

            def restored() -> bool:  # instance 0 imported, and its reply handled by the supervisor
                rec = tenant(c.status(), "pair")
                inst = rec.instances[0]
                shares = {i: g for i, _c, g in (rec.quota.instance_shares if rec.quota else ())}
                return inst.state == "ready" and inst.in_flight == 0 and shares.get(0) == 3000

            wait_for(restored, what="instance 0 restored while instance 1 waits")
            assert tenant(c.status(), "pair").state == "starting"  # the activation waits for instance 1
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: tenant(c.status(), "pair").instances[0].pid not in (None, first),
                     what="instance 0 restarted")
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        t.join(120)
        assert not errors, errors
        assert got == [pattern(5000, 22)]
        assert c.read(cap, h0, 3000) == pattern(3000, 21)  # the restarted instance got its buffer again
        rec = tenant(c.status(), "pair")
        shares = {i: g for i, _c, g in (rec.quota.instance_shares if rec.quota else ())}
        assert shares == {0: 3000, 1: 5000} and rec.gpu_bytes_in_use == 8000
        assert c.buffers(cap) == {h0: 3000, h1: 5000}


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="twt-p", dir=short_temp_dir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(run_dir: str, tenants: list[dict[str, Any]] | None = None) -> Any:
    return launch({"supervisor": {**FAST, "log_level": "warning"}, "tenant": tenants or []}, run_dir=run_dir)


def test_a_restart_brings_a_parked_tenant_back_parked(run_dir: str) -> None:
    with _start(run_dir) as sup:
        c = sup.client
        cap_raw = c.register(None, TenantSpec("dormant")).to_bytes()
        c.register(None, TenantSpec("awake"))
        h = c.alloc(TenantCapability.from_bytes(cap_raw), 64)
        _park_soon(c, "dormant")  # idle_timeout_s set with set_quota: stored too
        assert len(glob.glob(os.path.join(run_dir, "parked", "p*"))) == 1
    assert glob.glob(os.path.join(run_dir, "parked", "p*")) == []  # a stop takes the host copies with it
    sup2: SupervisorHandle
    with _start(run_dir) as sup2:
        c = sup2.client
        rec = tenant(c.status(), "dormant")
        assert rec.state == "parked" and rec.pids == ()  # not started at all
        assert tenant(c.status(), "awake").state == "running"
        cap = TenantCapability.from_bytes(cap_raw)  # still valid
        assert c.ping(cap).tenant == "dormant"
        # the host copies did not survive the restart (docs/OPERATIONS.md): the old handle is lost
        with pytest.raises(BufferLost):
            c.read(cap, h, 16)


def _kept(q: Any) -> dict[str, object]:
    """What a parked tenant keeps of its quota across a restart: every counter but what it holds."""
    return {k: getattr(q, k) for k in ("generation", "memory_quota_bytes", "gpu_memory_bytes_cap", "cpu_high_water",
                                       "cpu_refusals", "cpu_underflows", "gpu_high_water", "gpu_refusals",
                                       "gpu_underflows", "gpu_time_ns", "gpu_ops", "gpu_waits", "gpu_wait_ns",
                                       "gpu_throttled", "gpu_wait_bins")}


def test_a_restart_keeps_a_parked_tenants_quota_counters_exactly(run_dir: str) -> None:
    """Marks, refusals and GPU time of a parked tenant come back after a restart as they were; it
    holds nothing then (its host copies did not survive), and they go on from there."""
    with _start(run_dir) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("frugal", gpu_memory_bytes_cap=1 << 20))
        n = 30_000
        hx, hy = c.alloc(cap, 4 * n), c.alloc(cap, 4 * n)
        for _ in range(2):  # two refusals past the GPU cap
            with pytest.raises(TensorWasmError):
                c.alloc(cap, 2 << 20)
        # device work: accounted GPU time
        c.run_wasm(cap, guest_path("axpy_sum").read_bytes(), "run", [{"handle": hx}, {"handle": hy}, n, 2.0])
        _park_soon(c, "frugal")
        parked = c.quota(cap)
        assert tenant(c.status(), "frugal").state == "parked"
        assert parked.gpu_refusals == 2 and parked.gpu_high_water >= 8 * n and parked.gpu_time_ns > 0
    with _start(run_dir) as sup2:
        c = sup2.client
        assert tenant(c.status(), "frugal").state == "parked"
        restored = c.quota(cap)
        assert _kept(restored) == _kept(parked)
        assert restored.bytes_in_use == 0 and restored.gpu_bytes_in_use == 0  # nothing held survived
        c.ping(cap)  # activated: the counters go on from the kept ones
        with pytest.raises(TensorWasmError):
            c.alloc(cap, 2 << 20)
        assert c.quota(cap).gpu_refusals == 3


def _stored_parked_quota(run_dir: str, tid: str) -> str | None:
    """The parked counters the state database holds for ``tid`` (read-only, beside the supervisor)."""
    conn = sqlite3.connect(f"file:{os.path.join(run_dir, 'state', 'state.db')}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT parked_quota FROM tenants WHERE tenant_id = ?", (tid,)).fetchone()
    finally:
        conn.close()
    return None if row is None else row[0]


def test_a_supervisor_killed_with_a_parked_tenant_comes_back_with_its_counters_and_without_its_file(
        run_dir: str) -> None:
    """kill -9 of the supervisor while a tenant is parked: the next start finds it parked with
    the counters it parked with, and removes the dead supervisor's parked file (its bytes are
    lost with the supervisor, as documented)."""
    with _start(run_dir) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("held", gpu_memory_bytes_cap=1 << 20))
        h = c.alloc(cap, 70_000)
        c.write(cap, h, pattern(70_000, 9))
        with pytest.raises(TensorWasmError):
            c.alloc(cap, 2 << 20)
        _park_soon(c, "held")
        parked = c.quota(cap)
        (path,) = glob.glob(os.path.join(run_dir, "parked", "p*"))
        wait_for(lambda: _stored_parked_quota(run_dir, "held"), what="the parked counters stored")
        sup.process.kill()
        sup.process.wait(30)
    assert os.path.exists(path)  # left behind by the killed supervisor
    with _start(run_dir) as sup2:
        c = sup2.client
        assert not os.path.exists(path)
        assert tenant(c.status(), "held").state == "parked"
        restored = c.quota(cap)
        assert _kept(restored) == _kept(parked) and restored.gpu_refusals == 1
        with pytest.raises(BufferLost):
            c.read(cap, h, 16)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_parked_state_shows_in_twt_status_and_the_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    with supervisor([{"name": "napper"}], metrics_addr=f"127.0.0.1:{port}",
                    metrics_tenant_names=True, metrics_renders_per_s=1000) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "napper")
        c.alloc(cap, 4096)
        _park_soon(c, "napper")
        samples = _scrape(f"http://127.0.0.1:{port}/metrics")
        # a parked tenant has no series of its own (10,000 of them must not cost a scrape 30 MB):
        # counted by state, its buffer copies in the parked tenants' host bytes
        assert samples[("twt_tenants_by_state", (("state", "parked"),))] == 1
        assert samples[("twt_tenants_by_state", (("state", "running"),))] == 0
        assert samples[("twt_tenants_host_in_use_bytes", (("state", "parked"),))] == 4096
        assert not [key for key in samples if key[0].startswith("twt_tenant_") and ("tenant", "napper") in key[1]]
        code = main(["status", "--run-dir", sup.run_dir])
        out, _ = capsys.readouterr()
        row = next(line for line in out.splitlines() if line.startswith("napper"))
        assert row.split()[1:3] == ["parked", "0/1"], row
        assert code == 0  # parked is healthy
        assert "napper/0" not in out  # no "instance down" note for an idle tenant
        # the key from the command line: set-quota changes it, register takes it
        assert main(["set-quota", "napper", "--idle-timeout", "none", "--run-dir", sup.run_dir]) == 0
        assert tenant(c.status(), "napper").spec.idle_timeout_s is None
        assert main(["register", "late", "--idle-timeout", "2.5", "--run-dir", sup.run_dir]) == 0
        assert tenant(c.status(), "late").spec.idle_timeout_s == 2.5
        capsys.readouterr()


def test_every_instance_of_a_tenant_parks_and_comes_back_and_a_parked_tenant_can_be_evicted() -> None:
    with supervisor([{"name": "pair", "instances": 2}, {"name": "gone"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "pair")
        h0 = c.alloc(cap, 3000, instance=0)
        h1 = c.alloc(cap, 5000, instance=1)
        c.write(cap, h0, pattern(3000, 11))
        c.write(cap, h1, pattern(5000, 12))
        park = _park_soon(c, "pair")
        assert park["buffers"] == 2 and park["host_bytes"] == 8000
        assert tenant(c.status(), "pair").pids == ()
        assert len(glob.glob(os.path.join(sup.run_dir, "parked", "p*"))) == 2
        mark = event_cursor(c)
        assert c.read(cap, h1, 5000) == pattern(5000, 12)  # activates both instances
        wait_event(c, "activate", "pair", mark)
        assert c.read(cap, h0, 3000) == pattern(3000, 11)
        assert c.buffers(cap) == {h0: 3000, h1: 5000}
        # a parked tenant is evicted like any other: nothing to stop, its capability revoked, its
        # parked files removed (pair, idle again at once, may be parking or parked: either way)
        c.evict(None, "pair")
        parked_dir = os.path.join(sup.run_dir, "parked", "p*")
        wait_for(lambda: not glob.glob(parked_dir), what="pair's parked files removed")
        gone = c.tenant_capability(None, "gone")
        c.write(gone, c.alloc(gone, 100), pattern(100, 13))
        _park_soon(c, "gone")
        (path,) = glob.glob(parked_dir)
        assert c.evict(None, "gone").pids == ()
        wait_for(lambda: not os.path.exists(path), what="the evicted tenant's parked file removed")
        assert "gone" not in {t.tenant_id for t in c.status().tenants}
        with pytest.raises(TensorWasmError):
            c.ping(gone)


def test_a_tenant_on_the_cuda_backend_parks_and_comes_back_whole() -> None:
    """The cuda backend on the fake driver (tests/helpers/fake_cuda.py, as the cuda supervisor tests
    run it): the buffers leave device memory through the backend's copies and come back."""
    fake = "tests.helpers.fake_cuda"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_CUDA_", "CUDA_MPS_"))}
    env["FAKE_CUDA_MEMORY"] = str(1 << 30)
    settings = {**FAST, "backend": "cuda", "cuda_driver_module": fake, "cuda_nvrtc_module": fake,
                "device_reserve_bytes": 0}
    n = PARK_CHUNK_BYTES + 4099
    with launch({"supervisor": settings, "tenant": []}, env=env) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("gpu-tenant", gpu_memory_bytes_cap=64 << 20))
        h = c.alloc(cap, n)
        c.write(cap, h, pattern(n, 21))
        assert c.quota(cap).gpu_bytes_in_use >= n
        park = _park_soon(c, "gpu-tenant")
        assert park["host_bytes"] == n and c.quota(cap).gpu_bytes_in_use == 0
        with SupervisorClient(sup.run_dir, regions=False) as own:
            assert own.read(cap, h, n) == pattern(n, 21)
        assert c.quota(cap).gpu_bytes_in_use >= n or tenant(c.status(), "gpu-tenant").state == "parked"
