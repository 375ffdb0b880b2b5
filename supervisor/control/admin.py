"""The part that serves the admin ops (the admin capability), and the tenant lifecycle they drive.

Each admin op is a class of its own under :mod:`supervisor.control.ops` (its
handler, its ``twt`` command, its doc row); the handlers of register, evict,
set_quota, scale, inject_fault and capability call what is here: the tenants
table and what a tenant goes through: registration answered once every
instance is ready (or failed), the tenant marked failed after too many
restarts, parked requests refused when their instance is not coming back.
What status, tenant_status and hello show is :mod:`supervisor.control.records`.

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
:mod:`supervisor.control.service`, which drives the ops here; what it must know
of a tenant (an instance ready, a tenant gone) it hears from the tenant signals
(:mod:`supervisor.lifecycle.signals`), so this module never imports it.

The methods here are the domain: they take tenants and specs, never a client
or a request id. One that answers at once returns its result; one that waits
on workers (a registration answered once every instance is ready, an eviction
once its workers are gone) returns a :class:`~supervisor.runtime.completion.Completion`.
The op adapters (:mod:`supervisor.control.ops`) turn either into the wire's
answer; an internal caller (a restore, a reload) may ignore it.

Owns: the tenants table (``tenants``: id -> :class:`TenantRuntime`) and each
tenant's registration waiters. May touch: the registry (capabilities, quota
blocks), the state store, placement, the worker set (start, stop, drain,
faults), the dispatcher's parked requests, the regions, events. Hears from the
signals: an instance ready, a registration failed, an instance not restarted,
a tenant failed; tells them: a tenant down, a tenant evicted. Loop thread only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ParamSpec
from collections.abc import Callable, Mapping

from shared import protocol as proto
from shared.capability import RegistryAdminCapability
from shared.config import SupervisorConfig
from shared.errors import (
    CapacityExhausted,
    FaultInjectionDisabled,
    InvalidArgument,
    KernelTimeout,
    StateError,
    TenantFailed,
    TenantStopped,
    TensorWasmError,
    UnknownTenant,
    WorkerLost,
)
from shared.log import get_logger, log_event
from supervisor.host.mps import MpsDecision
from shared.quota import MAX_INSTANCES, QuotaCounters
from shared.records import TenantRecord
from shared.spec import TenantSpec
from shared.worker_link import FaultAck, FaultExit, FaultOrder
from supervisor.control.records import Records
from supervisor.observe.events import EventBus
from supervisor.runtime.completion import Completion
from supervisor.runtime.loop import Loop, Timer
from supervisor.routing.dispatcher import Dispatcher
from supervisor.routing.placement import Placement
from supervisor.routing.regions import RegionTable
from supervisor.store.registry import TenantRegistry
from supervisor.runtime.requests import Parked
from supervisor.store.state import Origin, StateStore
from supervisor.runtime.tenants import InstanceSlot, ParkPhase, ParkRecord, TenantRuntime, TenantState
from supervisor.runtime.workers import WorkerHandle, WorkerState
from supervisor.lifecycle.signals import Stage, TenantSignals
from supervisor.lifecycle.workerset import WorkerSet

__all__ = ["AdminOps", "FaultAnswer", "Registered"]

_log = get_logger("supervisor")
#: a state write and its arguments (AdminOps.write / record)
W = ParamSpec("W")

#: the WAL checkpoint runs this long after the last admin write: a burst of admin ops (a
#: group of registrations) pays its fsyncs once, after its replies, not one per op
CHECKPOINT_DELAY_S = 0.25

#: a registration's result once every instance is ready: ``{capability, tenant}`` (the wire's reply)
Registered = dict[str, object]


@dataclass(frozen=True, slots=True)
class FaultAnswer:
    """A fault's outcome: ``ok`` with the result, or the worker's refusal as the worker worded
    it (a wire error, answered as it came: the worker is the authority on why it refused)."""

    ok: bool
    result: dict[str, object]


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
        workers: WorkerSet,
        dispatcher: Dispatcher,
        regions: RegionTable,
        signals: TenantSignals,
        events: EventBus,
        records: Records,
        on_settled: Callable[[], None],
    ) -> None:
        """``records``: the records the ops answer with (a scale's, a quota change's).
        ``on_settled()``: no registration waits for its instances any more (the supervisor may be ready)."""
        self.config = config
        self.records = records
        self.loop = loop
        self.clock = loop.clock
        self.tenants = tenants
        self.registry = registry
        self.admin_cap = admin_cap
        self.state = state
        self.placement = placement
        self.workers = workers
        self.dispatcher = dispatcher
        self.regions = regions
        self.signals = signals
        self.events = events
        self._on_settled = on_settled
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
        signals.on_instance_ready(Stage.TENANT, self.instance_ready)
        signals.on_registration_failed(self.registration_failed)
        signals.on_instance_not_restarted(Stage.TENANT, self.instance_not_restarted)
        signals.on_tenant_failed(Stage.TENANT, self.tenant_failed)

    def runtime(self, tid: str) -> TenantRuntime:
        """The tenant's runtime; UnknownTenant when none is registered as ``tid``."""
        rt = self.tenants.get(tid)
        if rt is None:
            raise UnknownTenant(tid)
        return rt

    # ------------------------------------------------------------ register

    def register(self, spec: TenantSpec, *, origin: str = "runtime") -> Completion[Registered]:
        """Register a tenant, record it in the state, start its instances; completed once they are
        ready (with its capability and record), or failed. ``origin``: "runtime" for a client's
        register request - committed on the state's writer thread while the instances start, and
        completed once both are done; "file" for the config file's - written before this returns.
        Raises a typed error (nothing registered) when it is refused at once."""
        # capacity, placement and the MPS check first: a refusal must leave nothing registered
        if spec.tenant_id not in self.tenants:  # a second registration is AlreadyRegistered (the registry)
            self.check_capacity(tenants=1, workers=spec.instances)
        device = self.placement.place(spec, self._tenants_on())
        isolation = self.placement.isolation(spec)
        fresh = self.placement.gpu_time_slot(spec.tenant_id) is None
        if fresh:  # the board slot before the registry: CapacityExhausted leaves nothing behind
            self.placement.gpu_time_join(spec, device)
        try:
            cap, rt = self.registry.register_entry(self.admin_cap, spec, TenantRuntime)
        except BaseException:
            if fresh:
                self.placement.gpu_time_leave(spec.tenant_id)
            raise
        stored_origin: Origin = "file" if origin == "file" else "runtime"
        asked = origin != "file"
        if asked:
            # A client's registration: its commit runs on the writer thread from now on, while
            # the loop starts the instances and serves their binds; answered once both are done.
            # (Submitted after the binds instead, a warm registration measured the same.)
            self._unwritten.add(spec.tenant_id)
            self._submit_registration(spec, cap.generation, stored_origin)
        self.events.emit("register", tenant=spec.tenant_id, instances=spec.instances, generation=cap.generation)
        done: Completion[Registered] = Completion()
        self._start_tenant(rt, device, isolation, origin, (done, cap.to_bytes()))
        if asked:
            return done
        try:
            self.state.register(spec, cap.generation, stored_origin)
        except StateError:
            rt.register_waiters.clear()
            self.evict(spec.tenant_id, durable=False)  # not durable: not registered
            raise
        self._checkpoint_soon()
        self._check_registered(rt)
        return done

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
                    self.evict(rt.tenant_id, durable=False)  # never stored: nothing to delete
                    for done, _cap in waiters:
                        done.fail(failed)
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
                parked: bool = False, quota: QuotaCounters | None = None) -> None:
        """Bring back a tenant from the state at start: same generation (its capabilities work),
        its instances started - unless it was failed, which it stays until ``twt reset``, or
        parked, which it stays until its next request (its buffers' host copies did not survive
        the restart: its old handles answer ``BufferLost``). ``quota``: the counters a parked
        tenant kept in the state (its marks, refusals and GPU time go on from them)."""
        device = self.placement.place(spec, self._tenants_on())
        isolation = self.placement.isolation(spec)
        kept = quota if parked and failed_reason is None else None
        cap, rt = self.registry.register_entry(self.admin_cap, spec, TenantRuntime, generation=generation,
                                               counters=kept)
        self.events.emit("register", tenant=spec.tenant_id, instances=spec.instances, generation=generation,
                         restored=True, failed=failed_reason is not None, parked=parked)
        if failed_reason is not None:
            self._start_tenant(rt, device, isolation, origin, None, start=False)
            rt.state = TenantState.FAILED
            rt.failed_reason = failed_reason
        elif parked and spec.instances > 0:
            self._start_tenant(rt, device, isolation, origin, None, start=False)
            rt.park = ParkRecord(ParkPhase.PARKED, self.clock())
        else:
            self._start_tenant(rt, device, isolation, origin, (Completion(), cap.to_bytes()))
            rt.restoring = True  # nobody waits for its completion: it marks the tenant as coming up
        self._check_registered(rt)

    def _start_tenant(self, rt: TenantRuntime, device: int, isolation: MpsDecision, origin: str,
                      waiter: tuple[Completion[Registered], bytes] | None, *, start: bool = True) -> None:
        """A tenant just registered (``rt``: the registry's entry of it): placed, in the tenants
        table, its instances started (unless ``start`` is false)."""
        spec = rt.spec
        rt.device = device
        rt.origin = origin
        self.placement.add(spec.tenant_id, isolation)
        self.placement.gpu_time_join(spec, device)  # before any worker binds: it gets the board slot
        rt.slots = tuple(InstanceSlot(i) for i in range(spec.instances))  # () without instances: shared
        self.tenants[spec.tenant_id] = rt
        if start and rt.slots:  # a worker will write its block: read it until one is found without a worker
            self.records.unread(spec.tenant_id)
        if waiter is not None:
            rt.register_waiters.append(waiter)
            if start and rt.slots:  # only a worker can keep it waiting (a timer costs ~330 B until it is due)
                self.loop.timers.after(self.config.register_timeout_s, lambda: self._register_timeout(rt))
        if start:
            for slot in rt.slots:
                self.workers.start_instance(rt, slot)

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
        for done, cap_raw in waiters:
            done.resolve({"capability": cap_raw, "tenant": tenant})
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
        self.evict(rt.tenant_id, durable=False)
        for done, _ in waiters:
            done.fail(exc)
        self._on_settled()

    def settled(self) -> bool:
        """No registration is waiting for its instances (the supervisor is then ready)."""
        return all(not rt.register_waiters for rt in self.tenants.values())

    # ------------------------------------------------------------ tenant events (from the worker set)

    def instance_ready(self, rt: TenantRuntime) -> None:
        """An instance of ``rt`` is ready (or the tenant serves again): its registration may be
        answered, and what waited for an instance is sent."""
        self._check_registered(rt)
        self.dispatcher.dispatch_parked(rt)

    def instance_not_restarted(self, rt: TenantRuntime, index: int, code: int | None, sig: int | None,
                               reason: str) -> None:
        """Instance ``index`` is not coming back: answer what can only go there."""
        restarting = rt.coming_up()
        exc = WorkerLost(rt.tenant_id, index, code, sig, f"{reason}; not restarted (restart={rt.spec.restart.value})")
        self.dispatcher.refuse_all_parked(rt, lambda p: exc if p.instance == index or not restarting else None)

    def tenant_failed(self, rt: TenantRuntime, why: str) -> None:
        rt.state = TenantState.FAILED
        rt.failed_reason = why
        self.record(self.state.set_failed, rt.tenant_id, why)
        self.events.emit("failed", tenant=rt.tenant_id, reason=why, restarts=rt.restarts_total)
        self.signals.tenant_down(rt, TenantFailed(rt.tenant_id, len(rt.restart_times), rt.spec.restart_window_s))
        exc = TenantFailed(rt.tenant_id, len(rt.restart_times), rt.spec.restart_window_s)
        self.dispatcher.refuse_all_parked(rt, lambda p: exc)
        for slot in rt.slots:
            if slot.worker is not None:
                self.workers.stop_worker(slot.worker, "tenant failed")
        if rt.register_waiters:
            self.registration_failed(rt, exc)

    # ------------------------------------------------------------ evict, set_quota, scale

    def evict(self, tid: str, *, durable: bool = True) -> Completion[dict[str, object]]:
        """Evict ``tid``; completed with ``{evicted, pids}`` once its workers are gone.
        ``durable``: written first - StateError and nothing revoked when the
        write fails, so an eviction that was answered never comes undone at a restart. Without
        it (a registration that failed, never answered), written after, on a best effort."""
        rt = self.runtime(tid)
        if durable:
            self.write(self.state.evict, tid)  # waits for its registration's commit first
        else:
            self._unwritten.discard(tid)
        rt.state = TenantState.EVICTING
        self.regions.release_tenant(tid)  # before the block goes: their bytes are charged to it
        self.registry.unregister(self.admin_cap, tid)  # revokes capabilities, unlinks the block
        self.placement.gpu_time_leave(tid)  # its workers stop; a lease one holds passes on at its death
        self.records.forget(tid)
        del self.tenants[tid]
        if not durable:
            self.record(self.state.evict, tid)
        self.signals.tenant_down(rt, UnknownTenant(tid, message=f"tenant {tid!r} was evicted"))
        self.dispatcher.refuse_all_parked(rt, lambda p: WorkerLost(tid, p.instance or 0, reason="tenant evicted"))
        self.signals.evicted(rt)  # verified tokens, modules, held bytes: nothing of it stays
        workers = [s.worker for s in rt.slots if s.worker is not None and s.worker.state is not WorkerState.DEAD]
        for worker in workers:
            self.workers.stop_worker(worker, "evicted")
        self.events.emit("evict", tenant=tid, workers=[w.pid for w in workers])
        result: dict[str, object] = {"evicted": tid, "pids": [w.pid for w in workers]}
        remaining = {w.worker_id for w in workers}
        if not remaining:
            return Completion.resolved(result)
        done: Completion[dict[str, object]] = Completion()

        def on_dead(worker: WorkerHandle) -> None:
            remaining.discard(worker.worker_id)
            if not remaining:
                done.resolve(result)

        for worker in workers:
            worker.death_waiters.append(on_dead)
        return done

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
                    rt.slots = (*rt.slots, slot)
                slot.draining = False
                self.workers.start_instance(rt, slot)
        else:
            for slot in sorted(wanted, key=lambda s: s.index, reverse=True)[: len(wanted) - n]:
                slot.draining = True
                slot.restart_at = None
                if slot.worker is not None:
                    self.workers.drain(slot.worker)
            self.dispatcher.refuse_all_parked(rt, lambda p: _scaled_away(rt, p))
        self.events.emit("scale", tenant=tid, instances=n)
        rt.refresh_state()
        return self.records.tenant_record(rt)

    def set_quota(self, tid: str, changes: Mapping[str, object]) -> TenantRecord:
        """Change the limits ``changes`` names (``QUOTA_KEYS``): written to the state, then to the
        quota block and the lease board. InvalidArgument (nothing written) for none or a bad value;
        StateError (nothing applied) when the write fails."""
        rt = self.runtime(tid)
        if not changes:
            raise InvalidArgument(f"set_quota needs at least one of {', '.join(proto.QUOTA_KEYS)}")
        new_spec = rt.spec._with(**changes)  # validates (InvalidArgument: nothing written)
        self.write(self.state.update_spec, new_spec)  # StateError: nothing applied
        try:
            info = self.registry.set_quota_from(self.admin_cap, rt.tenant_id, changes)
        except BaseException:
            self.record(self.state.update_spec, rt.spec)  # put the stored spec back
            raise
        rt.spec = info.spec
        self.placement.gpu_time_join(rt.spec, rt.device)  # weight and cap: live on the lease board
        self.events.emit("set_quota", tenant=rt.tenant_id, **{k: getattr(info.spec, k) for k in changes})
        return self.records.tenant_record(rt)

    # ------------------------------------------------------------ faults

    def inject_fault(self, tid: str, kind: str, instance: int | None,
                     params: Mapping[str, object]) -> Completion[FaultAnswer]:
        """Order a fault into instance ``instance`` of ``tid`` (None: the first live one); completed
        once its worker acknowledged it or, for the kinds that end the process, once it is gone.
        FaultInjectionDisabled first (the production setting), before the tenant is even named."""
        if not self.config.fault_injection:
            raise FaultInjectionDisabled("inject_fault")
        rt = self.runtime(tid)
        if kind not in proto.FAULT_KINDS:
            raise InvalidArgument(f"unknown fault kind {kind!r}")
        if instance is None:
            live = rt.live_slots()
            if not live:
                raise WorkerLost(tid, 0, reason="no live instance to inject into")
            slot = live[0]
        else:
            if not 0 <= instance < len(rt.slots):
                raise InvalidArgument(f"instance must be in 0..{len(rt.slots) - 1}")
            slot = rt.slots[instance]
        worker = slot.worker
        if worker is None or not worker.control_hello or worker.state is WorkerState.DEAD:
            raise WorkerLost(tid, slot.index, reason="instance is not running")
        info: dict[str, object] = {"tenant": tid, "instance": slot.index, "pid": worker.pid, "kind": kind}
        done: Completion[FaultAnswer] = Completion()

        def answer(result: FaultAck | FaultExit) -> None:
            if isinstance(result, FaultAck) and not result.ok:
                err = result.error or TensorWasmError("worker refused the fault without a reason").to_dict()
                done.resolve(FaultAnswer(False, err))
            elif isinstance(result, FaultAck):
                done.resolve(FaultAnswer(True, {**info, "ok": True, "armed": result.armed}))
            else:
                done.resolve(FaultAnswer(True, {**info, **result.to_wire()}))

        self.workers.on_fault_answer(worker, answer)
        self.events.emit("fault", **info, params=params)
        self.workers.send_control(worker, proto.encode_control("fault", FaultOrder(kind, dict(params)).to_wire()))
        return done

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


def _scaled_away(rt: TenantRuntime, parked: Parked) -> TensorWasmError | None:
    """The answer for a request that waits for an instance a scale-down just took away (None: keep waiting)."""
    if not rt.wanted_slots():
        return TenantStopped(rt.tenant_id)
    if parked.instance is not None and rt.slots[parked.instance].draining:
        return InvalidArgument(f"instance {parked.instance} of {rt.tenant_id!r}, which holds the request's "
                               "buffer, was scaled away")
    return None
