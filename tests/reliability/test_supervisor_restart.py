"""The supervisor SIGKILLed again and again on one run directory, at different moments.

Each time: every process it started (workers, pool, forkserver, workers not
yet connected) is gone within 2 s, callers waiting on it get a typed error
(``RequestTimeout``) rather than hanging, and the next supervisor on the same
run dir starts at once. Its shared-memory segments are removed by its
resource tracker when only the supervisor is killed; when the whole process
tree is killed at once (a cgroup kill, the OOM killer taking the group) they
stay, and the next supervisor removes them before it is ready.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from shared import quota
from shared.errors import RequestTimeout, SupervisorUnavailable
from shared.spec import TenantSpec
from supervisor.client.launch import SupervisorHandle, launch
from tests.helpers import hygiene
from tests.helpers import segments as fab
from tests.helpers.cluster import tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: the liveness window 2 s, as the suite's FAST settings (not 0.6 s: a worker starved of CPU that
#: long beside four CPU burners was killed for its heartbeats, and its tenant failed the test)
SETTINGS = {"backend": "stub", "pool_size": 2, "heartbeat_interval_s": 0.2, "heartbeat_liveness": 10,
            "kill_grace_s": 0.5, "stop_timeout_s": 3.0}
TENANTS = [{"name": "a", "gpu_memory_bytes_cap": "64MiB"}, {"name": "b", "instances": 2}]


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="twt-r", dir=short_temp_dir())  # short: its sockets
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tree(pid: int) -> dict[int, float]:
    try:
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


def _alive(pid: int, created: float) -> bool:
    try:
        p = psutil.Process(pid)
        return bool(abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _prefix(sup: SupervisorHandle) -> str:
    """Segment names of this supervisor start with this (a prefix drawn per start: the registry id
    is the same after a restart, the state being durable)."""
    name = str(tenant(sup.client.status(), "a").quota.name)
    return name.rsplit("-", 1)[0] + "-"


# what is going on when the supervisor is killed ------------------------------------------------


def _idle(sup: SupervisorHandle) -> Callable[[], None]:
    return lambda: None


def _under_load(sup: SupervisorHandle) -> Callable[[], None]:
    """Requests in flight (a slow worker) and buffers held when the supervisor dies."""
    c = sup.client
    cap = c.tenant_capability(None, "a")
    c.alloc(cap, 1 << 20)
    c.inject_fault(None, "a", "slow", ms=2000)
    waiter = sup.connect(timeout_s=1.5)
    rids = [waiter.send("ping", cap) for _ in range(5)]

    def after() -> None:
        # the caller gets a typed timeout, not a hang
        with pytest.raises(RequestTimeout):
            waiter.recv()
        assert rids
        waiter.close()

    return after


def _registering(sup: SupervisorHandle) -> Callable[[], None]:
    """A 4-instance registration under way: workers spawned, some not yet connected."""
    spec = TenantSpec("late").with_instances(4)
    sup.client.send("register", sup.admin_capability, {"spec": spec.to_dict()})
    time.sleep(0.03)
    return lambda: None


def _stopping(sup: SupervisorHandle) -> Callable[[], None]:
    """SIGTERM (graceful stop begins), then SIGKILL a moment later."""
    sup.process.send_signal(signal.SIGTERM)
    time.sleep(0.02)
    return lambda: None


#: (what is going on, start method, kill the whole tree at once - as a cgroup kill does - or the supervisor only).
#: No idle supervisor killed alone with spawn: "registering" with spawn is that very supervisor (idle, its
#: workers spawned) with a registration under way besides, and every check of an idle round is made of it.
SCENARIOS = [("under load", _under_load, "forkserver", False), ("registering", _registering, "spawn", False),
             ("stopping", _stopping, "forkserver", False), ("under load", _under_load, "spawn", True),
             ("registering", _registering, "forkserver", True), ("idle", _idle, "forkserver", True)]


def test_repeated_supervisor_sigkill_and_restart_on_one_run_dir(run_dir: str) -> None:
    stale: set[str] = set()
    for name, scenario, method, whole_tree in SCENARIOS:
        with launch({"supervisor": {**SETTINGS, "log_level": "warning"}, "tenant": TENANTS}, run_dir=run_dir,
                    start_method=method) as sup:
            # the previous supervisor's segments were removed before this one became ready
            assert not (stale & hygiene.twt_segments()), (name, stale & hygiene.twt_segments())
            wait_for(lambda: len(sup.client.status().supervisor.pool.pids) == 2, what="pool full")
            assert tenant(sup.client.status(), "b").state == "running"
            prefix = _prefix(sup)
            procs = _tree(sup.pid)
            # its segments (two tenants and the device budget), before the scenario: once it is killed,
            # nobody owns those still there (a graceful stop may have removed some before the kill)
            owned = {n for n in hygiene.twt_segments() if n.startswith(prefix)}
            assert len(owned) >= 3, (name, owned)
            after = scenario(sup)
            procs.update(_tree(sup.pid))
            assert len(procs) >= 5, (name, procs)  # 3 instances + 2 pool (+ forkserver, + registering)
            if whole_tree:
                # the supervisor's resource tracker dies too: nobody but the next supervisor can clean up.
                # Stop the whole tree first, so no member (the tracker above all) reacts to another's death.
                for sig in (signal.SIGSTOP, signal.SIGKILL):
                    for pid in [sup.pid, *procs]:
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
            else:
                sup.process.kill()
            sup.process.wait(10)
            # PDEATHSIG, heartbeats and the parent check end them at once; wait for it (the wait's
            # time is a margin for a loaded machine, not a speed target)
            wait_for(lambda: not any(_alive(p, t) for p, t in procs.items()), timeout_s=30.0,
                     interval_s=0.01, what=f"{name}: every process of the killed supervisor gone")
            after()
            # Whoever cleans them first - the next supervisor, or one that another test run starts on
            # this machine meanwhile (it applies the same dead-owner rule) - none may be left once the
            # next supervisor is ready (checked at the top of the next round).
            stale = owned
            with pytest.raises(SupervisorUnavailable):
                type(sup.client)(run_dir)  # a client sees a stale run dir, not a hang
    # one more start cleans the last one's segments, and a graceful stop leaves nothing
    with launch({"supervisor": SETTINGS, "tenant": TENANTS}, run_dir=run_dir) as sup:
        assert not (stale & hygiene.twt_segments())
        assert sup.client.hello().pid == sup.pid


def _unfinished(name: str, size: int) -> str:
    """A segment as a creator killed between ``shm_open`` and its header's magic leaves it:
    ``size`` bytes (0: never sized), all zero."""
    fd = os.open(os.path.join(hygiene.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return name


def test_segments_whose_creation_a_whole_tree_kill_interrupted_are_removed_by_the_next_start(run_dir: str) -> None:
    """A whole-tree kill (SIGSTOP, then SIGKILL) can land inside a segment's creation: the name
    exists, but no header says whose it is. Only the next supervisor on the run dir, holding its
    lock, can know its creator is dead: it removes them; an operator's ``twt cleanup`` (no lock,
    a live supervisor's segment is unfinished for a moment) and other run dirs' starts leave them."""
    ns = quota.segment_namespace(run_dir)
    other_ns = quota.segment_namespace(run_dir + "-other")
    empty = _unfinished(fab.namespaced_name(ns, "3"), 0)  # shm_open done, ftruncate not
    headerless = _unfinished(fab.namespaced_name(ns, "4"), quota.SEGMENT_BYTES)  # sized, magic not yet written
    others = _unfinished(fab.namespaced_name(other_ns, "3"), quota.SEGMENT_BYTES)
    try:
        # without the run dir's lock nothing tells them from a live supervisor's segment in the making
        assert quota.cleanup_stale_segments(namespace=ns) == []
        assert fab.exists(empty) and fab.exists(headerless)
        assert sorted(quota.unfinished_segments(ns)) == sorted([empty, headerless])
        with pytest.raises(ValueError):
            quota.cleanup_stale_segments(run_dir_locked=True)  # a lock is one run dir's: a namespace is needed
        with launch({"supervisor": SETTINGS, "tenant": TENANTS}, run_dir=run_dir) as sup:
            assert not fab.exists(empty) and not fab.exists(headerless)
            assert fab.exists(others)  # another run dir's: its own start decides
            # and the running supervisor's own segments are whole: nothing of it reads as unfinished
            assert quota.unfinished_segments(ns) == []
            assert sup.client.hello().pid == sup.pid
    finally:
        fab.remove(empty, headerless, others)
