"""Warm pool, several instances per tenant, live scaling, start methods."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from shared.errors import GpuMemoryExhausted, InvalidArgument, WorkerLost
from shared.protocol import handle_instance
from shared.spec import TenantSpec
from tests.helpers.cluster import supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(120)


def _pool_pids(sup: object) -> list[int]:
    return list(sup.client.status().supervisor.pool.pids)  # type: ignore[attr-defined]


def _full_pool(sup: object, n: int = 2) -> list[int] | None:
    pids = _pool_pids(sup)
    return pids if len(pids) == n else None


def test_warm_registration_binds_a_pool_worker_and_pool_refills() -> None:
    with supervisor(pool_size=2) as sup:
        c = sup.client
        pool = wait_for(lambda: _full_pool(sup), what="pool full")
        cap = c.register(None, TenantSpec("acme"))
        pid = c.ping(cap).pid
        assert pid in pool, "the tenant got a pool worker"
        refilled = wait_for(lambda: _full_pool(sup), what="pool refilled")
        assert pid not in refilled
        # how much faster a warm registration is: a figure of `twt bench scale`, not asserted here
        c.evict(None, "acme")
        after = wait_for(lambda: _full_pool(sup), what="pool steady")
        assert pid not in after, "an evicted tenant's worker never returns to the pool"


def test_two_instances_share_one_quota_and_survive_each_other() -> None:
    cap_bytes = 8 << 20
    with supervisor(pool_size=0) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("duo").with_instances(2).with_gpu_memory_bytes_cap(cap_bytes))
        rec = tenant(c.status(), "duo")
        assert len(rec.pids) == 2 and rec.pids[0] != rec.pids[1]
        stop = threading.Event()
        errors: list[BaseException] = []
        seen_instances: set[int] = set()
        peaks: list[int] = []

        def hammer() -> None:
            client = sup.connect()
            held: list[int] = []
            try:
                while not stop.is_set():
                    try:
                        h = client.alloc(cap, 1 << 20)
                        seen_instances.add(handle_instance(h))
                        held.append(h)
                    except GpuMemoryExhausted:
                        if held:
                            client.free(cap, held.pop(0))
                for h in held:
                    client.free(cap, h)
            except BaseException as exc:  # noqa: BLE001 - a thread's failure, surfaced below
                errors.append(exc)
            finally:
                client.close()

        def sample() -> None:
            client = sup.connect()
            try:
                while not stop.is_set():
                    peaks.append(client.quota(cap).gpu_bytes_in_use)
            finally:
                client.close()

        threads = [threading.Thread(target=hammer) for _ in range(3)] + [threading.Thread(target=sample)]
        for t in threads:
            t.start()
        try:
            # hammer until what the test is about has happened (both instances served, the shared
            # cap refused someone, the sampler saw use), not for a fixed time
            wait_for(lambda: errors or (seen_instances == {0, 1} and c.quota(cap).gpu_refusals > 0
                                        and len(peaks) >= 20), timeout_s=60, what="both instances hammered")
        finally:
            stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert seen_instances == {0, 1}, "requests spread over both instances"
        snap = c.quota(cap)
        assert max(peaks) <= cap_bytes and snap.gpu_high_water <= cap_bytes
        assert snap.gpu_refusals > 0 and snap.gpu_bytes_in_use == 0

        # kill instance 0: instance 1 keeps serving; only handles of instance 0 are lost
        h1 = next(h for h in (c.alloc(cap, 1000) for _ in range(4)) if handle_instance(h) == 1)
        rec = tenant(c.status(), "duo")
        dead = rec.instances[0].pid
        os.kill(dead, signal.SIGKILL)
        # (a request already in flight on the dying instance would get WorkerLost; none is)
        wait_for(lambda: tenant(c.status(), "duo").instances[0].pid != dead, what="death seen")
        for _ in range(20):
            c.ping(cap)  # never fails: the live instance takes it while 0 restarts
        c.write(cap, h1, b"still here")
        assert c.read(cap, h1, 10) == b"still here"
        wait_for(lambda: tenant(c.status(), "duo").state == "running", what="instance 0 back")


def test_scale_up_and_down_live() -> None:
    with supervisor(pool_size=1) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("elastic"))
        rec = c.scale(None, "elastic", 3)
        rec = wait_for(lambda: (r := tenant(c.status(), "elastic")).state == "running" and len(r.pids) == 3 and r,
                       what="3 instances")
        pids = rec.pids
        h = next(h for h in (c.alloc(cap, 10) for _ in range(6)) if handle_instance(h) == 2)
        c.scale(None, "elastic", 1)
        rec = wait_for(lambda: (r := tenant(c.status(), "elastic")) and len(r.pids) == 1 and r, what="scaled down")
        assert rec.pids == pids[:1]
        with pytest.raises((InvalidArgument, WorkerLost)):
            c.read(cap, h, 1)  # its instance is gone
        assert rec.gpu_bytes_in_use == 0 or all(handle_instance(x) == 0 for x in c.buffers(cap))
        c.ping(cap)
        with pytest.raises(ValueError):
            c.scale(None, "elastic", 65)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_start_methods(method: str) -> None:
    with supervisor(start_method=method, pool_size=1) as sup:
        cap = sup.client.register(None, TenantSpec("m").with_instances(2))
        assert sup.client.ping(cap).tenant == "m"
        assert sup.client.hello().start_method == method
