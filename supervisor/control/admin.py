"""The part that serves the admin ops (the admin capability), and the tenant lifecycle they drive.

Each admin op is a class of its own under :mod:`supervisor.control.ops` (its
handler, its ``twt`` command, its doc row); the handlers of register, evict,
set_quota, scale, inject_fault, capability, status, tenant_status and hello
call what is here: the tenants table and what a tenant goes through: registration answered once every
instance is ready (or failed), the tenant marked failed after too many
restarts, parked requests refused when their instance is not coming back.

Every change an admin op makes is written to the state store
(:mod:`supervisor.store.state`) as one transaction - register, evict, set_quota,
scale, a tenant marked failed - so a restarted supervisor comes back with
it; the request path never writes. An op asked for by a client is written
*before* it is applied (a registration before it is answered): one that
cannot be written (a full disk) is refused with ``StateError`` and changes
nothing - an eviction that answered OK is never undone by a restart.
A client's registration is committed on the state's writer thread while the
loop starts its instances (the fsync overlaps the workers' binds), and
registrations that arrive while a commit runs share the next transaction
(group commit: one fsync for all of them). The WAL is checkpointed on that
thread once admin writes pause (:data:`CHECKPOINT_DELAY_S`), never on a
reply's path. The service
ops (reload, reset, restart, rotate-key, and the restore at start) live in
:mod:`supervisor.control.service`, which drives the ops here; the lifecycle tells it
what it must know (an instance ready, a tenant gone)
through :class:`ServiceHooks`, so this module never imports it.

Owns: the tenants table (``tenants``: id -> :class:`TenantRuntime`) and each
tenant's registration waiters. May touch: the registry (capabilities, quota
blocks), the state store, placement, the worker set (start, stop, drain,
faults), the frontend's parked requests, the pending table (every answer
goes through it), events. Loop thread only.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import fields
from typing import ParamSpec, Protocol
from collections.abc import Callable

import psutil

from shared import protocol as proto
from shared.capability import RegistryAdminCapability
from shared.config import SupervisorConfig
from shared.errors import (
    CapacityExhausted,
    InvalidArgument,
    KernelTimeout,
    StateError,
    TenantFailed,
    TenantStopped,
    TensorWasmError,
    UnknownTenant,
    WorkerLost,
)
from shared.checks import is_int
from shared.log import get_logger, log_event
from shared.mps import MpsDecision
from shared.quota import MAX_INSTANCES, QuotaSnapshot
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
from shared.spec import TenantSpec
from supervisor.observe.events import EventBus
from supervisor.admission.frontend import Frontend
from supervisor.observe.gpu_share import SAMPLE_EVERY_S, GpuShareWindow
from supervisor.observe.status_rows import tenant_row
from supervisor.runtime.loop import Loop, Timer
from supervisor.routing.pending import PendingTable
from supervisor.routing.placement import Placement
from supervisor.store.registry import TenantRegistry
from supervisor.runtime.requests import Parked
from supervisor.store.rundir import RunDir
from supervisor.admission.guard import FrontendGuard
from supervisor.store.state import Origin, StateStore
from supervisor.runtime.tenants import InstanceSlot, ParkPhase, ParkRecord, TenantRuntime, TenantState
from supervisor.runtime.workers import WorkerHandle, WorkerState
from supervisor.lifecycle.workerset import WorkerSet

__all__ = ["AdminOps", "ServiceHooks"]

_log = get_logger("supervisor")
#: a state write and its arguments (AdminOps.write / record)
W = ParamSpec("W")

#: the WAL checkpoint runs this long after the last admin write: a burst of admin ops (a
#: group of registrations) pays its fsyncs once, after its replies, not one per op
CHECKPOINT_DELAY_S = 0.25


class ServiceHooks(Protocol):
    """What the tenant lifecycle hands up to the service ops (implemented by
    :class:`supervisor.control.service.ServiceOps`, which drives the ops here): an
    instance that became ready, a tenant gone."""

    def instance_ready(self, rt: TenantRuntime) -> None: ...
    def tenant_down(self, rt: TenantRuntime, exc: TensorWasmError) -> None: ...


class AdminOps:
    """The admin ops and the tenant lifecycle (see the module docstring)."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        loop: Loop,
        tenants: dict[str, TenantRuntime],
        registry: TenantRegistry,
        admin_cap: RegistryAdminCapability,
        state: StateStore,
        placement: Placement,
        pending: PendingTable,
        events: EventBus,
        rundir: RunDir,
        backend_name: str,
        backend_reason: str,
        counters: Callable[[], int],
        on_settled: Callable[[], None],
        guard: FrontendGuard,
        tenant_label: Callable[[str], str] | None = None,
        backend_versions: tuple[str, str] = ("", ""),
    ) -> None:
        """``tenant_label``: a tenant's metric label (``supervisor.observe.metrics.TenantLabels``), shown in its record.
        ``backend_versions``: the driver's and CUDA's versions (``BackendChoice``), shown in the status."""
        self.config = config
        self.guard = guard
        self.tenant_label = tenant_label
        self.loop = loop
        self.clock = loop.clock
        self.tenants = tenants
        self.registry = registry
        self.admin_cap = admin_cap
        self.state = state
        self.placement = placement
        self.pending = pending
        self.events = events
        self.rundir = rundir
        self.backend_name = backend_name
        self.backend_reason = backend_reason
        self.backend_versions = backend_versions
        self._internal_errors = counters
        self._on_settled = on_settled
        self.started = time.time()
        #: tenants without a worker whose block was read since their last worker went (or that never
        #: had one: a new block is all zeros): sample_gpu_time and the refusal scan skip them
        self._quiet_sampled: set[str] = set()
        self.quiet_refusals: set[str] = set()
        self._workers: WorkerSet | None = None
        self._frontend: Frontend | None = None
        self._service: ServiceHooks | None = None
        #: registrations waiting for the writer thread; it takes all there are into one
        #: transaction (group commit) - the loop appends, the writer takes, under the lock
        self._to_write: list[tuple[TenantSpec, int, Origin]] = []
        self._to_write_lock = threading.Lock()
        #: writes handed to the state's writer thread, oldest first, not yet reaped
        self._inflight: list[Future[tuple[list[str], StateError | None]]] = []
        #: tenants whose registration is not durable yet (never answered before it is)
        self._unwritten: set[str] = set()
        self._written_r: int | None = None  # the writer thread's "done" pipe (made on first use)
        self._written_w: int | None = None
        self._checkpoint_timer: Timer | None = None
        #: each tenant's GPU-time share over the last window (sampled by a loop timer)
        self.gpu_share = GpuShareWindow()
        loop.timers.after(SAMPLE_EVERY_S, self.sample_gpu_time)

    def attach(self, workers: WorkerSet, frontend: Frontend, service: ServiceHooks) -> None:
        """The parts this one calls, which are built after it (they call it too); once, at set-up."""
        self._workers, self._frontend, self._service = workers, frontend, service

    @property
    def workers(self) -> WorkerSet:
        assert self._workers is not None, "AdminOps used before Supervisor._setup attached its parts"
        return self._workers

    @property
    def frontend(self) -> Frontend:
        assert self._frontend is not None, "AdminOps used before Supervisor._setup attached its parts"
        return self._frontend

    @property
    def service(self) -> ServiceHooks:
        assert self._service is not None, "AdminOps used before Supervisor._setup attached its parts"
        return self._service

    def runtime(self, tid: str) -> TenantRuntime:
        """The tenant's runtime; UnknownTenant when none is registered as ``tid``."""
        rt = self.tenants.get(tid)
        if rt is None:
            raise UnknownTenant(tid)
        return rt

    # ------------------------------------------------------------ register

    def register(self, spec: TenantSpec, client: bytes | None, rid: int | None, *, origin: str = "runtime") -> None:
        """Register a tenant (``origin``: "file" for the config file's, "runtime" for a register
        request), record it in the state, start its instances; answered once they are ready."""
        # capacity, placement and the MPS check first: a refusal must leave nothing registered
        if spec.tenant_id not in self.tenants:  # a second registration is AlreadyRegistered (the registry)
            self.check_capacity(tenants=1, workers=spec.instances)
        device = self.placement.place(spec, self._tenants_on())
        isolation = self.placement.isolation(spec)
        fresh = self.placement.gpu_time_slot(spec.tenant_id) is None
        if fresh:  # the board slot before the registry: CapacityExhausted leaves nothing behind
            self.placement.gpu_time_join(spec, device)
        try:
            cap = self.registry.register_with_capability(self.admin_cap, spec)
        except BaseException:
            if fresh:
                self.placement.gpu_time_leave(spec.tenant_id)
            raise
        stored_origin: Origin = "file" if origin == "file" else "runtime"
        if client is not None:
            # A client's registration: its commit runs on the writer thread from now on, while
            # the loop starts the instances and serves their binds; answered once both are done.
            # (Submitted after the binds instead, a warm registration measured the same.)
            self._unwritten.add(spec.tenant_id)
            self._submit_registration(spec, cap.generation, stored_origin)
        self.events.emit("register", tenant=spec.tenant_id, instances=spec.instances, generation=cap.generation)
        rt = self._start_tenant(spec, cap.generation, device, isolation, origin, (client, rid, cap.to_bytes()))
        if client is not None:
            return
        try:
            self.state.register(spec, cap.generation, stored_origin)
        except StateError:
            rt.register_waiters.clear()
            self.evict(spec.tenant_id, None, None, durable=False)  # not durable: not registered
            raise
        self._checkpoint_soon()
        self._check_registered(rt)

    def _tenants_on(self) -> Counter[int]:
        """Tenants per device, the placement's tie-breaker: counted only where there is a choice
        (a registration among 10,000 tenants on one device must not cost a pass over them all)."""
        if len(self.placement.indexes) < 2:
            return Counter()
        return Counter(t.device for t in self.tenants.values())

    def check_capacity(self, *, tenants: int, workers: int) -> None:
        """CapacityExhausted unless ``tenants`` more tenants and ``workers`` more instances fit
        under ``max_tenants`` / ``max_workers`` (failed tenants count: ``twt reset`` restarts them)."""
        cfg = self.config
        if tenants > 0 and len(self.tenants) + tenants > cfg.max_tenants:
            raise CapacityExhausted("tenants", len(self.tenants), tenants, cfg.max_tenants, "max_tenants")
        if workers > 0:
            in_use = sum(rt.spec.instances for rt in self.tenants.values())
            if in_use + workers > cfg.max_workers:
                raise CapacityExhausted("workers", in_use, workers, cfg.max_workers, "max_workers")

    def _submit_registration(self, spec: TenantSpec, generation: int, origin: Origin) -> None:
        """Queue a registration's row for the writer thread (see :meth:`_write_registrations`)."""
        with self._to_write_lock:
            self._to_write.append((spec, generation, origin))
        if self._written_r is None:
            self._written_r, self._written_w = os.pipe()
            os.set_blocking(self._written_r, False)
            os.set_blocking(self._written_w, False)
            self.loop.register(self._written_r, self._on_written)
        wake_fd = self._written_w
        assert wake_fd is not None

        def wake(_: Future[tuple[list[str], StateError | None]]) -> None:  # on the writer thread: only a byte down the pipe
            try:
                os.write(wake_fd, b"\0")
            except OSError:
                pass  # pipe full: the loop is awake already

        future = self.state.submit(self._write_registrations)
        self._inflight.append(future)
        future.add_done_callback(wake)

    def _write_registrations(self) -> tuple[list[str], StateError | None]:
        """On the writer thread: every queued registration in one transaction (group commit:
        the ones that arrived while the previous commit ran go together). Returns their ids and
        the error, if the commit failed; the loop answers or undoes them (:meth:`_reap_writes`)."""
        with self._to_write_lock:
            rows, self._to_write = self._to_write, []
        if not rows:
            return [], None  # taken by an earlier call's transaction
        try:
            self.state.register_many(rows)
        except StateError as exc:
            return [spec.tenant_id for spec, _, _ in rows], exc
        return [spec.tenant_id for spec, _, _ in rows], None

    def _on_written(self) -> None:
        assert self._written_r is not None
        try:
            os.read(self._written_r, 4096)
        except BlockingIOError:
            pass
        self._reap_writes(block=False)

    def _reap_writes(self, *, block: bool) -> None:
        """Finish the writer's registrations, in order (``block``: wait for every one in flight):
        answer those whose instances are ready, or undo and refuse them (StateError)."""
        while self._inflight:
            future = self._inflight[0]
            if not block and not future.done():
                return
            self._inflight.pop(0)
            tids, failed = future.result()
            live = [rt for tid in tids if tid in self._unwritten and (rt := self.tenants.get(tid)) is not None]
            self._unwritten.difference_update(tids)
            if failed is not None:
                log_event(_log, logging.ERROR, "state.write_failed", error=str(failed), op="register",
                          tenants=len(tids))
                for rt in live:
                    waiters, rt.register_waiters = rt.register_waiters, []
                    self.evict(rt.tenant_id, None, None, durable=False)  # never stored: nothing to delete
                    for client, rid, _cap in waiters:
                        self.pending.refuse(client, rid or 0, "register", failed)
                self._on_settled()
                continue
            if len(tids) > 1:
                log_event(_log, logging.INFO, "state.group_commit", tenants=len(tids))
            if tids:
                self._checkpoint_soon()
            for rt in live:
                self._check_registered(rt)

    def _settle_writes(self) -> None:
        """Every registration applied so far durable (or undone) before another write."""
        self._reap_writes(block=True)

    def _checkpoint_soon(self) -> None:
        """Checkpoint the WAL once admin writes pause (CHECKPOINT_DELAY_S after the last one)."""
        if self._checkpoint_timer is not None:
            self._checkpoint_timer.cancel()
        self._checkpoint_timer = self.loop.timers.after(CHECKPOINT_DELAY_S, self._checkpoint)

    def _checkpoint(self) -> None:
        """On the writer thread: the loop never waits for it (nor does a registration)."""
        self._checkpoint_timer = None

        def done(future: Future[None]) -> None:
            exc = future.exception()
            if exc is not None:  # the commits are durable in the WAL; only the fold-in failed
                log_event(_log, logging.WARNING, "state.checkpoint_failed", error=str(exc))

        self.state.submit(self.state.checkpoint).add_done_callback(done)

    def write(self, write: Callable[W, None], *args: W.args, **kwargs: W.kwargs) -> None:
        """Write an admin change *before* it is applied: StateError (nothing applied) when it
        cannot be written. Registrations applied before it are written first."""
        self._settle_writes()
        write(*args, **kwargs)
        self._checkpoint_soon()

    def restore(self, spec: TenantSpec, generation: int, origin: str, failed_reason: str | None, *,
                parked: bool = False) -> None:
        """Bring back a tenant from the state at start: same generation (its capabilities work),
        its instances started - unless it was failed, which it stays until ``twt reset``, or
        parked, which it stays until its next request (its buffers' host copies did not survive
        the restart: its old handles answer ``BufferLost``)."""
        device = self.placement.place(spec, self._tenants_on())
        isolation = self.placement.isolation(spec)
        cap = self.registry.restore_with_capability(self.admin_cap, spec, generation)
        self.events.emit("register", tenant=spec.tenant_id, instances=spec.instances, generation=generation,
                         restored=True, failed=failed_reason is not None, parked=parked)
        if failed_reason is not None:
            rt = self._start_tenant(spec, generation, device, isolation, origin, None, start=False)
            rt.state = TenantState.FAILED
            rt.failed_reason = failed_reason
        elif parked and spec.instances > 0:
            rt = self._start_tenant(spec, generation, device, isolation, origin, None, start=False)
            rt.park = ParkRecord(ParkPhase.PARKED, self.clock())
        else:
            rt = self._start_tenant(spec, generation, device, isolation, origin, (None, None, cap.to_bytes()))
            rt.restoring = True
        self._check_registered(rt)

    def _start_tenant(self, spec: TenantSpec, generation: int, device: int, isolation: MpsDecision, origin: str,
                      waiter: tuple[bytes | None, int | None, bytes] | None, *, start: bool = True) -> TenantRuntime:
        block = self.registry.block(self.admin_cap, spec.tenant_id)
        rt = TenantRuntime(spec, block, generation)
        rt.device = device
        rt.origin = origin
        self.placement.add(spec.tenant_id, isolation)
        self.placement.gpu_time_join(spec, device)  # before any worker binds: it gets the board slot
        rt.slots = [InstanceSlot(i) for i in range(spec.instances)]
        self.tenants[spec.tenant_id] = rt
        if not start or not rt.slots:  # no worker will write its new block: nothing to read until one does
            self._quiet_sampled.add(spec.tenant_id)
            self.quiet_refusals.add(spec.tenant_id)
        if waiter is not None:
            rt.register_waiters.append(waiter)
            if start and rt.slots:  # only a worker can keep it waiting (a timer costs ~330 B until it is due)
                self.loop.timers.after(self.config.register_timeout_s, lambda: self._register_timeout(rt))
        if start:
            for slot in rt.slots:
                self.workers.start_instance(rt, slot)
        return rt

    def _check_registered(self, rt: TenantRuntime) -> None:
        rt.refresh_state()
        if rt.tenant_id in self._unwritten:
            self._reap_writes(block=False)  # its commit may be done already (no wait for the wake-up)
            if rt.tenant_id in self._unwritten:
                return  # answered once written (_reap_writes)
        if not rt.register_waiters or rt.state not in (TenantState.RUNNING, TenantState.STOPPED):
            return
        waiters, rt.register_waiters = rt.register_waiters, []
        tenant = {
            "tenant_id": rt.tenant_id,
            "state": rt.state.value,
            "generation": rt.generation,
            "device": rt.device,
            "pids": [s.worker.pid for s in rt.slots if s.worker],
        }
        for client, rid, cap_raw in waiters:
            self.pending.answer(client, rid or 0, "register", {"capability": cap_raw, "tenant": tenant})
        rt.restoring = False
        self._on_settled()

    def _register_timeout(self, rt: TenantRuntime) -> None:
        if rt.register_waiters and self.tenants.get(rt.tenant_id) is rt:
            self.registration_failed(rt, KernelTimeout(self.config.register_timeout_s, "register"))

    def registration_failed(self, rt: TenantRuntime, exc: TensorWasmError) -> None:
        waiters, rt.register_waiters = rt.register_waiters, []
        log_event(_log, logging.ERROR, "tenant.register_failed", tenant=rt.tenant_id, error=str(exc))
        if rt.restoring:
            # a tenant from the state is never dropped because it did not come up: it is
            # marked failed (kept, with its capability) until the operator resets or evicts it
            rt.restoring = False
            if rt.state is not TenantState.FAILED:
                self.tenant_failed(rt, f"did not start after the supervisor restarted: {exc}")
            self._on_settled()
            return
        self.evict(rt.tenant_id, None, None, durable=False)
        for client, rid, _ in waiters:
            self.pending.refuse(client, rid or 0, "register", exc)
        self._on_settled()

    def settled(self) -> bool:
        """No registration is waiting for its instances (the supervisor is then ready)."""
        return all(not rt.register_waiters for rt in self.tenants.values())

    # ------------------------------------------------------------ tenant events (from the worker set)

    def instance_ready(self, rt: TenantRuntime) -> None:
        self._check_registered(rt)
        self.frontend.dispatch_parked(rt)
        self.service.instance_ready(rt)

    def instance_not_restarted(self, rt: TenantRuntime, index: int, code: int | None, sig: int | None,
                               reason: str) -> None:
        """Instance ``index`` is not coming back: answer what can only go there."""
        restarting = rt.coming_up()
        exc = WorkerLost(rt.tenant_id, index, code, sig, f"{reason}; not restarted (restart={rt.spec.restart.value})")
        self.frontend.refuse_all_parked(rt, lambda p: exc if p.instance == index or not restarting else None)

    def tenant_failed(self, rt: TenantRuntime, why: str) -> None:
        rt.state = TenantState.FAILED
        rt.failed_reason = why
        self.record(self.state.set_failed, rt.tenant_id, why)
        self.events.emit("failed", tenant=rt.tenant_id, reason=why, restarts=rt.restarts_total)
        self.service.tenant_down(rt, TenantFailed(rt.tenant_id, len(rt.restart_times), rt.spec.restart_window_s))
        exc = TenantFailed(rt.tenant_id, len(rt.restart_times), rt.spec.restart_window_s)
        self.frontend.refuse_all_parked(rt, lambda p: exc)
        for slot in rt.slots:
            if slot.worker is not None:
                self.workers.stop_worker(slot.worker, "tenant failed")
        if rt.register_waiters:
            self.registration_failed(rt, exc)

    # ------------------------------------------------------------ evict, set_quota, scale

    def evict(self, tid: str, client: bytes | None, rid: int | None, *, durable: bool = True) -> None:
        """Evict ``tid``. ``durable``: written first - StateError and nothing revoked when the
        write fails, so an eviction that was answered never comes undone at a restart. Without
        it (a registration that failed, never answered), written after, on a best effort."""
        rt = self.runtime(tid)
        if durable:
            self.write(self.state.evict, tid)  # waits for its registration's commit first
        else:
            self._unwritten.discard(tid)
        rt.state = TenantState.EVICTING
        self.frontend.regions.release_tenant(tid)  # before the block goes: their bytes are charged to it
        self.registry.unregister(self.admin_cap, tid)  # revokes capabilities, unlinks the block
        self.placement.gpu_time_leave(tid)  # its workers stop; a lease one holds passes on at its death
        self.gpu_share.forget(tid)
        del self.tenants[tid]
        if not durable:
            self.record(self.state.evict, tid)
        self.service.tenant_down(rt, UnknownTenant(tid, message=f"tenant {tid!r} was evicted"))
        self.frontend.refuse_all_parked(rt, lambda p: WorkerLost(tid, p.instance or 0, reason="tenant evicted"))
        self.frontend.forget(rt)  # verified tokens, modules, held bytes: nothing of it stays
        workers = [s.worker for s in rt.slots if s.worker is not None and s.worker.state is not WorkerState.DEAD]
        for worker in workers:
            self.workers.stop_worker(worker, "evicted")
        self.events.emit("evict", tenant=tid, workers=[w.pid for w in workers])
        if client is None:
            return
        result = {"evicted": tid, "pids": [w.pid for w in workers]}
        remaining = {w.worker_id for w in workers}
        if not remaining:
            self.pending.answer(client, rid or 0, "evict", result)
            return

        def on_dead(worker: WorkerHandle) -> None:
            remaining.discard(worker.worker_id)
            if not remaining:
                self.pending.answer(client, rid or 0, "evict", result)

        for worker in workers:
            worker.death_waiters.append(on_dead)

    def scale(self, tid: str, n: int) -> TenantRecord:
        rt = self.runtime(tid)
        spec = rt.spec.with_instances(n)  # validates the range
        self.check_capacity(tenants=0, workers=n - rt.spec.instances)
        wanted = rt.wanted_slots()
        free = sum(1 for s in rt.slots if s.draining and s.worker is None) + MAX_INSTANCES - len(rt.slots)
        if n - len(wanted) > free:
            raise InvalidArgument(f"no free instance slot (at most {MAX_INSTANCES})")
        self.write(self.state.update_spec, spec)  # StateError: nothing applied
        self.registry.update_spec(self.admin_cap, spec)
        rt.spec = spec
        for down in wanted[:n] if rt.state is not TenantState.FAILED else ():
            if down.worker is None and down.restart_at is None:  # down for good (not restarted): start it again
                self.workers.start_instance(rt, down)
        if n > len(wanted):
            for _ in range(n - len(wanted)):
                # reuse a scaled-away slot whose worker is gone, else open a new one
                slot = next((s for s in rt.slots if s.draining and s.worker is None), None)
                if slot is None:
                    if len(rt.slots) >= MAX_INSTANCES:
                        raise InvalidArgument(f"no free instance slot (at most {MAX_INSTANCES})")
                    slot = InstanceSlot(len(rt.slots))
                    rt.slots.append(slot)
                slot.draining = False
                self.workers.start_instance(rt, slot)
        else:
            for slot in sorted(wanted, key=lambda s: s.index, reverse=True)[: len(wanted) - n]:
                slot.draining = True
                slot.restart_at = None
                if slot.worker is not None:
                    self.workers.drain(slot.worker)
            self.frontend.refuse_all_parked(rt, lambda p: _scaled_away(rt, p))
        self.events.emit("scale", tenant=tid, instances=n)
        rt.refresh_state()
        return self.tenant_record(rt)

    def record(self, write: Callable[W, None], *args: W.args, **kwargs: W.kwargs) -> None:
        """Write a change no client asked for that is already applied (a tenant marked failed, a
        failed registration undone). A failed write cannot undo it: it is logged and published
        (``state_error``) so the operator knows a restart would lose it."""
        try:
            self._settle_writes()
            write(*args, **kwargs)
            self._checkpoint_soon()
        except StateError as exc:
            log_event(_log, logging.ERROR, "state.write_failed", error=str(exc))
            self.events.emit("state_error", path=exc.path, error=exc.detail)

    # ------------------------------------------------------------ records

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
        quiet = self._quiet_sampled  # without a worker, its time cannot grow: sampled once, then skipped
        if len(quiet) > len(self.tenants):
            quiet.intersection_update(self.tenants)
        for tid, rt in self.tenants.items():
            if not rt.block.closed:
                working = any(s.worker is not None for s in rt.slots)
                if not working and tid in quiet:
                    continue
                if working:
                    quiet.discard(tid)
                else:
                    quiet.add(tid)
                self.gpu_share.observe(tid, now, rt.block.gpu_time_ns)
        self.loop.timers.after(SAMPLE_EVERY_S, self.sample_gpu_time)

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
            regions=tuple(r.to_record() for r in self.frontend.regions.of_tenant(rt.tenant_id)),
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


def _scaled_away(rt: TenantRuntime, parked: Parked) -> TensorWasmError | None:
    """The answer for a request that waits for an instance a scale-down just took away (None: keep waiting)."""
    if not rt.wanted_slots():
        return TenantStopped(rt.tenant_id)
    if parked.instance is not None and rt.slots[parked.instance].draining:
        return InvalidArgument(f"instance {parked.instance} of {rt.tenant_id!r}, which holds the request's "
                               "buffer, was scaled away")
    return None
