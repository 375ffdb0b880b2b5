"""The supervisor process: one single-threaded loop composed of a few parts.

    clients ──DEALER──► ROUTER frontend ─┐ Frontend: decode header only; check capability;
    remote  ──CURVE───► ROUTER tcp://… ──┤ (TcpFrontend, when ``listen`` is set: same path)
                                         │ back-pressure (max_in_flight); Dispatcher: pick instance
    workers ◄──DEALER── ROUTER backend ◄─┘ WorkerSet: forward [hdr'|body] (body not copied)
    workers ──DEALER──► ROUTER control     WorkerSet: hello / heartbeats / fault acks
    subscribers ◄─SUB── PUB events         spawn, ready, exit, restart, failed ...
                        EventLog           the same events, numbered and bounded: the ``events`` op
    worker sentinels (fds) ─► poller       WorkerSet.on_death: a death is seen at once

The parts, each owning its own state, built bottom-up by one factory
(:func:`supervisor.wiring.build_parts`; docs/ARCHITECTURE.md draws who calls whom):

    Loop          (loop.py)       poller, timers, wake pipe; the clock
    TenantSignals (signals.py)    news from below (a worker ready, a tenant failed) to the parts above
    PendingTable  (pending.py)    requests in flight, deadlines, THE one place a request is finished
    Replies       (replies.py)    answers out on the frontend socket, bounded per client
    WorkerSet     (workerset.py)  pool, spawn, bind, stop, kill, death, restart, liveness
    Parking       (parking.py)    idle tenants parked (buffers to host memory, workers gone) and activated
    Dispatcher    (dispatcher.py) a tenant request to an instance: choice, forwarding, parked requests
    AdminOps      (admin.py)      admin ops and the tenant lifecycle (register ... evict, failed)
    ServiceOps    (service.py)    restore at start, reload (SIGHUP), reset, rolling restart, rotate-key
    Frontend      (frontend.py)   client requests: decode, capability, admission, back-pressure
    StateStore    (state.py)      the durable state: registry key, tenants, generations (SQLite)
    Supervisor    (this module)   the state and run dir, the loop body, housekeeping, start and stop

Two guards sit in the loop body: a :class:`~supervisor.runtime.stall.StallGuard`
(a supervisor that was itself stopped or starved does not take its own
lateness for its workers' deaths) and the denied-event audit
(:class:`~supervisor.store.audit.DeniedAudit`, every refused capability published,
rate-limited).

Owns: the parts (:class:`~supervisor.wiring.Parts`: the ZMQ context and
sockets among them), signal handlers, the run dir's ready file and the
metrics snapshot hand-off. Everything the loop does is
non-blocking; sends use ``NOBLOCK`` and a full peer (a slow client) loses
its reply rather than stalling everyone. The quota hot path never passes
through here: workers consume and release on their tenant's shared-memory
block directly; the loop reads the blocks for status and reclaims a dead
instance's share.

Threads: everything runs on the loop thread except :meth:`Supervisor.request_stop`
and :meth:`Supervisor.request_reload` (signal handlers, any thread) and :meth:`Supervisor.metrics_snapshot` (the
exporter's HTTP threads), which only wake the loop and wait on a
:class:`supervisor.runtime.loop.Handoff`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from types import FrameType
from typing import Any

from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.capability import RegistryAdminCapability
from shared.log import get_logger, log_event
from shared.prctl import set_process_name
from supervisor.control.admin import AdminOps
from supervisor.control.ops.put_module import restore_modules
from supervisor.lifecycle.backend_select import select_backend
from supervisor.lifecycle.drain import Drain
from supervisor.observe.event_log import EventLog
from supervisor.observe.events import EventBus
from supervisor.observe.metrics import (
    DeviceGauges,
    Metrics,
    MetricsSnapshot,
    NullMetrics,
    QUIET_STATES,
    TenantGauges,
)
from supervisor.observe.sd_notify import SystemdNotifier
from supervisor.runtime.loop import Clock, Handoff, Loop
from supervisor.runtime.stall import StallGuard
from supervisor.runtime.tenants import TenantRuntime
from supervisor.runtime.workers import Spawner, SpawnerFactory, WorkerState
from supervisor.store.modules import MODULES_DIR, ModuleStore
from supervisor.store.registry import TenantRegistry
from supervisor.store.rundir import RunDir
from supervisor.store.state import StateStore
from supervisor.admission.frontend import small_frame_bytes
from supervisor.wiring import Parts, Surroundings, build_parts

__all__ = ["Supervisor"]

_log = get_logger("supervisor")

TICK_S = 0.05
#: the housekeeping tick of an idle supervisor (:meth:`Supervisor._idle`: nothing in flight, parked,
#: starting, stopping or due), at most the heartbeat interval and within the stall guard's slack:
#: what a tick still does then is judged in seconds (heartbeats, parking's idle timeouts, the RSS
#: pass), and anything that makes work wakes the loop, whose turn brings the short tick back (at 20
#: a second, an idle supervisor's loop thread was ~0.5 % of a core)
IDLE_TICK_S = 0.25
#: after a stall of the loop, how long deadline expiries wait (a few turns of the loop, each
#: reading up to a batch of queued replies per socket)
STALL_GRACE_S = 0.25
RSS_CHECK_INTERVAL_S = 1.0
#: worker states an idle supervisor may have (:meth:`Supervisor._idle`)
_SETTLED = frozenset({WorkerState.IDLE, WorkerState.READY})


class Supervisor:
    """Runs until :meth:`request_stop` (or SIGTERM/SIGINT in :meth:`run`; SIGHUP reloads the config file)."""

    def __init__(self, config: SupervisorConfig, *, metrics: Metrics | None = None,
                 rundir: RunDir | None = None, clock: Clock = time.monotonic,
                 spawner: SpawnerFactory = Spawner, notifier: SystemdNotifier | None = None) -> None:
        """``rundir``: the run dir, possibly already locked (``twt supervise`` locks it before binding anything).

        ``clock`` and ``spawner`` are the seams of the in-process lifecycle tests: a fake clock the
        test advances, and workers that live on this loop instead of in processes
        (tests/helpers/fake_workers.py). Production uses the monotonic clock and real processes.
        ``notifier``: systemd's ``Type=notify`` messages (:mod:`supervisor.observe.sd_notify`); default none.
        """
        self.config = config
        self.metrics = metrics or NullMetrics()
        self.notifier = notifier or SystemdNotifier(None)
        self.rundir = rundir or RunDir(config.run_dir, config.client_group)
        # opened in start(), once the run dir is ours: the registry's identity comes from the state
        self.state: StateStore | None = None
        #: the tenants' stored modules on disk, beside the state (written on their own thread)
        self.modules = ModuleStore(os.path.join(config.state_path, MODULES_DIR))
        self.registry: TenantRegistry | None = None
        self.loop = Loop(clock)
        self._spawner_factory = spawner
        self.tenants: dict[str, TenantRuntime] = {}
        #: every event, numbered, for the ``events`` op (bounded: supervisor.observe.event_log)
        self.event_log = EventLog(config.event_log_size, self._generation_of)
        self.events = EventBus(None, self.event_log)
        self.internal_errors = 0  # bugs caught by the loop's safety net (see _internal_error)
        self.ready = False
        self._stopping = False
        self._stop_started: float | None = None
        #: a stop was asked for (a signal, request_stop): the drain runs first (supervisor.lifecycle.drain)
        self._stop_wanted = False
        self._drain = Drain(config.drain_timeout_s, config.stop_timeout_s + 2 * config.kill_grace_s)
        self._last_rss_check = 0.0
        self._restoring = False  # service.restore() runs: not ready yet, whatever has settled
        self._reload_wanted = False
        # A gap of a second between housekeeping passes (every 50 ms, 0.2 s idle) is a stall - and always one
        # that reaches the liveness window, the time after which a worker would be judged hung.
        # Deadline expiries then wait STALL_GRACE_S: replies that came during the stall are read first.
        window = config.heartbeat_interval_s * config.heartbeat_liveness
        self.stall = StallGuard(threshold_s=min(max(1.0, config.heartbeat_interval_s), window),
                                grace_s=STALL_GRACE_S)
        self._metrics = Handoff(self.loop.wake, MetricsSnapshot())
        self.parts: Parts | None = None
        self._next_tick = 0.0
        #: the tick while :meth:`_idle`: the supervisor's beats to its workers stay on time, and a gap
        #: between ticks stays within the stall guard's slack (longer, it would count as the loop's
        #: lateness and be left out of the workers' silence)
        self._idle_tick_s = max(TICK_S, min(IDLE_TICK_S, config.heartbeat_interval_s, 0.8 * self.stall.slack_s))
        self._closed = False
        self._acquired = False
        self._owns_process = False  # run() (the daemon) names the process; start() alone does not

    # ------------------------------------------------------------ set up

    def _open_state(self) -> tuple[StateStore, TenantRegistry, RegistryAdminCapability]:
        """The state store and the registry it holds the identity of (StateError: the start stops).

        Segment names get a prefix drawn per start under the run dir's namespace: the
        registry id is the same after a restart, and a killed supervisor's segments may still exist.
        """
        self.state = StateStore.open(self.config.state_path)
        self.registry, admin_cap = TenantRegistry.from_state(self.state, segment_prefix=self.rundir.new_segment_prefix(),
                                                             lazy_segments=True)  # a segment only while a worker runs
        return self.state, self.registry, admin_cap

    def _setup(self) -> Parts:
        """Build the parts (:func:`supervisor.wiring.build_parts`), then bring back every stored
        tenant and the config file's difference, their stored modules, and the warm pool."""
        # the backend first, while this process has one thread: its probe is then a fork of it
        # (supervisor.lifecycle.backend_select), not a fresh interpreter
        backend = select_backend(self.config)
        state, registry, admin_cap = self._open_state()
        stored = state.tenants()
        parts = self.parts = build_parts(Surroundings(
            self.config, self.loop, self.rundir, state, registry, admin_cap, self.tenants, self.metrics,
            self.event_log, self.modules, self._spawner_factory, stored, stopping=lambda: self._stopping,
            internal_errors=lambda: self.internal_errors, on_settled=self._maybe_ready,
            on_key_rotated=self._key_rotated, backend=backend,
        ))
        self.events = parts.events
        self.metrics.bind_source(self.metrics_snapshot)
        # every stored tenant, then the config file's difference; not ready before the last one is
        # back (each restored tenant settles on its own, and the first would otherwise make it ready)
        self._restoring = True
        try:
            parts.service.restore(stored)
        finally:
            self._restoring = False
        restore_modules(self.modules, parts.frontend, self.tenants,  # their stored modules, without a resend
                        state.tenant_generations())
        parts.workers.refill_pool()
        return parts

    def _key_rotated(self, new_admin: RegistryAdminCapability) -> None:
        """The registry key was rotated: the run dir's admin capability and ready files follow."""
        self.rundir.write_admin_capability(new_admin.to_bytes())
        if self.ready and self.parts is not None:
            self.rundir.write_ready({**self._ready_info(self.parts.admin),
                                     "registry_id": self.parts.admin.registry.registry_id})

    def _generation_of(self, tenant: str) -> int | None:
        """The generation ``tenant`` is registered with now (the event log tags its events with it)."""
        rt = self.tenants.get(tenant)
        return rt.generation if rt is not None else None

    # ------------------------------------------------------------ run and stop

    def request_stop(self) -> None:
        """Begin a graceful stop: drain, then stop the workers (safe from a signal handler or another
        thread). A second call ends the drain at once (a second SIGTERM/SIGINT)."""
        if self._stop_wanted:
            self._drain.hurry()
        self._stop_wanted = True
        self.loop.wake()

    def request_reload(self) -> None:
        """Re-read the config file on the loop (SIGHUP; safe from a signal handler or another thread)."""
        self._reload_wanted = True
        self.loop.wake()

    def run(self) -> int:
        """Set up, serve until stopped, tear down (SIGTERM/SIGINT stop, SIGHUP reloads).

        Returns the process exit code: 0 after a graceful stop. A failure to start raises
        (``twt supervise`` maps the exception to its exit code).
        """
        prev: dict[int, Any] = {}  # signal.getsignal()'s handlers (typeshed's private union), put back as they were

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log_event(_log, logging.INFO, "supervisor.signal", signal=signum)
            if signum == signal.SIGHUP:
                self.request_reload()  # a closed terminal or `systemctl reload`: never a stop
            else:
                self.request_stop()

        self._owns_process = True
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            prev[int(sig)] = signal.signal(sig, on_signal)
        try:
            self.start()
            while self.turn():
                pass
        finally:
            self.close()
            for signum, handler in prev.items():
                signal.signal(signum, handler)
        return 0

    def start(self) -> None:
        """Lock the run dir, open the state, bind the sockets, restore the tenants (no signal handlers).

        :meth:`run` is ``start``, :meth:`turn` until it says stop, then :meth:`close`; the
        in-process lifecycle tests call the three themselves, turning the loop by hand.
        """
        self.rundir.acquire()  # RunDirLocked: another supervisor owns it - touch nothing
        self._acquired = True
        try:
            self._setup()
            self._maybe_ready()
        except BaseException:
            self.close()
            raise
        self._next_tick = self.loop.clock()

    def turn(self, max_wait_s: float | None = None) -> bool:
        """One turn of the loop: poll (at most until the next tick, or ``max_wait_s``), handle what
        is ready, run due timers and housekeeping. Returns False once a stop has completed."""
        parts = self.parts
        assert parts is not None, "start() first"
        loop = self.loop
        # unauthenticated requests waiting for their turn (supervisor.admission.fairness): do not sleep
        waiting = parts.frontend.guard.fair.backlog
        wait = 0.0 if waiting else max(0.0, self._next_tick - loop.clock())
        if max_wait_s is not None:
            wait = min(wait, max_wait_s)
        for handler in loop.poll(wait):
            try:
                handler()
            except Exception:  # noqa: BLE001 - a bug in one handler must not take every tenant down
                self._internal_error("dispatch")
        try:
            parts.frontend.end_turn()
        except Exception:  # noqa: BLE001 - as above
            self._internal_error("dispatch")
        if self._metrics.wanted():
            self._refresh_metrics()
        if self._reload_wanted and not self._stop_wanted:
            self._reload_wanted = False
            self.notifier.reloading()
            failed: str | None = None
            try:
                error = parts.service.reload_quietly()
                failed = None if error is None else str(error)
            except Exception as exc:  # noqa: BLE001 - as above
                self._internal_error("reload")
                failed = f"internal error: {exc!r}"
            if self.ready:
                # systemd ends a reload (RELOADING=1) at the next READY=1, failed or not; STATUS says which
                self.notifier.ready(f"serving {len(self.tenants)} tenant(s); reloaded" if failed is None else
                                    f"reload failed, still serving {len(self.tenants)} tenant(s) on the previous "
                                    f"config: {failed}")
        now = loop.clock()
        try:
            loop.timers.run_due(now)
            if now >= self._next_tick:
                self._next_tick = now + TICK_S
                self._housekeeping(parts, now)
                if self._idle(parts, now):
                    self._next_tick = now + self._idle_tick_s
            elif self._next_tick - now > TICK_S and not self._idle(parts, now):
                # an idle tick, and this turn's events made work (a request, a start, a stop...):
                # housekeeping within TICK_S again, as if the supervisor had never been idle
                self._next_tick = now + TICK_S
        except Exception:  # noqa: BLE001 - as above
            self._internal_error("housekeeping")
        if self._stop_wanted and not self._stopping:
            self._drain_turn(parts, now)
        if self._stopping:
            if self._stop_started is None:
                self._stop_started = now
                self.notifier.stopping(f"stopping {len(parts.workers.workers)} worker(s)")
                log_event(_log, logging.INFO, "supervisor.stopping", workers=len(parts.workers.workers))
                parts.workers.stop_all("shutdown")
            waited = now - self._stop_started
            if not parts.workers.workers or waited > self.config.stop_timeout_s + 2 * self.config.kill_grace_s:
                return False
        return True

    def _drain_turn(self, parts: Parts, now: float) -> None:
        """The drain between a stop's signal and the workers' stop: new requests refused
        ``Draining`` (the frontend asks the drain), in-flight ones answered; over when none is
        left, at ``drain_timeout_s``, or at a second signal."""
        in_flight = len(parts.pending) + sum(rt.waiting for rt in self.tenants.values())
        if self._drain.begin(now):
            parts.frontend.begin_drain(self._drain)
            self.metrics.mark_draining()  # /readyz: not ready, and why
            self.notifier.stopping(f"draining {in_flight} request(s) in flight "
                                   f"(at most {self.config.drain_timeout_s:g} s)")
            log_event(_log, logging.INFO, "supervisor.draining", in_flight=in_flight,
                      drain_timeout_s=self.config.drain_timeout_s)
        if self._drain.over(now, in_flight):
            if in_flight:
                log_event(_log, logging.WARNING, "supervisor.drain_timeout", in_flight=in_flight,
                          drain_timeout_s=self.config.drain_timeout_s, hurried=self._drain.hurried)
            self._stopping = True

    def _housekeeping(self, parts: Parts, now: float) -> None:
        self.notifier.watchdog(now)  # systemd's WatchdogSec: only a turning loop sends it
        stalled = self.stall.tick(now)
        if stalled is not None:
            # SIGSTOP or a starved host: the loop did not run. Heartbeats and replies that came
            # meanwhile are still unread; judge nobody by the clock until they have been.
            log_event(_log, logging.WARNING, "supervisor.stalled", stalled_s=round(stalled, 3))
            self.events.emit("stall", stalled_s=round(stalled, 3), grace_s=self.stall.grace_s)
        if not self.stall.in_grace(now):
            for worker, pending in parts.pending.expire(now):
                timeout = pending.deadline - pending.started
                parts.workers.kill(worker, f"request {pending.op!r} exceeded its deadline of {timeout:g} s",
                                   "deadline")
            parts.dispatcher.expire_parked(now)
        parts.workers.check_liveness(now, self.stall.silence)
        if now - self._last_rss_check >= RSS_CHECK_INTERVAL_S:
            self._last_rss_check = now
            parts.audit.flush()
            parts.replies.prune()
            parts.frontend.guard.refresh()
            parts.dispatcher.reap_regions()
            parts.workers.check_rss()
            if self.metrics.reads_snapshots:
                self._refresh_metrics()
            self._scan_refusals()
        if not self._stop_wanted:
            parts.parking.check_idle(now)  # no new park once a stop is asked for (the drain)
            parts.workers.refill_pool()

    def _idle(self, parts: Parts, now: float) -> bool:
        """Nothing that needs the short tick: ready, no stop or reload asked for, no request in flight,
        parked or waiting its turn, no timer due within an idle tick (the tick is the timers' clock:
        pacing, holds, restarts' backoff, sampling - one due later is run as late as before, the
        short tick back once it is near), no stall's grace, the pool at its target, and every
        worker warm in the pool or bound - none starting, binding, draining, stopping or being
        killed. Cheap first: at 10,000 parked tenants this runs a few times a second, and none of
        it is per tenant."""
        if (not self.ready or self._restoring or self._stop_wanted or self._stopping or self._reload_wanted
                or len(parts.pending) or parts.frontend.guard.fair.backlog or parts.dispatcher.any_parked
                or self.stall.in_grace(now)):
            return False
        due = self.loop.timers.next_due()
        if due is not None and due < now + self._idle_tick_s:  # due before an idle tick would come
            return False
        workers = parts.workers
        if workers.pool_starting or len(workers.pool) != workers.pool_target:  # a refill or a shrink to come
            return False
        return all(w.state in _SETTLED and w.kill_at is None for w in workers.workers.values())

    def _internal_error(self, where: str) -> None:
        """Log a bug with its traceback and keep serving (counted in status as internal_errors)."""
        self.internal_errors += 1
        _log.error("supervisor.internal_error", exc_info=True, extra={"twt_fields": {"where": where}})

    def close(self) -> None:
        """Tear down: answer what is in flight, kill every worker, unlink, release the run dir (once)."""
        if self._closed or not self._acquired:
            return  # nothing to undo: never started, or the run dir was another supervisor's
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        parts = self.parts
        try:
            if parts is not None:
                parts.pending.abandon(list(parts.workers.workers.values()), "the supervisor is stopping")
                parts.workers.kill_all_now()
                parts.regions.close()  # none outlives the supervisor
                parts.parking.close()  # the parked copies' files: host copies never outlive it
            if self.registry is not None:
                self.registry.close()
        finally:
            self.modules.close()  # every queued module write done
            if self.state is not None:
                self.state.close()
            if parts is not None:
                if parts.tcp is not None:
                    parts.tcp.close()
                parts.zctx.destroy(linger=0)
            self.loop.close()
            self.metrics.close()
            if parts is not None:
                parts.placement.close()  # unlink the device budget segments
            self.rundir.release()
            log_event(_log, logging.INFO, "supervisor.stopped")

    # ------------------------------------------------------------ ready

    def _maybe_ready(self) -> None:
        """Write the ready file once every configured tenant is up (or failed)."""
        parts = self.parts
        if self.ready or parts is None or self._restoring or not parts.admin.settled():
            return
        self.ready = True
        parts.frontend.mark_ready()  # hello without a capability says so from now on
        if self._owns_process:
            set_process_name("twt-supervisor")  # only the daemon's own process, never an embedder's
        self.rundir.write_ready(self._ready_info(parts.admin))
        self.notifier.ready(f"serving {len(self.tenants)} tenant(s) on the {parts.records.backend_name} backend")
        self.metrics.mark_ready()  # /readyz (it also waits for the warm pool, from the snapshot)
        log_event(_log, logging.INFO, "supervisor.ready", run_dir=self.rundir.path, pid=os.getpid(),
                  backend=parts.records.backend_name, start_method=self.config.start_method, tenants=len(self.tenants))

    def _ready_info(self, admin: AdminOps) -> dict[str, object]:
        tcp = self.parts.tcp if self.parts is not None else None
        return {
            "pid": os.getpid(),
            "version": proto.PROTOCOL_VERSION,
            "registry_id": admin.registry.registry_id,
            "backend": admin.records.backend_name,
            "frontend": self.rundir.endpoint("frontend"),
            # requests whose every frame is at most small_frame_bytes (docs/PROTOCOL.md)
            "small_frontend": self.rundir.endpoint("small"),
            "small_frame_bytes": small_frame_bytes(self.config),
            "events": self.rundir.endpoint("events"),
            "started": admin.records.started,
            "metrics_url": getattr(self.metrics, "url", None),
            "state_dir": self.config.state_path,
            # the TCP frontend as bound (port 0 resolved) and its CURVE public key (Z85)
            "listen": list(tcp.endpoints) if tcp is not None else [],
            "server_public_key": tcp.keys.public_text if tcp is not None else None,
        }

    # ------------------------------------------------------------ metrics and quota events

    def metrics_snapshot(self) -> MetricsSnapshot:
        """Per-tenant gauges, for the exporter's HTTP thread.

        That thread never touches a quota block itself (closing a block while
        another thread holds a view of it fails): it asks the loop, which
        rebuilds the dict (``_refresh_metrics``) and hands it over; the loop
        also refreshes it every second. Waits at most 1 s for a fresh one.
        """
        return self._metrics.request(1.0)

    def _refresh_metrics(self) -> None:
        """Loop thread: rebuild the exporter's snapshot (tenants, warm pool, device budgets)."""
        tenants = {}
        states: Counter[str] = Counter()
        quiet_host: Counter[str] = Counter()
        for tid, rt in self.tenants.items():
            state = rt.state.value
            states[state] += 1
            if rt.block.closed:
                continue
            if state in QUIET_STATES:  # counted by state only: no worker, nothing moves but its copies
                quiet_host[state] += rt.block.bytes_in_use
                continue
            tenants[tid] = TenantGauges(rt.block.snapshot(), len(rt.live_slots()), rt.state.value,
                                        wanted=sum(1 for s in rt.slots if not s.draining),
                                        gpu_time_weight=rt.spec.gpu_time_weight, gpu_time_cap=rt.spec.gpu_time_cap)
        parts = self.parts
        if parts is None:
            self._metrics.publish(MetricsSnapshot(tenants=tenants, states=dict(states),
                                                  quiet_host_bytes=dict(quiet_host)))
            return
        devices = tuple(DeviceGauges(d.index, d.budget_limit_bytes, d.budget_used_bytes, d.budget_refusals)
                        for d in parts.placement.status())
        self._metrics.publish(MetricsSnapshot(
            tenants=tenants, states=dict(states), quiet_host_bytes=dict(quiet_host), pool_idle=len(parts.workers.pool),
            pool_starting=parts.workers.pool_starting,
            pool_size=parts.workers.pool_target, backend=parts.records.backend_name, devices=devices,
            frontend=parts.frontend.guard.counters(),
        ))

    def _scan_refusals(self) -> None:
        """Emit ``quota_refusal`` for each tenant whose refusal counters grew. Only workers write
        them, so a tenant without a worker is read once after its last one went, then skipped:
        10,000 registered tenants do not cost the loop a pass over 10,000 blocks each second."""
        parts = self.parts
        if parts is None:
            return
        for rt in parts.records.to_read(parts.records.unread_refusals):
            cpu_refusals, gpu_refusals = rt.block.refusals()  # two loads, not a whole snapshot
            total = cpu_refusals + gpu_refusals
            if total > rt.seen_refusals:
                self.events.emit("quota_refusal", tenant=rt.tenant_id, new=total - rt.seen_refusals,
                                 cpu_refusals=cpu_refusals, gpu_refusals=gpu_refusals)
                rt.seen_refusals = total
