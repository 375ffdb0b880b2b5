"""A tenant's quota as the supervisor holds it: a shared-memory block while workers run, a record otherwise.

    registered / restored ──► RECORD  (QuotaCounters: limits, marks, counts, GPU time, the
          ▲                      │     supervisor's own charges; no segment, no fd, no mapping)
          │                      │ open(): a worker is about to be bound
          │                      ▼
          └─── close_segment() ─ SEGMENT (QuotaBlock: the workers consume on it directly)
               (no worker alive: parked, stopped, failed, completed)

A worker attaches the block by the name its bind message carries, so the block
only has to exist while a worker of the tenant may be attached: from the bind
of its first worker until its last worker is gone and reclaimed. In between the
tenant's whole quota state is a :class:`~shared.quota.QuotaCounters` of a few
hundred bytes, and ``open()`` makes a fresh segment from it (a new name, the
same counters) before the next bind is sent: nothing a snapshot shows changes
across the round trip except the segment's name.

Tenants registered with the same limits at the same generation share one
record until one of them changes (copy on write): ten thousand fresh tenants
cost one record, not ten thousand. The supervisor's own charges (a parked
tenant's buffer copies, its data regions) go to the record while there is no segment, with the block's rules
(:class:`~shared.quota.QuotaCounters`), and move into the segment's
unattributed share when it is made.

Owns: the tenant's block and its record. Loop thread only (an in-process
:class:`~supervisor.store.registry.TenantRegistry` creates blocks eagerly and
never closes them early, so its threads see a plain block).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from shared.errors import SegmentError
from shared.ids import tenant_name
from shared.quota import GPU_WAIT_BUCKETS_S, UNCHANGED, QuotaBlock, QuotaCounters, QuotaSnapshot, Unchanged

__all__ = ["TenantQuota", "kept_counters", "kept_counters_json"]

#: the counters a parked tenant's state row keeps across a supervisor restart: what only grows
#: (high-water marks, refusals, underflows) and the GPU time accounted. The limits are the spec's
#: (stored with it), the generation is the row's, and what the tenant *holds* is not kept: its
#: host copies and regions live in the supervisor's memory and do not survive the restart, so
#: a restored tenant holds nothing
_KEPT_MARKS = ("cpu_high_water", "cpu_refusals", "cpu_underflows", "gpu_high_water", "gpu_refusals", "gpu_underflows")
_KEPT_GPU_TIME = ("gpu_time_ns", "gpu_ops", "gpu_waits", "gpu_wait_ns", "gpu_throttled")
#: the form of the kept counters (a later one that cannot be read is refused, never misread)
_KEPT_FORM = 1


def kept_counters_json(snap: QuotaSnapshot) -> str:
    """What a parked tenant's state row keeps of its quota (see _KEPT_MARKS), as compact JSON."""
    data: dict[str, object] = {"form": _KEPT_FORM}
    data.update({name: getattr(snap, name) for name in _KEPT_MARKS})
    data.update({name: getattr(snap, name) for name in _KEPT_GPU_TIME})
    data["gpu_wait_bins"] = list(snap.gpu_wait_bins)
    return json.dumps(data, separators=(",", ":"))


def kept_counters(raw: str, *, generation: int, memory_quota_bytes: int, gpu_memory_bytes_cap: int | None,
                  cuda_mem_pool_quota_bytes: int | None) -> QuotaCounters:
    """The record a restored parked tenant starts from: ``raw`` (:func:`kept_counters_json`) with
    the limits and generation given (the spec's and the row's). Holds nothing (see _KEPT_MARKS).
    ValueError naming the problem when ``raw`` is not kept counters of a form this version reads.

    A wait histogram of another bucket count (GPU_WAIT_BUCKETS_S changed between versions)
    cannot be mapped bucket to bucket: its totals are kept and the histogram starts empty."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"kept quota counters are not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("form") != _KEPT_FORM:
        raise ValueError(f"kept quota counters of an unknown form: {str(raw)[:80]!r}")
    record = QuotaCounters(generation=generation, memory_quota_bytes=memory_quota_bytes,
                           gpu_memory_bytes_cap=gpu_memory_bytes_cap,
                           cuda_mem_pool_quota_bytes=cuda_mem_pool_quota_bytes)

    for name in _KEPT_MARKS:
        setattr(record, name, _amount(name, data.get(name, 0)))
    times = tuple(_amount(name, data.get(name, 0)) for name in _KEPT_GPU_TIME)
    bins = data.get("gpu_wait_bins", [])
    if not isinstance(bins, list):
        raise ValueError(f"kept quota counter gpu_wait_bins must be a list, got {bins!r:.40}")
    width = len(GPU_WAIT_BUCKETS_S) + 1
    kept_bins = [_amount("gpu_wait_bins", b) for b in bins]
    if len(kept_bins) != width:
        kept_bins = [0] * width
    gpu_time = (*times, *kept_bins)
    record.gpu_time = gpu_time if any(gpu_time) else None
    return record


def _amount(name: str, value: object) -> int:
    """One kept count (ValueError when it is not a non-negative int)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"kept quota counter {name} must be a non-negative int, got {value!r:.40}")
    return value


class TenantQuota:
    """One tenant's quota: its :class:`~shared.quota.QuotaBlock` while it has one, else its counters.

    The methods the supervisor uses on a block (reads, snapshot, live limits, its own
    charges, reclaiming a dead instance's share) work in both forms.
    """

    __slots__ = ("tenant_id", "_block", "_record", "_namer", "_closed", "_shared")

    def __init__(self, tenant_id: str, record: QuotaCounters, namer: Callable[[], str], *,
                 block: QuotaBlock | None = None, shared: bool = False) -> None:
        """``namer()`` names each new segment (the registry's prefix and a fresh slot). With
        ``block``, the tenant starts with its segment (``record`` is then unused). ``shared``:
        ``record`` is shared with other tenants (copied before this one changes it)."""
        self.tenant_id = tenant_name(tenant_id)  # the spec's own str: no copy
        self._block = block
        self._record: QuotaCounters | None = None if block is not None else record
        self._namer = namer
        self._closed = False
        self._shared = shared and block is None

    # ------------------------------------------------------------ the segment

    @property
    def segment(self) -> QuotaBlock | None:
        """The live block, or None while the tenant holds no segment."""
        return self._block

    def open(self) -> str:
        """The segment's name, made now from the record when there is none (before a worker is
        bound: it attaches by this name). SegmentError when closed or when it cannot be made."""
        if self._closed:
            raise SegmentError("", f"the quota of {self.tenant_id!r} is closed (tenant evicted)")
        if self._block is None:
            record = self._record
            assert record is not None
            try:
                self._block = QuotaBlock.create(self.tenant_id, name=self._namer(), counters=record)
            except OSError as exc:  # /dev/shm full or out of descriptors: the bind fails, typed
                raise SegmentError("", f"cannot create the quota segment of {self.tenant_id!r}: {exc}") from None
            self._record = None
            self._shared = False
        return self._block.name

    def close_segment(self) -> bool:
        """Take the segment down, keeping every counter in the record (no worker may be attached:
        a share changed after this read would be lost). True when there was one."""
        block = self._block
        if block is None or self._closed:
            return False
        if block.closed:  # truncated under us: nothing readable to keep; the limits still stand
            return False
        self._record = block.counters()
        self._shared = False
        self._block = None
        block.unlink()
        block.close()
        return True

    # ------------------------------------------------------------ reads

    def _rec(self) -> QuotaCounters:
        record = self._record
        if record is None or self._closed:
            raise SegmentError("", "quota block is closed")
        return record

    def _own(self) -> QuotaCounters:
        """The record, made this tenant's own before it changes (copy on write)."""
        record = self._rec()
        if self._shared:
            record = self._record = record.copy()
            self._shared = False
        return record

    @property
    def name(self) -> str:
        """The segment's name ("" while there is none)."""
        return self._block.name if self._block is not None else ""

    @property
    def closed(self) -> bool:
        """Evicted (or the segment truncated under us); a tenant without a segment is not closed."""
        if self._closed:
            return True
        return self._block.closed if self._block is not None else False

    @property
    def bytes_in_use(self) -> int:
        return self._block.bytes_in_use if self._block is not None else self._rec().bytes_in_use

    @property
    def gpu_bytes_in_use(self) -> int:
        return self._block.gpu_bytes_in_use if self._block is not None else self._rec().gpu_bytes_in_use

    @property
    def memory_quota_bytes(self) -> int:
        return self._block.memory_quota_bytes if self._block is not None else self._rec().memory_quota_bytes

    @property
    def gpu_memory_bytes_cap(self) -> int | None:
        return self._block.gpu_memory_bytes_cap if self._block is not None else self._rec().gpu_memory_bytes_cap

    @property
    def cuda_mem_pool_quota_bytes(self) -> int | None:
        if self._block is not None:
            return self._block.cuda_mem_pool_quota_bytes
        return self._rec().cuda_mem_pool_quota_bytes

    @property
    def generation(self) -> int:
        return self._block.generation if self._block is not None else self._rec().generation

    @property
    def gpu_time_ns(self) -> int:
        return self._block.gpu_time_ns if self._block is not None else self._rec().gpu_time_ns

    def instance_share(self, index: int) -> tuple[int, int]:
        if self._block is not None:
            return self._block.instance_share(index)
        found = [(c, g) for i, c, g in self._rec().instance_shares if i == index]
        return found[0] if found else (0, 0)

    def refusals(self) -> tuple[int, int]:
        """(cpu, gpu) refusal counts (:meth:`shared.quota.QuotaBlock.refusals`)."""
        if self._block is not None:
            return self._block.refusals()
        record = self._rec()
        return record.cpu_refusals, record.gpu_refusals

    def snapshot(self) -> QuotaSnapshot:
        if self._block is not None:
            return self._block.snapshot()
        return self._rec().snapshot(self.tenant_id)

    # ------------------------------------------------------------ the supervisor's charges

    def consume_bytes(self, n: int) -> None:
        if self._block is not None:
            self._block.consume_bytes(n)
        else:
            self._own().consume_bytes(n, self.tenant_id)

    def release_bytes(self, n: int) -> None:
        if self._block is not None:
            self._block.release_bytes(n)
        else:
            self._own().release_bytes(n, self.tenant_id)

    def consume_gpu_bytes(self, n: int) -> None:
        if self._block is not None:
            self._block.consume_gpu_bytes(n)
        else:
            self._own().consume_gpu_bytes(n, self.tenant_id)

    def release_gpu_bytes(self, n: int) -> None:
        if self._block is not None:
            self._block.release_gpu_bytes(n)
        else:
            self._own().release_gpu_bytes(n, self.tenant_id)

    # ------------------------------------------------------------ admin

    def set_limits(
        self,
        *,
        memory_quota_bytes: int | Unchanged = UNCHANGED,
        gpu_memory_bytes_cap: int | None | Unchanged = UNCHANGED,
        recorded_cuda_mem_pool_quota: int | None | Unchanged = UNCHANGED,
    ) -> None:
        target = self._block if self._block is not None else self._own()
        target.set_limits(memory_quota_bytes=memory_quota_bytes, gpu_memory_bytes_cap=gpu_memory_bytes_cap,
                          recorded_cuda_mem_pool_quota=recorded_cuda_mem_pool_quota)

    def reclaim_instance(self, index: int) -> tuple[int, int]:
        if self._block is not None:
            return self._block.reclaim_instance(index)
        return self._own().reclaim_instance(index)

    def reclaim_instance_gpu(self, index: int) -> int:
        if self._block is not None:
            return self._block.reclaim_instance_gpu(index)
        record = self._own()
        cpu, gpu = record.reclaim_instance(index)
        if cpu:
            record.instance_shares = (*record.instance_shares, (index, cpu, 0))
        return gpu

    # ------------------------------------------------------------ lifecycle

    def unlink(self) -> None:
        """Remove the segment's name, if there is a segment (idempotent)."""
        if self._block is not None:
            self._block.unlink()

    def close(self) -> None:
        """The tenant is gone: the segment (if any) unmapped, the record dropped (idempotent)."""
        self._closed = True
        if self._block is not None:
            self._block.close()
        self._record = None

    def __repr__(self) -> str:
        form = "closed" if self._closed else (self._block.name if self._block is not None else "record")
        return f"<TenantQuota {self.tenant_id!r} {form}>"
