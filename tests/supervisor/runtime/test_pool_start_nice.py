"""A pool worker starts below the normal priority (``pool_start_nice``) where its threads may
raise theirs back, and is at the normal priority once warmed or bound (worker.priority)."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from shared.config import SupervisorConfig, load_config
from shared.prctl import may_raise_priority
from shared.spec import TenantSpec
from supervisor.runtime.workers import Spawner, pool_start_nice
from tests.helpers.cluster import supervisor, wait_for

pytestmark = pytest.mark.timeout(120)

NOWHERE = {"backend": "tcp://127.0.0.1:9", "control": "tcp://127.0.0.1:9"}


def _permitted() -> bool:
    return sys.platform.startswith("linux") and may_raise_priority(os.getpriority(os.PRIO_PROCESS, 0))


def test_pool_start_nice_is_checked_and_read_from_the_environment() -> None:
    assert SupervisorConfig().pool_start_nice == 0  # off by default
    assert load_config(environ={"TWT_POOL_START_NICE": "5"}).pool_start_nice == 5
    for bad in ("20", "-1"):
        with pytest.raises(ValueError, match="pool_start_nice"):
            load_config(environ={"TWT_POOL_START_NICE": bad})


def test_only_a_pool_workers_boot_asks_for_it_and_only_where_it_can_be_undone() -> None:
    spawner = Spawner(SupervisorConfig(start_method="spawn", pool_start_nice=7), NOWHERE)
    assert spawner.start_nice == (7 if _permitted() else 0)
    assert spawner.prepare(pool=True).boot.start_nice == spawner.start_nice
    assert spawner.prepare().boot.start_nice == 0  # an instance's own start: the normal priority
    assert Spawner(SupervisorConfig(start_method="spawn", pool_start_nice=0), NOWHERE).start_nice == 0
    assert pool_start_nice(0) == 0


def _nices(pid: int) -> set[int]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out.add(int(f.read().rsplit(")", 1)[1].split()[16]))
        except OSError:
            pass  # a thread that ended meanwhile
    return out


@pytest.mark.skipif(not _permitted(), reason="a thread here may not raise its priority back (CAP_SYS_NICE, RLIMIT_NICE)")
def test_warmed_and_bound_pool_workers_run_at_the_normal_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with supervisor(pool_size=2, pool_start_nice=6) as sup, sup.connect() as c:
        def warm_pool() -> bool:
            pool = c.status(limit=1).supervisor.pool
            return pool.idle >= 2 and pool.starting == 0

        wait_for(warm_pool, what="a warm pool")
        workers = [p.pid for p in psutil.Process(sup.pid).children(recursive=True) if p.name() == "twt-worker"]
        assert len(workers) >= 2
        for pid in workers:
            assert _nices(pid) == {base}, pid
        cap = c.register(None, TenantSpec.from_dict({"tenant_id": "t"}))
        c.ping(cap)
        bound = [i.pid for t in c.status().tenants if t.tenant_id == "t" for i in t.instances]
        assert bound and bound[0] is not None
        assert _nices(int(bound[0])) == {base}


@pytest.mark.skipif(not _permitted(), reason="a thread here may not raise its priority back (CAP_SYS_NICE, RLIMIT_NICE)")
def test_the_supervisor_raises_a_starting_pool_worker_taken_for_a_tenant() -> None:
    """``raise_priority``: every thread of a process started below (a starting pool worker bound to
    a tenant before it warmed) back at the supervisor's priority."""
    import subprocess

    from supervisor.runtime.workers import raise_priority

    base = os.getpriority(os.PRIO_PROCESS, 0)
    code = ("import os, sys, threading, time\n"
            "os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 4))\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert _nices(proc.pid) == {min(19, base + 4)}
        raise_priority(proc.pid, 4)
        assert _nices(proc.pid) == {base}
        raise_priority(proc.pid, 0)  # nothing asked: nothing done
        raise_priority(-1, 4)  # no such process: nothing done, no error
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
