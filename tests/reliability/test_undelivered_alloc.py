"""No allocation outlives its request unless its client was told of it.

A client sends ``alloc`` and is gone before the reply (here: a ``slow`` fault holds the worker's
reply back while the client's socket closes). The worker allocated and the tenant is charged, but
the reply cannot be delivered (EHOSTUNREACH): the supervisor frees the buffer, so the tenant's quota
does not shrink for bytes nobody holds. Real supervisor, stub backend; waits for events, not times.
"""

from __future__ import annotations

import pytest

from shared import protocol as proto
from shared.spec import TenantSpec
from tests.helpers.cluster import supervisor, tenant, wait_for
from tests.helpers.raw_client import dealer

pytestmark = pytest.mark.timeout(120)


def test_an_alloc_whose_client_left_before_the_reply_is_freed() -> None:
    with supervisor(log_level="error") as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("t"))
        kept = c.alloc(cap, 8192)  # a buffer its client holds: it stays charged
        c.inject_fault(None, "t", "slow", ms=1500)  # replies held back 1.5 s (within the 2 s deadline)
        sock = dealer(sup.run_dir)
        sock.send(proto.encode_request(1, "alloc", cap.to_bytes(), {"nbytes": 65536}))

        def gpu() -> int:
            return int(tenant(c.status(), "t").gpu_bytes_in_use)

        wait_for(lambda: gpu() == 8192 + 65536, timeout_s=30, what="the worker allocated")
        sock.close(0)  # gone before the reply
        wait_for(lambda: gpu() == 8192, timeout_s=30, what="the undelivered allocation freed")
        c.inject_fault(None, "t", "slow", ms=0)
        assert c.buffers(cap) == {kept: 8192}
        assert tenant(c.status(), "t").restarts == 0  # freed, not by replacing the worker
