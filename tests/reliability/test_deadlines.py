"""A request's deadline runs from when the supervisor received it, whatever happens to it meanwhile.

A request that finds no ready instance is parked; it must be answered by
its deadline whether no instance comes back in time, or one does and then
does not answer.
"""

from __future__ import annotations

import os
import signal
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
#: the parked-then-dispatched ping's deadline: far above what a restart takes on a loaded machine, so
#: that the ping is dispatched before it, and far below the blocker's run time, so that it expires
#: while the worker is busy
PING_DEADLINE_S = 10.0
#: how long the blocker run holds the worker's executor (its own time limit)
BLOCKER_S = 60.0
#: the restart backoff while the two requests are sent and seen parked (at least this long: two sends
#: and a few status polls, on a loaded machine)
PARK_AT_LEAST_S = 3.2
#: heartbeats a worker may miss before it is taken for hung (0.2 s each here): a window (20 s)
#: longer than the ping's deadline, which the stopped worker outlives
HUNG_AFTER_BEATS = 100


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
    """Parked until a restart, then sent to the restarted worker, which does not answer it: answered
    KernelTimeout by its original deadline, counted from when the supervisor received it.

    The worker does not answer because it is busy: a runaway run parked just before the ping holds
    its one executor for ``BLOCKER_S`` (the run's own limit, shortened to fit its deadline; a
    loaded machine only makes it later), far past the ping's deadline. So nothing here races the
    host's speed - no fault armed after the dispatch, no window in which to observe the dispatch.

    Once both are seen dispatched the worker is stopped (SIGSTOP): it could not have answered the
    ping anyway (its executor is the runaway's), and the runaway no longer burns a core until the
    deadline (~6 s of CPU). The liveness window is longer than the ping's deadline, so the stopped
    worker is killed for the missed deadline, as the busy one is, never taken for hung first.
    """
    spec = TenantSpec("parky", request_timeout_s=PING_DEADLINE_S, wasm_timeout_s=BLOCKER_S,
                      wasm_fuel=(1 << 62), max_restarts=50, restart_window_s=600.0)
    with supervisor(pool_size=1, log_level="error", heartbeat_liveness=HUNG_AFTER_BEATS) as sup:
        c = sup.client
        cap = c.register(None, spec)
        runaway = guest_path("runaway").read_bytes()
        waiter = sup.connect(timeout_s=BLOCKER_S + LATE_S)
        try:
            _restarting_for(sup, PARK_AT_LEAST_S)  # then nothing but the two sends before the restart
            # one socket: the supervisor receives them in this order, parks both, and sends both,
            # in this order, to the restarted worker, which runs one request at a time
            blocker = waiter.send("run_wasm", cap, {"export": "run", "timeout_s": BLOCKER_S}, runaway)
            t0 = time.monotonic()
            ping = waiter.send("ping", cap)
            wait_for(lambda: tenant(c.status(), "parky").parked == 2, interval_s=0.002, what="both parked")
            # both dispatched, in order, to the restarted worker: the runaway holds its executor
            rec = wait_for(lambda: (r := tenant(c.status(), "parky")).parked == 0 and r.in_flight == 2 and r,
                           what="both dispatched")
            os.kill(rec.instances[0].pid, signal.SIGSTOP)  # killed (SIGKILL) at the missed deadline
            replies = {}
            while ping not in replies:
                rid, ok, payload, _ = waiter.recv()
                replies[rid] = (ok, payload, time.monotonic() - t0)
            ok, payload, latency = replies[ping]
            assert not ok, payload
            exc = error_from_dict(payload)
            assert isinstance(exc, KernelTimeout), payload
            # answered from the worker's side of the deadline (dispatched), not as a parked request
            # that no instance came for: the ping deadline is far above a restart's duration
            assert "no instance" not in str(exc), exc
            # the deadline it was answered at is the one set when it arrived, not one restarted at dispatch
            assert exc.timeout_s == pytest.approx(PING_DEADLINE_S), exc
            assert PING_DEADLINE_S - 0.05 <= latency <= PING_DEADLINE_S + LATE_S, (
                f"answered {latency:.2f} s after it was sent; its deadline was {PING_DEADLINE_S:g} s")
            # the blocker's worker was killed for the missed deadline: it is answered too, never left hanging
            while blocker not in replies:
                rid, ok, payload, _ = waiter.recv()
                replies[rid] = (ok, payload, time.monotonic() - t0)
            assert not replies[blocker][0], replies[blocker]
        finally:
            waiter.close()
