"""What the supervisor shows of itself and its tenants: the hello, status and tenant records.

The read-only side of the admin ops: ``hello``, ``status`` (paged by tenant id)
and ``tenant_status`` answer from here, as do the records the lifecycle ops
return (a scale, a quota change, a reset). It also keeps the GPU-time share
window, sampled once a second by a loop timer, and which tenants are unread (a
worker may have written their block since it was last read: the others, most of
10,000 parked tenants, are skipped).

Owns: the share window, the unread sets, the start time. May touch (read): the
tenants table, the worker set's pool, placement, regions, the guard's counters,
the run dir's path. Loop thread only.
"""

from __future__ import annotations

import bisect
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import fields

import psutil

from shared import protocol as proto
from shared.checks import is_int
from shared.config import SupervisorConfig
from shared.errors import InvalidArgument
from shared.quota import QuotaSnapshot
from shared.records import (
    HelloInfo,
    InstanceRecord,
    STATUS_PAGE_DEFAULT,
    STATUS_PAGE_MAX,
    PoolRecord,
    StatusRecord,
    StatusSummary,
    SupervisorRecord,
    TenantRecord,
)
from supervisor.admission.guard import FrontendGuard
from supervisor.lifecycle.workerset import WorkerSet
from supervisor.observe.gpu_share import SAMPLE_EVERY_S, GpuShareWindow
from supervisor.observe.status_rows import tenant_row
from supervisor.routing.placement import Placement
from supervisor.routing.regions import RegionTable
from supervisor.runtime.loop import Loop
from supervisor.runtime.tenants import TenantRuntime, TenantState
from supervisor.store.registry import TenantRegistry
from supervisor.store.rundir import RunDir

__all__ = ["Records"]


class Records:
    """The supervisor's and its tenants' records (see the module docstring)."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        loop: Loop,
        tenants: dict[str, TenantRuntime],
        registry: TenantRegistry,
        placement: Placement,
        workers: WorkerSet,
        regions: RegionTable,
        guard: FrontendGuard,
        rundir: RunDir,
        backend_name: str,
        backend_reason: str,
        counters: Callable[[], int],
        tenant_label: Callable[[str], str] | None = None,
        backend_versions: tuple[str, str] = ("", ""),
    ) -> None:
        """``counters()``: the loop's internal errors. ``tenant_label``: a tenant's metric label
        (``supervisor.observe.metrics.TenantLabels``), shown in its record. ``backend_versions``:
        the driver's and CUDA's versions (``BackendChoice``), shown in the status."""
        self.config = config
        self.loop = loop
        self.clock = loop.clock
        self.tenants = tenants
        self.registry = registry
        self.placement = placement
        self.workers = workers
        self.regions = regions
        self.guard = guard
        self.rundir = rundir
        self.backend_name = backend_name
        self.backend_reason = backend_reason
        self.backend_versions = backend_versions
        self.tenant_label = tenant_label
        self._internal_errors = counters
        self.started = time.time()
        #: tenants whose block a worker may have written since the sample (or the refusal scan) last
        #: read it: those registered with a worker to start, and those a worker served at the last
        #: look (read once more after it went). Every other tenant - most of 10,000 parked ones - is
        #: quiet and skipped; kept as the few unread rather than the many quiet (a set of 10,000
        #: names costs ~50 B a tenant)
        self._unread_sampled: set[str] = set()
        self.unread_refusals: set[str] = set()
        #: each tenant's GPU-time share over the last window (sampled by a loop timer)
        self.gpu_share = GpuShareWindow()
        loop.timers.after(SAMPLE_EVERY_S, self.sample_gpu_time)

    def unread(self, tid: str) -> None:
        """A worker is about to serve ``tid`` (registered with instances to start): read its block
        at the next looks, until one finds it without a worker."""
        self._unread_sampled.add(tid)
        self.unread_refusals.add(tid)

    def forget(self, tid: str) -> None:
        """``tid`` was evicted: its share window goes."""
        self.gpu_share.forget(tid)

    def hello_info(self) -> HelloInfo:
        return HelloInfo(
            pid=os.getpid(),
            registry_id=self.registry.registry_id,
            backend=self.backend_name,
            backend_reason=self.backend_reason,
            start_method=self.config.start_method,
            protocol=proto.PROTOCOL_VERSION,
            uptime_s=round(time.time() - self.started, 3),
        )

    def sample_gpu_time(self) -> None:
        """Feed each tenant's accounted GPU time to the share window (a loop timer, every second)."""
        now = time.monotonic()
        for rt in self.to_read(self._unread_sampled):  # without a worker its time cannot grow
            self.gpu_share.observe(rt.tenant_id, now, rt.block.gpu_time_ns)
        self.loop.timers.after(SAMPLE_EVERY_S, self.sample_gpu_time)

    def to_read(self, unread: set[str]) -> list[TenantRuntime]:
        """The tenants a once-a-second look at the blocks reads (``unread``: that look's set, kept
        up to date here): those a worker serves, and those whose last worker went since the last
        look - not a pass over every registered tenant. Only workers write what the looks read,
        so a tenant without a worker is read once after its last one went, then skipped."""
        serving = self.workers.serving_tenants()
        out: list[TenantRuntime] = []
        for tid in serving | unread:
            rt = self.tenants.get(tid)
            if rt is None or rt.block.closed:
                unread.discard(tid)
                continue
            if tid in serving:
                unread.add(tid)
            else:
                unread.discard(tid)
            out.append(rt)
        return out

    def _gpu_time_record(self, rt: TenantRuntime, snap: QuotaSnapshot) -> dict[str, object]:
        """What status and top show of the tenant's GPU time (docs/GPU-QUOTAS.md)."""
        gpu_ns = snap.gpu_time_ns
        share = self.gpu_share.share(rt.tenant_id, time.monotonic(), gpu_ns)
        waits = snap.gpu_waits
        return {
            "weight": rt.spec.gpu_time_weight,
            "cap": rt.spec.gpu_time_cap,
            "gpu_time_s": round(gpu_ns / 1e9, 6),
            "share": None if share is None else round(share, 4),
            "window_s": self.gpu_share.window_s,
            "throttled": snap.gpu_throttled,
            "ops": snap.gpu_ops,
            "wait_mean_s": round(snap.gpu_wait_ns / waits / 1e9, 6) if waits else 0.0,
        }

    def tenant_record(self, rt: TenantRuntime) -> TenantRecord:
        snap = rt.block.snapshot() if not rt.block.closed else None
        now = self.clock()
        instances = []
        for slot in rt.slots:
            w = slot.worker
            instances.append(InstanceRecord(
                index=slot.index,
                pid=w.pid if w else None,
                state=(w.state.value if w else ("restarting" if slot.restart_at else "down")),
                in_flight=len(w.in_flight) if w else 0,
                incarnation=slot.incarnation,
                restarts=slot.restarts,
                uptime_s=round(now - w.ready_at, 3) if w and w.ready_at else None,
                draining=slot.draining,
                last_exit=slot.last_exit,
            ))
        return TenantRecord(
            tenant_id=rt.tenant_id,
            state=rt.state.value,
            generation=rt.generation,
            failed_reason=rt.failed_reason,
            pids=tuple(i.pid for i in instances if i.pid is not None),
            instances=tuple(instances),
            restarts=rt.restarts_total,
            in_flight=rt.in_flight,
            parked=rt.waiting,
            uptime_s=round(time.time() - rt.registered_at, 3),
            backend=self.backend_name,
            device=rt.device,
            isolation=self.placement.isolation_of(rt.tenant_id),
            spec=rt.spec,
            bytes_in_use=snap.bytes_in_use if snap else 0,
            memory_quota_bytes=snap.memory_quota_bytes if snap else rt.spec.memory_quota_bytes,
            gpu_bytes_in_use=snap.gpu_bytes_in_use if snap else 0,
            gpu_memory_bytes_cap=snap.gpu_memory_bytes_cap if snap else rt.spec.gpu_memory_bytes_cap,
            quota=snap,
            regions=tuple(r.to_record() for r in self.regions.of_tenant(rt.tenant_id)),
            origin=rt.origin,
            metrics_label=self.tenant_label(rt.tenant_id) if self.tenant_label is not None else "",
            gpu_time=self._gpu_time_record(rt, snap) if snap else {},
        )

    def status(self, *, after: str | None = None, limit: int = STATUS_PAGE_DEFAULT,
               state: str | None = None, rows: bool = False) -> StatusRecord:
        """The supervisor, its devices, the summary of every tenant, and one page of tenant records:
        up to ``limit`` of them by tenant id, those after ``after`` (the previous page's ``next``),
        only those in ``state`` when given. A cursor, not an offset: a tenant registered or evicted
        between two pages does not shift the others, so one pass sees every tenant that stayed
        registered exactly once. InvalidArgument for a limit outside 1..STATUS_PAGE_MAX or an
        unknown state."""
        if not is_int(limit) or not 1 <= limit <= STATUS_PAGE_MAX:
            raise InvalidArgument(f"status: limit must be an int in 1..{STATUS_PAGE_MAX}, got {limit!r}")
        states = [s.value for s in TenantState]
        if state is not None and state not in states:
            raise InvalidArgument(f"status: state must be one of {', '.join(states)}, got {state!r}")
        hello = self.hello_info()
        ws = self.workers
        by_device: dict[int, list[str]] = {}
        counts: Counter[str] = Counter()
        wanted = ready = 0
        for tid, rt in self.tenants.items():
            by_device.setdefault(rt.device, []).append(tid)
            counts[rt.state.value] += 1
            for slot in rt.slots:
                if not slot.draining:
                    wanted += 1
                    ready += slot.ready
        ids = sorted(tid for tid, rt in self.tenants.items() if state is None or rt.state.value == state)
        start = 0 if after is None else bisect.bisect_right(ids, after)
        page = ids[start:start + limit]
        more = start + limit < len(ids)
        return StatusRecord(
            supervisor=SupervisorRecord(
                **{f.name: getattr(hello, f.name) for f in fields(hello)},
                run_dir=self.rundir.path,
                pool=PoolRecord(idle=len(ws.pool), starting=ws.pool_starting, size=ws.pool_target,
                                pids=tuple(w.pid for w in ws.pool)),
                workers=len(ws.workers),
                internal_errors=self._internal_errors(),
                rss_bytes=psutil.Process().memory_info().rss,
                driver_version=self.backend_versions[0],
                cuda_version=self.backend_versions[1],
                **self.guard.status(),
            ),
            tenants=() if rows else tuple(self.tenant_record(self.tenants[tid]) for tid in page),
            rows=tuple(tenant_row(self.tenants[tid], self.gpu_share, time.monotonic()) for tid in page) if rows else (),
            devices=tuple(self.placement.status(by_device)),
            summary=StatusSummary(tenants=len(self.tenants), states=dict(sorted(counts.items())), instances=wanted,
                                  ready=ready),
            next=page[-1] if more and page else None,
        )
