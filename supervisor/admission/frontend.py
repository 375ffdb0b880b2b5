"""The frontend: client requests in - decode, capability check, admission, back-pressure.

Whether a request is served is decided here; where and when it goes - which
instance, now or parked until one is ready - is the dispatcher's
(:mod:`supervisor.routing.dispatcher`), to which every admitted tenant request
that needs a worker is handed.

Two local sockets take the same requests (docs/PROTOCOL.md "The two local
sockets"): ``small.ipc``, whose frames libzmq holds to :data:`SMALL_FRAME_BYTES`
(``MAXMSGSIZE``: a peer that sends a bigger one is dropped before the frame is
copied), and ``frontend.ipc``, which takes frames of any size (bulk bodies, and
every request of a client that does not know ``small.ipc``). A tenant refused for
its rate on ``frontend.ipc`` would be refused again until its bucket refills, so
that socket is then not read for that long (``_paced_by_rate``) - its frames wait
in libzmq's short pipe (4 messages), the kernel and the sender instead of being
copied to be refused - unless a tenant within its rate sent there in the last few
milliseconds. A local client's small requests, on ``small.ipc``, are never held
up by it.

Owns: the frontend ROUTER sockets' *receive* side (the two ipc ones, and the CURVE TCP
one when ``listen`` is set: the same decode, checks and limits for all; at
most ``READ_BATCH`` messages per socket per wake-up into the fair queue
(:mod:`supervisor.admission.fairness`), of which each loop turn serves a bounded part
per tenant; every request first passes admission
(:mod:`supervisor.admission.rates`: per-tenant requests and bytes per second,
per-peer for the unauthenticated); admin
ops on TCP refused unless ``allow_remote_admin``), the verified-capability
cache, the tenants' stored modules (``put_module``) and parked requests, and
the shared-memory data regions of local clients (``regions``: a
:class:`~supervisor.routing.regions.RegionTable`; ``region_create`` /
``region_release`` are answered here, ``write_region`` / ``read_region`` are
resolved to the tenant's own region and forwarded; refused on TCP, whose
peers cannot map this host's shared memory).
May touch: the pending table (every answer goes through it), the dispatcher
(to route), the registry (to verify capabilities), the event log (read:
``events``, which either capability may send: the capability is verified here and
its op's class reads the log for it). Admin ops are
verified here and handed to their handler, one per op (:mod:`supervisor.control.ops`,
bound to the part that serves it, given at construction). Told by the tenant
signals (:mod:`supervisor.lifecycle.signals`) of an evicted tenant (nothing of it
stays here) and of a rotated registry key (nothing verified before counts).
Loop thread only.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from shared import protocol as proto
from shared.capability import MonitorCapability, RegistryAdminCapability, TenantCapability, capability_from_bytes
from shared.config import SupervisorConfig
from shared.errors import (
    AdmissionRate,
    ClientRepliesQueued,
    Draining,
    InFlightLimit,
    InvalidArgument,
    ProtocolError,
    TenantFailed,
    TenantIsolationViolation,
    TenantStopped,
    TensorWasmError,
    UnknownModule,
    UnknownTenant,
)
from shared.log import get_logger
from shared.sizes import MAX_MODULE_BYTES
from supervisor.admission.guard import FrontendGuard
from supervisor.admission.rates import RefusalUnanswered
from supervisor.runtime.loop import Loop, Timer
from supervisor.routing.dispatcher import Body, Dispatcher
from supervisor.routing.pending import PendingTable
from supervisor.routing.regions import RegionTable, ipc_peer_pid
from supervisor.store.registry import TenantRegistry
from supervisor.store.modules import ModuleStore
from supervisor.routing.replies import Replies
from supervisor.admission.tcp_frontend import IPC_INDEX, SMALL_INDEX, TCP_INDEX
from supervisor.runtime.tenants import TenantRuntime, TenantState
from supervisor.runtime.workers import WorkerHandle

#: messages read from one frontend socket per wake-up: a turn's share of one tenant, so a lone
#: tenant's batch is served at once and a flood of garbage delays a verified request by one short read
READ_BATCH = 16
#: messages read per wake-up while the fair queue is full
BATCH_BACKLOGGED = 8
#: with two frontend sockets, every this many messages read from one the other is asked for input
YIELD_EVERY = 4
#: the idle TCP sessions are looked for this often (or four times per tcp_idle_timeout_s, if shorter)
IDLE_SWEEP_S = 0.5

__all__ = ["SMALL_FRAME_BYTES", "AdminHandler", "ClientMessage", "DenialHook", "DrainState", "EitherOp", "EventPages",
           "Frontend", "Handlers", "Holdings", "LocalOp", "Routes", "Sockets", "TenantSignalsLike", "small_frame_bytes"]

_log = get_logger("supervisor")

#: the fairness key of the verified monitor capability (no tenant id has parentheses)
MONITOR_KEY = "(monitor)"
#: entries of the verified-capability cache before it is cleared
_VERIFIED_CAP_CACHE = 65536

#: plain ints: ``int & zmq.POLLIN`` goes through enum.Flag (~1 us a message)
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_IPC = bytes([IPC_INDEX])
_TCP = bytes([TCP_INDEX])
_SMALL = bytes([SMALL_INDEX])
#: the largest frame ``small.ipc`` takes (at least ``max_header_bytes``): libzmq drops a peer that sends
#: a bigger one before reading it; requests with a bigger body go to ``frontend.ipc`` (docs/PROTOCOL.md)
SMALL_FRAME_BYTES = 256 << 10
#: the longest single pause of ``frontend.ipc`` for a tenant past its rate (see _paced_by_rate)
MAX_RATE_PAUSE_S = 0.05
#: after such a pause, ``frontend.ipc`` is read one message a wake-up for this long: a batch read
#: at once would copy a whole batch of which the bucket admits one
RATE_PACED_S = 0.1
#: ``frontend.ipc`` is never paused this long after a tenant within its rate was served from it (a client
#: that does not know ``small.ipc`` keeps its latency beside a bulk flood; 5 ms let its slow round trips
#: through: a victim's write-flood p50 1.73-2.30x against 1.32-1.43x unpaced)
IPC_LIGHT_S = 0.1

#: an admin op's handler, bound to the part that serves it: (client, rid, args) (supervisor.control.ops)
AdminHandler = Callable[[bytes, int, dict[str, object]], None]
#: a tenant op the frontend answers itself (supervisor.control.ops): (this frontend, tenant, args, body) -> the result
LocalOp = Callable[["Frontend", TenantRuntime, dict[str, object], Body], object]
#: an op either capability may send, answered by the frontend (supervisor.control.ops): (this frontend,
#: the tenant the capability names, None for the admin's; args) -> the result
EitherOp = Callable[["Frontend", "TenantRuntime | None", dict[str, object]], object]
#: told of every refused capability: (the capability bytes or None, the op) - the denied-event audit
DenialHook = Callable[["bytes | None", str], None]


class DrainState(Protocol):
    """The supervisor's drain once a stop began (:class:`supervisor.lifecycle.drain.Drain`)."""

    @property
    def active(self) -> bool: ...
    def refusal(self, now: float) -> Draining: ...


class EventPages(Protocol):
    """The event log the ``events`` op pages through (:class:`supervisor.observe.event_log.EventLog`)."""

    def page(self, view: Any, args: Mapping[str, object]) -> dict[str, object]: ...


class TenantSignalsLike(Protocol):
    """What the frontend hears of the tenant signals (:class:`supervisor.lifecycle.signals.TenantSignals`)."""

    def on_evicted(self, slot: Callable[[TenantRuntime], None]) -> None: ...
    def on_key_rotated(self, slot: Callable[[RegistryAdminCapability], None]) -> None: ...


@dataclass(frozen=True, slots=True)
class Handlers:
    """The handlers of the ops the supervisor serves itself, by name (``supervisor.control.ops``):
    every admin op's, bound to its part; every tenant op's the frontend answers from what it
    holds; every op's either capability may send. Each table must hold exactly the ops of its
    kind in the op table (RuntimeError at construction: a bug, found at start)."""

    admin: Mapping[str, AdminHandler]
    local: Mapping[str, LocalOp]
    either: Mapping[str, EitherOp]

    def __post_init__(self) -> None:
        _check_ops(self.admin, self.local, self.either)


def small_frame_bytes(config: SupervisorConfig) -> int:
    """The largest frame ``small.ipc`` takes: :data:`SMALL_FRAME_BYTES`, or the header limit if larger."""
    return max(SMALL_FRAME_BYTES, config.max_header_bytes)


@dataclass(frozen=True, slots=True)
class Sockets:
    """The frontend ROUTER sockets it reads: the local ones - ``frontend.ipc`` (frames of any size)
    and ``small.ipc`` (frames up to :func:`small_frame_bytes`; None in a test that has only the
    first) - and the CURVE TCP one when ``listen`` is set."""

    ipc: zmq.Socket[bytes]
    tcp: zmq.Socket[bytes] | None = None
    small: zmq.Socket[bytes] | None = None


@dataclass(frozen=True, slots=True)
class Routes:
    """Where an admitted request goes and how it is answered: the pending table (every answer),
    the replies (its sockets' send side), the dispatcher (a tenant request that needs a worker)
    and the local clients' shared-memory regions."""

    pending: PendingTable
    replies: Replies
    dispatcher: Dispatcher
    regions: RegionTable


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the frontend reads to verify and answer: the registry (capabilities), the tenants and
    the workers by identity (the worker set's table: whose TCP sessions are busy), the admin
    capability's bytes, the event log (``events``) and the stored modules (``put_module``; None:
    none kept)."""

    registry: TenantRegistry
    tenants: Mapping[str, TenantRuntime]
    workers: Mapping[bytes, WorkerHandle]
    admin_cap: bytes
    event_log: EventPages
    module_store: ModuleStore | None = None


class Frontend:
    """Client requests to workers (see the module docstring)."""

    def __init__(self, config: SupervisorConfig, *, loop: Loop, sockets: Sockets, guard: FrontendGuard,
                 routes: Routes, holdings: Holdings, handlers: Handlers, signals: TenantSignalsLike | None = None,
                 on_denied: DenialHook | None = None) -> None:
        """``guard``: the bounds every request passes (admission, fairness, held bytes, the TCP
        connections). ``signals``: told of evictions and key rotations (None: a frontend of a test
        that has neither). ``on_denied``: told of every refused capability (the denied-event audit)."""
        self.config = config
        #: the stored modules on disk (put_module), with a state directory
        self.module_store = holdings.module_store
        self.clock = loop.clock
        self.loop = loop
        sock, tcp_sock = sockets.ipc, sockets.tcp
        self.sock = sock
        self.replies = routes.replies
        self.pending = routes.pending
        self.dispatcher = routes.dispatcher
        self.workers = holdings.workers
        self.registry = holdings.registry
        self.tenants = holdings.tenants
        self.guard = guard
        self._admin_raw = holdings.admin_cap
        #: the monitor capability's bytes, once verified (a key rotation drops them)
        self._monitor_raw: bytes | None = None
        self.on_denied = on_denied
        self.regions = routes.regions
        self.event_log = holdings.event_log
        #: raw capability bytes -> the tenant runtime they were verified for
        self._verified_caps: dict[bytes, TenantRuntime] = {}
        self._admin_ops, self._local_ops, self._either_ops = handlers.admin, handlers.local, handlers.either
        #: the supervisor is ready (every configured tenant up): ``hello`` without a capability says so
        self.ready = False
        #: the supervisor's drain once a stop began (supervisor.lifecycle.drain): new requests but the
        #: read-only ones are refused ``Draining`` while what is in flight finishes
        self.drain: DrainState | None = None
        if signals is not None:
            signals.on_evicted(self.forget)
            signals.on_key_rotated(self._key_rotated)
        #: each frontend socket and its read handler, by prefix (unregistered while not read)
        self._sources: dict[bytes, tuple[zmq.Socket[bytes], Callable[[], None]]] = {
            _IPC: (sock, lambda: self._on_readable(sock, _IPC))}
        #: the TCP socket and its read handler (unregistered while paced: supervisor.admission.pacing)
        self._tcp: tuple[zmq.Socket[bytes], Callable[[], None]] | None = None
        if tcp_sock is not None:
            self._tcp = self._sources[_TCP] = (tcp_sock, lambda: self._on_readable(tcp_sock, _TCP))
        small_sock = sockets.small
        if small_sock is not None:
            self._sources[_SMALL] = (small_sock, lambda: self._on_readable(small_sock, _SMALL))
        #: each frontend socket's neighbours: what a read of one looks at (see _on_readable)
        self._other: dict[bytes, list[tuple[zmq.Socket[bytes], bytes]]] = {
            prefix: [(other, p) for p, (other, _) in self._sources.items() if p != prefix]
            for prefix in self._sources} if len(self._sources) > 1 else {}
        #: until when ``frontend.ipc`` is read one message a wake-up (see _paced_by_rate)
        self._ipc_paced_until = 0.0
        #: until when a tenant not over its rate counts as active on ``frontend.ipc`` (never paced then)
        self._ipc_light_until = 0.0
        for source, handler in self._sources.values():
            loop.register(source, handler)
        #: the sockets not read now, by prefix, and why ("paced": the TCP pacer; "held": a hold,
        #: supervisor.admission.yielding); read again once no reason is left
        self._unread: dict[bytes, set[str]] = {}
        #: the tenants over their rate now (supervisor.admission.yielding), as of this turn
        self._over: frozenset[str] = frozenset()
        #: the hold on now (its longest end's timer) and the tenants it holds
        self._hold: Timer | None = None
        self._hold_tenants: frozenset[str] = frozenset()
        #: no hold begins before this (after a hold that ran its full length: as long again)
        self._no_hold_until = 0.0
        #: until when a tenant within its rate counts as active (the over-rate ones are contended)
        self._contended_until = 0.0
        #: socket -> until when a tenant within its rate is active on it (never held then)
        self._light_sources: dict[bytes, float] = {}
        #: over-rate tenants held past their contended budgets, and the timers that end it
        self._budget_held: dict[str, Timer] = {}
        #: the TCP connections' activity (supervisor.admission.peers: the idle rule and the eviction)
        self._sessions = guard.connections if tcp_sock is not None else None
        if self._sessions is not None:
            self._sessions.busy = self._tcp_clients_busy
            self._sweep_s = min(IDLE_SWEEP_S, config.tcp_idle_timeout_s / 4)
            loop.timers.after(self._sweep_s, self._sweep_idle_tcp)
        #: each message's connection, for the memory guard (supervisor.admission.fd_guard)
        conns = guard.connections
        self._conns = conns if conns is not None and conns.guard.memory_bytes else None  # the bound off: no record
        if self._conns is not None:
            self._conns.guard.busy = self._clients_busy

    # ------------------------------------------------------------ decode

    def _on_readable(self, sock: zmq.Socket[bytes], prefix: bytes, follow: bool = True) -> None:
        # Read what is queued (asking ZMQ_EVENTS between messages: a recv that fails with
        # EAGAIN costs ~5 us here, the query ~1.6 us) into the fair queue; the loop's turn
        # serves it (end_turn). At most READ_BATCH a wake-up, and only a few while the
        # queue is full: a flood waits in its sender. A message without a verified
        # capability is first charged to its peer's bucket (supervisor.admission.rates): past
        # it, dropped here, before it costs anything more.
        #
        # Two frontend sockets (ipc and TCP) are one source: libzmq fair-queues the peers of
        # one socket, not across sockets, so while a flood fills one, every YIELD_EVERY
        # messages the other is asked for input, and when it has some the batch ends and the
        # other is read right after this one is served (a tcp-ping flood's victim on
        # ipc waited ~0.5 ms before the loop read it, a whole batch and its serving).
        if prefix in self._unread:  # (polled before the pause or hold began, this turn)
            return
        recv, events = sock.recv, sock.getsockopt
        others = [o for o in self._other.get(prefix, ()) if o[1] not in self._unread] if follow else []
        fair, admission = self.guard.fair, self.guard.admission
        now = self.clock()
        batch: list[ClientMessage] = []
        yielded = False
        dropped = 0
        budget = fair.read_budget(READ_BATCH, BATCH_BACKLOGGED)
        conns, read_at = self._conns, time.monotonic()
        if prefix == _IPC and now < self._ipc_paced_until:
            budget = 1  # its tenant was past its rate a moment ago: read what the bucket may admit
        # at the hard ceiling, held tenants' items waiting: a socket a tenant within its rate is
        # active on is still read (FairTurn.past_ceiling), the held tenants' messages refused
        past = not budget and fair.held and self._light_sources.get(prefix, 0.0) > now
        if past:
            budget = fair.past_ceiling(BATCH_BACKLOGGED)
        for i in range(1, budget + 1):
            try:  # recv_multipart, less its getsockopt(RCVMORE) per frame: Frame.more says it
                frame = recv(_NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:
                    frame = recv(_NOBLOCK, copy=False)
                    frames.append(frame)
            except zmq.Again:
                break
            fd = _srcfd(frames[0])
            if conns is not None and fd >= 0:  # it completed: not a message that never ends
                conns.completed(fd, read_at, prefix, frames[0])
            if prefix == _TCP and self._sessions is not None and fd >= 0 and not self._tcp_seen(frames[0], fd, now):
                msg = None  # its session was dropped: never served, never executed
            else:
                msg = self.decode(frames, prefix)
            if past and msg is not None and msg.key in fair.held:
                self._refuse_held(msg, now)
            elif msg is not None and (msg.key is not None or admission.admit_unauthenticated(msg.client, now)):
                batch.append(msg)
            else:
                dropped += 1
            if not int(events(_EVENTS)) & _POLLIN:
                break
            if others and not i % YIELD_EVERY and any(int(o[0].getsockopt(_EVENTS)) & _POLLIN for o in others):
                yielded = True
                break
        if dropped:
            self.dropped_unanswered(prefix, dropped)
        if batch:
            self._take(batch)
        if yielded:
            for other_sock, other_prefix in others:
                if other_prefix not in self._unread and int(other_sock.getsockopt(_EVENTS)) & _POLLIN:
                    self._on_readable(other_sock, other_prefix, follow=False)

    def _refuse_held(self, msg: ClientMessage, now: float) -> None:
        """A held tenant's request read past the fair queue's ceiling (FairTurn.past_ceiling):
        refused for its rate (it is over it), answered or - past its refusals' answers - dropped
        and counted, as admission does; it stays over its rate on that socket."""
        rt = self.tenants.get(msg.key) if msg.key is not None else None
        if rt is None:  # (evicted since it was held: its requests are refused when served anyway)
            self.dropped_unanswered(msg.client[:1])
            return
        self.guard.yielding.refused(msg.client[:1], rt.tenant_id, now)
        try:
            self.guard.admission.refuse(rt.tenant_id, rt.spec, now, in_flight=rt.in_flight + rt.waiting)
        except RefusalUnanswered as exc:
            self.pending.count_refusal(exc.tenant, msg.op, "unanswered")
            self.dropped_unanswered(msg.client[:1])
        except AdmissionRate as exc:
            self._refused(msg.client, msg.rid, msg.op, exc, msg.cap_raw)

    def _tcp_seen(self, frame: zmq.Frame, fd: int, now: float) -> bool:
        """A request came on the TCP socket: note its connection's activity (``fd``: the one libzmq
        read it from). False: its session was dropped by the supervisor, and it must not be served."""
        sessions = self._sessions
        assert sessions is not None
        client = _TCP + frame.bytes
        seen = sessions.gate.seen(fd, client, now)
        if seen != "ok":  # an ACCEPTED still in the monitor's queue may explain it
            sessions.settle()
            seen = sessions.gate.seen(fd, client, now)
        return seen != "dropped"

    def _tcp_clients_busy(self) -> set[bytes]:
        """The TCP clients with a request in flight (at a worker, or parked): their sessions are
        neither idle nor evicted. (One read and waiting for its turn was active a moment ago.)"""
        return {c for c in self._clients_busy() if c[:1] == _TCP}

    def _clients_busy(self) -> set[bytes]:
        """Every client with a request in flight (any socket): called from the fd guard's thread, so
        a table changing under it raises RuntimeError (the guard asks again)."""
        busy = {p.client for w in list(self.workers.values()) for p in list(w.in_flight.values())
                if p.client is not None}
        busy.update(p.client for rt in list(self.tenants.values()) if rt.waiting for p in list(rt.parked))
        return busy

    def _sweep_idle_tcp(self) -> None:
        """Timer: close the TCP sessions idle for ``tcp_idle_timeout_s`` (see supervisor.admission.peers)."""
        if self._sessions is None or self._tcp is None or self._tcp[0].closed:
            return
        try:
            self._sessions.expire_idle(self.config.tcp_idle_timeout_s)
        finally:
            self.loop.timers.after(self._sweep_s, self._sweep_idle_tcp)

    def dropped_unanswered(self, prefix: bytes, n: int = 1) -> None:
        """``n`` messages read from the socket ``prefix`` names were dropped unanswered: the TCP
        socket is not read for a while when it owes too many such drops (supervisor.admission.pacing);
        the local one is never paced."""
        if prefix != _TCP:
            return
        pacer = self.guard.pacer
        pause = pacer.dropped(n, self.clock())
        if not pause or self.tcp_paused or self._tcp is None:
            return
        self._stop_reading(_TCP, "paced")
        pacer.paused(pause)
        self.loop.timers.after(pause, lambda: self._start_reading(_TCP, "paced"))

    @property
    def tcp_paused(self) -> bool:
        """The TCP socket is not read now (a pause of the pacer)."""
        return "paced" in self._unread.get(_TCP, ())

    def _stop_reading(self, prefix: bytes, why: str) -> None:
        """Leave the socket ``prefix`` names unread, for ``why``, until :meth:`_start_reading` says so."""
        reasons = self._unread.get(prefix)
        if reasons is None:
            reasons = self._unread[prefix] = set()
            self.loop.unregister(self._sources[prefix][0])
        reasons.add(why)

    def _start_reading(self, prefix: bytes, why: str) -> None:
        """``why`` no longer keeps the socket ``prefix`` names unread: read it again once nothing
        does (unless it was closed meanwhile)."""
        reasons = self._unread.get(prefix)
        if reasons is None or why not in reasons:
            return
        reasons.discard(why)
        if reasons:
            return
        del self._unread[prefix]
        sock, handler = self._sources[prefix]
        if not sock.closed:
            self.loop.register(sock, handler)

    # ------------------------------------------------------------ holds (supervisor.admission.yielding)

    def _serve_turn(self, msg: ClientMessage) -> None:
        """Serve one request while some tenant is over its rate (supervisor.admission.yielding): an
        over-rate tenant's is charged to its contended budget while another tenant is active; a
        request of a tenant within its rate may begin a hold."""
        self.serve(msg)
        key = msg.key
        if key is None:
            return
        now = self.clock()
        if key in self._over:
            if now < self._contended_until:
                self._charge(key, now)
            return
        yielding = self.guard.yielding
        self._contended_until = until = now + yielding.contended_s
        self._light_sources[msg.client[:1]] = until
        if self._hold is None and yielding.max_hold_s > 0.0 and now >= self._no_hold_until:
            self._begin_hold(now)

    def _unshared(self, tenant: str, now: float) -> bool:
        """No tenant within its rate is active on a socket ``tenant`` sent on lately: leaving those
        sockets unread delays nobody else."""
        light = self._light_sources
        return not any(light.get(source, 0.0) > now for source in self.guard.yielding.sources_of(tenant))

    def _begin_hold(self, now: float) -> None:
        """Hold the tenants over their rate while another tenant's request is in flight (their
        sockets unread where no other active tenant sends: _set_held)."""
        held = self._over
        if not held or not self._others_in_flight():
            return
        yielding = self.guard.yielding
        yielding.holds += 1
        self._hold_tenants = held
        self._hold = self.loop.timers.after(yielding.max_hold_s, lambda: self._end_hold(full=True))
        self._set_held(now)

    def _others_in_flight(self) -> bool:
        """A request of a tenant not over its rate is in flight at a worker."""
        heavy = 0
        tenants = self.tenants
        for tenant in self._over:
            rt = tenants.get(tenant)
            if rt is not None:
                heavy += rt.in_flight
        return len(self.pending) > heavy

    def _end_hold(self, full: bool = False) -> None:
        """The hold is over: the requests it waited for were answered, or (``full``) it ran its
        longest - then no hold begins for as long again."""
        timer, self._hold = self._hold, None
        if timer is None:
            return
        now = self.clock()
        if full:
            self.guard.yielding.full_holds += 1
            self._no_hold_until = now + self.guard.yielding.max_hold_s
        else:
            timer.cancel()
        self._hold_tenants = frozenset()
        self._set_held(now)

    def _charge(self, tenant: str, now: float) -> None:
        """One request of an over-rate tenant served while another tenant is active: past its
        contended budget, it is held until the budget is back (its sockets unread where they are
        its own: _set_held)."""
        if tenant in self._budget_held:
            return
        rt = self.tenants.get(tenant)
        rate = self.guard.admission.requests_per_s
        if rt is not None and rt.spec.requests_per_s is not None:
            rate = rt.spec.requests_per_s
        yielding = self.guard.yielding
        wait = yielding.charge(tenant, rate, now)
        if not wait:
            return
        yielding.budget_holds += 1
        self._budget_held[tenant] = self.loop.timers.after(wait, lambda: self._budget_back(tenant))
        self._set_held(now)

    def _budget_back(self, tenant: str) -> None:
        """An over-rate tenant's contended budget is back: served and read again (unless held)."""
        if self._budget_held.pop(tenant, None) is not None:
            self._set_held(self.clock())

    def _set_held(self, now: float) -> None:
        """The held tenants - the hold's and those past their budgets - wait in the fair queue,
        and the sockets they send on are not read unless another tenant within its rate is active
        there (``small.ipc``, shared by local clients: read on, so the other's next request is read
        as soon as it comes, and the held tenant's read requests wait in order); the others are
        read again."""
        held = self._hold_tenants | frozenset(self._budget_held)
        self.guard.fair.held = held
        sources_of = self.guard.yielding.sources_of
        sources = {source for t in held if self._unshared(t, now) for source in sources_of(t)}
        for prefix in self._sources:
            if prefix in sources:
                self._stop_reading(prefix, "held")
            else:
                self._start_reading(prefix, "held")

    def _take(self, batch: list[ClientMessage]) -> None:
        """Serve or queue one read batch (see _on_readable)."""
        fair = self.guard.fair
        # The common case, served at once: nothing waits, and the batch is one verified
        # tenant's, within its share of a turn (the fair queue would serve it as it is) -
        # in count and in time: what is left once the batch has taken a quantum waits for
        # the turn, so that a request of another tenant arriving meanwhile waits no longer.
        first = batch[0].key
        add = fair.add
        if (not fair.backlog and first is not None and len(batch) <= fair.per_tenant_per_turn
                and first not in fair.held and all(m.key == first for m in batch)):
            clock = time.perf_counter
            end = clock() + fair.quantum_s
            serve = self._serve_turn if self._over else self.serve
            for i, msg in enumerate(batch):
                serve(msg)
                if clock() >= end:
                    for rest in batch[i + 1:]:
                        add(True, first, rest)
                    break
            return
        dropped = 0
        for msg in batch:
            key = msg.key
            if key is None and not fair.fits_unauthenticated(msg.size):
                key = msg.key = self._verified_now(msg.cap_raw)
                if key is not None:  # what its client sent before with the same token, queued unverified
                    cap = msg.cap_raw
                    for earlier in fair.promote(msg.client, key, lambda m: bool(m.cap_raw == cap)):
                        earlier.key = key
            dropped += not add(key is not None, key if key is not None else msg.client, msg)
        if dropped:  # a batch is one socket's (_on_readable)
            self.dropped_unanswered(batch[0].client[:1], dropped)

    def _verified_now(self, cap_raw: bytes | None) -> str | None:
        """The tenant a capability not verified yet names, verified now (None: none, or one that
        does not verify). Asked only of a message the backlog's byte bound for the unauthenticated
        would drop (supervisor.admission.fairness): a client's pipelined first requests with big
        bodies arrive before the first is served and its token cached, and all but one of them
        would be dropped unanswered - a client with a valid capability, refused nothing, told
        nothing. Verified, they are its tenant's, queued and admitted as every other request of
        it; a forged or revoked token is still dropped (it cost one MAC, as serving it would)."""
        key = self.verified_key(cap_raw)
        if key is not None or cap_raw is None:
            return key
        try:
            return self._verify(cap_raw).tenant_id
        except TensorWasmError:  # forged, malformed, revoked, its tenant gone: unauthenticated still
            return None

    def end_turn(self) -> None:
        """End of a loop turn: serve one bounded turn of what was read (supervisor.admission.fairness);
        end the hold once the requests it waited for were answered (supervisor.admission.yielding)."""
        yielding = self.guard.yielding
        if self._hold is not None and not self._others_in_flight():
            self._end_hold()
        if self._over or yielding.tracking:  # (none refused for its rate lately: nothing to ask)
            self._over = frozenset(yielding.over_rate(self.clock()))
        if self.guard.fair.backlog:
            self.guard.fair.run_turn(self._serve_turn if self._over else self.serve, time.perf_counter)

    def decode(self, frames: list[zmq.Frame], prefix: bytes = _IPC) -> ClientMessage | None:
        """Decode one client message (None: unanswerable, dropped) and note whose it is:
        ``key`` is the tenant (or "admin") when its capability was verified before.

        ``prefix`` names the socket it came in on; the client key is it plus the
        peer's identity (see :mod:`supervisor.routing.replies`).
        """
        client = prefix + frames[0].bytes
        if len(frames) not in (2, 3):
            rid = proto.peek_rid(frames[1].bytes) if len(frames) > 1 else None
            if rid is None:
                return None
            return ClientMessage(client, rid, "", None, {}, None,
                                 ProtocolError(f"expected 1 or 2 frames, got {len(frames) - 1}"))
        header = frames[1].bytes
        try:
            rid, op, cap_raw, args = proto.decode_client_header(header, self.config.max_header_bytes)
        except ProtocolError as exc:
            rid2 = proto.peek_rid(header)
            # without its traceback: its frames reach this turn's list, which holds the
            # message - a cycle that keeps every flooded header alive until a full GC
            return None if rid2 is None else ClientMessage(client, rid2, "", None, {}, None,
                                                           exc.with_traceback(None))
        body = frames[2] if len(frames) == 3 else None
        if body is not None and not proto.OPS[op].body_in:
            return ClientMessage(client, rid, op, None, {}, None,
                                 ProtocolError(f"op {op!r} takes no body frame (PROTOCOL.md: body_in)"))
        pid_arg = proto.OPS[op].peer_pid_arg
        if pid_arg is not None:  # owned by the process the kernel names, never the one the client does
            args = {k: v for k, v in args.items() if k != pid_arg}
            pid = _peer_pid(frames[1]) if prefix != _TCP else None
            if pid is not None:
                args[pid_arg] = pid
        msg = ClientMessage(client, rid, op, cap_raw, args, body, None,
                            size=len(header) + (len(body) if body is not None else 0))
        msg.key = self.verified_key(cap_raw)
        return msg

    def verified_key(self, cap_raw: bytes | None) -> str | None:
        """The tenant whose verified capability these exact bytes are ("admin" for the
        admin capability), or None: never verified (forged, foreign, new or absent)."""
        if cap_raw is None:
            return None
        rt = self._verified_caps.get(cap_raw)
        if rt is not None and self.tenants.get(rt.tenant_id) is rt:
            return rt.tenant_id
        if hmac.compare_digest(cap_raw, self._admin_raw):
            return "admin"
        if self._monitor_raw is not None and hmac.compare_digest(cap_raw, self._monitor_raw):
            return MONITOR_KEY
        return None

    def serve(self, msg: ClientMessage) -> None:
        """Serve one request (every request read ends here, or in the drops before)."""
        client = msg.client
        if client[:1] == _TCP and self._sessions is not None:
            gate = self._sessions.gate
            if gate.dropped(client):  # read before its session was dropped: never served
                self.dropped_unanswered(_TCP)
                return
            self._serve(msg)
            if msg.key is not None or self.verified_key(msg.cap_raw) is not None:
                gate.verified(client)  # a tenant's (or the admin's) session: evicted last
            return
        if client[:1] == _IPC and msg.key is not None and msg.key not in self._over:  # not paced for a while
            self._ipc_light_until = self.clock() + IPC_LIGHT_S
        self._serve(msg)

    def _serve(self, msg: ClientMessage) -> None:
        client, rid, op, body = msg.client, msg.rid, msg.op, msg.body
        if msg.error is not None:
            self._refused(client, rid, op, msg.error, None)
            return
        if msg.cap_raw is None and proto.OPS[op].anonymous:
            self._anonymous(client, rid)
            return
        if self.drain is not None and self.drain.active and op not in proto.MONITOR_OPS:
            self._refused(client, rid, op, self.drain.refusal(self.clock()), msg.cap_raw)
            return
        try:
            if proto.OPS[op].any_capability:  # ``events``: the capability picks what it shows
                self._either_capability(client, rid, op, msg.cap_raw, msg.args, msg.size)
            elif proto.OPS[op].admin:
                self._admin_request(client, rid, op, msg.cap_raw, msg.args)
            else:
                self._tenant_request(client, rid, op, msg.cap_raw, msg.args, body, msg.size)
        except RefusalUnanswered as exc:  # refused for its rate, past the answers to that: dropped, counted
            self.pending.count_refusal(exc.tenant, op, "unanswered")
            self.dropped_unanswered(client[:1])
        except TenantIsolationViolation as exc:  # a refused capability (revoked ones included): audited
            self._refused(client, rid, op, exc, msg.cap_raw)
            if self.on_denied is not None:
                self.on_denied(msg.cap_raw, op)
        except TensorWasmError as exc:
            self._refused(client, rid, op, exc, msg.cap_raw)
        except ValueError as exc:  # a value out of its domain (check_args checked the types)
            self._refused(client, rid, op, InvalidArgument(f"{op}: {exc}"), msg.cap_raw)
        except Exception as exc:  # noqa: BLE001 - nothing a client sends may crash the loop
            # TypeError, KeyError ...: check_args let the input through, so this is our bug - logged
            # with its trace and answered as an internal error, never blamed on the client's input
            _log.error("supervisor.request_failed", exc_info=True, extra={"twt_fields": {"op": op}})
            self._refused(client, rid, op, TensorWasmError(f"internal error handling {op!r}: {exc!r}"), msg.cap_raw)

    def _admin_request(self, client: bytes, rid: int, op: str, cap_raw: bytes | None, args: dict[str, object]) -> None:
        """One admin request: the admin capability first, then the op's arguments, then its handler."""
        if cap_raw is None:
            raise TenantIsolationViolation(None, f"admin op {op!r} (no capability)", "missing")
        if not self._monitor_allowed(op, cap_raw):
            if client[:1] == _TCP and not self.config.allow_remote_admin:
                raise TenantIsolationViolation(None, f"admin op {op!r} over TCP (allow_remote_admin is false)"
                                               + ("; the monitor capability reads it remotely"
                                                  if proto.OPS[op].monitor else ""))
            self.registry.verify_admin(RegistryAdminCapability.from_bytes(cap_raw))
        proto.check_args(op, args)
        self._admin_ops[op](client, rid, args)

    def _monitor_allowed(self, op: str, cap_raw: bytes) -> bool:
        """True when ``cap_raw`` is this registry's monitor capability and ``op`` is one it grants
        (read-only: from either frontend, ``allow_remote_admin`` or not). False when it is no
        monitor capability (the admin checks follow); a forged or foreign one, or one offered for
        an op it does not grant, is refused here."""
        cap = capability_from_bytes(cap_raw)
        if not isinstance(cap, MonitorCapability):
            return False
        if not proto.OPS[op].monitor:
            raise TenantIsolationViolation(None, f"op {op!r} (the monitor capability grants read-only ops only: "
                                           f"{', '.join(sorted(proto.MONITOR_OPS))})", "wrong_kind")
        self.registry.verify_monitor(cap)
        self._monitor_raw = cap_raw  # its next requests are served as verified (verified_key)
        return True

    def _refused(self, client: bytes, rid: int, op: str, exc: TensorWasmError, cap_raw: bytes | None) -> None:
        """Answer a request the supervisor itself refused (and count it).

        Only a verified capability earns a full answer and a metric label of its
        tenant. Anything else gets a short error, sent tracked, while its peer has
        few of them unread (else it is dropped); counted under one label: a forged
        token's tenant name never becomes a label.
        """
        key = self.verified_key(cap_raw)
        if key is None:
            err = self.guard.unauthenticated_error(client, exc)
            if err is not None:
                errors = self.guard.errors
                errors.sent(client, self.replies.error_tracked(client, rid, err, errors.track(client)))
            else:  # dropped: too many of its peer's error replies unread
                self.dropped_unanswered(client[:1])
            self.pending.count_refusal("", op, exc.code)
            return
        self.pending.refuse(client, rid, op, exc, tenant="" if key in ("admin", MONITOR_KEY) else key)

    def _anonymous(self, client: bytes, rid: int) -> None:
        """``hello`` without a capability, on either frontend: the liveness probe. It answers the
        protocol version and readiness only - nothing of any tenant, the registry or the host -
        and goes the way of a refusal to an unauthenticated peer (its turn after verified
        requests, the same budget, sent tracked through ``guard.errors``), so a flood of
        probes costs what a flood of bad tokens costs."""
        errors = self.guard.errors
        if not errors.allow(client):
            return
        errors.sent(client, self.replies.ok_tracked(
            client, rid, {"protocol": proto.PROTOCOL_VERSION, "ready": self.ready}, errors.track(client)))

    # ------------------------------------------------------------ either capability (``events``)

    def _either_capability(self, client: bytes, rid: int, op: str, cap_raw: bytes | None, args: dict[str, object],
                           size: int = 0) -> None:
        """An op either capability may send: the admin capability (over TCP only with
        ``allow_remote_admin``) or a tenant's (admitted as every tenant request is); the op's handler
        gets the tenant it names (None: the admin) and answers at once, nothing held per client."""
        if cap_raw is None:
            raise TenantIsolationViolation(None, f"op {op!r} (no capability)", "missing")
        cap = capability_from_bytes(cap_raw)
        rt: TenantRuntime | None = None
        if self._monitor_allowed(op, cap_raw):
            pass  # the monitor's view is the admin's, read-only
        elif isinstance(cap, RegistryAdminCapability):
            if client[:1] == _TCP and not self.config.allow_remote_admin:
                raise TenantIsolationViolation(None, f"admin {op} over TCP (allow_remote_admin is false); "
                                               "a tenant capability follows its own tenant's events")
            self.registry.verify_admin(cap)
        else:
            rt = self._verify(cap_raw)
            self._admit(client, rt, size)
        proto.check_args(op, args)
        result = self._either_ops[op](self, rt, args)
        self.pending.answer(client, rid, op, result, tenant="" if rt is None else rt.tenant_id)

    # ------------------------------------------------------------ tenant requests

    def _tenant_request(
        self, client: bytes, rid: int, op: str, cap_raw: bytes | None, args: dict[str, object], body: Body,
        size: int = 0,
    ) -> None:
        if cap_raw is None:
            raise TenantIsolationViolation(None, f"op {op!r} (no capability)", "missing")
        rt = self._verify(cap_raw)
        tid = rt.tenant_id
        # Every limit applies to every op, before anything is done for it: admission
        # (requests and bytes per second), the failed tenant, max_in_flight (quota and
        # put_module count, though answered at once), the module cap.
        self._admit(client, rt, size)
        proto.check_args(op, args)
        if rt.state is TenantState.FAILED:
            raise TenantFailed(tid, len(rt.restart_times), rt.spec.restart_window_s)
        in_flight, max_in_flight = rt.in_flight + rt.waiting, rt.spec.max_in_flight
        if in_flight >= max_in_flight:
            raise InFlightLimit(tid, in_flight, max_in_flight)
        spec = proto.OPS[op]
        if body is not None and spec.module_body and len(body) > MAX_MODULE_BYTES:
            raise InvalidArgument(f"module of {len(body):,} B exceeds the {MAX_MODULE_BYTES:,}-byte limit")
        if spec.local_only and client[:1] == _TCP:
            raise InvalidArgument(f"{op}: shared-memory regions serve local (ipc) clients only; "
                                  "a remote client sends its bytes in frames")
        if spec.served_by == "frontend":  # answered here, from what the supervisor holds
            self.pending.answer(client, rid, op, self._local_ops[op](self, rt, args, body), tenant=tid)
            return
        # only what needs a worker keeps a tenant awake: a poll of its quota does not (parking)
        rt.last_request = self.clock()
        if spec.region_arg is not None:
            # the tenant's own region or refused; the worker learns its name from us only
            args = {**args, "region_name": self.regions.resolve(tid, args.get(spec.region_arg)).name}
        if spec.stored_module and body is None:
            digest = args.get("digest")
            stored = rt.modules.get(digest) if isinstance(digest, str) else None
            if stored is None or not isinstance(digest, str):
                raise UnknownModule(tid, str(digest))
            rt.modules.move_to_end(digest)
            body = stored
        if rt.state is TenantState.STOPPED:
            raise TenantStopped(tid)
        if spec.big_reply:
            queued = self.replies.queued_bytes(client)
            if queued > self.config.max_client_reply_bytes:
                raise ClientRepliesQueued(tid, in_flight, max_in_flight, queued=queued,
                                          budget=self.config.max_client_reply_bytes)
        self.dispatcher.route(rt, client, rid, op, args, body, in_flight=in_flight, max_in_flight=max_in_flight)

    def _admit(self, client: bytes, rt: TenantRuntime, size: int) -> None:
        """Charge one request of ``rt``'s to admission (supervisor.admission.rates); refused for its
        rate, its tenant is over its rate on the socket it came on (supervisor.admission.yielding)."""
        now = self.clock()
        try:
            self.guard.admission.admit(rt.tenant_id, rt.spec, size, now, in_flight=rt.in_flight + rt.waiting)
        except (AdmissionRate, RefusalUnanswered) as exc:
            if self.guard.yielding.refused(client[:1], rt.tenant_id, now):
                self._over = self._over | {rt.tenant_id}
            if client[:1] == _IPC:
                self._paced_by_rate(rt.tenant_id, exc.retry_after_s or 0.0, now)
            raise

    def _paced_by_rate(self, tenant: str, wait: float, now: float) -> None:
        """``tenant`` was refused for its rate on ``frontend.ipc`` (the socket that takes bulk frames):
        what it sends next would be refused too until its bucket has it, so the socket is not read
        for ``wait`` (at most MAX_RATE_PAUSE_S) - its messages wait in libzmq's short pipe
        (BULK_RCVHWM), the kernel and its sender, never copied to be refused - and then read one
        message a wake-up for RATE_PACED_S. Only while no tenant within its rate was served from it
        for IPC_LIGHT_S (a local client that does not know ``small.ipc`` is not delayed by another's
        flood: the socket is read as it was before ``small.ipc``)."""
        if (wait <= 0.0 or now < self._ipc_light_until or self._light_sources.get(_IPC, 0.0) > now
                or "rate" in self._unread.get(_IPC, ())):
            return
        wait = min(wait, MAX_RATE_PAUSE_S)
        self._ipc_paced_until = now + wait + RATE_PACED_S
        self.guard.yielding.rate_pauses += 1
        self._stop_reading(_IPC, "rate")
        self.loop.timers.after(wait, lambda: self._start_reading(_IPC, "rate"))

    def mark_ready(self) -> None:
        """Every configured tenant is up: ``hello`` without a capability says ready from now on."""
        self.ready = True

    def begin_drain(self, drain: DrainState) -> None:
        """A stop began: new requests but the read-only ones are refused ``Draining`` (``drain``
        says for how long), and ``hello`` without a capability says not ready."""
        self.drain = drain
        self.ready = False

    def _key_rotated(self, new_admin: RegistryAdminCapability) -> None:
        """The registry key was rotated: nothing verified before counts (the verified-capability
        cache dropped), and requests carrying the new admin capability's bytes are verified."""
        self._verified_caps.clear()
        self._monitor_raw = None
        self._admin_raw = new_admin.to_bytes()

    def _verify(self, cap_raw: bytes) -> TenantRuntime:
        # Fast path: these exact bytes were verified for this very tenant runtime
        # (an eviction replaces the runtime, so a revoked token misses here).
        rt = self._verified_caps.get(cap_raw)
        if rt is not None and self.tenants.get(rt.tenant_id) is rt:
            return rt
        tid = self.registry.verify(TenantCapability.from_bytes(cap_raw))
        rt = self.tenants.get(tid)
        if rt is None or rt.state is TenantState.EVICTING:
            raise UnknownTenant(tid)
        if len(self._verified_caps) >= _VERIFIED_CAP_CACHE:
            self._verified_caps.clear()
        self._verified_caps[cap_raw] = rt
        return rt

    def forget(self, rt: TenantRuntime) -> None:
        """An evicted tenant leaves nothing behind here: its verified tokens (which kept
        its runtime alive), stored modules and held bytes."""
        for raw in [raw for raw, cached in self._verified_caps.items() if cached is rt]:
            del self._verified_caps[raw]
        rt.modules.clear()
        if self.module_store is not None:
            self.module_store.drop(rt.tenant_id, rt.generation)
        self.guard.held.forget(rt.tenant_id)
        self.guard.admission.forget(rt.tenant_id)
        self.guard.yielding.forget(rt.tenant_id)
        self._over = self._over - {rt.tenant_id}
        self._hold_tenants = self._hold_tenants - {rt.tenant_id}
        timer = self._budget_held.pop(rt.tenant_id, None)
        if timer is not None:
            timer.cancel()
        self._set_held(self.clock())


def _check_ops(admin_ops: Mapping[str, AdminHandler], local_ops: Mapping[str, LocalOp],
               either_ops: Mapping[str, EitherOp]) -> None:
    """RuntimeError unless each handler table holds exactly the ops of its kind in the op table."""
    for kind, handlers, declared in (
        ("admin", admin_ops, {n for n, spec in proto.OPS.items() if spec.admin}),
        ("frontend", local_ops,
         {n for n, spec in proto.OPS.items() if spec.served_by == "frontend" and not spec.any_capability}),
        ("either-capability", either_ops, {n for n, spec in proto.OPS.items() if spec.any_capability}),
    ):
        if set(handlers) != declared:  # the op table and the handlers disagree: a bug, at start
            raise RuntimeError(f"{kind} ops {sorted(declared)} declared, {sorted(handlers)} served")


def _srcfd(frame: zmq.Frame) -> int:
    """The fd of the connection libzmq read ``frame`` from (``ZMQ_SRCFD``); -1 where unknown."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:  # a libzmq without ZMQ_SRCFD: no activity is known, none is dropped
        return -1


def _peer_pid(frame: zmq.Frame) -> int | None:
    """The pid the kernel recorded for the ipc connection ``frame`` came on (None: none known)."""
    try:
        return ipc_peer_pid(frame.get("Peer-Address"))
    except zmq.ZMQError:  # no such property on this libzmq
        return None


@dataclass(eq=False, slots=True)
class ClientMessage:
    """One decoded client message of a loop turn (``error``: answer it with this)."""

    client: bytes
    rid: int
    op: str
    cap_raw: bytes | None
    args: dict[str, object]
    body: zmq.Frame | None  # the request's body frame (recv_multipart(copy=False))
    error: TensorWasmError | None
    key: str | None = None  # the verified tenant ("admin"), None when unauthenticated
    size: int = 0  # header and body bytes, for the backlog's byte bound
