"""A guest's output flood through a real supervisor and worker: the run answers with its own deadline's
timeout (or out of fuel), never the tenant's request timeout, and the same worker serves the next run.

The guest (tests/helpers/wasm_bombs.py ``output_flood``) makes fd_write calls of 1,024 iovecs over the
same 1 MiB of newlines (1 GiB a call) in a loop. Handled a line at a time, one call held the worker for
hours: no answer came before the request timeout, and the supervisor killed the worker. The request
timeout here (60 s, and the client's own 30 s wait) is only the bound within which a run stuck inside
one host call is seen for what it is on a loaded machine; the run's own deadline is 0.5 s, and the test
asserts the outcome, not the time.
"""

from __future__ import annotations

import pytest

from shared.errors import KernelTimeout, WasmTrap
from shared.spec import TenantSpec
from tests.helpers.cluster import instance_pid, supervisor, tenant
from tests.helpers.wasm_bombs import output_flood

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def test_an_output_flood_ends_with_the_runs_deadline_or_fuel_and_the_worker_lives() -> None:
    spec = TenantSpec.from_dict({"tenant_id": "talker", "wasm_timeout_s": 0.5, "request_timeout_s": 60.0,
                                 "wasm_max_memory_bytes": 4 * MiB, "wasm_fuel": 10**15})
    flood = output_flood()
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, spec)
        pid = instance_pid(sup, "talker")
        with pytest.raises(KernelTimeout) as timeout:
            c.run_wasm(cap, flood, "flood")
        assert timeout.value.timeout_s == 0.5  # the run's deadline, not the request's
        with pytest.raises(WasmTrap) as trap:
            c.run_wasm(cap, flood, "flood", fuel=10**8)  # less than one call costs
        assert trap.value.trap_code == "out_of_fuel"
        reply = c.run_wasm(cap, flood, "once", fuel=10**9)
        assert reply.results == (0,) and len(reply.logs) + reply.logs_dropped == 1 << 20
        assert instance_pid(sup, "talker") == pid
        assert tenant(c.status(), "talker").restarts == 0
