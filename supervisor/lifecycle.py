"""Worker and tenant lifecycle: pool, spawn, bind, stop, kill, death, restart, registration state.

Death handling (the sentinel fired): every in-flight request is answered
(:class:`WorkerLost`, or :class:`MemoryExhausted` after the RSS backstop),
the instance's quota share is reclaimed, an ``exit`` event is published and
the restart policy decides (see :mod:`supervisor.tenants`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import psutil
import zmq

from shared import protocol as proto
from shared.errors import (
    KernelTimeout,
    MemoryExhausted,
    TenantFailed,
    TensorWasmError,
    UnknownTenant,
    WorkerLost,
)
from shared.exits import context_lost_error, exit_reason
from shared.log import get_logger, log_event
from shared.proctitle import set_process_name
from shared.spec import TenantSpec
from supervisor.routing import _Routing
from supervisor.tenants import InstanceSlot, TenantRuntime, TenantState
from supervisor.workers import (
    Pending,
    WorkerHandle,
    WorkerState,
    exit_status,
    kill_tree,
)

__all__: list[str] = []  # an internal layer of Supervisor (supervisor.router)

_log = get_logger("supervisor")


class _Lifecycle(_Routing):
    def _signal_ready(self) -> None:
        if self.ready:
            return
        self.ready = True
        set_process_name("twt-supervisor")
        self.rundir.write_ready(
            {
                "pid": os.getpid(),
                "version": proto.PROTOCOL_VERSION,
                "registry_id": self.registry.registry_id,
                "backend": self.backend_name,
                "frontend": self.rundir.endpoint("frontend"),
                "events": self.rundir.endpoint("events"),
                "started": self._started,
                "metrics_url": getattr(self.metrics, "url", None),
            }
        )
        log_event(
            _log,
            logging.INFO,
            "supervisor.ready",
            run_dir=self.rundir.path,
            pid=os.getpid(),
            backend=self.backend_name,
            start_method=self.config.start_method,
            tenants=len(self.tenants),
        )
        if self.on_ready is not None:
            self.on_ready(self)

    def _register(self, spec: TenantSpec, client: bytes | None, rid: int | None) -> None:
        from collections import Counter

        # placement and the MPS check first: a refusal must leave nothing registered
        device = self.placement.place(spec, Counter(t.device for t in self.tenants.values()))
        isolation = self.placement.isolation(spec)
        cap = self.registry.register_with_capability(self.admin, spec)
        block = self.registry.block(self.admin, spec.tenant_id)
        rt = TenantRuntime(spec, block, cap.generation)
        rt.device = device
        self.placement.add(spec.tenant_id, isolation)
        rt.slots = [InstanceSlot(i) for i in range(spec.instances)]
        self.tenants[spec.tenant_id] = rt
        rt.register_waiters.append((client, rid, cap.to_bytes(), time.monotonic() + self.config.register_timeout_s))
        self.events.emit("register", tenant=spec.tenant_id, instances=spec.instances, generation=cap.generation)
        for slot in rt.slots:
            self._start_instance(rt, slot)
        self._after(self.config.register_timeout_s, lambda: self._register_timeout(rt))
        self._check_registered(rt)

    def _check_registered(self, rt: TenantRuntime) -> None:
        rt.refresh_state()
        if not rt.register_waiters:
            return
        if rt.state is TenantState.RUNNING:
            waiters, rt.register_waiters = rt.register_waiters, []
            for client, rid, cap_raw, _ in waiters:
                if client is not None:
                    self._reply(
                        client,
                        rid,
                        {
                            "capability": cap_raw,
                            "tenant": {
                                "tenant_id": rt.tenant_id,
                                "state": rt.state.value,
                                "generation": rt.generation,
                                "device": rt.device,
                                "pids": [s.worker.pid for s in rt.slots if s.worker],
                            },
                        },
                    )
            self._maybe_ready()

    def _register_timeout(self, rt: TenantRuntime) -> None:
        if rt.register_waiters and self.tenants.get(rt.tenant_id) is rt:
            self._fail_registration(rt, KernelTimeout(self.config.register_timeout_s, "register"))

    def _fail_registration(self, rt: TenantRuntime, exc: TensorWasmError) -> None:
        waiters, rt.register_waiters = rt.register_waiters, []
        log_event(_log, logging.ERROR, "tenant.register_failed", tenant=rt.tenant_id, error=str(exc))
        self._evict(rt.tenant_id, None, None)
        for client, rid, _, _ in waiters:
            self._reply_error(client, rid, exc)
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        """Write the ready file once every configured tenant is up (or failed)."""
        if not self.ready and all(not rt.register_waiters for rt in self.tenants.values()):
            self._signal_ready()

    def _evict(self, tid: str, client: bytes | None, rid: int | None) -> None:
        rt = self.tenants.get(tid)
        if rt is None:
            raise UnknownTenant(tid)
        rt.state = TenantState.EVICTING
        self.registry.unregister(self.admin, tid)  # revokes capabilities, unlinks the block
        del self.tenants[tid]
        self._forget_tenant(rt)
        for p in rt.parked:
            self._reply_error(p.client, p.rid, WorkerLost(tid, p.instance or 0, reason="tenant evicted"))
        rt.parked.clear()
        workers = [s.worker for s in rt.slots if s.worker is not None and s.worker.state is not WorkerState.DEAD]
        for worker in workers:
            self._stop_worker(worker, "evicted")
        self.events.emit("evict", tenant=tid, workers=[w.pid for w in workers])
        if client is None:
            return
        pids = [w.pid for w in workers]
        remaining = {w.worker_id for w in workers}
        if not remaining:
            self._reply(client, rid or 0, {"evicted": tid, "pids": pids})
            return

        def on_dead(worker: WorkerHandle) -> None:
            remaining.discard(worker.worker_id)
            if not remaining:
                self._reply(client, rid or 0, {"evicted": tid, "pids": pids})

        for worker in workers:
            worker.death_waiters.append(on_dead)

    def _drain(self, worker: WorkerHandle) -> None:
        """Stop routing to a worker; stop it once its in-flight requests are answered."""
        worker.state = WorkerState.DRAINING
        if not worker.in_flight:
            self._stop_worker(worker, "scaled down")

    def _spawn(self) -> WorkerHandle:
        worker = self.spawner.spawn()
        self.workers[worker.ident] = worker
        self.by_token[worker.token] = worker
        self.by_sentinel[worker.sentinel] = worker
        self.poller.register(worker.sentinel, zmq.POLLIN)
        self.events.emit("spawn", worker=worker.worker_id, pid=worker.pid, method=self.spawner.method)
        return worker

    def _refill_pool(self) -> None:
        want = self.config.pool_size
        if self._pool_failures and time.monotonic() < self._pool_retry_at:
            return
        if self._pool_failures:
            self._pool_retry_at = time.monotonic() + min(30.0, 0.1 * 2 ** min(self._pool_failures, 9))
        while len(self.pool) + self.pool_starting < want:
            worker = self._spawn()
            worker.tenant = None
            self.pool_starting += 1

    def _start_instance(self, rt: TenantRuntime, slot: InstanceSlot) -> None:
        """Give a slot a worker: a warm one from the pool, else a fresh process."""
        slot.restart_at = None
        slot.incarnation += 1
        worker = self.pool.pop() if self.pool else None
        if worker is None:
            worker = self._spawn()
            worker.tenant = rt.tenant_id
            worker.instance = slot.index
            slot.worker = worker
            return  # bound when its hellos arrive
        worker.tenant = rt.tenant_id
        worker.instance = slot.index
        slot.worker = worker
        self._bind(rt, slot, worker)
        # No refill here: starting a process blocks the loop for a few ms, which
        # would delay this very registration's reply. Housekeeping refills.

    def _on_connected(self, worker: WorkerHandle) -> None:
        if not worker.connected:
            return
        if worker.tenant is None:
            self.pool_starting -= 1
            worker.state = WorkerState.IDLE
            worker.ready_at = time.monotonic()
            self.pool.append(worker)
            self.events.emit("ready", worker=worker.worker_id, pid=worker.pid, pool=True)
            return
        rt = self.tenants.get(worker.tenant)
        slot = (
            rt.slots[worker.instance]
            if rt is not None and worker.instance is not None and worker.instance < len(rt.slots)
            else None
        )
        if rt is None or slot is None or slot.worker is not worker:
            self._stop_worker(worker, "tenant gone before bind")
            return
        self._bind(rt, slot, worker)

    def _bind(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle) -> None:
        worker.state = WorkerState.BINDING
        worker.incarnation = slot.incarnation
        args = {
            "spec": rt.spec.to_dict(),
            "instance": slot.index,
            "incarnation": slot.incarnation,
            "segment": rt.block.name,
            "backend": self.backend_name,
            "backend_options": self._backend_options_for(rt),
        }
        now = time.monotonic()

        def done(ok: bool, payload: Any) -> None:
            self._on_bound(rt, slot, worker, ok, payload)

        pending = Pending(None, 0, "bind", rt.tenant_id, slot.index, now, now + self.config.register_timeout_s, done)
        try:
            self._send_to_worker(worker, "bind", args, None, pending)
        except TensorWasmError as exc:
            done(False, exc.to_dict())

    def _backend_options_for(self, rt: TenantRuntime) -> dict[str, Any]:
        opts = dict(self.backend_options)
        opts["device_index"] = rt.device
        opts.update(self.placement.worker_options(rt.spec, rt.device))  # budget, caps, MPS environment
        return opts

    def _on_bound(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle, ok: bool, payload: Any) -> None:
        if self.tenants.get(rt.tenant_id) is not rt or slot.worker is not worker:
            self._stop_worker(worker, "tenant gone during bind")
            return
        if not ok:
            err = payload if isinstance(payload, dict) else {}
            log_event(
                _log,
                logging.ERROR,
                "worker.bind_failed",
                tenant=rt.tenant_id,
                instance=slot.index,
                error=err.get("message"),
            )
            from shared.errors import error_from_dict

            exc = error_from_dict(err)
            self._kill(worker, f"bind failed: {exc}", "bind")
            if rt.register_waiters:
                self._fail_registration(rt, exc)
            return
        worker.state = WorkerState.READY
        worker.ready_at = time.monotonic()
        self.events.emit(
            "ready",
            tenant=rt.tenant_id,
            instance=slot.index,
            worker=worker.worker_id,
            pid=worker.pid,
            incarnation=slot.incarnation,
            startup_ms=round((worker.ready_at - worker.spawned_at) * 1000, 3),
        )
        rt.refresh_state()
        self._check_registered(rt)
        self._dispatch_parked(rt)

    def _stop_worker(self, worker: WorkerHandle, reason: str) -> None:
        """Planned stop: ``stop`` on control (SIGTERM if it never connected), SIGKILL after the timeout."""
        if worker.state in (WorkerState.DEAD, WorkerState.STOPPING):
            return
        worker.state = WorkerState.STOPPING
        worker.expected_exit = True
        worker.kill_reason = worker.kill_reason or reason
        if worker in self.pool:
            self.pool.remove(worker)
        if worker.control_hello:
            self._send_control(worker, proto.encode_control("stop"))
        else:
            kill_tree(worker.pid, signal.SIGTERM)
        worker.kill_at = time.monotonic() + self.config.stop_timeout_s

    def _kill(self, worker: WorkerHandle, reason: str, cause: str) -> None:
        """Forced stop: SIGTERM now, SIGKILL of the whole tree after ``kill_grace_s``."""
        if worker.state is WorkerState.DEAD or worker.killed:
            return
        worker.killed = True
        worker.kill_cause = cause
        if not worker.expected_exit:
            worker.kill_reason = reason
        log_event(
            _log,
            logging.WARNING,
            "worker.kill",
            worker=worker.worker_id,
            pid=worker.pid,
            tenant=worker.tenant,
            instance=worker.instance,
            reason=reason,
            cause=cause,
        )
        self.events.emit(
            "kill",
            worker=worker.worker_id,
            pid=worker.pid,
            tenant=worker.tenant,
            instance=worker.instance,
            reason=reason,
        )
        worker.state = WorkerState.STOPPING
        if worker in self.pool:
            self.pool.remove(worker)
        kill_tree(worker.pid, signal.SIGTERM)
        worker.kill_at = time.monotonic() + self.config.kill_grace_s

    def _on_death(self, worker: WorkerHandle) -> None:
        """The sentinel fired: answer, reclaim, publish, restart."""
        self.poller.unregister(worker.sentinel)
        del self.by_sentinel[worker.sentinel]
        self.workers.pop(worker.ident, None)
        self.by_token.pop(worker.token, None)
        was_pool = worker.tenant is None
        if was_pool and worker.state is WorkerState.STARTING:
            self.pool_starting -= 1
        if worker in self.pool:
            self.pool.remove(worker)
        expected = worker.expected_exit
        worker.state = WorkerState.DEAD
        code, sig = exit_status(worker.process)
        if worker.process.exitcode is not None:
            worker.process.close()
        reason = worker.kill_reason or exit_reason(code, sig)  # "CUDA context lost: ..." for a sticky error
        tid, index = worker.tenant, worker.instance
        # 1. every in-flight request gets a typed answer
        rt = self.tenants.get(tid) if tid else None
        for rid, pending in list(worker.in_flight.items()):
            if worker.rss_exceeded is not None:
                rss, limit = worker.rss_exceeded
                exc: TensorWasmError = MemoryExhausted(
                    pending.tenant,
                    rss,
                    limit,
                    rss,
                    message=f"worker {pending.tenant}/{pending.instance} was killed: RSS {rss:,} B above "
                    f"its limit of {limit:,} B (memory quota + allowance)",
                )
            else:
                exc = WorkerLost(pending.tenant, pending.instance, code, sig, reason)
            if pending.callback is not None:
                pending.callback(False, exc.to_dict())
            else:
                if rt is not None:
                    rt.in_flight -= 1
                self._reply_error(pending.client, pending.client_rid, exc)
                self.metrics.request_done(pending.tenant, pending.op, exc.code, time.monotonic() - pending.started)
        worker.in_flight.clear()
        # 2. its share of the quota comes back (the driver freed its GPU memory)
        reclaimed = (0, 0)
        if rt is not None and index is not None and not rt.block.closed:
            reclaimed = rt.block.reclaim_instance(index)
            self._after_reclaim(rt, reclaimed)
        # 3. tell the world
        if worker.rss_exceeded:
            cause = "rss"
        elif expected:
            cause = "stop"
        elif worker.kill_cause:
            cause = worker.kill_cause  # heartbeat, deadline, protocol, startup, bind
        elif context_lost_error(code) is not None:
            cause = "cuda"
        else:
            cause = "signal" if sig else "exit"
        self.metrics.worker_exit(tid, cause)
        self.events.emit(
            "exit",
            worker=worker.worker_id,
            pid=worker.pid,
            tenant=tid,
            instance=index,
            exit_code=code,
            signal=sig,
            reason=reason,
            expected=expected,
            reclaimed_cpu=reclaimed[0],
            reclaimed_gpu=reclaimed[1],
        )
        for waiter in worker.fault_waiters:
            waiter({"exited": True, "exit_code": code, "signal": sig})
        worker.fault_waiters.clear()
        for on_dead in worker.death_waiters:
            on_dead(worker)
        worker.death_waiters.clear()
        if was_pool and not expected and worker.ready_at is None:
            self._pool_failures += 1  # a worker that cannot even start: back off refilling
        elif was_pool:
            self._pool_failures = 0
        # 4. restart policy
        if rt is None or index is None or index >= len(rt.slots):
            return
        slot = rt.slots[index]
        if slot.worker is not worker:
            return
        slot.worker = None
        slot.last_exit = {"exit_code": code, "signal": sig, "reason": reason, "at": time.time()}
        if slot.draining or self._stopping or rt.state is TenantState.EVICTING:
            if slot.draining and index == len(rt.slots) - 1:
                while rt.slots and rt.slots[-1].draining and rt.slots[-1].worker is None:
                    rt.slots.pop()
            rt.refresh_state()
            return
        if rt.register_waiters and worker.ready_at is None:
            self._fail_registration(rt, WorkerLost(rt.tenant_id, index, code, sig, f"died while starting: {reason}"))
            return
        if not rt.should_restart(code, sig, killed=worker.killed and not expected):
            rt.refresh_state()
            self._fail_parked_for(rt, index, code, sig, reason)
            return
        if not rt.note_restart(time.monotonic()):
            self._mark_failed(rt, f"{len(rt.restart_times)} restarts within {rt.spec.restart_window_s:g} s")
            return
        delay = rt.backoff_s()
        slot.restarts += 1
        self.metrics.restart(rt.tenant_id)
        self.events.emit("restart", tenant=rt.tenant_id, instance=index, delay_s=delay, restarts=slot.restarts)
        rt.refresh_state()
        if delay <= 0:
            self._start_instance(rt, slot)
        else:
            slot.restart_at = time.monotonic() + delay
            self._after(delay, lambda: self._restart_due(rt, slot))

    def _after_reclaim(self, rt: TenantRuntime, reclaimed: tuple[int, int]) -> None:
        """Hook for the device budget (bytes of a dead instance come back to its device too)."""
        self.placement.reclaim_dead()  # by slot owner: exact even if it died mid-alloc

    def _restart_due(self, rt: TenantRuntime, slot: InstanceSlot) -> None:
        if (
            self.tenants.get(rt.tenant_id) is rt
            and slot.restart_at is not None
            and slot.worker is None
            and not self._stopping
        ):
            self._start_instance(rt, slot)

    def _fail_parked_for(self, rt: TenantRuntime, index: int, code: int | None, sig: int | None, reason: str) -> None:
        """Instance ``index`` is not coming back: answer what can only go there."""
        restarting = any(s.worker is not None or s.restart_at is not None for s in rt.slots if not s.draining)
        keep = []
        for p in rt.parked:
            if p.instance == index or not restarting:
                self._reply_error(
                    p.client,
                    p.rid,
                    WorkerLost(
                        rt.tenant_id, index, code, sig, f"{reason}; not restarted (restart={rt.spec.restart.value})"
                    ),
                )
            else:
                keep.append(p)
        rt.parked.clear()
        rt.parked.extend(keep)

    def _mark_failed(self, rt: TenantRuntime, why: str) -> None:
        rt.state = TenantState.FAILED
        rt.failed_reason = why
        self.events.emit("failed", tenant=rt.tenant_id, reason=why, restarts=rt.restarts_total)
        exc = TenantFailed(rt.tenant_id, len(rt.restart_times), rt.spec.restart_window_s)
        while rt.parked:
            p = rt.parked.popleft()
            self._reply_error(p.client, p.rid, exc)
        for slot in rt.slots:
            if slot.worker is not None:
                self._stop_worker(slot.worker, "tenant failed")
        if rt.register_waiters:
            self._fail_registration(rt, exc)

    def _check_rss(self) -> None:
        allowance = self.config.rss_allowance_bytes
        for rt in self.tenants.values():
            limit = rt.spec.memory_quota_bytes + allowance
            for slot in rt.slots:
                worker = slot.worker
                if worker is None or worker.state is not WorkerState.READY:
                    continue
                try:
                    rss = psutil.Process(worker.pid).memory_info().rss
                except psutil.Error:
                    continue
                if rss > limit:
                    worker.rss_exceeded = (rss, limit)
                    self._kill(worker, f"RSS {rss:,} B above {limit:,} B (memory quota + allowance)", "rss")

    def _scan_refusals(self) -> None:
        self._refresh_metrics()
        for rt in self.tenants.values():
            if rt.block.closed:
                continue
            snap = rt.block.snapshot()
            total = snap.cpu_refusals + snap.gpu_refusals
            if total > rt.seen_refusals:
                self.events.emit(
                    "quota_refusal",
                    tenant=rt.tenant_id,
                    new=total - rt.seen_refusals,
                    cpu_refusals=snap.cpu_refusals,
                    gpu_refusals=snap.gpu_refusals,
                )
                rt.seen_refusals = total

    def _expire(self, worker: WorkerHandle, rid: int, pending: Pending) -> None:
        """A request outlived its deadline: answer it, then kill the stuck worker."""
        del worker.in_flight[rid]
        rt = self.tenants.get(pending.tenant)
        if rt is not None and pending.client is not None:
            rt.in_flight -= 1
        timeout = pending.deadline - pending.started
        exc = KernelTimeout(
            timeout,
            pending.op,
            message=f"{pending.op} on {pending.tenant}/{pending.instance} exceeded its deadline of "
            f"{timeout:g} s; the worker is being restarted",
        )
        if pending.callback is not None:
            pending.callback(False, exc.to_dict())
        else:
            self._reply_error(pending.client, pending.client_rid, exc)
            self.metrics.request_done(pending.tenant, pending.op, exc.code, time.monotonic() - pending.started)
        self._kill(worker, f"request {pending.op!r} exceeded its deadline of {timeout:g} s", "deadline")
