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
from supervisor.demo import guest_path
from tests.helpers.cluster import supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(60)

GRACE_S = 2.0  # a margin that holds on a loaded 2-core machine
REQUEST_TIMEOUT_S = 1.0
WASM_TIMEOUT_S = 2.0
#: what supervisor.routing gives a run_wasm: its run time plus DEADLINE_GRACE_S (2 s), at least request_timeout_s
RUN_DEADLINE_S = WASM_TIMEOUT_S + 2.0


def _spec() -> TenantSpec:
    return TenantSpec("parky", request_timeout_s=REQUEST_TIMEOUT_S, wasm_timeout_s=WASM_TIMEOUT_S)




def test_parked_request_expires_at_its_deadline() -> None:
    with supervisor(pool_size=1) as sup:
        c = sup.client
        cap = c.register(None, _spec())
        c.scale(None, "parky", 0)
        wait_for(lambda: not tenant(c.status(), "parky")["instances"], what="no instance left")
        t0 = time.monotonic()
        with pytest.raises(KernelTimeout, match="no instance"):
            c.ping(cap)
        assert REQUEST_TIMEOUT_S - 0.05 <= time.monotonic() - t0 <= REQUEST_TIMEOUT_S + GRACE_S


def test_parked_then_dispatched_request_keeps_its_deadline() -> None:
    """Parked 1.5 s, then sent to a worker that does not answer: still answered by its original deadline."""
    with supervisor(pool_size=1, heartbeat_interval_s=1.0, heartbeat_liveness=10) as sup:
        c = sup.client
        cap = c.register(None, _spec())
        c.scale(None, "parky", 0)
        wait_for(lambda: not tenant(c.status(), "parky")["instances"], what="no instance left")
        waiter = sup.connect(timeout_s=30)
        t0 = time.monotonic()
        # about half a second of real work in the guest, well inside its 2 s run limit
        waiter.send("run_wasm", cap, {"export": "run", "args": [1 << 18, 1500], "timeout_s": WASM_TIMEOUT_S},
                    guest_path("long_job").read_bytes())
        time.sleep(1.5)
        c.scale(None, "parky", 1)
        wait_for(lambda: tenant(c.status(), "parky")["in_flight"] == 1, interval_s=0.002, what="dispatched")
        c.inject_fault(None, "parky", "slow", instance=0, ms=30_000)  # the run's reply will not come in time
        _, ok, payload, _ = waiter.recv()
        latency = time.monotonic() - t0
        waiter.close()
        assert not ok and isinstance(error_from_dict(payload), KernelTimeout), payload
        assert latency <= RUN_DEADLINE_S + GRACE_S, (
            f"answered {latency:.2f} s after it was sent; its deadline was {RUN_DEADLINE_S:g} s")
