"""Service operations: restore at start, reload, reset, rolling restart, key rotation.

What keeps a supervisor a *service* across its own restarts and config
changes, on top of the admin ops (:mod:`supervisor.control.admin`); the
handlers of the reload, reset, restart and rotate_key ops (classes under
:mod:`supervisor.control.ops`) call the methods here::

    start ........ restore()      every tenant from the state (same generation: capabilities
                                  minted before keep working; failed ones stay failed), then
                                  the config file's difference applied as a reload would
    SIGHUP, reload reload()       re-read the config file; plan (supervisor.lifecycle.reload), check
                                  every placement, then apply: register, evict, change live
                                  (quotas at once, instances by scaling, worker-bound fields by
                                  a rolling restart). A file that cannot be applied changes
                                  nothing: ConfigError, a reload_failed event and a log line
    reset TENANT ... reset()      clear the failed state, start the instances (same capability)
    restart TENANT . restart()    replace the instances one at a time (drain, stop, start,
                                  wait for ready, next); never counted as restarts
    rotate-key ..... rotate_key() a new registry key, stored first, then swapped in: every
                                  capability is revoked, the new admin capability written

A reset or a restart waits for the tenant to run again: it returns a
:class:`~supervisor.runtime.completion.Completion` of the tenant's record,
which the op adapter answers with; no method here sees a client or a request id.

Owns: the rolling restarts and the reset/restart waiters (fields of
:class:`TenantRuntime`), the config file's ``[supervisor]`` table as last
read. May touch: the admin ops (register, evict, scale, restore, records),
the worker set (start, drain), the registry, the state store, placement,
events. Hears from the tenant signals (:mod:`supervisor.lifecycle.signals`): an
instance ready, a tenant down; tells them: the registry key rotated. Loop thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from shared.config import SupervisorConfig, read_config_file, tenants_of
from shared.errors import ConfigError, StateError, TenantFailed, TensorWasmError
from shared.log import get_logger, log_event
from supervisor.control.admin import AdminOps
from supervisor.observe.events import EventBus
from supervisor.routing.placement import Placement
from supervisor.store.registry import TenantRegistry
from supervisor.lifecycle.reload import ReloadPlan, SpecChange, TenantNow, plan_reload
from supervisor.store.state import RegistryKey, StateStore, StoredTenant
from supervisor.runtime.completion import Completion
from supervisor.runtime.tenants import TenantRuntime, TenantState
from supervisor.runtime.workers import WorkerState
from supervisor.lifecycle.signals import Stage, TenantSignals
from supervisor.lifecycle.workerset import WorkerSet

__all__ = ["ServiceOps"]

_log = get_logger("supervisor")


class ServiceOps:
    """The service operations (see the module docstring)."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        admin: AdminOps,
        workers: WorkerSet,
        registry: TenantRegistry,
        state: StateStore,
        placement: Placement,
        signals: TenantSignals,
        events: EventBus,
    ) -> None:
        self.config = config
        self.admin = admin
        self.workers = workers
        self.registry = registry
        self.state = state
        self.placement = placement
        self.signals = signals
        self.events = events
        self._file_settings = _settings_of(config.config_file)
        signals.on_instance_ready(Stage.SERVICE, self.instance_ready)
        signals.on_tenant_down(self.tenant_down)

    # ------------------------------------------------------------ start

    def restore(self, records: list[StoredTenant] | None = None) -> dict[str, int]:
        """Bring back every stored tenant, then register the config file's new ones
        (``records``: the stored tenants, when the caller has just read them: not parsed twice).

        A stored file tenant whose entry changed while the supervisor was down
        comes back with the file's spec; one removed from the file is evicted.
        Started without a config file, nothing is compared: every stored tenant
        comes back as it was.
        """
        if records is None:
            records = self.state.tenants()
        if self.config.config_file is None:
            plan = ReloadPlan()
        else:
            plan = plan_reload(self.config.tenants,
                               {r.tenant_id: TenantNow(r.spec, r.registered_spec, r.origin) for r in records})
        changed = {c.tenant_id: c for c in plan.change}
        adopted = {s.tenant_id for s in plan.adopt}
        restored = failed = 0
        for record in records:
            tid = record.tenant_id
            if tid in plan.evict:
                self.admin.record(self.state.evict, tid)
                log_event(_log, logging.INFO, "tenant.removed_from_config", tenant=tid)
                continue
            spec = record.spec
            if tid in changed:
                spec = changed[tid].new
                self.admin.record(self.state.update_spec, spec, registered_spec=spec)
            elif tid in adopted:
                self.admin.record(self.state.update_spec, spec, registered_spec=spec)
            try:
                self.admin.restore(spec, record.generation, record.origin, record.failed_reason,
                                   parked=record.parked, quota=record.quota)
            except TensorWasmError as exc:  # e.g. a pinned device this supervisor no longer manages
                log_event(_log, logging.ERROR, "tenant.restore_failed", tenant=tid, error=str(exc))
                self.events.emit("state_error", path=self.state.path, error=f"tenant {tid!r} not restored: {exc}")
                continue
            restored += 1
            failed += record.failed
        for spec in plan.register:
            try:
                self.admin.register(spec, origin="file")
            except TensorWasmError as exc:
                log_event(_log, logging.ERROR, "tenant.register_failed", tenant=spec.tenant_id, error=str(exc))
        for tid in plan.conflicts:
            log_event(_log, logging.WARNING, "tenant.config_conflict", tenant=tid,
                      detail="registered at runtime; the config file's entry is ignored until it is evicted")
        summary = {"restored": restored, "failed": failed, "registered": len(plan.register),
                   "evicted": len(plan.evict), "changed": len(plan.change)}
        log_event(_log, logging.INFO, "supervisor.restored", state=self.state.path, **summary)
        return summary

    # ------------------------------------------------------------ reload

    def reload(self) -> dict[str, object]:
        """Apply the config file's difference; :class:`ConfigError` (nothing changed) when it cannot be."""
        path = self.config.config_file
        try:
            if path is None:
                raise ConfigError("(none)", "the supervisor was started without --config: there is no file to read")
            plan = self._plan(path)
        except ConfigError as exc:
            log_event(_log, logging.ERROR, "supervisor.reload_failed", path=exc.path, error=exc.detail)
            self.events.emit("reload_failed", path=exc.path, error=exc.detail)
            raise
        errors = self._apply(plan)
        summary = {**plan.summary(), "errors": errors}
        self.events.emit("reload", path=path, **summary)
        return summary

    def reload_quietly(self) -> ConfigError | None:
        """SIGHUP: as :meth:`reload`; a bad file is reported (event, log) and the loop goes on.
        Returns the error of a file that could not be applied (None: applied)."""
        try:
            self.reload()
        except ConfigError as exc:
            return exc
        return None

    def _plan(self, path: str) -> ReloadPlan:
        try:
            fields = read_config_file(path)
            SupervisorConfig.checked(fields)  # every [supervisor] value and tenant table checked, as at start
        except (ValueError, TypeError) as exc:
            raise ConfigError(path, str(exc)) from None
        current = {}
        stored = {r.tenant_id: r for r in self.state.tenants()}
        for tid, rt in self.admin.tenants.items():
            rec = stored.get(tid)
            if rec is not None:
                current[tid] = TenantNow(rt.spec, rec.registered_spec, rec.origin)
        settings = {k: v for k, v in fields.items() if k != "tenants"}
        plan = plan_reload(tenants_of(fields), current, old_settings=self._file_settings, new_settings=settings)
        # every placement is checked before anything changes: a file that cannot be applied changes nothing
        problems = []
        counts = Counter(t.device for t in self.admin.tenants.values())
        for spec in (*plan.register, *(c.new for c in plan.change if c.needs_placement)):
            try:
                self.placement.place(spec, counts)
                self.placement.isolation(spec)
            except TensorWasmError as exc:
                problems.append(f"tenant {spec.tenant_id!r}: {exc}")
        if problems:
            raise ConfigError(path, "; ".join(problems))
        self._file_settings = settings
        return plan

    def _apply(self, plan: ReloadPlan) -> list[str]:
        errors: list[str] = []
        for tid in plan.evict:
            self._try(errors, tid, lambda t=tid: self.admin.evict(t))  # type: ignore[misc]
        for spec in plan.register:
            self._try(errors, spec.tenant_id, lambda s=spec: self.admin.register(s, origin="file"))  # type: ignore[misc]
        for change in plan.change:
            self._try(errors, change.tenant_id, lambda c=change: self._apply_change(c))  # type: ignore[misc]
        for spec in plan.adopt:
            rt = self.admin.tenants.get(spec.tenant_id)
            if rt is not None:
                self.admin.record(self.state.update_spec, rt.spec, registered_spec=spec)
        return errors

    @staticmethod
    def _try(errors: list[str], tid: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except TensorWasmError as exc:
            log_event(_log, logging.ERROR, "supervisor.reload_item_failed", tenant=tid, error=str(exc))
            errors.append(f"{tid}: {exc}")

    def _apply_change(self, change: SpecChange) -> None:
        """Quotas and supervisor-read fields at once; instances by scaling; worker-bound fields by a
        rolling restart (the new workers are bound with the new spec)."""
        rt = self.admin.runtime(change.tenant_id)
        new = change.new
        if change.needs_placement:
            counts = Counter(t.device for t in self.admin.tenants.values() if t is not rt)
            rt.device = self.placement.place(new, counts)
            self.placement.add(rt.tenant_id, self.placement.isolation(new))
        target = new.with_instances(rt.spec.instances)
        self.registry.update_spec(self.admin.admin_cap, target)  # quota fields go to the block now
        rt.spec = target
        self.placement.gpu_time_join(target, rt.device)  # weight and cap go to the lease board now
        if change.scale:
            self.admin.scale(rt.tenant_id, new.instances)
        if change.needs_restart and rt.state is not TenantState.FAILED:
            self._start_rolling(rt)
        self.admin.record(self.state.update_spec, rt.spec, registered_spec=new)

    # ------------------------------------------------------------ reset and restart

    def reset(self, tid: str) -> Completion[dict[str, object]]:
        """Clear a failed tenant (and its restart history) and start its instances; completed with
        its record once it runs (failed if it goes down first)."""
        rt = self.admin.runtime(tid)
        was_failed = rt.state is TenantState.FAILED
        if was_failed:
            self.admin.write(self.state.set_failed, tid, None)  # StateError: nothing reset
        rt.restart_times.clear()
        if was_failed:
            rt.state = TenantState.STARTING
            rt.failed_reason = None
        for slot in rt.slots:
            if slot.draining:
                continue
            worker = slot.worker
            if worker is None:
                if was_failed or slot.restart_at is None:
                    self.workers.start_instance(rt, slot)
            elif worker.state is WorkerState.STOPPING and worker.expected_exit:
                slot.replace = True  # the failed tenant's worker is still stopping: its successor follows
        self.events.emit("reset", tenant=tid, was_failed=was_failed)
        rt.refresh_state()
        done: Completion[dict[str, object]] = Completion()
        rt.ready_waiters.append(done)
        self._answer_ready(rt)
        return done

    def restart(self, tid: str) -> Completion[dict[str, object]]:
        """Replace every instance with a new worker, one at a time; completed with the tenant's
        record once the last one is ready (failed if the tenant goes down first)."""
        rt = self.admin.runtime(tid)
        if rt.state is TenantState.FAILED:
            raise TenantFailed(tid, len(rt.restart_times), rt.spec.restart_window_s,
                               message=f"tenant {tid!r} is failed: 'twt reset {tid}' starts it again")
        done: Completion[dict[str, object]] = Completion()
        rt.ready_waiters.append(done)
        self._start_rolling(rt)
        return done

    def _start_rolling(self, rt: TenantRuntime) -> None:
        queued = [s.index for s in rt.slots if not s.draining and s.index not in rt.rolling and s is not rt.rolling_slot]
        rt.rolling.extend(queued)
        self.events.emit("rolling_restart", tenant=rt.tenant_id, instances=len(queued))
        self._advance(rt)

    def _advance(self, rt: TenantRuntime) -> None:
        while rt.rolling_slot is None and rt.rolling:
            index = rt.rolling.popleft()
            if index >= len(rt.slots) or rt.slots[index].draining:
                continue
            slot = rt.slots[index]
            rt.rolling_slot = slot
            rt.rolling_incarnation = slot.incarnation
            worker = slot.worker
            if worker is None:
                if slot.restart_at is None:
                    self.workers.start_instance(rt, slot)
            elif worker.state in (WorkerState.STOPPING, WorkerState.DRAINING, WorkerState.DEAD):
                slot.replace = True
            else:
                slot.replace = True
                worker.kill_reason = worker.kill_reason or "rolling restart"
                self.workers.drain(worker)  # in-flight requests finish first; then stop, then a new worker
        rt.refresh_state()
        self._answer_ready(rt)

    def instance_ready(self, rt: TenantRuntime) -> None:
        """An instance of ``rt`` became ready: the rolling restart moves on; waiters may be answered."""
        slot = rt.rolling_slot
        if slot is not None and slot.ready and slot.incarnation > rt.rolling_incarnation:
            rt.rolling_slot = None
            self._advance(rt)
        else:
            self._answer_ready(rt)

    def _answer_ready(self, rt: TenantRuntime) -> None:
        if not rt.ready_waiters or rt.rolling_slot is not None or rt.rolling:
            return
        rt.refresh_state()
        if rt.state is not TenantState.RUNNING:
            return
        waiters, rt.ready_waiters = rt.ready_waiters, []
        record = self.admin.records.tenant_record(rt).to_wire()
        for done in waiters:
            done.resolve(record)

    def tenant_down(self, rt: TenantRuntime, exc: TensorWasmError) -> None:
        """The tenant failed or was evicted: its rolling restart stops, its waiters get ``exc``."""
        rt.rolling.clear()
        rt.rolling_slot = None
        waiters, rt.ready_waiters = rt.ready_waiters, []
        for done in waiters:
            done.fail(exc)

    # ------------------------------------------------------------ rotate-key

    def rotate_key(self) -> dict[str, object]:
        """A new registry key: stored first (a crash cannot bring the old one back), then swapped in."""
        key = RegistryKey.fresh()
        old = bytes.fromhex(self.registry.registry_id)
        try:
            self.state.put_registry_key(key, retire=old)
        except StateError:
            log_event(_log, logging.ERROR, "supervisor.rotate_key_failed", state=self.state.path)
            raise  # nothing rotated
        key, new_admin = self.registry.rotate_key(self.admin.admin_cap, key)
        self.admin.admin_cap = new_admin
        self.signals.key_rotated(new_admin)
        self.events.emit("rotate_key", registry=self.registry.registry_id[:8], retired=old.hex()[:8])
        return {"admin_capability": new_admin.to_bytes(), "registry_id": self.registry.registry_id}


def _settings_of(path: str | None) -> dict[str, object]:
    """The ``[supervisor]`` table of the config file as it is now (empty when there is none)."""
    if path is None:
        return {}
    try:
        fields = read_config_file(path)
    except ValueError:
        return {}
    return {k: v for k, v in fields.items() if k != "tenants"}
