"""The shared-memory data regions this supervisor owns for local clients, each bound to one tenant.

    region_create {nbytes}           RegionTable.create   charge the tenant's host quota, then
      + the peer's pid (SO_PEERCRED)                      create the segment (0600, unguessable name)
    write_region / read_region       RegionTable.resolve  the tenant's own region, or refused; the
      {region, region_offset, ...}                        forwarded args get the region's *name*
    region_release {region}          RegionTable.release  unlink, uncharge (workers are told to unmap)
    housekeeping (every second)      RegionTable.reap     regions whose client process died
    evict / shutdown                 release_tenant/close every region of the tenant / all of them

Room in ``/dev/shm``: a region's pages are reserved when it is created
(``posix_fallocate``, in :func:`shared._shm.create`), so a full ``/dev/shm``
refuses the region (``SegmentError``) instead of a SIGBUS later. And regions
together may use only what ``/dev/shm`` has free minus :data:`SHM_RESERVE_BYTES`,
kept for the quota blocks of tenants still to come and the device budgets:
filling ``/dev/shm`` with regions (within a tenant's host quota, which is
sized for RAM, not for a container's 64 MiB ``/dev/shm``) can no longer
refuse the next registration.

Ownership: the supervisor creates every region (so it owns the name and
unlinks it; its resource tracker and the next supervisor's stale-segment
sweep remove what a killed supervisor left) and charges its bytes to the
tenant's host memory quota until it is released. A region records the client
process that asked for it (pid and start time, so a reused pid is not taken
for it); when that process is gone the region is reclaimed at the next
sweep, and at the latest when its tenant is evicted. That pid is never the
client's word: it is what the kernel recorded for the ipc connection the
request came on (``SO_PEERCRED``, which libzmq appends to an ipc peer's
address: ``Peer-Address`` = ``"...:uid:gid:pid"``, read by
:func:`ipc_peer_pid`). A client that claims pid 1 (alive for ever) gets a region
owned by itself all the same, reclaimed when it exits. A request without peer
credentials gets no region. TCP clients get none either (they cannot map
this host's memory: the frontend refuses the region ops there).

All of it runs on the supervisor's loop thread.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Final

from shared import _shm
from shared.checks import is_int
from shared.errors import InvalidArgument, SegmentError
from shared.log import get_logger, log_event
from shared.quota import process_alive, process_start_ms
from shared.records import RegionRecord
from shared.region import DATA_OFFSET, Region, round_region_size
from supervisor.store.tenant_quota import TenantQuota

__all__ = ["MAX_REGIONS_PER_TENANT", "SHM_RESERVE_BYTES", "OwnedRegion", "RegionTable", "ipc_peer_pid",
           "shm_free_bytes"]

_log = get_logger("supervisor.routing.regions")

#: regions one tenant may hold at once (their bytes are bounded by its host quota)
MAX_REGIONS_PER_TENANT: Final = 64
#: what regions leave free in /dev/shm: quota blocks (8 KiB each) of 1,024 more tenants
SHM_RESERVE_BYTES: Final = 8 << 20


def ipc_peer_pid(address: object) -> int | None:
    """The process id in an ipc peer's address as libzmq reports it where ``SO_PEERCRED``
    exists (``"<path>:<uid>:<gid>:<pid>"``: the message property ``Peer-Address``); None when
    the address carries no credentials (another transport, or a libzmq built without them)."""
    if not isinstance(address, str):
        return None
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    pid = int(parts[3])
    return pid if pid > 0 else None  # 0: the peer is in a pid namespace the supervisor cannot see


def shm_free_bytes(path: str = _shm.SHM_DIR) -> int | None:
    """Bytes an unprivileged process may still allocate in ``path`` (None: cannot tell)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@dataclass(eq=False)
class OwnedRegion:
    """One region: its segment (owned), its tenant and quota block, and the client it serves."""

    region_id: int
    tenant_id: str
    region: Region
    block: TenantQuota
    client_pid: int
    client_start_ms: int
    created_at: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        return self.region.name

    @property
    def nbytes(self) -> int:
        """Bytes charged to the tenant: the data capacity (the header page is ours)."""
        return self.region.capacity

    def to_record(self) -> RegionRecord:
        return RegionRecord(region=self.region_id, nbytes=self.nbytes, pid=self.client_pid,
                            age_s=round(time.time() - self.created_at, 3))


class RegionTable:
    """Every region of one supervisor, by id and by tenant."""

    def __init__(self, prefix: str, *, max_per_tenant: int = MAX_REGIONS_PER_TENANT,
                 shm_reserve_bytes: int = SHM_RESERVE_BYTES) -> None:
        self.prefix = prefix
        self.max_per_tenant = max_per_tenant
        self.shm_reserve_bytes = shm_reserve_bytes
        self._by_id: dict[int, OwnedRegion] = {}
        self._by_tenant: dict[str, dict[int, OwnedRegion]] = {}
        self._next_id = 1

    def create(self, tenant_id: str, block: TenantQuota, nbytes: object, client_pid: object,
               *, generation: int = 0) -> OwnedRegion:
        """A new region for ``tenant_id``'s client process ``client_pid``: the pid the kernel
        reported for its connection (:func:`ipc_peer_pid`), never one the client sent; None
        when its connection carries none.

        Raises InvalidArgument (size, no or a dead client process, too many regions),
        MemoryExhausted (the tenant's host quota) or SegmentError (no room in /dev/shm past
        its reserve, or the tenant's quota block is unusable); nothing is held then.
        """
        size = round_region_size(nbytes)
        if not is_int(client_pid) or client_pid <= 0:
            raise InvalidArgument("region_create: the supervisor cannot tell which process this client is (its "
                                  "connection carries no peer credentials); regions serve local ipc clients only")
        try:
            start_ms = process_start_ms(client_pid)
        except (ProcessLookupError, OSError):
            raise InvalidArgument(f"region_create: the client process {client_pid} has exited") from None
        held = self._by_tenant.get(tenant_id, {})
        if len(held) >= self.max_per_tenant:
            raise InvalidArgument(f"tenant {tenant_id!r} holds {len(held)} regions already "
                                  f"(limit {self.max_per_tenant}); release one first")
        free = shm_free_bytes()
        if free is not None and DATA_OFFSET + size > free - self.shm_reserve_bytes:
            raise SegmentError(_shm.SHM_DIR, f"no room for a region of {size:,} B: {max(0, free):,} B free, "
                                             f"{self.shm_reserve_bytes:,} B of it kept for quota blocks; release "
                                             "regions (or enlarge /dev/shm)")
        if block.closed:  # checks the block's size first: a truncated one would be a SIGBUS
            raise SegmentError(block.name, f"the quota block of {tenant_id!r} is unusable (truncated or closed)")
        block.consume_bytes(size)  # MemoryExhausted: nothing else happens
        try:
            region = Region.create(tenant_id, size, prefix=self.prefix, generation=generation)
        except BaseException:
            block.release_bytes(size)
            raise
        rec = OwnedRegion(self._next_id, tenant_id, region, block, client_pid, start_ms)
        self._next_id += 1
        self._by_id[rec.region_id] = rec
        self._by_tenant.setdefault(tenant_id, {})[rec.region_id] = rec
        log_event(_log, logging.INFO, "region.create", tenant=tenant_id, region=rec.region_id,
                  nbytes=size, pid=client_pid)
        return rec

    def resolve(self, tenant_id: str, region_id: object) -> OwnedRegion:
        """``tenant_id``'s region ``region_id``; another tenant's is as unknown as a released one."""
        if not is_int(region_id):
            raise InvalidArgument(f"region must be an int id, got {type(region_id).__name__}")
        rec = self._by_id.get(region_id)
        if rec is None or rec.tenant_id != tenant_id:
            raise InvalidArgument(f"unknown region {region_id} (never created by this tenant, or released)")
        return rec

    def release(self, tenant_id: str, region_id: object) -> OwnedRegion:
        """Release one of ``tenant_id``'s regions (the caller tells the workers to unmap it)."""
        rec = self.resolve(tenant_id, region_id)
        self._drop(rec, "released")
        return rec

    def release_tenant(self, tenant_id: str) -> list[OwnedRegion]:
        """Every region of a tenant (eviction: before its quota block goes)."""
        recs = list(self._by_tenant.get(tenant_id, {}).values())
        for rec in recs:
            self._drop(rec, "tenant evicted")
        return recs

    def reap(self) -> list[OwnedRegion]:
        """Release the regions whose client process is gone; returns them."""
        dead = [rec for rec in self._by_id.values() if not process_alive(rec.client_pid, rec.client_start_ms)]
        for rec in dead:
            self._drop(rec, "client died")
        return dead

    def of_tenant(self, tenant_id: str) -> list[OwnedRegion]:
        return list(self._by_tenant.get(tenant_id, {}).values())

    def bytes_of(self, tenant_id: str) -> int:
        return sum(rec.nbytes for rec in self._by_tenant.get(tenant_id, {}).values())

    def __len__(self) -> int:
        return len(self._by_id)

    def close(self) -> None:
        """Release everything (supervisor shutdown). Never raises."""
        for rec in list(self._by_id.values()):
            try:
                self._drop(rec, "shutdown")
            except Exception as exc:  # noqa: BLE001 - keep releasing; logged
                log_event(_log, logging.WARNING, "region.release_failed", region=rec.region_id, error=repr(exc))

    def _drop(self, rec: OwnedRegion, reason: str) -> None:
        self._by_id.pop(rec.region_id, None)
        held = self._by_tenant.get(rec.tenant_id)
        if held is not None:
            held.pop(rec.region_id, None)
            if not held:
                del self._by_tenant[rec.tenant_id]
        nbytes = rec.nbytes
        try:
            rec.region.unlink()  # clients' and workers' mappings stay valid until they unmap
            rec.region.close()
        finally:
            if not rec.block.closed:
                rec.block.release_bytes(nbytes)
        log_event(_log, logging.INFO, "region.release", tenant=rec.tenant_id, region=rec.region_id,
                  nbytes=nbytes, reason=reason)
