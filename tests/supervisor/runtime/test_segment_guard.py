"""A same-uid process truncating a tenant's quota block cannot crash the supervisor.

Same-uid clients are trusted (outside the threat model), but one ``ftruncate`` must not take every
tenant down with a SIGBUS: the supervisor keeps its quota blocks' fds and checks their size before
touching them (shared._segment.MappedSegment._closed), so the truncated tenant's requests are
refused with SegmentError and every other tenant is served. Real supervisor, stub backend.
"""

from __future__ import annotations

import os

import pytest

from shared import _shm
from shared.errors import SegmentError, TensorWasmError
from shared.quota import KIND_TENANT, SEGMENT_PREFIX, read_header
from tests.helpers.cluster import supervisor, wait_for

pytestmark = pytest.mark.timeout(120)


def _block_of(tenant: str, owner_pid: int) -> str:
    """``tenant``'s quota block of the supervisor ``owner_pid`` - never another test's: tests run in
    parallel, and another supervisor may have a tenant of the same name."""
    for name in _shm.list_segments(SEGMENT_PREFIX):
        try:
            header = read_header(name)
        except (SegmentError, OSError):
            continue
        if header.kind == KIND_TENANT and header.label == tenant and header.owner_pid == owner_pid:
            return name
    raise AssertionError(f"no quota block of {tenant!r}")


def test_a_truncated_quota_block_is_refused_not_a_sigbus() -> None:
    with supervisor([{"name": "victim"}, {"name": "bystander"}]) as sup:
        c = sup.client
        victim = c.tenant_capability(None, "victim")
        bystander = c.tenant_capability(None, "bystander")
        c.alloc(victim, 4096)
        os.truncate(os.path.join(_shm.SHM_DIR, _block_of("victim", sup.pid)), 0)
        with pytest.raises(SegmentError):
            c.quota(victim)  # the frontend's snapshot
        with pytest.raises(SegmentError):
            c.region_create(victim, 64 << 10)  # a consume on the block
        with pytest.raises(SegmentError):
            c.set_quota(None, "victim", memory_quota_bytes="1GiB")  # set_limits
        try:
            c.alloc(victim, 4096)  # the worker touches the block: it may die of it, never the supervisor
        except TensorWasmError:
            pass
        status = c.status()  # tenant records (snapshots) of every tenant
        assert {t.tenant_id for t in status.tenants} == {"victim", "bystander"}

        def victim_worker_gone() -> bool:  # died of the SIGBUS; its death was handled (reclaim guarded)
            rec = next(t for t in c.status().tenants if t.tenant_id == "victim")
            return rec.restarts >= 1 or rec.state != "running"

        wait_for(victim_worker_gone, timeout_s=30, what="the victim's worker replaced")
        c.ping(bystander)
        c.alloc(bystander, 4096)
        c.evict(None, "victim")  # unlinks and closes the truncated block
        c.ping(bystander)
        assert sup.process.poll() is None
        assert c.status().supervisor.internal_errors == 0
