"""A tenant as one table row (``status`` with ``view = "rows"``: what ``twt top`` reads).

``twt top`` refreshes every tenant every couple of seconds. A full
:class:`~shared.records.TenantRecord` (spec, quota snapshot, instances, regions,
GPU-time map) costs the loop and the client about 0.2 ms to build, encode and
decode; at 10,000 tenants a refresh read that way takes seconds. A
:class:`~shared.records.TenantRow` holds the table's columns only, read from
the tenant's quota (its block, or its record when it has no worker: no
segment is touched for a parked tenant) and the GPU-share window.

Owns nothing. Loop thread only (reads the runtime and the quota).
"""

from __future__ import annotations

import time

from shared.records import TenantRow
from supervisor.observe.gpu_share import GpuShareWindow
from supervisor.runtime.tenants import TenantRuntime

__all__ = ["tenant_row"]


def tenant_row(rt: TenantRuntime, share: GpuShareWindow, now: float) -> TenantRow:
    """``rt`` as a table row; ``now``: ``time.monotonic()`` (the share window's clock)."""
    block = rt.block
    snap = None if block.closed else block.snapshot()
    wanted = ready = 0
    pids = []
    for slot in rt.slots:
        worker = slot.worker
        if worker is not None and worker.pid is not None:
            pids.append(worker.pid)
        if not slot.draining:
            wanted += 1
            ready += slot.ready
    gpu_ns = snap.gpu_time_ns if snap is not None else 0
    gpu_share = share.share(rt.tenant_id, now, gpu_ns) if snap is not None else None
    return TenantRow(
        tenant_id=rt.tenant_id,
        state=rt.state.value,
        ready=ready,
        wanted=wanted,
        pids=tuple(pids),
        bytes_in_use=snap.bytes_in_use if snap else 0,
        memory_quota_bytes=snap.memory_quota_bytes if snap else rt.spec.memory_quota_bytes,
        gpu_bytes_in_use=snap.gpu_bytes_in_use if snap else 0,
        gpu_memory_bytes_cap=snap.gpu_memory_bytes_cap if snap else rt.spec.gpu_memory_bytes_cap,
        cpu_high_water=snap.cpu_high_water if snap else 0,
        gpu_high_water=snap.gpu_high_water if snap else 0,
        cpu_refusals=snap.cpu_refusals if snap else 0,
        gpu_refusals=snap.gpu_refusals if snap else 0,
        restarts=rt.restarts_total,
        uptime_s=round(time.time() - rt.registered_at, 3),
        gpu_time_weight=rt.spec.gpu_time_weight,
        gpu_time_cap=rt.spec.gpu_time_cap,
        gpu_time_s=round(gpu_ns / 1e9, 6),
        gpu_share=None if gpu_share is None else round(gpu_share, 4),
        in_flight=rt.in_flight,
    )
