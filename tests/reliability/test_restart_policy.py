"""The restart policy sees the supervisor's own kills as failures, whatever exit code the worker managed."""

from __future__ import annotations

import pytest

from shared.errors import WorkerLost
from shared.spec import RestartPolicy, TenantSpec
from tests.helpers.cluster import instance_pid, supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(60)


def _on_failure() -> TenantSpec:
    # the default request deadline: what these tests wait for is the worker's answer (garbage) or its
    # exit, and a starved host may take over a second to deliver either - a 1 s deadline answered
    # KernelTimeout instead of the malformed reply's WorkerLost
    return TenantSpec("picky", restart=RestartPolicy.ON_FAILURE)


def test_on_failure_leaves_a_clean_exit_down() -> None:
    with supervisor(log_level="error") as sup:
        c = sup.client
        cap = c.register(None, _on_failure())
        c.inject_fault(None, "picky", "exit", code=0)
        rec = wait_for(lambda: (r := tenant(c.status(), "picky")).instances[0].state == "down" and r,
                       what="instance down")
        assert rec.restarts == 0 and rec.instances[0].last_exit.exit_code == 0
        with pytest.raises(WorkerLost, match=r"no instance of 'picky' is running or restarting.*restart=on-failure"):
            c.ping(cap)  # answered at once, not parked: no instance is coming back
        assert tenant(c.status(), "picky").parked == 0
        c.scale(None, "picky", 1)  # "1 instance" again: the one that is down starts
        wait_for(lambda: tenant(c.status(), "picky").state == "running", what="picky running again")
        assert c.ping(cap).instance == 0


def test_on_failure_restarts_a_worker_the_supervisor_killed() -> None:
    with supervisor(log_level="error") as sup:
        c = sup.client
        cap = c.register(None, _on_failure())
        pid = wait_for(lambda: instance_pid(sup, "picky"), what="ready")
        c.inject_fault(None, "picky", "corrupt")
        with pytest.raises(WorkerLost, match="malformed reply"):
            c.ping(cap)  # the supervisor kills a worker that sends garbage: that is a failure
        wait_for(lambda: (p := instance_pid(sup, "picky")) and p != pid, timeout_s=15, what="restarted")
        assert c.ping(cap).tenant == "picky"
