"""A request's deadline runs from when the supervisor received it, whatever happens to it meanwhile.

A request that finds no ready instance is parked; it must be answered by
its deadline whether no instance comes back in time, or one does and then
does not answer.
"""

from __future__ import annotations

import time

import pytest

from shared.errors import KernelTimeout, error_from_dict
from shared.spec import TenantSpec
from supervisor.tools.demo import guest_path
from tests.helpers.cluster import SupervisorHandle, supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(150)  # several crash-and-respawn cycles: slow on a loaded 2-core machine

GRACE_S = 2.0  # how long the restart lasts past the deadline
#: how late an answer may come past its deadline and still count as the deadline's: generous (a
#: loaded 2-core machine), and still far below the 30 s the slow fault would take without one
LATE_S = 10.0
REQUEST_TIMEOUT_S = 1.0
WASM_TIMEOUT_S = 2.0
#: what supervisor.routing gives a run_wasm: its run time plus DEADLINE_GRACE_S (2 s), at least request_timeout_s
RUN_DEADLINE_S = WASM_TIMEOUT_S + 2.0


def _spec() -> TenantSpec:
    return TenantSpec("parky", request_timeout_s=REQUEST_TIMEOUT_S, wasm_timeout_s=WASM_TIMEOUT_S,
                      max_restarts=50, restart_window_s=600.0)




def _restarting_for(sup: SupervisorHandle, at_least_s: float) -> float:
    """Crash parky's worker until its next restart is put off by at least ``at_least_s`` (the backoff).

    Restarts within the window back off 0, 50 ms, 100 ms ... 5 s; while one is
    due, the tenant has no ready instance but one is coming, so requests are
    parked, not refused. Returns the delay of the restart now pending.
    """
    c = sup.client
    while True:
        c.inject_fault(None, "parky", "crash")  # returns once the process is gone
        rec = tenant(c.status(), "parky")
        delay = 0.05 * 2 ** (rec.restarts - 2) if rec.restarts >= 2 else 0.0
        if delay >= at_least_s:
            assert rec.instances[0].state == "restarting", rec.instances
            return min(delay, 5.0)
        wait_for(lambda: tenant(c.status(), "parky").state == "running", what="parky restarted")


def test_parked_request_expires_at_its_deadline() -> None:
    with supervisor(pool_size=1, log_level="error") as sup:
        c = sup.client
        cap = c.register(None, _spec())
        _restarting_for(sup, REQUEST_TIMEOUT_S + GRACE_S)
        t0 = time.monotonic()
        with pytest.raises(KernelTimeout, match="no instance"):
            c.ping(cap)
        assert REQUEST_TIMEOUT_S - 0.05 <= time.monotonic() - t0 <= REQUEST_TIMEOUT_S + LATE_S


def test_parked_then_dispatched_request_keeps_its_deadline() -> None:
    """Parked until a restart 0.8-1.6 s away, then sent to the restarted worker, which does not answer:
    still answered by its original deadline."""
    with supervisor(pool_size=1, log_level="error") as sup:
        c = sup.client
        cap = c.register(None, _spec())
        _restarting_for(sup, 0.8)
        waiter = sup.connect(timeout_s=30)
        t0 = time.monotonic()
        # about half a second of real work in the guest, well inside its 2 s run limit
        waiter.send("run_wasm", cap, {"export": "run", "args": [1 << 18, 1500], "timeout_s": WASM_TIMEOUT_S},
                    guest_path("long_job").read_bytes())
        wait_for(lambda: tenant(c.status(), "parky").parked == 1, interval_s=0.002, what="parked")
        wait_for(lambda: tenant(c.status(), "parky").in_flight == 1, interval_s=0.002, what="dispatched")
        c.inject_fault(None, "parky", "slow", instance=0, ms=30_000)  # the run's reply will not come in time
        _, ok, payload, _ = waiter.recv()
        latency = time.monotonic() - t0
        waiter.close()
        assert not ok and isinstance(error_from_dict(payload), KernelTimeout), payload
        assert latency <= RUN_DEADLINE_S + LATE_S, (
            f"answered {latency:.2f} s after it was sent; its deadline was {RUN_DEADLINE_S:g} s")
