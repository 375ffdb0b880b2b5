"""A parked file deleted or truncated from outside (supervisor.lifecycle.parking): the buffers it
held are lost - their handles answer BufferLost - and the tenant activates with the rest of its
state (its other instance's buffers, its modules, its quota) instead of failing every activation."""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest

from shared import protocol as proto
from shared.errors import BufferLost
from supervisor.client.api import SupervisorClient
from supervisor.tools.demo import guest_path
from tests.helpers.cluster import supervisor, tenant
from tests.helpers.events import event_cursor, pattern, wait_event

pytestmark = pytest.mark.timeout(180)

IDLE = 0.3








def _park(c: SupervisorClient, tid: str) -> dict[str, Any]:
    mark = event_cursor(c)
    c.set_quota(None, tid, idle_timeout_s=IDLE)
    park = wait_event(c, "park", tid, mark)
    c.set_quota(None, tid, idle_timeout_s=3600.0)  # parked now: it stays active once woken
    return park


def _file_holding(run_dir: str, data: bytes) -> str:
    for path in glob.glob(os.path.join(run_dir, "parked", "p*")):
        with open(path, "rb") as f:
            if f.read() == data:
                return path
    raise AssertionError("no parked file holds those bytes")


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_lost_parked_file_loses_its_buffers_and_the_tenant_activates_with_the_rest(how: str) -> None:
    with supervisor([{"name": "torn", "instances": 2}], pool_size=2, pool_max=2) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "torn")
        lost = c.alloc(cap, 6000, instance=0)
        kept = c.alloc(cap, 5000, instance=1)
        c.write(cap, lost, pattern(6000, 3))
        c.write(cap, kept, pattern(5000, 4))
        digest = c.put_module(cap, guest_path("probe").read_bytes())
        assert c.run_wasm(cap, digest, "add", [2, 3]).results == (5,)
        before = c.quota(cap)
        park = _park(c, "torn")
        assert park["buffers"] == 2
        path = _file_holding(sup.run_dir, pattern(6000, 3))
        if how == "deleted":
            os.unlink(path)
        else:
            os.truncate(path, 100)
        mark = event_cursor(c)
        assert c.read(cap, kept, 5000) == pattern(5000, 4)  # the request that wakes it is served
        woke = wait_event(c, "activate", "torn", mark)
        assert woke["lost"] == 1 and woke["buffers"] == 1
        assert tenant(c.status(), "torn").state == "running"
        for op in (lambda: c.read(cap, lost, 16), lambda: c.write(cap, lost, b"x"), lambda: c.free(cap, lost)):
            with pytest.raises(BufferLost):
                op()
        assert c.buffers(cap) == {kept: 5000}
        # the rest of its state: the module still runs, the lost buffer's bytes left its quota
        assert c.run_wasm(cap, digest, "add", [20, 22]).results == (42,)
        now = c.quota(cap)
        assert now.gpu_bytes_in_use == 5000
        assert now.bytes_in_use == before.bytes_in_use
        # the instance goes on: a new buffer there never takes the lost one's name
        fresh = c.alloc(cap, 64, instance=0)
        assert proto.handle_seq(fresh) > proto.handle_seq(lost)
        c.write(cap, fresh, b"back")
        assert c.read(cap, fresh, 4) == b"back"
        assert not os.path.exists(path)  # its name went when it was found lost
        # parked and woken again: the lost handle still answers BufferLost, the rest comes back
        _park(c, "torn")
        mark = event_cursor(c)
        assert c.read(cap, fresh, 4) == b"back"
        assert wait_event(c, "activate", "torn", mark)["lost"] == 0
        with pytest.raises(BufferLost):
            c.read(cap, lost, 16)
        assert c.read(cap, kept, 5000) == pattern(5000, 4)
