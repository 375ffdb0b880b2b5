"""The worker set: pool, spawn, bind, stop, kill, death, restart, liveness.

Owns: every worker process the supervisor started (by identity, token and
sentinel fd), the warm pool and its refill back-off, the backend ROUTER
socket (requests out, replies in) and the control ROUTER socket (hellos,
heartbeats, stop, faults), and the restart decision after a death.

May touch: the pending table (requests out, replies and deaths in), the
tenants' instance slots (which worker serves which slot), the quota block
of a dead instance (reclaim), placement (a dead instance's device bytes),
events and metrics. What a death or a bind means for the *tenant*
(registration answered, parked requests sent or refused, tenant failed) is
decided by the parts above, told through :class:`TenantHooks` (the tenant
signals, :mod:`supervisor.lifecycle.signals`). Loop thread only, but for
one thread that starts workers' processes (:class:`_Starter`: the wait for a
fork is off the loop) and touches nothing else.

A worker's handle is made on the loop before its process exists (its
identity and token are known first): a hello it says before its start is
taken in finds it, an instance with no warm worker takes a start still in
flight (or queued) rather than starting another, and a stop or kill asked of
it meanwhile is carried out as its start ends (:meth:`WorkerSet._signal`).

A slot whose buffers are parked (``InstanceSlot.keep_incarnation``, set by
:mod:`supervisor.lifecycle.parking`) keeps its incarnation when a worker starts in it, so the
restored buffers answer to their old handles.

Death handling (the sentinel fired): every in-flight request is answered
(:class:`WorkerLost`, or :class:`MemoryExhausted` after the RSS backstop),
the instance's quota share is reclaimed (its device slots by its pid), an
``exit`` event is published and the restart policy decides (see
:mod:`supervisor.runtime.tenants`).
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import queue
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Protocol
from collections.abc import Callable

import zmq

from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.errors import (
    MemoryExhausted,
    ProtocolError,
    TensorWasmError,
    WorkerLost,
    WorkerQueueFull,
    error_from_dict,
)
from shared.exitcodes import exit_cause, exit_reason
from shared.log import get_logger, log_event
from shared.records import ExitRecord
from shared.worker_link import WORKER_WARMED, BindMessage, FaultAck, FaultExit, WorkerHello
from supervisor.lifecycle.quiet import QuietGate
from supervisor.observe.events import EventBus
from supervisor.runtime.loop import Loop
from supervisor.observe.metrics import Metrics
from supervisor.routing.pending import PendingTable
from supervisor.routing.placement import Placement
from supervisor.runtime.requests import Pending
from supervisor.runtime.stall import run_delay_ns, thread_report
from supervisor.runtime.restart_policy import (
    AbortRegistration,
    Backoff,
    Decision,
    Drop,
    ExitFacts,
    Fail,
    NotRestarted,
    Replace,
    after_exit,
)
from supervisor.runtime.tenants import InstanceSlot, TenantRuntime, TenantState
from supervisor.runtime.workers import (
    NOT_STARTED,
    OffLoopSpawner,
    PreparedStart,
    SpawnerLike,
    WorkerHandle,
    WorkerState,
    exit_status,
    raise_priority,
)

__all__ = ["TenantHooks", "WorkerSet"]

_log = get_logger("supervisor")

#: messages taken from one socket per wake-up before the loop looks at the others: a few
#: (not hundreds), so one tenant's burst of replies delays another's by a short turn only
BATCH = 32

#: the adaptive pool's demand window: instance starts are counted with weight exp(-age / this)
POOL_RATE_WINDOW_S = 30.0
#: and its burst window: the same count over a few seconds, which a burst of activations raises at
#: once (the pool follows the larger of the two rates)
POOL_BURST_WINDOW_S = 2.0
#: a burst's rate is read over its own span while that is short (a decayed count that starts from
#: nothing holds only 1 - exp(-span / window) of its rate: a burst of activations at 15/s counted
#: 3/s half a second in, when the pool needed to grow), once it counts this many starts spread over
#: at least POOL_BURST_MIN_SPAN_S (starts at one moment - a tenant's instances - are not a rate)
POOL_BURST_MIN_STARTS = 3
POOL_BURST_MIN_SPAN_S = 0.25
#: a pool worker's spawn-to-ready time until one has been measured
POOL_DEFAULT_REFILL_S = 1.0
#: how long a taken pool worker's replacement waits before it starts: refills start at the
#: housekeeping tick (every 0.05 s, supervisor.supervisor.TICK_S), one tick later when one is put
#: off for a bind in flight - half a tick on average, a tick and a half at most; one tick counted
POOL_REFILL_LAG_S = 0.05
#: pool workers starting at once (forked, not yet warmed): a refill of several starts them one
#: after another as each is warmed, not all at the housekeeping tick - a start is ~10 ms of CPU,
#: and a burst of them at a tick took the cores from the activations of that moment
POOL_STARTS_AT_ONCE = 2
#: and while an activation is out (supervisor.lifecycle.quiet): a start beside it takes a core from
#: the woken tenant's restore and first requests on a 2-core host
POOL_STARTS_WHILE_OUT = 1
#: a refill - a warm pool worker's replacement, the housekeeping tick's, the next start in line -
#: waits while an activation is out (the quiet gate: a start's CPU, ~11 ms - fork, the child's
#: start, the warm-up - ran across the woken tenant's restore and first requests), at most this
#: long from when it was first held (no later than the housekeeping tick's refill it replaced:
#: POOL_REFILL_LAG_S, counted in the pool's size), and then one start at a time
POOL_HOLD_MAX_S = 0.05
#: a refill waits only while the pool keeps at least this many warm workers for the next
#: activation; a take that leaves fewer starts the held refill at once
POOL_HOLD_FLOOR = 1
#: the share of activations that should find a warm pool worker: the pool holds the demand of one
#: refill's time at this quantile (a Poisson count of starts at the rate measured), not its mean
POOL_WARM_SHARE = 0.99
#: how often every device-budget and GPU-time slot's owner is checked for life (a ``/proc`` read per
#: live worker: tens of ms at tens of workers on a loaded host, so not at every death - a death
#: the loop saw is reclaimed by its pid alone); the net for an owner gone unseen
RECLAIM_SCAN_INTERVAL_S = 10.0
#: the decayed count of recent instance starts from which the pool keeps workers beyond ``pool_size``
#: (0.5: a start within the last ~20 s, or several within the window)
POOL_MIN_DEMAND = 0.5
#: and at most this much loop time of worker replies per wake-up (the first is always taken): the
#: relays of one tenant's flood of replies delay another tenant's request by one such slice, like a
#: tenant's share of a frontend turn (supervisor.admission.fairness)
BACKEND_SLICE_S = 0.0002
#: plain ints: ``int & zmq.POLLIN`` goes through enum.Flag (~1 us a message)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _MORE = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
#: a worker that has not said hello on both sockets by then is killed
HELLO_TIMEOUT_S = 60.0


class TenantHooks(Protocol):
    """Where the worker set tells what happened to a tenant's worker (implemented by
    :class:`~supervisor.lifecycle.signals.TenantSignals`, which the parts above hear)."""

    def bind_sent(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle) -> None: ...
    def instance_ready(self, rt: TenantRuntime) -> None: ...
    def registration_failed(self, rt: TenantRuntime, exc: TensorWasmError) -> None: ...
    def instance_not_restarted(self, rt: TenantRuntime, index: int, code: int | None, sig: int | None,
                               reason: str) -> None: ...
    def tenant_failed(self, rt: TenantRuntime, why: str) -> None: ...
    def is_stopping(self) -> bool: ...


class WorkerSet:
    """Worker processes and their sockets (see the module docstring)."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        loop: Loop,
        pending: PendingTable,
        tenants: Mapping[str, TenantRuntime],
        spawner: SpawnerLike,
        backend: zmq.Socket[bytes],
        control: zmq.Socket[bytes],
        placement: Placement,
        backend_name: str,
        backend_options: dict[str, object],
        events: EventBus,
        metrics: Metrics,
        hooks: TenantHooks,
    ) -> None:
        self.config = config
        self.loop = loop
        self.clock = loop.clock
        self.pending = pending
        self.tenants = tenants
        self.spawner = spawner
        self.backend = backend
        self.control = control
        self.placement = placement
        self.backend_name = backend_name
        self.backend_options = backend_options
        self.events = events
        self.metrics = metrics
        self.hooks = hooks
        self.workers: dict[bytes, WorkerHandle] = {}
        self.by_token: dict[str, WorkerHandle] = {}
        self.pool: list[WorkerHandle] = []  # idle, unbound, ready to bind (warmed up)
        #: pool workers connected and still warming up (their hello said so): bound only when the
        #: pool is empty, counted in ``pool_starting`` until they say ``warmed``
        self.warming: list[WorkerHandle] = []
        #: workers whose hello said they warm up (by worker id), until they say ``warmed`` or are bound
        self._will_warm: set[str] = set()
        self.pool_starting = 0
        #: the last refill was put off for a bind in flight (the next one is not: see refill_pool)
        self._refill_put_off = False
        #: while an activation is out, refills wait (POOL_HOLD_MAX_S at most) and so do parks ahead
        #: (supervisor.lifecycle.parking): the one gate both hold their work at
        self.quiet = QuietGate(loop.timers, self.clock)
        self._pool_failures = 0
        self._pool_retry_at = 0.0
        #: the warm pool's size now: ``pool_size`` .. ``pool_max``, following the demand (see pool_target_now)
        self.pool_target = config.pool_size
        #: demand on the pool: an exponentially decayed rate of instance starts (per s), when last
        #: decayed, and a pool worker's mean spawn-to-ready time (s), the time one refill takes
        self._demand_rate = 0.0
        self._demand_at = 0.0
        #: the same over POOL_BURST_WINDOW_S: a burst's rate
        self._burst_rate = 0.0
        self._burst_at = 0.0
        #: when the burst now counted began (its count had fallen below one start before it), and
        #: its last start
        self._burst_began = 0.0
        self._burst_last = 0.0
        self._refill_s: float | None = None
        self._last_beat = 0.0
        self._last_reclaim_scan = 0.0
        #: workers' processes start on this thread (made at the first start; None: none yet, or a
        #: spawner that starts on the loop - the in-process tests' stand-in)
        self._starter: _Starter | None = None
        #: a worker that missed a beat: its last beat then, and its threads' run-queue waits then
        #: (ns by thread id)
        self._starve_base: dict[str, tuple[float, dict[int, int]]] = {}
        loop.register(backend, self._on_backend)
        loop.register(control, self._on_control)

    # ------------------------------------------------------------ sending

    def send_request(self, worker: WorkerHandle, op: str, args: dict[str, object], body: zmq.Frame | bytes | memoryview | None,
                     pending: Pending) -> None:
        """Send a request to ``worker``; it is in the pending table from now on. Raises
        :class:`WorkerQueueFull` (its queue is full) or :class:`WorkerLost` (it is gone)."""
        rid = self.pending.new_rid()
        header = proto.encode_worker_request(rid, op, args)
        try:
            if body is None:  # two plain sends: send_multipart's per-frame checks and enum flags cost more
                send = self.backend.send
                send(worker.ident, _MORE)
                send(header, _NOBLOCK)
            else:
                self.backend.send_multipart([worker.ident, header, body], _NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the worker's socket is gone (it is dying); EAGAIN: its queue is full
            if exc.errno == zmq.EAGAIN:
                rt = self.tenants.get(pending.tenant)
                raise WorkerQueueFull(pending.tenant, rt.in_flight + rt.waiting if rt is not None else 0,
                                      rt.spec.max_in_flight if rt is not None else 0, instance=pending.instance,
                                      queued=len(worker.in_flight)) from None
            raise WorkerLost(pending.tenant, pending.instance, reason=f"worker unreachable: {exc.strerror}") from None
        self.pending.add(worker, rid, pending)
        if self.quiet.following and self.quiet.next_sent(pending.tenant, rid):
            worker.gated = True  # a woken tenant's next request: held work waits for its answer

    def free_undelivered(self, tenant: str, handle: int) -> None:
        """An ``alloc`` succeeded but its client was never told (its reply could not be sent):
        free the buffer, so the tenant is not charged for bytes nobody holds. A worker that
        cannot be asked, or does not answer within the deadline, is replaced (its death
        returns the bytes)."""
        rt = self.tenants.get(tenant)
        index = proto.handle_instance(handle)
        if rt is None or index >= len(rt.slots):
            return
        slot = rt.slots[index]
        worker = slot.worker
        if (worker is None or worker.state not in (WorkerState.READY, WorkerState.DRAINING)
                or slot.incarnation & 0xFFFF != proto.handle_incarnation(handle)):
            return  # that incarnation is gone: its buffers went with it
        log_event(_log, logging.WARNING, "buffer.undelivered_freed", tenant=tenant, instance=index,
                  handle=proto.format_handle(handle))

        def done(ok: bool, payload: object) -> None:
            if not ok and worker.state is not WorkerState.DEAD:
                self.kill(worker, "could not free an allocation whose reply was lost", "protocol")

        now = self.clock()
        pending = Pending(None, 0, "free", tenant, index, now, now + proto.OPS["free"].deadline_s(rt.spec), done)
        try:
            self.send_request(worker, "free", {"handle": handle}, None, pending)
        except TensorWasmError:
            self.kill(worker, "could not free an allocation whose reply was lost", "protocol")

    def send_control(self, worker: WorkerHandle, data: bytes) -> None:
        try:
            self.control.send_multipart([worker.ident, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # dying or flooded: the heartbeat check handles it

    # ------------------------------------------------------------ pool and start

    def _spawn(self, pool: bool = False) -> WorkerHandle:
        """A new worker: its handle now; its process on the starter thread where the spawner can
        start one there (a start waits for the fork server's fork - 1-5 ms quiet, tens of ms on a
        loaded host - which on the loop held every request behind it), else here. ``pool``: a
        pool worker (it starts below the normal priority: Spawner.start_nice)."""
        spawner = self.spawner
        if not isinstance(spawner, OffLoopSpawner):
            worker = spawner.spawn()
            self._track(worker)
            self._took_in(worker)
            return worker
        prepared = spawner.prepare(pool=pool)
        worker = WorkerHandle(worker_id=prepared.worker_id, token=prepared.token, process=NOT_STARTED, pid=0,
                              sentinel=-1, spawned_at=self.clock(), routing_id=prepared.routing_id, started=False)
        self._track(worker)
        if self._starter is None:
            self._starter = _Starter(spawner.start, self.loop, self._on_started)
        self._starter.submit(prepared, worker)
        return worker

    def _track(self, worker: WorkerHandle) -> None:
        """The worker set knows ``worker`` by identity and token (its hellos find it)."""
        self.workers[worker.ident] = worker
        self.by_token[worker.token] = worker

    def _took_in(self, worker: WorkerHandle) -> None:
        """``worker``'s process exists: its sentinel goes on the loop."""
        self.loop.register(worker.sentinel, lambda: self.on_death(worker))
        self.events.emit("spawn", worker=worker.worker_id, pid=worker.pid, method=self.spawner.method)

    def _on_started(self) -> None:
        """Starts the starter thread finished (loop thread): each worker's process goes into its
        handle, and what was asked of the handle meanwhile is carried out - a signal (a stop or a
        kill: the process gets it now), a stop of the whole supervisor that began after it was
        asked for (it is stopped too), its hellos (both in: it is connected now). A start that
        failed is the worker's death (a pool worker's counts as a failed pool start)."""
        if self._starter is None:
            return
        for worker, started, error in self._starter.take():
            self._start_ended(worker, started, error)

    def _start_ended(self, worker: WorkerHandle, started: WorkerHandle | None, error: BaseException | None) -> None:
        if started is None:
            log_event(_log, logging.ERROR, "worker.start_failed", worker=worker.worker_id, tenant=worker.tenant,
                      error=repr(error))
            if not worker.expected_exit:
                worker.kill_reason = worker.kill_reason or f"could not start: {error!r}"
            if worker.state is not WorkerState.DEAD:
                self.on_death(worker)
            return
        worker.process, worker.pid, worker.sentinel = started.process, started.pid, started.sentinel
        worker.started = True
        if self.workers.get(worker.ident) is not worker:  # forgotten meanwhile (teardown): it goes at once
            self.spawner.signal(worker, signal.SIGKILL)
            return
        self._took_in(worker)
        if worker.pending_signal is not None:
            sig, worker.pending_signal = worker.pending_signal, None
            self.spawner.signal(worker, sig)
        elif self.hooks.is_stopping() and worker.state not in (WorkerState.STOPPING, WorkerState.DEAD):
            self.stop_worker(worker, "shutdown")  # asked for after the stop's stop_all: it goes too
        elif worker.connected and worker.state is WorkerState.STARTING:
            self._on_connected(worker)

    def _signal(self, worker: WorkerHandle, sig: int) -> None:
        """Signal ``worker``'s process, or, its start still in flight, as the start ends (SIGKILL
        is not lowered to SIGTERM)."""
        if worker.started:
            self.spawner.signal(worker, sig)
        elif worker.pending_signal != signal.SIGKILL:
            worker.pending_signal = sig

    def refill_pool(self) -> None:
        """Start pool workers up to the target (and stop idle ones beyond it). Not while a bind
        is in flight, as long as a warm worker is left: a new process's start and warm-up take
        tens of ms of CPU, which on a small host the bind (an activation waiting on it) would
        wait behind; the next housekeeping tick refills. Put off one tick at most: under a
        stream of activations a bind is in flight at many ticks, and a pool never refilled
        would hand out starting processes instead."""
        now = self.clock()
        if self._pool_failures and now < self._pool_retry_at:
            return
        if self.pool and not self._refill_put_off and self.binding():
            self._refill_put_off = True
            return
        self._refill_put_off = False
        if self._pool_failures:
            self._pool_retry_at = now + pool_retry_delay_s(self._pool_failures)
        target = self.pool_target = self.pool_target_now(now)
        self._start_pool_workers(target)
        while self.config.pool_max is not None and self.pool and len(self.pool) + self.pool_starting > target:
            self.stop_worker(self.pool[0], "pool shrunk")  # the demand fell: the oldest idle worker goes

    def _start_pool_workers(self, target: int, *, held: bool = False) -> None:
        """Start pool workers towards ``target``, at most POOL_STARTS_AT_ONCE in flight (starting or
        warming up) - POOL_STARTS_WHILE_OUT while an activation is out; each one's readiness starts
        the next (:meth:`_pool_ready`). While an activation is out and the pool keeps
        POOL_HOLD_FLOOR warm workers, the refill waits for the quiet gate (POOL_HOLD_MAX_S at
        most); ``held``: this is that refill (it starts now, whatever is out)."""
        if len(self.pool) + self.pool_starting >= target:
            return
        quiet = self.quiet.quiet
        if not quiet and not held and len(self.pool) >= POOL_HOLD_FLOOR:
            self.quiet.hold("pool", self._start_held, POOL_HOLD_MAX_S)
            return
        at_once = POOL_STARTS_AT_ONCE if quiet else POOL_STARTS_WHILE_OUT
        while len(self.pool) + self.pool_starting < target and self.pool_starting < at_once:
            worker = self._spawn(pool=True)
            worker.tenant = None
            self.pool_starting += 1
        if not quiet and len(self.pool) + self.pool_starting < target:
            self.quiet.hold("pool", self._start_held, POOL_HOLD_MAX_S)  # the rest as the gate opens

    def serving_tenants(self) -> set[str]:
        """The tenants some live worker of this set serves (starting, binding, ready or stopping).
        A pass over the workers - the active ones, the pool and those stopping - for the loop's
        periodic looks at tenants, which at 10,000 registered tenants must not pass over them all."""
        return {w.tenant for w in self.workers.values() if w.tenant is not None and w.state is not WorkerState.DEAD}

    def binding(self) -> bool:
        """Whether a bind is in flight (an activation's or a registration's, or a restart's)."""
        return any(w.state is WorkerState.BINDING for w in self.workers.values())

    def pool_target_now(self, now: float) -> int:
        """The warm pool's size for the demand now, ``pool_size`` .. ``pool_max``: enough that an
        activation finds a warm worker POOL_WARM_SHARE of the time. A taken worker's replacement
        is warm a refill time later (POOL_REFILL_LAG_S to its start plus a pool worker's mean
        spawn-to-ready time); the starts within that time are a Poisson count at the start rate,
        so the pool holds that count's POOL_WARM_SHARE quantile plus one (a base-stock policy:
        an activation finds none warm when the starts of the last refill time reach the pool's
        size). Sized for the mean alone (the rate times the refill time), 7-10 % of the density
        bench's activations found no warm worker, in the stream's clumps. At least one beyond
        ``pool_size`` while there is recent demand (POOL_MIN_DEMAND). The rate is the larger of
        two decayed rates: over POOL_RATE_WINDOW_S (it keeps the pool up through a steady
        stream) and over POOL_BURST_WINDOW_S (a burst of activations raises the target within
        it; the long rate rises by 1/30 a start, and a pool of ``pool_size`` runs dry first).
        Without ``pool_max`` it is ``pool_size``."""
        cfg = self.config
        if cfg.pool_max is None or cfg.pool_max <= cfg.pool_size:
            return cfg.pool_size
        rate = self._decayed_rate(now)
        refill_s = (self._refill_s if self._refill_s is not None else POOL_DEFAULT_REFILL_S) + POOL_REFILL_LAG_S
        if rate * POOL_RATE_WINDOW_S < POOL_MIN_DEMAND:
            return cfg.pool_size
        rate = max(rate, self._burst_estimate(now))
        need = poisson_quantile(rate * refill_s, POOL_WARM_SHARE) + 1
        return min(cfg.pool_max, max(cfg.pool_size + 1, need))

    def _burst_estimate(self, now: float) -> float:
        """The burst window's rate, read over the burst's span while that is short (see
        POOL_BURST_MIN_STARTS): the opening of a stream of activations raises the pool's target
        while it happens, not seconds later when the pool has long run dry."""
        burst = self._decayed_burst(now)
        span = self._burst_last - self._burst_began
        if burst * POOL_BURST_WINDOW_S < POOL_BURST_MIN_STARTS or span < POOL_BURST_MIN_SPAN_S:
            return burst
        return burst / (1.0 - math.exp(-span / POOL_BURST_WINDOW_S))

    def _decayed_rate(self, now: float) -> float:
        if now > self._demand_at:
            self._demand_rate *= math.exp(-(now - self._demand_at) / POOL_RATE_WINDOW_S)
            self._demand_at = now
        return self._demand_rate

    def _decayed_burst(self, now: float) -> float:
        if now > self._burst_at:
            self._burst_rate *= math.exp(-(now - self._burst_at) / POOL_BURST_WINDOW_S)
            self._burst_at = now
        return self._burst_rate

    def _note_demand(self) -> None:
        """An instance asked for a worker (an activation, a registration, a restart): one more in the rates."""
        now = self.clock()
        self._demand_rate = self._decayed_rate(now) + 1.0 / POOL_RATE_WINDOW_S
        if self._decayed_burst(now) * POOL_BURST_WINDOW_S < 1.0:
            self._burst_began = now  # a new burst: nothing of the last one is left to count
        self._burst_last = now
        self._burst_rate = self._decayed_burst(now) + 1.0 / POOL_BURST_WINDOW_S

    def start_instance(self, rt: TenantRuntime, slot: InstanceSlot) -> str:
        """Give a slot a worker at once: a warm one from the pool (bound now); else a pool worker
        already starting (bound when its hellos arrive: it is further along than a new process,
        and a new one would compete with it for the CPU); else a fresh process. Returns which:
        ``warm``, ``warming`` (connected, its warm-up cut short), ``starting`` or ``spawned`` (an
        activation's ``activate`` event counts them).
        The pool is refilled by housekeeping (a new process's start and warm-up compete with
        this very request's bind for the CPU), but where this take leaves it with no warm worker
        and no start (:meth:`_refill_if_dry`): the next instance would start its own."""
        self._note_demand()
        slot.restart_at = None
        slot.completed = False
        if not slot.keep_incarnation:  # parked buffers: their handles name the incarnation they come back to
            slot.incarnation += 1
            slot.lost = None  # the incarnation check answers them BufferLost from now on
        worker = self.pool.pop() if self.pool else None
        how = "warm"
        if worker is None and self.warming:  # connected, its warm-up not done: the bind cuts it short
            worker = self.warming.pop(0)
            self._will_warm.discard(worker.worker_id)
            self.pool_starting -= 1
            how = "warming"
        if worker is not None:
            worker.tenant = rt.tenant_id
            worker.instance = slot.index
            slot.worker = worker
            # a pool worker: its startup is the bind, not its spawn; a warm one is replaced once the
            # bind is done (one still warming up is the pool's last: the housekeeping tick refills),
            # and then as the quiet gate opens (the woken tenant's requests answered)
            self._bind(rt, slot, worker, self.clock(), replace=how == "warm")
            if len(self.pool) < POOL_HOLD_FLOOR:
                self.quiet.run_now("pool")  # a held refill: the next activation needs it now
            if not self.pool:
                # no warm worker left: the next instance waits for the first start in line, which
                # started below the normal priority (Spawner.start_nice) - it runs at ours from now
                following = self.warming[0] if self.warming else self._starting_pool_worker()
                if following is not None:
                    raise_priority(following.pid, getattr(self.spawner, "start_nice", 0))
            self._refill_if_dry()
            return how
        worker = self._starting_pool_worker()
        how = "starting"
        if worker is not None:
            self.pool_starting -= 1  # the tenant's now: not the pool's (its death is the instance's)
            # it started below the normal priority (a pool worker's start): the tenant waits for it now
            raise_priority(worker.pid, getattr(self.spawner, "start_nice", 0))
        else:
            worker = self._spawn()
            how = "spawned"
        worker.tenant = rt.tenant_id
        worker.instance = slot.index
        slot.worker = worker
        self._refill_if_dry()
        return how  # bound when its hellos arrive

    def _start_held(self) -> None:
        """The refill held at the quiet gate: it opened, the hold's bound passed, or the pool fell
        below its floor."""
        if not self._pool_failures and not self.hooks.is_stopping():
            self._start_pool_workers(self.pool_target, held=True)

    def _refill_if_dry(self) -> None:
        """No warm worker and no start left for the next instance: the pool refills now, not at
        the next housekeeping tick (the next instance would start a process of its own) - where
        starts run on the starter thread, so that a start costs the loop no wait here."""
        if self._starter is not None and not self.pool and not self.pool_starting and not self.hooks.is_stopping():
            self.refill_pool()

    def _starting_pool_worker(self) -> WorkerHandle | None:
        """The pool worker started first among those not connected yet (None: none is starting)."""
        if not self.pool_starting:
            return None
        starting = [w for w in self.workers.values()
                    if w.tenant is None and w.state is WorkerState.STARTING and not w.expected_exit and not w.killed]
        return min(starting, key=lambda w: w.spawned_at) if starting else None

    def _on_connected(self, worker: WorkerHandle) -> None:
        if not worker.connected or not worker.started:
            return  # its start ends later: the starter's report calls this again (_start_ended)
        if worker.tenant is None:
            worker.state = WorkerState.IDLE
            if worker.worker_id in self._will_warm:
                self.warming.append(worker)  # ready once it says ``warmed`` (_on_warmed)
                return
            self._pool_ready(worker)
            return
        rt = self.tenants.get(worker.tenant)
        slot = (
            rt.slots[worker.instance]
            if rt is not None and worker.instance is not None and worker.instance < len(rt.slots)
            else None
        )
        if rt is None or slot is None or slot.worker is not worker:
            self.stop_worker(worker, "tenant gone before bind")
            return
        self._bind(rt, slot, worker, worker.spawned_at)

    def _pool_ready(self, worker: WorkerHandle) -> None:
        """A pool worker is ready to bind: connected and, where it warms up, warmed."""
        self.pool_starting -= 1
        worker.ready_at = self.clock()
        took = max(0.0, worker.ready_at - worker.spawned_at)
        self._refill_s = took if self._refill_s is None else 0.8 * self._refill_s + 0.2 * took
        self.pool.append(worker)
        self.events.emit("ready", worker=worker.worker_id, pid=worker.pid, pool=True)
        if not self._pool_failures and not self.hooks.is_stopping():
            self._start_pool_workers(self.pool_target)  # the next start in line, now: not at the tick

    def _on_warmed(self, worker: WorkerHandle) -> None:
        """A pool worker says its warm-up is done: it joins the pool. Ignored from a worker not
        warming up now: bound meanwhile (the bind cut its warm-up short, and its notice crossed
        the bind), stopping, or saying it again (nothing it says makes it bindable twice)."""
        if worker.worker_id not in self._will_warm:
            return
        self._will_warm.discard(worker.worker_id)
        if worker in self.warming:
            self.warming.remove(worker)
            self._pool_ready(worker)

    def _leave_pool(self, worker: WorkerHandle) -> None:
        """``worker`` leaves the pool for good (stopped, killed, dead; called before its state
        changes): a pool worker still starting or warming up no longer counts in
        ``pool_starting`` - counted once, however many of stop, kill and death it goes through."""
        if worker in self.pool:
            self.pool.remove(worker)
        if worker in self.warming:
            self.warming.remove(worker)
            self.pool_starting -= 1
        elif worker.tenant is None and worker.state is WorkerState.STARTING:
            self.pool_starting -= 1
        self._will_warm.discard(worker.worker_id)

    def _bind(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle, asked_at: float, *,
              replace: bool = False) -> None:
        """``asked_at``: when the instance asked for this worker (its spawn, or the bind of a pool
        worker); the ``ready`` event's ``startup_ms`` counts from there. ``replace``: a warm pool
        worker, whose replacement starts once the bind is done (:meth:`_on_bound`)."""
        worker.state = WorkerState.BINDING
        worker.incarnation = slot.incarnation
        opts = dict(self.backend_options)
        opts["device_index"] = rt.device
        opts.update(self.placement.worker_options(rt.spec, rt.device))  # budget, caps, MPS environment
        now = self.clock()

        def done(ok: bool, payload: object) -> None:
            self._on_bound(rt, slot, worker, ok, payload, asked_at, replace)

        pending = Pending(None, 0, "bind", rt.tenant_id, slot.index, now, now + self.config.register_timeout_s, done)
        try:
            message = BindMessage(
                spec=rt.spec,
                instance=slot.index,
                incarnation=slot.incarnation,
                segment=rt.block.open(),  # a tenant without a worker has no segment: made now, same counters
                backend=self.backend_name,
                backend_options=opts,
            )
            self.send_request(worker, "bind", message.to_wire(), None, pending)
        except TensorWasmError as exc:
            done(False, exc.to_dict())
            return
        self.hooks.bind_sent(rt, slot, worker)

    def _on_bound(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle, ok: bool, payload: object,
                  asked_at: float, replace: bool = False) -> None:
        if self.tenants.get(rt.tenant_id) is not rt or slot.worker is not worker:
            self.stop_worker(worker, "tenant gone during bind")
            return
        if not ok:
            err = payload if isinstance(payload, dict) else {}
            log_event(_log, logging.ERROR, "worker.bind_failed", tenant=rt.tenant_id, instance=slot.index,
                      error=err.get("message"))
            exc = error_from_dict(err)
            self.kill(worker, f"bind failed: {exc}", "bind")
            if rt.register_waiters:
                self.hooks.registration_failed(rt, exc)
            return
        worker.state = WorkerState.READY
        worker.ready_at = self.clock()
        self.events.emit(
            "ready",
            tenant=rt.tenant_id,
            instance=slot.index,
            worker=worker.worker_id,
            pid=worker.pid,
            incarnation=slot.incarnation,
            startup_ms=round((worker.ready_at - asked_at) * 1000, 3),
            pooled=asked_at != worker.spawned_at,  # a warm pool worker, bound now
        )
        rt.refresh_state()
        self.hooks.instance_ready(rt)
        if replace and not self._pool_failures and not self.hooks.is_stopping():
            # a warm pool worker went to a tenant: its replacement starts now that the bind is done
            # (within the starts at once), not at the next housekeeping tick - or, an activation
            # out, as the quiet gate opens (POOL_HOLD_MAX_S at most)
            self._start_pool_workers(self.pool_target)

    # ------------------------------------------------------------ stop and kill

    def drain(self, worker: WorkerHandle) -> None:
        """Stop routing to a worker; stop it once its in-flight requests are answered."""
        worker.state = WorkerState.DRAINING
        if not worker.in_flight:
            self.stop_worker(worker, "scaled down")

    def stop_worker(self, worker: WorkerHandle, reason: str) -> None:
        """Planned stop: ``stop`` on control (SIGTERM if it never connected), SIGKILL after the timeout."""
        if worker.state in (WorkerState.DEAD, WorkerState.STOPPING):
            return
        self._leave_pool(worker)
        worker.state = WorkerState.STOPPING
        worker.expected_exit = True
        worker.kill_reason = worker.kill_reason or reason
        if worker.control_hello:
            self.send_control(worker, proto.encode_control("stop"))
        else:
            self._signal(worker, signal.SIGTERM)
        worker.kill_at = self.clock() + self.config.stop_timeout_s

    def stop_all(self, reason: str) -> None:
        for worker in list(self.workers.values()):
            self.stop_worker(worker, reason)

    def kill(self, worker: WorkerHandle, reason: str, cause: str, threads: str = "") -> None:
        """Forced stop: SIGTERM now, SIGKILL of the whole tree after ``kill_grace_s``.

        ``threads``: what the worker's threads were doing (:func:`thread_report`), logged with a
        kill for silence so that the log says why it was silent."""
        if worker.state is WorkerState.DEAD or worker.killed:
            return
        worker.killed = True
        worker.kill_cause = cause
        if not worker.expected_exit:
            worker.kill_reason = reason
        fields = dict(worker=worker.worker_id, pid=worker.pid, tenant=worker.tenant, instance=worker.instance)
        extra = {"threads": threads} if threads else {}
        log_event(_log, logging.WARNING, "worker.kill", **fields, reason=reason, cause=cause, **extra)
        self.events.emit("kill", **fields, reason=reason)
        self._leave_pool(worker)
        worker.state = WorkerState.STOPPING
        self._signal(worker, signal.SIGTERM)
        worker.kill_at = self.clock() + self.config.kill_grace_s

    def kill_all_now(self, timeout_s: float = 5.0) -> None:
        """Teardown: SIGKILL whatever is alive, wait (bounded) for it, forget every worker. Starts
        in flight on the starter thread are waited for first (half the time at most), and die with
        the rest; one that ends later still is killed as it ends (_start_ended: forgotten)."""
        deadline = time.monotonic() + timeout_s
        if self._starter is not None:
            self._starter.orphans = self.spawner.signal  # a start that ends from now on is killed by the thread
            for worker, started, _ in self._starter.close(self.loop, timeout_s / 2):
                if started is not None:
                    worker.process, worker.pid, worker.sentinel = started.process, started.pid, started.sentinel
                    worker.started = True
            self._starter = None
        for worker in list(self.workers.values()):
            if worker.started:
                self.spawner.signal(worker, signal.SIGKILL)
        for worker in list(self.workers.values()):
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is not None:
                worker.process.close()
        self.workers.clear()

    # ------------------------------------------------------------ death and restart

    def on_death(self, worker: WorkerHandle) -> None:
        """The sentinel fired (or the start failed): answer, reclaim, publish, restart."""
        if worker.started:
            self.loop.unregister(worker.sentinel)
        self.workers.pop(worker.ident, None)
        self.by_token.pop(worker.token, None)
        was_pool = worker.tenant is None
        self._leave_pool(worker)
        expected = worker.expected_exit
        worker.state = WorkerState.DEAD
        code, sig = exit_status(worker.process)
        if worker.process.exitcode is not None:
            worker.process.close()
        reason = worker.kill_reason or exit_reason(code, sig)  # "CUDA context lost: ..." for a sticky error
        tid, index = worker.tenant, worker.instance
        # 1. every in-flight request gets a typed answer
        rt = self.tenants.get(tid) if tid else None

        def error_of(p: Pending) -> TensorWasmError:
            if worker.rss_exceeded is not None:
                rss, limit = worker.rss_exceeded
                return MemoryExhausted(
                    p.tenant, rss, limit, rss,
                    message=f"worker {p.tenant}/{p.instance} was killed: RSS {rss:,} B above "
                    f"its limit of {limit:,} B (memory quota + allowance)",
                )
            return WorkerLost(p.tenant, p.instance, code, sig, reason)

        self.pending.fail_worker(worker, error_of)
        # 2. its share of the quota comes back (the driver freed its GPU memory)
        reclaimed = (0, 0)
        if rt is not None and index is not None and not rt.block.closed:
            reclaimed = rt.block.reclaim_instance(index)
        # its device-budget share and GPU-time slot, by slot owner (exact even if it died mid-alloc):
        # this pid's slots only, not a /proc read per live worker (the periodic scan is the net)
        if worker.started:
            self.placement.reclaim_pid(worker.pid)
        # 3. tell the world
        if worker.rss_exceeded:
            cause = "rss"
        elif expected:
            cause = "stop"
        elif worker.kill_cause:
            cause = worker.kill_cause  # heartbeat, deadline, protocol, startup, bind
        else:
            cause = exit_cause(code, sig)
        self.metrics.worker_exit(tid, cause)
        self.events.emit(
            "exit", worker=worker.worker_id, pid=worker.pid, tenant=tid, instance=index, exit_code=code,
            signal=sig, reason=reason, cause=cause, expected=expected, reclaimed_cpu=reclaimed[0], reclaimed_gpu=reclaimed[1],
        )
        for waiter in worker.fault_waiters:
            waiter(FaultExit(code, sig))
        worker.fault_waiters.clear()
        for on_dead in worker.death_waiters:
            on_dead(worker)
        worker.death_waiters.clear()
        if worker.gated and tid is not None:
            worker.gated = False
            self.quiet.done(tid)  # its requests were answered above (WorkerLost)
        if was_pool and not expected and worker.ready_at is None:
            self._pool_failures += 1  # a worker that cannot even start: back off refilling
        elif was_pool:
            self._pool_failures = 0
        # 4. the slot's next step: a pure decision (supervisor.runtime.restart_policy), carried out here
        if rt is None or index is None or index >= len(rt.slots):
            return
        slot = rt.slots[index]
        if slot.worker is not worker:
            return
        slot.worker = None
        slot.last_exit = ExitRecord(exit_code=code, signal=sig, reason=reason, at=time.time())
        replace = slot.replace
        if expected:
            slot.replace = False  # asked for once, for this exit
        decision = after_exit(ExitFacts(
            policy=rt.spec.restart, exit_code=code, signal=sig, expected=expected,
            killed=worker.killed and not expected, replace=replace, draining=slot.draining,
            shutting_down=self.hooks.is_stopping() or rt.state is TenantState.EVICTING,
            tenant_failed=rt.state is TenantState.FAILED,
            registering=bool(rt.register_waiters) and worker.ready_at is None,
            restart_times=tuple(rt.restart_times), now=self.clock(),
            max_restarts=rt.spec.max_restarts, window_s=rt.spec.restart_window_s,
        ))
        self._carry_out(rt, slot, index, decision, code, sig, reason)
        self.release_idle_segment(rt)

    def release_idle_segment(self, rt: TenantRuntime) -> None:
        """Take down the quota segment of a tenant no worker holds and none is about to
        (parked, stopped, failed, completed): its counters stay in its record, and the next
        bind makes the segment again (:class:`~supervisor.store.tenant_quota.TenantQuota`).
        An instance waiting for a back-off restart keeps it (the restart is moments away)."""
        if self.tenants.get(rt.tenant_id) is not rt or rt.state is TenantState.EVICTING:
            return
        for slot in rt.slots:
            if slot.restart_at is not None or (slot.worker is not None and slot.worker.state is not WorkerState.DEAD):
                return
        rt.block.close_segment()

    def _carry_out(self, rt: TenantRuntime, slot: InstanceSlot, index: int, decision: Decision,
                   code: int | None, sig: int | None, reason: str) -> None:
        """Do what :func:`~supervisor.runtime.restart_policy.after_exit` decided for the slot."""
        if isinstance(decision, Drop):
            if decision.trim and index == len(rt.slots) - 1:
                while rt.slots and rt.slots[-1].draining and rt.slots[-1].worker is None:
                    rt.slots = rt.slots[:-1]
            rt.refresh_state()
        elif isinstance(decision, Replace):
            self.start_instance(rt, slot)
            rt.refresh_state()
        elif isinstance(decision, AbortRegistration):
            self.hooks.registration_failed(
                rt, WorkerLost(rt.tenant_id, index, code, sig, f"died while starting: {reason}"))
        elif isinstance(decision, NotRestarted):
            slot.completed = decision.completed
            rt.refresh_state()
            self.hooks.instance_not_restarted(rt, index, code, sig, reason)
        elif isinstance(decision, Fail):
            rt.record_restart(self.clock())
            self.hooks.tenant_failed(rt, decision.why)
        else:
            rt.record_restart(self.clock())
            delay = decision.delay_s if isinstance(decision, Backoff) else 0.0
            slot.restarts += 1
            self.metrics.restart(rt.tenant_id)
            self.events.emit("restart", tenant=rt.tenant_id, instance=index, delay_s=delay, restarts=slot.restarts)
            rt.refresh_state()
            if delay <= 0:
                self.start_instance(rt, slot)
            else:
                slot.restart_at = self.clock() + delay
                self.loop.timers.after(delay, lambda: self._restart_due(rt, slot))

    def _restart_due(self, rt: TenantRuntime, slot: InstanceSlot) -> None:
        if (
            self.tenants.get(rt.tenant_id) is rt
            and slot.restart_at is not None
            and slot.worker is None
            and not self.hooks.is_stopping()
        ):
            self.start_instance(rt, slot)

    # ------------------------------------------------------------ housekeeping

    def check_liveness(self, now: float, silence: Callable[[float, float], float] | None = None) -> None:
        """Heartbeats out, silence and missing hellos punished, SIGKILL escalation.

        ``silence(since, now)``: how long a worker counts as silent; the supervisor's
        :class:`~supervisor.runtime.stall.StallGuard` leaves out time the loop itself was stalled.
        """
        cfg = self.config
        quiet = silence or (lambda since, at: at - since)
        if now - self._last_beat >= cfg.heartbeat_interval_s:
            self._last_beat = now
            beat = proto.encode_control("hb")
            silent_after = cfg.heartbeat_interval_s * cfg.heartbeat_liveness
            if self._starve_base:  # the dead ones' baselines go
                live = {w.worker_id for w in self.workers.values() if w.state is not WorkerState.DEAD}
                self._starve_base = {k: v for k, v in self._starve_base.items() if k in live}
            for worker in list(self.workers.values()):
                if worker.state is WorkerState.DEAD:
                    continue
                if worker.control_hello:
                    self.send_control(worker, beat)
                    silent = quiet(worker.last_heartbeat, now)
                    if worker.kill_at is None and silent - self._starved(worker, silent) > silent_after:
                        taken = self._starve_base.get(worker.worker_id)
                        self.kill(worker, f"missed heartbeats for {silent:.1f} s", "heartbeat",
                                  threads=thread_report(worker.pid, taken[1] if taken else None))
                elif worker.kill_at is None and quiet(worker.spawned_at, now) > HELLO_TIMEOUT_S:
                    self.kill(worker, "never said hello", "startup")
        for worker in list(self.workers.values()):
            if worker.kill_at is not None and now >= worker.kill_at and worker.state is not WorkerState.DEAD:
                self._signal(worker, signal.SIGKILL)
                worker.kill_at = float("inf")
        if now - self._last_reclaim_scan >= RECLAIM_SCAN_INTERVAL_S:
            self._last_reclaim_scan = now
            self.placement.reclaim_dead()  # the safety net: any owner gone that no death told of

    def _starved(self, worker: WorkerHandle, silent: float) -> float:
        """How much of ``worker``'s silence it spent waiting for a CPU (seconds, at most one
        liveness window): a worker starved on a loaded host beats late, it is not hung.

        Measured from the moment it first missed a beat (a baseline of its threads' run-queue
        waits, :func:`~supervisor.runtime.stall.run_delay_ns`, read only then: a worker that beats
        on time costs nothing) as the longest wait of any one of its threads since: the thread
        that beats, or the one holding the interpreter it needs. A stopped or really hung worker
        does not wait on a run queue, so it is killed on time; one that spins without beating is
        killed one window later at most."""
        cfg = self.config
        if silent <= cfg.heartbeat_interval_s:
            self._starve_base.pop(worker.worker_id, None)
            return 0.0
        taken = self._starve_base.get(worker.worker_id)
        if taken is None or taken[0] != worker.last_heartbeat:  # none yet, or it beat since: a new silence
            self._starve_base[worker.worker_id] = (worker.last_heartbeat, run_delay_ns(worker.pid) or {})
            return 0.0
        base = taken[1]
        now = run_delay_ns(worker.pid)
        if not now:
            return 0.0
        waited = max((ns - base.get(tid, ns) for tid, ns in now.items()), default=0) / 1e9
        return min(waited, cfg.heartbeat_interval_s * cfg.heartbeat_liveness)

    def check_rss(self) -> None:
        """The RSS backstop: a worker above its tenant's memory quota plus an allowance is killed.

        A pass over the workers (the ready ones are read), not over every registered tenant: at
        10,000 tenants, parked or without a worker, that pass held the loop for 7-12 ms each
        second (an activating request that came meanwhile waited for it)."""
        allowance = self.config.rss_allowance_bytes
        for worker in list(self.workers.values()):
            if worker.state is not WorkerState.READY or worker.tenant is None or worker.instance is None:
                continue
            rt = self.tenants.get(worker.tenant)
            if rt is None or worker.instance >= len(rt.slots) or rt.slots[worker.instance].worker is not worker:
                continue
            rss = self.spawner.rss(worker)
            if rss is None:
                continue
            limit = rt.spec.memory_quota_bytes + allowance
            if rss > limit:
                worker.rss_exceeded = (rss, limit)
                self.kill(worker, f"RSS {rss:,} B above {limit:,} B (memory quota + allowance)", "rss")

    # ------------------------------------------------------------ sockets in

    def _on_backend(self) -> None:
        sock = self.backend
        recv, events, clock = sock.recv, sock.getsockopt, time.perf_counter
        end = clock() + BACKEND_SLICE_S
        for n in range(BATCH):
            if n and (not int(events(_EVENTS)) & _POLLIN or clock() >= end):
                return
            try:  # recv_multipart, less its getsockopt(RCVMORE) per frame: Frame.more says it
                frame = recv(_NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:
                    frame = recv(_NOBLOCK, copy=False)
                    frames.append(frame)
            except zmq.Again:
                return
            worker = self.workers.get(frames[0].bytes)
            if worker is None or worker.state is WorkerState.DEAD:
                continue
            try:
                rid, ok, payload = proto.decode_worker_reply(frames[1].bytes)
            except (ProtocolError, IndexError) as exc:
                self.kill(worker, f"malformed reply ({exc})", "protocol")
                continue
            if rid == 0:
                self._on_data_hello(worker, payload)
                continue
            if not self.pending.on_reply(worker, rid, ok, payload, frames[2] if len(frames) > 2 else None):
                continue  # answered already (deadline) - the late reply is dropped
            if self.pending.undelivered:  # an allocation its client was never told of
                for tenant, handle in self.pending.take_undelivered():
                    self.free_undelivered(tenant, handle)
            worker.served += 1
            if worker.gated and self.quiet.answered(worker.tenant or "", rid):
                worker.gated = False  # the woken tenant's requests are answered: held work may run
            if worker.state is WorkerState.DRAINING and not worker.in_flight:
                self.stop_worker(worker, "scaled down")

    def _on_data_hello(self, worker: WorkerHandle, payload: object) -> None:
        if worker.data_hello and payload == WORKER_WARMED:
            self._on_warmed(worker)
            return
        if not _hello_of(worker, payload) or worker.data_hello:
            self.kill(worker, "bad hello on the data socket", "protocol")
            return
        worker.data_hello = True
        if worker.tenant is None and WorkerHello.from_wire(payload).warming:
            self._will_warm.add(worker.worker_id)
        self._on_connected(worker)

    def _on_control(self) -> None:
        for _ in range(BATCH):
            try:
                ident, data = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # wrong frame count
            try:
                kind, args = proto.decode_control(data)
            except ProtocolError:
                continue
            worker = self.workers.get(ident)
            if worker is None or worker.state is WorkerState.DEAD:
                continue
            now = self.clock()
            if kind == "hello":
                if not _hello_of(worker, args) or worker.control_hello:
                    self.kill(worker, "bad hello on the control socket", "protocol")
                    continue
                worker.control_hello = True
                worker.last_heartbeat = now
                self._on_connected(worker)
            elif kind == "hb":
                worker.last_heartbeat = now
            elif kind == "fault_ack":
                worker.last_heartbeat = now
                try:
                    ack = FaultAck.from_wire(args)
                except ProtocolError:
                    self.kill(worker, "malformed fault_ack", "protocol")
                    continue
                if worker.fault_waiters:
                    worker.fault_waiters.pop(0)(ack)

    def on_fault_answer(self, worker: WorkerHandle, answer: Callable[[FaultAck | FaultExit], None]) -> None:
        """``answer`` gets the worker's fault ack, or its exit if the fault ends the process."""
        worker.fault_waiters.append(answer)


def _hello_of(worker: WorkerHandle, payload: object) -> bool:
    """Is ``payload`` a hello carrying this worker's one-time token? (compared in constant time)"""
    try:
        given = WorkerHello.from_wire(payload).token
    except (ProtocolError, TypeError):
        return False
    return isinstance(given, str) and hmac.compare_digest(given.encode(), worker.token.encode())


def pool_retry_delay_s(failures: int) -> float:
    """How long the pool waits before refilling after ``failures`` workers in a row failed to start:
    0.2 s, 0.4 s, 0.8 s ... up to 30 s."""
    return float(min(30.0, 0.1 * 2 ** min(failures, 9)))


def poisson_quantile(mean: float, share: float) -> int:
    """The least ``k`` with P(N <= k) >= ``share`` for N Poisson with ``mean`` (0 for no mean): how
    many pool workers one refill time's starts take, but in 1 - ``share`` of refill times."""
    if mean <= 0.0:
        return 0
    if mean > 100.0:  # exp(-mean) underflows from ~745: the normal approximation is close there
        return math.ceil(mean + statistics.NormalDist().inv_cdf(share) * math.sqrt(mean))
    term = cdf = math.exp(-mean)
    k = 0
    while cdf < share and k < 10_000:
        k += 1
        term *= mean / k
        cdf += term
    return k


_Started = tuple[WorkerHandle, WorkerHandle | None, BaseException | None]


class _Starter:
    """Starts workers' processes on a thread of its own, so that the loop does not wait for a fork.

    ``submit`` (loop thread) queues a prepared start with the handle the loop made for it; the
    thread starts the process and posts (handle, started, error), then writes a byte to a pipe the
    loop polls, whose handler ``take``s what finished (loop thread). ``close`` ends the thread
    after the start in flight (bounded) and hands back what finished, for teardown to kill; once
    teardown set ``orphans``, a start still running is killed by the thread as it ends, and the
    starts queued behind it are never made.
    """

    def __init__(self, start: Callable[[PreparedStart], WorkerHandle], loop: Loop, on_done: Callable[[], None]) -> None:
        self._start = start
        self._jobs: queue.SimpleQueue[tuple[PreparedStart, WorkerHandle] | None] = queue.SimpleQueue()
        self._done: deque[_Started] = deque()
        #: set once the loop no longer takes starts in (teardown): how the thread kills one itself
        self.orphans: Callable[[WorkerHandle, int], None] | None = None
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        loop.register(self._read, on_done)
        self._thread = threading.Thread(target=self._run, name="twt-worker-starter", daemon=True)
        self._thread.start()

    def submit(self, prepared: PreparedStart, worker: WorkerHandle) -> None:
        self._jobs.put((prepared, worker))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            prepared, worker = job
            if self.orphans is not None:
                continue  # queued when the teardown began: never started
            try:
                started: WorkerHandle | None = self._start(prepared)
                error: BaseException | None = None
            except BaseException as exc:  # noqa: BLE001 - the loop thread reports it (a start that failed)
                started, error = None, exc
            orphans = self.orphans
            if orphans is not None and started is not None:
                orphans(started, signal.SIGKILL)  # the loop is gone: nobody would take it in
                started.process.join(5.0)
                if started.process.exitcode is not None:
                    started.process.close()  # reaped
                continue
            self._done.append((worker, started, error))
            try:
                os.write(self._write, b"\0")
            except OSError:
                pass  # pipe full (the loop is woken already) or closed (teardown)

    def take(self) -> list[_Started]:
        """What finished since the last take (loop thread)."""
        try:
            while os.read(self._read, 4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self, loop: Loop, timeout_s: float) -> list[_Started]:
        """End the thread once the start in flight is done (at most ``timeout_s``); what finished
        and was not taken yet."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        loop.unregister(self._read)
        found = self.take()
        if not self._thread.is_alive():  # else it may still write: its fds stay (a daemon thread, at teardown)
            os.close(self._read)
            os.close(self._write)
        return found
