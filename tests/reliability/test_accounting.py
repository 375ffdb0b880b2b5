"""What a tenant can learn about its own buffers agrees with the quota counters, on every instance."""

from __future__ import annotations

import pytest

from shared import protocol as proto
from shared.spec import TenantSpec
from supervisor.tools.chaos import reconcile
from tests.helpers.cluster import supervisor, tenant

pytestmark = pytest.mark.timeout(60)


def test_buffers_lists_every_instance() -> None:
    with supervisor(log_level="error") as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("two").with_instances(2))
        held = {c.alloc(cap, 4096 * (i + 1)): 4096 * (i + 1) for i in range(6)}
        assert {proto.handle_instance(h) for h in held} == {0, 1}  # spread over both instances
        # the counters know where every byte is ...
        assert reconcile(tenant(c.status(), "two"), held).ok
        # ... and so should the tenant
        assert c.buffers(cap) == held
