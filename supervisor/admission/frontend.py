"""The frontend: client requests in - decode, capability check, back-pressure, instance choice, forwarding.

A request names no worker: the supervisor picks the least-loaded ready
instance of the capability's tenant, or the instance that holds the buffer
handles it names (buffer affinity; ``alloc`` may name an instance). A handle
from an earlier incarnation of its instance is answered
:class:`~shared.errors.BufferLost` at once. When no instance is ready but one
is starting or restarting, the request is parked, bounded by
``max_in_flight`` and its deadline, and sent as soon as one is
(:meth:`Frontend.dispatch_parked`); a tenant scaled to 0 is answered
:class:`~shared.errors.TenantStopped`, and one whose instances are gone for
good :class:`~shared.errors.WorkerLost`, at once. A request that needs a worker
for a *parked* tenant (:mod:`supervisor.lifecycle.parking`) waits the same way and
wakes it (``wake_parked``); nothing is sent while its buffers move
(``TenantRuntime.park`` set).

Owns: the frontend ROUTER sockets' *receive* side (ipc, and the CURVE TCP
one when ``listen`` is set: the same decode, checks and limits for both; at
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
May touch: the pending table (every answer goes through it), the worker set
(to send), the registry (to verify capabilities), the event log (read:
``events``, which either capability may send: the capability is verified here and
its op's class reads the log for it). Admin ops are
verified here and handed to their handler, one per op (:mod:`supervisor.control.ops`,
bound to the part that serves it: ``serve_ops``). Loop thread only.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass
from collections.abc import Callable

import zmq

from shared import protocol as proto
from shared.capability import MonitorCapability, RegistryAdminCapability, TenantCapability, capability_from_bytes
from shared.checks import is_int
from shared.config import SupervisorConfig
from shared.errors import (
    BufferLost,
    ClientRepliesQueued,
    InFlightLimit,
    InvalidArgument,
    KernelTimeout,
    ProtocolError,
    TenantFailed,
    TenantIsolationViolation,
    TenantStopped,
    TensorWasmError,
    UnknownModule,
    UnknownTenant,
    WorkerLost,
)
from shared.log import get_logger
from shared.sizes import MAX_MODULE_BYTES
from shared.spec import DEADLINE_GRACE_S
from supervisor.observe.event_log import EventLog
from supervisor.lifecycle.drain import Drain
from supervisor.admission.guard import FrontendGuard
from supervisor.admission.rates import RefusalUnanswered
from supervisor.runtime.loop import Loop
from supervisor.routing.pending import PendingTable
from supervisor.routing.regions import RegionTable, ipc_peer_pid
from supervisor.store.registry import TenantRegistry
from supervisor.store.modules import ModuleStore
from supervisor.routing.replies import Replies
from supervisor.runtime.requests import Parked, Pending
from supervisor.admission.tcp_frontend import IPC_INDEX, TCP_INDEX
from supervisor.runtime.tenants import InstanceSlot, ParkPhase, ParkRecord, TenantRuntime, TenantState
from supervisor.lifecycle.workerset import WorkerSet

#: messages read from one frontend socket per wake-up: a turn's share of one tenant, so a lone
#: tenant's batch is served at once and a flood of garbage delays a verified request by one short read
READ_BATCH = 16
#: messages read per wake-up while the fair queue is full
BATCH_BACKLOGGED = 8
#: with two frontend sockets, every this many messages read from one the other is asked for input
YIELD_EVERY = 4
#: the idle TCP sessions are looked for this often (or four times per tcp_idle_timeout_s, if shorter)
IDLE_SWEEP_S = 0.5

__all__ = ["ClientMessage", "Frontend"]

_log = get_logger("supervisor")

#: the fairness key of the verified monitor capability (no tenant id has parentheses)
MONITOR_KEY = "(monitor)"
#: entries of the verified-capability cache before it is cleared
_VERIFIED_CAP_CACHE = 65536

#: plain ints: ``int & zmq.POLLIN`` goes through enum.Flag (~1 us a message)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_IPC = bytes([IPC_INDEX])
_TCP = bytes([TCP_INDEX])
#: a request's body: its frame as received, or a module put_module stored (a run by digest)
Body = zmq.Frame | bytes | None


def _ignore_reply(ok: bool, payload: object) -> None:
    """Callback of the supervisor's own fire-and-forget worker requests."""


def _ignore_wake(rt: TenantRuntime) -> None:
    """``wake_parked`` until parking is wired in (a supervisor without it never parks)."""


#: an admin op's handler, bound to the part that serves it: (client, rid, args) (supervisor.control.ops)
AdminHandler = Callable[[bytes, int, dict[str, object]], None]
#: a tenant op the frontend answers itself, bound to it (supervisor.control.ops): (tenant, args, body) -> the result
LocalOp = Callable[[TenantRuntime, dict[str, object], "Body"], object]
#: an op either capability may send, bound to the frontend (supervisor.control.ops): (the tenant the
#: capability names, None for the admin's; args) -> the result
EitherOp = Callable[["TenantRuntime | None", dict[str, object]], object]
#: told of every refused capability: (the capability bytes or None, the op) - the denied-event audit
DenialHook = Callable[["bytes | None", str], None]


class Frontend:
    """Client requests to workers (see the module docstring)."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        loop: Loop,
        sock: zmq.Socket[bytes],
        tcp_sock: zmq.Socket[bytes] | None = None,
        replies: Replies,
        pending: PendingTable,
        workers: WorkerSet,
        registry: TenantRegistry,
        tenants: Mapping[str, TenantRuntime],
        guard: FrontendGuard,
        admin_cap: bytes,
        on_denied: DenialHook | None = None,
        regions: RegionTable,
        event_log: EventLog,
        module_store: ModuleStore | None = None,
    ) -> None:
        self.config = config
        #: the stored modules on disk (put_module), with a state directory
        self.module_store = module_store
        self.clock = loop.clock
        self.loop = loop
        self.sock = sock
        self.replies = replies
        self.pending = pending
        self.workers = workers
        self.registry = registry
        self.tenants = tenants
        #: the admin ops' handlers, by name (serve_ops, at set-up)
        self._admin_ops: Mapping[str, AdminHandler] = {}
        self.guard = guard
        self._admin_raw = admin_cap
        #: the monitor capability's bytes, once verified (forget_verified drops them)
        self._monitor_raw: bytes | None = None
        self.on_denied = on_denied
        self.regions = regions
        self.event_log = event_log
        #: raw capability bytes -> the tenant runtime they were verified for
        self._verified_caps: dict[bytes, TenantRuntime] = {}
        #: the tenant ops this part answers itself, by name (serve_ops, at set-up)
        self._local_ops: Mapping[str, LocalOp] = {}
        #: the ops either capability may send, by name (serve_ops, at set-up)
        self._either_ops: Mapping[str, EitherOp] = {}
        #: the supervisor is ready (every configured tenant up): ``hello`` without a capability says so
        self.ready = False
        #: the supervisor's drain once a stop began (supervisor.lifecycle.drain): new requests but the
        #: read-only ones are refused ``Draining`` while what is in flight finishes
        self.drain: Drain | None = None
        #: a request that needs a worker came for a parked tenant (supervisor.lifecycle.parking, set at set-up)
        self.wake_parked: Callable[[TenantRuntime], None] = _ignore_wake
        #: each frontend socket's neighbour (ipc <-> tcp): what a read of one looks at (see _on_readable)
        self._other: dict[bytes, tuple[zmq.Socket[bytes], bytes]] = {}
        loop.register(sock, lambda: self._on_readable(sock, _IPC))
        #: the TCP socket and its read handler (unregistered while paced: supervisor.admission.pacing)
        self._tcp: tuple[zmq.Socket[bytes], Callable[[], None]] | None = None
        #: the TCP socket is not read now (a pause of the pacer)
        self.tcp_paused = False
        if tcp_sock is not None:
            self._other = {_IPC: (tcp_sock, _TCP), _TCP: (sock, _IPC)}
            self._tcp = (tcp_sock, lambda: self._on_readable(tcp_sock, _TCP))
            loop.register(tcp_sock, self._tcp[1])
        #: the TCP connections' activity (supervisor.admission.peers: the idle rule and the eviction)
        self._sessions = guard.connections if tcp_sock is not None else None
        if self._sessions is not None:
            self._sessions.busy = self._tcp_clients_busy
            self._sweep_s = min(IDLE_SWEEP_S, config.tcp_idle_timeout_s / 4)
            loop.timers.after(self._sweep_s, self._sweep_idle_tcp)

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
        if self.tcp_paused and prefix == _TCP:  # (polled before the pause began, this turn)
            return
        recv, events = sock.recv_multipart, sock.getsockopt
        other = self._other.get(prefix) if follow and not self.tcp_paused else None
        other_events = other[0].getsockopt if other is not None else None
        fair, admission = self.guard.fair, self.guard.admission
        now = self.clock()
        batch: list[ClientMessage] = []
        yielded = False
        dropped = 0
        for i in range(1, fair.read_budget(READ_BATCH, BATCH_BACKLOGGED) + 1):
            try:
                frames = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if prefix == _TCP and self._sessions is not None and not self._tcp_seen(frames[0], now):
                msg = None  # its session was dropped: never served, never executed
            else:
                msg = self.decode(frames, prefix)
            if msg is not None and (msg.key is not None or admission.admit_unauthenticated(msg.client, now)):
                batch.append(msg)
            else:
                dropped += 1
            if not int(events(_EVENTS)) & _POLLIN:
                break
            if other_events is not None and not i % YIELD_EVERY and int(other_events(_EVENTS)) & _POLLIN:
                yielded = True
                break
        if dropped:
            self.dropped_unanswered(prefix, dropped)
        if batch:
            self._take(batch)
        if yielded and other is not None:
            self._on_readable(other[0], other[1], follow=False)

    def _tcp_seen(self, frame: zmq.Frame, now: float) -> bool:
        """A request came on the TCP socket: note its connection's activity (by the fd libzmq read
        it from). False: its session was dropped by the supervisor, and it must not be served."""
        sessions = self._sessions
        assert sessions is not None
        try:
            fd = int(frame.get(zmq.SRCFD))
        except zmq.ZMQError:  # a libzmq without ZMQ_SRCFD: no activity is known, none is dropped
            return True
        client = _TCP + frame.bytes
        seen = sessions.gate.seen(fd, client, now)
        if seen != "ok":  # an ACCEPTED still in the monitor's queue may explain it
            sessions.settle()
            seen = sessions.gate.seen(fd, client, now)
        return seen != "dropped"

    def _tcp_clients_busy(self) -> set[bytes]:
        """The TCP clients with a request in flight (at a worker, or parked): their sessions are
        neither idle nor evicted. (One read and waiting for its turn was active a moment ago.)"""
        busy = {p.client for w in self.workers.workers.values() for p in w.in_flight.values()
                if p.client is not None and p.client[:1] == _TCP}
        busy.update(p.client for rt in self.tenants.values() if rt.waiting for p in rt.parked if p.client[:1] == _TCP)
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
        self.tcp_paused = True
        self.loop.unregister(self._tcp[0])
        pacer.paused(pause)
        self.loop.timers.after(pause, self._resume_tcp)

    def _resume_tcp(self) -> None:
        """The end of a pause: read the TCP socket again (unless it was closed meanwhile)."""
        self.tcp_paused = False
        if self._tcp is not None and not self._tcp[0].closed:
            self.loop.register(*self._tcp)

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
                and all(m.key == first for m in batch)):
            clock = time.perf_counter
            end = clock() + fair.quantum_s
            for i, msg in enumerate(batch):
                self.serve(msg)
                if clock() >= end:
                    for rest in batch[i + 1:]:
                        add(True, first, rest)
                    break
            return
        dropped = 0
        for msg in batch:
            key = msg.key
            dropped += not add(key is not None, key if key is not None else msg.client, msg)
        if dropped:  # a batch is one socket's (_on_readable)
            self.dropped_unanswered(batch[0].client[:1], dropped)

    def end_turn(self) -> None:
        """End of a loop turn: serve one bounded turn of what was read (supervisor.admission.fairness)."""
        if self.guard.fair.backlog:
            self.guard.fair.run_turn(self.serve, time.perf_counter)

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
            pid = _peer_pid(frames[1]) if prefix == _IPC else None
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

    def serve_ops(self, admin_ops: Mapping[str, AdminHandler], local_ops: Mapping[str, LocalOp],
                  either_ops: Mapping[str, EitherOp]) -> None:
        """The handlers of the ops the supervisor serves itself, by name (``supervisor.control.ops``):
        every admin op's, bound to its part; every tenant op's this part answers from what it holds;
        every op's either capability may send. Once, at set-up, once those parts exist; each table
        must match the op table."""
        for kind, handlers, declared in (
            ("admin", admin_ops, {n for n, spec in proto.OPS.items() if spec.admin}),
            ("frontend", local_ops,
             {n for n, spec in proto.OPS.items() if spec.served_by == "frontend" and not spec.any_capability}),
            ("either-capability", either_ops, {n for n, spec in proto.OPS.items() if spec.any_capability}),
        ):
            if set(handlers) != declared:  # the op table and the handlers disagree: a bug, at start
                raise RuntimeError(f"{kind} ops {sorted(declared)} declared, {sorted(handlers)} served")
        self._admin_ops, self._local_ops, self._either_ops = admin_ops, local_ops, either_ops

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
                self.guard.errors.sent(client, self.replies.error_tracked(client, rid, err))
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
        if not self.guard.errors.allow(client):
            return
        self.guard.errors.sent(client, self.replies.ok_tracked(
            client, rid, {"protocol": proto.PROTOCOL_VERSION, "ready": self.ready}))

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
            self.guard.admission.admit(rt.tenant_id, rt.spec, size, self.clock(),
                                       in_flight=rt.in_flight + rt.waiting)
        proto.check_args(op, args)
        result = self._either_ops[op](rt, args)
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
        self.guard.admission.admit(tid, rt.spec, size, self.clock(), in_flight=rt.in_flight + rt.waiting)
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
            self.pending.answer(client, rid, op, self._local_ops[op](rt, args, body), tenant=tid)
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
        if spec.merge is not None:
            if spec.lists_buffers and rt.park is not None and rt.park.phase is not ParkPhase.EXPORTING:
                self.pending.answer(client, rid, op, parked_buffers(rt.park), tenant=tid)  # no activation
                return
            self._fan_out(rt, client, rid, op, spec.merge)
            return
        pinned = pinned_instance(rt, op, args)
        if pinned is not None:
            lost = lost_buffer(rt, op, args)
            if lost is not None:
                raise lost
        # a parked tenant: the request waits (below) while parking activates the tenant
        slot = slot_for(rt, pinned) if rt.park is None else None
        now = self.clock()
        if rt.park is not None:
            self.wake_parked(rt)
            slot = slot_for(rt, pinned) if rt.park is None else None  # a park cancelled: serve at once
        if slot is None and rt.park is None:
            if not (rt.coming_up() if pinned is None else rt.slots[pinned].coming_up):
                raise _nothing_coming_up(rt, pinned)
        # What the supervisor will hold for this request, reserved before it holds it
        # (supervisor.routing.budgets): a read's reply, and a parked request's body.
        held = self.guard.held
        reply = spec.reply_body_bytes(args, self.config.max_message_bytes)
        held.reserve(tid, "replies", reply, in_flight=in_flight, max_in_flight=max_in_flight)
        try:
            if slot is None:
                # no ready instance, but one is starting or restarting: wait for it, bounded
                size = len(body) if body is not None else 0
                held.reserve(tid, "parked", size, in_flight=in_flight, max_in_flight=max_in_flight)
                rt.parked.append(Parked(client, rid, op, args, body, now,
                                        now + spec.deadline_s(rt.spec, args.get("timeout_s")), pinned,
                                        held_reply=reply, held_body=size))
                return
            self._forward(rt, slot, client, rid, op, args, body, now, held=reply)
        except BaseException:
            held.release(tid, "replies", reply)
            raise

    def set_admin_capability(self, raw: bytes) -> None:
        """The admin capability's bytes changed (key rotation): requests carrying them are verified."""
        self._admin_raw = raw

    def forget_verified(self) -> None:
        """Drop the verified-capability cache (the registry key was rotated: nothing verified before counts)."""
        self._verified_caps.clear()
        self._monitor_raw = None

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

    def _fan_out(self, rt: TenantRuntime, client: bytes, rid: int, op: str,
                 merge: Callable[[list[Mapping[str, object]]], object]) -> None:
        """An op sent to every ready instance of the tenant (``OpSpec.merge``): the first error, or
        every instance's reply merged into one."""
        slots = rt.live_slots()
        if not slots:
            raise WorkerLost(rt.tenant_id, 0, reason=f"no ready instance to send {op} to")
        now = self.clock()
        deadline = now + rt.spec.request_timeout_s
        remaining = {slot.index for slot in slots}
        parts: list[Mapping[str, object]] = []  # each instance's reply
        errors: list[object] = []
        request = Pending(client, rid, op, rt.tenant_id, 0, now, deadline)

        def collect(index: int) -> Callable[[bool, object], None]:
            def done(ok: bool, payload: object) -> None:
                if index not in remaining:
                    return
                remaining.discard(index)
                if ok and isinstance(payload, dict):
                    parts.append(payload)
                else:
                    errors.append(payload)
                if remaining:
                    return
                if errors:
                    self.pending.finish(request, False, errors[0])
                else:
                    self.pending.finish(request, True, merge(parts))

            return done

        for slot in slots:
            assert slot.worker is not None
            done = collect(slot.index)
            part = Pending(None, 0, op, rt.tenant_id, slot.index, now, deadline, done)
            try:
                self.workers.send_request(slot.worker, op, {}, None, part)
            except TensorWasmError as exc:
                done(False, exc.to_dict())

    # ------------------------------------------------------------ regions

    def unmap_region(self, rt: TenantRuntime, name: str) -> None:
        """Tell the tenant's live workers to unpin and unmap a released region (best effort:
        a worker that misses it unmaps at exit, and the name is unlinked already)."""
        now = self.clock()
        for slot in rt.live_slots():
            assert slot.worker is not None
            part = Pending(None, 0, "region_drop", rt.tenant_id, slot.index, now,
                           now + rt.spec.request_timeout_s, _ignore_reply)
            try:
                self.workers.send_request(slot.worker, "region_drop", {"name": name}, None, part)
            except TensorWasmError:
                pass  # dying or flooded: its mapping ends with it

    def reap_regions(self) -> None:
        """Housekeeping: reclaim the regions whose client process died."""
        for owned in self.regions.reap():
            rt = self.tenants.get(owned.tenant_id)
            if rt is not None:
                self.unmap_region(rt, owned.name)

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

    def _forward(
        self,
        rt: TenantRuntime,
        slot: InstanceSlot,
        client: bytes,
        rid: int,
        op: str,
        args: dict[str, object],
        body: Body,
        now: float,
        *,
        started: float | None = None,
        deadline: float | None = None,
        held: int = 0,
    ) -> None:
        """Send to the slot's worker. A request that waited (parked) keeps its
        original start and deadline; a run is shortened to fit what is left.
        ``held``: reply bytes reserved for it, handed to its Pending (raises: not taken)."""
        worker = slot.worker
        assert worker is not None
        spec = proto.OPS[op]
        if spec.guest_run:
            args = with_wasm_limits(rt, args, None if deadline is None else deadline - now - DEADLINE_GRACE_S)
        own = now + spec.deadline_s(rt.spec, args.get("timeout_s"))
        deadline = own if deadline is None else min(own, deadline)
        pending = Pending(client, rid, op, rt.tenant_id, slot.index, started if started is not None else now, deadline,
                          held=held)
        self.workers.send_request(worker, op, args, body, pending)

    # ------------------------------------------------------------ parked requests

    def dispatch_parked(self, rt: TenantRuntime) -> None:
        """An instance became ready: send what waited for one (not while the tenant's buffers are
        moving: parking sends them once it is active, supervisor.lifecycle.parking)."""
        if rt.park is not None:
            return
        now = self.clock()
        keep: list[Parked] = []
        while rt.waiting:
            p = rt.parked.popleft()
            slot = slot_for(rt, p.instance)
            if slot is None:
                keep.append(p)
                continue
            lost = lost_buffer(rt, p.op, p.args) if p.instance is not None else None
            if lost is not None:  # its instance restarted while it waited: the buffer went with it
                self.pending.refuse_parked(rt.tenant_id, p, lost)
                continue
            # the body leaves the parked budget: it goes to the worker now
            self.guard.held.release(rt.tenant_id, "parked", p.held_body)
            p.held_body = 0
            try:
                self._forward(rt, slot, p.client, p.rid, p.op, p.args, p.body, now,
                              started=p.started, deadline=p.deadline, held=p.held_reply)
            except TensorWasmError as exc:
                self.pending.refuse_parked(rt.tenant_id, p, exc)
        if keep:
            rt.parked.extend(keep)

    def expire_parked(self, now: float) -> None:
        """Parked requests whose deadline passed get :class:`KernelTimeout` (every tick: nothing to do costs one look per tenant)."""
        for rt in self.tenants.values():
            while rt.waiting and rt.parked[0].deadline <= now:  # waiting: no queue made for a look
                p = rt.parked.popleft()
                waited = p.deadline - p.started
                self.pending.refuse_parked(rt.tenant_id, p, KernelTimeout(
                    waited, p.op, message=f"no instance of {rt.tenant_id!r} became ready within {waited:g} s"))

    def refuse_all_parked(self, rt: TenantRuntime, exc_of: Callable[[Parked], TensorWasmError | None]) -> None:
        """Answer the parked requests for which ``exc_of`` gives an error; keep the others."""
        keep = []
        while rt.waiting:
            p = rt.parked.popleft()
            exc = exc_of(p)
            if exc is None:
                keep.append(p)
            else:
                self.pending.refuse_parked(rt.tenant_id, p, exc)
        if keep:
            rt.parked.extend(keep)


# ------------------------------------------------------------ instance choice (pure policy)


def _peer_pid(frame: zmq.Frame) -> int | None:
    """The pid the kernel recorded for the ipc connection ``frame`` came on (None: none known)."""
    try:
        return ipc_peer_pid(frame.get("Peer-Address"))
    except zmq.ZMQError:  # no such property on this libzmq
        return None


def request_handles(op: str, args: dict[str, object]) -> list[int]:
    """The buffer handles a request names (``OpSpec.handles``: ``handle``, or the ``{handle}`` items of its list)."""
    return proto.OPS[op].handles(args)


def pinned_instance(rt: TenantRuntime, op: str, args: dict[str, object]) -> int | None:
    """The instance a request must go to: the one holding the buffers it names, or the one its
    ``instance_arg`` names (``alloc``'s ``instance``).

    InvalidArgument when its buffers live on different instances (naming them),
    or when the instance is not one the tenant runs.
    """
    spec = proto.OPS[op]
    if not spec.pins:
        return None  # the hot path (ping, quota-free ops): nothing to look at
    if spec.instance_arg is not None:
        pinned = args.get(spec.instance_arg)
        if pinned is not None and (not is_int(pinned) or pinned < 0):
            raise InvalidArgument(f"{op}: {spec.instance_arg} must be a non-negative int")
        what = f"{op} names"
    else:
        handles = spec.handles(args)
        where: dict[int, list[str]] = {}
        for h in handles:
            where.setdefault(proto.handle_instance(h), []).append(proto.format_handle(h))
        if len(where) > 1:
            held = "; ".join(f"{', '.join(names)} on {rt.tenant_id}/{i}" for i, names in sorted(where.items()))
            raise InvalidArgument(
                f"{op}: its buffers live on different instances ({held}); a run sees the buffers of one instance: "
                f"allocate them on one (twt alloc {rt.tenant_id} SIZE --instance N, or alloc(cap, n, instance=N))"
            )
        pinned = next(iter(where), None)
        what = "buffer handle names"
    if pinned is not None and (pinned >= len(rt.slots) or rt.slots[pinned].draining):
        running = ", ".join(str(s.index) for s in rt.wanted_slots()) or "none"
        raise InvalidArgument(f"{what} instance {pinned}, which {rt.tenant_id!r} does not run "
                              f"(its instances: {running})")
    return pinned


def lost_buffer(rt: TenantRuntime, op: str, args: dict[str, object]) -> BufferLost | None:
    """:class:`BufferLost` for the first handle whose instance restarted since (or died with it), else None.

    A handle is alive while its slot's worker is the incarnation that made it;
    a slot with no worker lost it (a restart is pending), one with a newer
    incarnation restarted.
    """
    for h in request_handles(op, args):
        index = proto.handle_instance(h)
        if index >= len(rt.slots):
            continue  # refused by pinned_instance
        slot = rt.slots[index]
        gone = slot.worker is None and rt.park is None  # a parked slot's buffers wait in the supervisor
        if gone or slot.incarnation & 0xFFFF != proto.handle_incarnation(h):
            return BufferLost(rt.tenant_id, proto.format_handle(h), index, slot.incarnation)
    return None


def parked_buffers(park: ParkRecord) -> dict[str, object]:
    """The answer of an op that lists buffers (``OpSpec.lists_buffers``) for a parked tenant, from
    its host copies (it is not activated for it)."""
    listed = sorted((b.handle, len(b.data)) for bufs in park.buffers.values() for b in bufs)
    return {"buffers": listed, "bytes": sum(n for _, n in listed)}


def expected_reply_bytes(op: str, args: dict[str, object], limit: int) -> int:
    """The reply body a request will bring back (``OpSpec.reply_body_bytes``: a ``read``'s ``nbytes``, at most ``limit``)."""
    return proto.OPS[op].reply_body_bytes(args, limit)


def _nothing_coming_up(rt: TenantRuntime, pinned: int | None) -> TensorWasmError:
    """The answer when no instance (or not the pinned one) is ready or coming (so waiting is useless)."""
    wanted = rt.wanted_slots()
    if not wanted:
        return TenantStopped(rt.tenant_id)
    gone = rt.slots[pinned] if pinned is not None else max(wanted, key=lambda s: s.last_exit.at if s.last_exit else 0.0)
    last = gone.last_exit
    who = f"instance {gone.index} of {rt.tenant_id!r} is not" if pinned is not None else f"no instance of {rt.tenant_id!r} is"
    reason = (f"{who} running or restarting (restart={rt.spec.restart.value}; "
              f"last exit of {rt.tenant_id}/{gone.index}: {last.reason if last else 'unknown'})")
    again = (f"`twt restart {rt.tenant_id}` runs it again" if rt.state is TenantState.COMPLETED
             else f"`twt scale {rt.tenant_id} N` starts instances again")
    return WorkerLost(rt.tenant_id, gone.index, last.exit_code if last else None, last.signal if last else None, reason,
                      message=f"{reason}; {again}")


def slot_for(rt: TenantRuntime, pinned: int | None) -> InstanceSlot | None:
    """The ready instance to send to (least loaded, or the pinned one), None when none is ready."""
    if pinned is None:
        return rt.pick_slot()
    if pinned < len(rt.slots) and rt.slots[pinned].ready:
        return rt.slots[pinned]
    return None


def with_wasm_limits(rt: TenantRuntime, args: dict[str, object], left_s: float | None = None) -> dict[str, object]:
    """A run's fuel and time: defaults from the spec, and never above it (nor above ``left_s``,
    what a parked request has left of its deadline, if given)."""
    spec = rt.spec
    fuel = args.get("fuel")
    out = dict(args)
    out["fuel"] = (
        min(fuel, spec.wasm_fuel)
        if is_int(fuel) and fuel > 0
        else spec.wasm_fuel
    )
    timeout_s = spec.wasm_run_s(args.get("timeout_s"))
    out["timeout_s"] = timeout_s if left_s is None or left_s >= timeout_s else max(0.001, left_s)
    return out




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
