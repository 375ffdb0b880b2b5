"""Start real supervisors for tests (``launch()`` with fast test settings) and poll for conditions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from shared.records import StatusRecord, TenantRecord
from supervisor.client.launch import SupervisorHandle, launch
from tests.helpers import zygote
from tests.helpers.timeouts import scaled

T = TypeVar("T")

#: fast failure detection for tests; everything else as in production. The liveness window
#: (interval x liveness, 2.5 s; production: 3 s) is no hair-trigger: a worker starved of CPU for
#: a second or two on a loaded machine must not be killed in a test that is not about heartbeats
#: (its silence is judged from its first missed beat, half a second in, less what it then waited
#: for a CPU). Beats every 0.5 s, not every 0.2: each one, both ways for every worker of every
#: supervisor the suite starts, wakes both processes' loops and libzmq's I/O threads, and an idle
#: supervisor with three workers took 1.1-1.4 % of a core at 0.2 s, 0.75-0.8 % at 0.5 s; what a hung
#: worker's detection takes (2.5-3 s, was 2-2.2 s) only the few tests that wait for one see.
FAST = {
    "heartbeat_interval_s": 0.5,
    "heartbeat_liveness": 5,
    "stop_timeout_s": 3.0,
    "kill_grace_s": 0.5,
    "pool_size": 0,
    "backend": "stub",
    # a stop drains what is in flight for at most this long (production: 35 s): a test that stops its
    # supervisor with a hung request waits no longer (tests/supervisor/lifecycle/test_drain.py sets its own)
    "drain_timeout_s": 2.0,
}


def default_start_method() -> str | None:
    """How :func:`supervisor`'s supervisors start workers unless a test names a method.

    ``forkserver`` while the suite's zygote forks supervisors (tests/helpers/zygote.py): the
    supervisor's fork server is then a fork of the zygote's child, which has the workers' preload
    imported already, so each worker costs a fork (~0.03 s of CPU) instead of a fresh ``spawn``
    interpreter (~0.15 s), and the fork server itself almost nothing; the suite starts hundreds of
    workers. Without the zygote (``PYTEST_TWT_ZYGOTE=0``) the product's default (``spawn``): a
    cold fork server costs more than it saves for one or two workers. A supervisor started through
    ``launch()`` directly, or ``twt supervise``, that names no method gets the same from the zygote
    (:func:`tests.helpers.zygote.with_start_method`). ``spawn`` stays covered by every test that
    names it and by the supervisors that are not forked.
    """
    return "forkserver" if zygote.enabled() else None


@contextmanager
def supervisor(tenants: list[dict[str, Any]] | None = None, **settings: Any) -> Iterator[SupervisorHandle]:
    """A launched supervisor on the stub backend with FAST settings (overridable), its workers
    started by :func:`default_start_method` unless ``start_method`` is given."""
    sup_settings = {**FAST, **settings}
    start_method = sup_settings.pop("start_method", None) or default_start_method()
    with launch({"supervisor": sup_settings, "tenant": tenants or []}, start_method=start_method) as handle:
        yield handle


#: the least time a wait_for gives its event (see wait_for)
MIN_WAIT_S = 30.0


#: :func:`wait_for`'s polls without an ``interval_s`` of the caller's: the first after 20 ms, each
#: later one half as long again after the last, up to 50 ms apart. A poll is a status call or two
#: (~0.5 ms of CPU on each side); most waits end within a few polls, and the longer ones (restarts on
#: a loaded host: seconds) polled 50 times a second for nothing
FIRST_INTERVAL_S, MAX_INTERVAL_S = 0.02, 0.05


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float | None = None,
             what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout_s``.

    The timeout only turns a hang into a failure with a message; it never asserts speed. So it is
    scaled like every hang guard (:func:`~tests.helpers.timeouts.scaled`) and at least
    :data:`MIN_WAIT_S`, whatever the caller wrote: on a loaded machine a restart may take many
    times what it takes on a quiet one, and a passing test returns as soon as the event comes.
    ``interval_s``: a fixed time between polls (a test that must catch a state soon after it comes);
    without it they back off from :data:`FIRST_INTERVAL_S` to :data:`MAX_INTERVAL_S`.
    """
    timeout_s = max(scaled(timeout_s), MIN_WAIT_S)
    deadline = time.monotonic() + timeout_s
    last: Any = None
    pause = FIRST_INTERVAL_S if interval_s is None else interval_s
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(pause)
        if interval_s is None:
            pause = min(MAX_INTERVAL_S, pause * 1.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate!r} (last: {last!r})")


def wait_for_count(count: Callable[[], int], target: int, stall_s: float = MIN_WAIT_S, interval_s: float = 0.1,
                   what: str = "") -> int:
    """Poll ``count`` until it reaches ``target``; fail only when it stops moving for ``stall_s``.

    For a test that waits for an amount of work (a flood of thousands of requests): how long that
    work takes depends on the machine and what runs beside it, so no fixed bound fits every host.
    As long as the count keeps growing the wait goes on (the test's own timeout still ends a
    hang); a count that stands still fails with the figure it reached.
    """
    stall_s = max(stall_s, MIN_WAIT_S)
    last = count()
    moved = time.monotonic()
    while last < target:
        time.sleep(interval_s)
        now = count()
        if now != last:
            last, moved = now, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise AssertionError(f"{what or 'the count'} stopped at {last} of {target} (no progress for {stall_s} s)")
    return last


def tenant(status: StatusRecord, tenant_id: str) -> TenantRecord:
    record = status.tenant(tenant_id)
    if record is None:
        raise KeyError(tenant_id)
    return record


def instance_pid(handle: SupervisorHandle, tenant_id: str, index: int = 0) -> int | None:
    inst = tenant(handle.client.status(), tenant_id).instances[index]
    return inst.pid if inst.state == "ready" else None
