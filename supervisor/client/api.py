"""SupervisorClient: typed calls to a running supervisor, found by its run directory.

    with SupervisorClient("/tmp/twt-1000") as c:
        acme = c.register(c.admin, TenantSpec("acme").with_gpu_memory_bytes_cap("1GiB"))
        h = c.alloc(acme, 1 << 20)
        c.write(acme, h, b"\\0" * 1024)

Remote errors are raised as the same classes with the same fields
(``GpuMemoryExhausted.requested`` ...). Every call has a timeout
(:class:`RequestTimeout`); a missing supervisor is
:class:`SupervisorUnavailable`. One client is one DEALER socket: use one
client per thread (calls on one client from several threads are serialised).
For pipelining, :meth:`send` and :meth:`recv` expose the raw request/reply.
Every op goes through one typed call, :meth:`invoke` (``client.invoke(cap,
Echo.Args(text="hi")) -> Echo.Reply``; a body frame where the op's definition
takes one): each named method builds its op's arguments, invokes, and returns
the reply or a part of it, so an op without a named method (``echo``) is sent
the same way.

Remote supervisors (their ``listen`` TCP frontend, CURVE-encrypted) are
reached with :meth:`SupervisorClient.remote`; the methods are the same. A
wrong server key or a plaintext peer raises :class:`HandshakeFailed`, an
endpoint that never answers :class:`SupervisorUnavailable` within the
timeout, and a connection lost while a reply is awaited
:class:`SupervisorUnavailable` at once (a socket monitor watches the link).

Idle remote links. The supervisor closes a TCP session that carried no request
for its ``tcp_idle_timeout_s`` (60 s by default), and a request that reaches a
session as it closes is never executed - but it is lost, and the client cannot
tell that from a request lost to a crash, so it never sends one twice. The rule
is to reconnect *before* sending instead: a remote client whose link has carried
nothing for ``idle_reconnect_s`` (30 s: half the server's default timeout; keep
it at most half the server's) with no reply outstanding closes its socket and
opens a new one (a new CURVE handshake) before the request. The new session is
fresh on the server's side, so the request cannot meet an idle drop; nothing is
re-sent, nothing is lost. A session dropped earlier than that (a server with a
shorter timeout, or one evicted for a new client at ``max_tcp_peers``) is
reconnected by libzmq by itself; only a request sent in the instant of such a
drop can be lost, and it is reported (:class:`SupervisorUnavailable`), never
retried.
Local sockets: requests go to the supervisor's ``small.ipc`` (frames of at most
``small_frame_bytes``, from ``supervisor.json``), and one with a bigger frame (a
module, a ``write`` body in frames) to ``frontend.ipc`` on a second DEALER made at
its first use; :meth:`recv` reads either (docs/PROTOCOL.md "The two local sockets").
A supervisor without ``small.ipc`` gets every request on ``frontend.ipc``.
Bulk bytes: :meth:`write`, :meth:`read`, :meth:`read_into`, :meth:`put_array`
and :meth:`get_array` move payloads from ``bulk_threshold`` (256 KiB) on
through a shared-memory region bound to the tenant (``supervisor.client.bulk``),
and smaller ones, or all of them with ``regions=False``, in frames.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Generator, Mapping, Sequence
import dataclasses
import enum
from typing import TYPE_CHECKING, Final, TypeVar, cast

import zmq

from shared import protocol as proto
from shared.capability import MonitorCapability, RegistryAdminCapability, TenantCapability, capability_from_bytes
from shared.checks import is_int
from shared.errors import (
    HandshakeFailed,
    InvalidArgument,
    ProtocolError,
    RequestTimeout,
    SupervisorUnavailable,
    TensorWasmError,
    error_from_dict,
)
from shared.quota import QuotaSnapshot
from shared.records import (
    STATUS_PAGE_MAX,
    AliveInfo,
    EvictResult,
    FaultResult,
    HelloInfo,
    PingInfo,
    RegionGrant,
    ReloadResult,
    RunResult,
    StatusRecord,
    TenantRecord,
)
from shared.spec import TenantSpec
from shared.zmq_monitor import recv_monitor_event
from shared.curve_keys import CurveKeyPair, load_client_keys, parse_public_key
from supervisor.client.bulk import DEFAULT_REGION_BYTES, DEFAULT_THRESHOLD, BulkPath, byte_view
from supervisor.client.event_follow import follow
from shared.rundir import read_admin_capability, read_ready, verify_run_dir

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from typing_extensions import Buffer

__all__ = ["SupervisorClient"]

class _Unchanged(enum.Enum):
    """The default of a set_quota limit that is not given (``None`` means "no limit")."""

    TOKEN = 0


_UNCHANGED: Final = _Unchanged.TOKEN
Capability = TenantCapability | RegistryAdminCapability | MonitorCapability
T = TypeVar("T")
R = TypeVar("R", bound=proto.FromWire)


def _given(value: T | _Unchanged) -> T | proto.Absent:
    """A set_quota limit as its typed argument: one not given is left out of the request."""
    return proto.ABSENT if isinstance(value, _Unchanged) else value


#: a remote client reconnects before a request once its link has carried nothing this long: half
#: the supervisor's default tcp_idle_timeout_s (see the module docstring)
DEFAULT_IDLE_RECONNECT_S = 30.0
#: ZMTP heartbeats of a remote client: a silent server is dropped after the timeout
_HEARTBEAT_IVL_MS = 2_000
_HEARTBEAT_TIMEOUT_MS = 6_000
_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the server could not decrypt our hello (wrong server public key?), "
    "or closed the connection during the handshake (its connection limits: max_tcp_peers_per_source for "
    "this address, max_tcp_peers, its fd budget)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol mismatch (the peer does not speak CURVE: a plaintext endpoint?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused the handshake (our client key is not in its client_keys_dir "
    "allow-list, or it serves max_tcp_peers peers already)",
}


def _cap_bytes(cap: Capability | bytes | None) -> bytes | None:
    if cap is None or isinstance(cap, bytes):
        return cap
    return cap.to_bytes()


def _tenant_of(cap: Capability | bytes | None) -> str | None:
    """The tenant a capability names; None for the admin's, none at all, or bytes that are no capability."""
    if isinstance(cap, bytes):
        try:
            cap = capability_from_bytes(cap)
        except TensorWasmError:
            return None  # the supervisor answers it (there is no tenant to wait for)
    return cap.tenant_id if isinstance(cap, TenantCapability) else None


class SupervisorClient:
    """A connection to the supervisor whose run directory is ``run_dir``."""

    def __init__(self, run_dir: str, *, timeout_s: float = 30.0, check: bool = True, regions: bool = True,
                 bulk_threshold: int = DEFAULT_THRESHOLD, region_bytes: int = DEFAULT_REGION_BYTES,
                 expected_uid: int | None = None) -> None:
        """``regions``: move payloads of ``bulk_threshold`` bytes and more through shared-memory
        regions (this client runs on the supervisor's host: it connects over ``ipc://``);
        ``region_bytes`` bounds the staging region per tenant (charged to its host quota).
        ``expected_uid``: who must own the run dir, its sockets and files (default: this
        process's uid); anything else is refused with :class:`UntrustedRunDir` before a
        byte is sent."""
        self.run_dir = os.path.abspath(run_dir)
        self.timeout_s = timeout_s
        self._expected_uid = os.getuid() if expected_uid is None else expected_uid
        info = read_ready(self.run_dir, self._expected_uid)
        if check:
            if info is None:
                raise SupervisorUnavailable(self.run_dir, "no supervisor.json (not running, or not ready yet)")
            pid = info.get("pid")
            import psutil  # here: ~18 ms of import that only this check needs (every twt command pays it)

            if not isinstance(pid, int) or not psutil.pid_exists(pid):
                raise SupervisorUnavailable(self.run_dir, f"supervisor pid {pid} is not running (stale run dir)")
        self.info = info or {}
        self.connect_timeout_s = timeout_s
        verify_run_dir(self.run_dir, self._expected_uid)  # again: the sockets exist now
        frontend = "ipc://" + os.path.join(self.run_dir, "frontend.ipc")
        limit = self.info.get("small_frame_bytes")
        if "small_frontend" in self.info and is_int(limit) and limit > 0:
            # requests go to small.ipc; one with a frame above its limit to frontend.ipc (docs/PROTOCOL.md)
            self._open("ipc://" + os.path.join(self.run_dir, "small.ipc"), None, None)
            self._big_endpoint: str | None = frontend
            self._small_limit: int | None = limit
        else:  # a supervisor without small.ipc: every request on frontend.ipc
            self._open(frontend, None, None)
        self._bulk = BulkPath(self, enabled=regions, threshold=bulk_threshold, region_bytes=region_bytes)

    def _open(self, endpoint: str, keys: CurveKeyPair | None, server_key: bytes | None,
              idle_reconnect_s: float | None = None) -> None:
        self.endpoint = endpoint
        if not hasattr(self, "_small_limit"):
            #: local: frontend.ipc, where requests with a frame above ``_small_limit`` go when
            #: :attr:`endpoint` is small.ipc (None: every request goes to :attr:`endpoint`)
            self._big_endpoint = None
            self._small_limit = None
        #: the DEALER on ``_big_endpoint``, connected at its first request; its poller with ours
        self._big: zmq.Socket[bytes] | None = None
        self._both: zmq.Poller | None = None
        #: rids sent by ``_big_endpoint`` whose reply has not been read nor given up on
        self._big_pending: set[int] = set()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._keys, self._server_key = keys, server_key
        self.idle_reconnect_s = idle_reconnect_s
        #: remote: fresh connections made before a request because the link had been idle
        self.reconnects = 0
        #: remote: requests sent whose reply has not been read (rid -> None); a link with one is not idle
        self._outstanding: dict[int, None] = {}
        self._connect_socket()
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        #: tenant -> (until, the refusal): the supervisor refused a request of it for its rate and said when
        #: to come back (``retry_after_s``); until then its requests are refused here, unsent (see send)
        self._rate_wait: dict[str, tuple[float, dict[str, object]]] = {}
        self._admin: RegistryAdminCapability | None = None
        #: the read-only monitor capability (a remote client given one instead of the admin's)
        self._monitor_cap: MonitorCapability | None = None
        self._closed = False

    def _connect_socket(self) -> None:
        """A new DEALER (and, remote, its CURVE keys and link monitor), connected to :attr:`endpoint`."""
        keys, server_key = self._keys, self._server_key
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._monitor: zmq.Socket[bytes] | None = None
        self._link_up = False  # remote: a CURVE handshake succeeded and the link has not dropped since
        self._link_drops = 0  # remote: links lost so far (a request sent before a drop is lost)
        self._down_since = time.monotonic()  # remote: when the link was last seen down
        #: remote: the last call failed before any connection took its request (it reached no supervisor)
        self.last_request_unsent = False
        if keys is not None and server_key is not None:
            self._sock.curve_serverkey = server_key
            self._sock.curve_publickey = keys.public
            self._sock.curve_secretkey = keys.secret
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(self.endpoint)
        #: remote: when the link last carried a request or a reply (a fresh socket counts as one)
        self._last_io = time.monotonic()

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
        self._sock.close(0)
        if self._big is not None:
            self._big.close(0)
            self._big = self._both = None

    def _big_socket(self) -> zmq.Socket[bytes]:
        """The DEALER for requests with a frame above small.ipc's limit (frontend.ipc), made once."""
        if self._big is None:
            assert self._big_endpoint is not None
            big = self._ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.setsockopt(zmq.RCVHWM, 10_000)
            big.setsockopt(zmq.SNDHWM, 10_000)
            big.connect(self._big_endpoint)
            self._both = zmq.Poller()
            self._both.register(self._sock, zmq.POLLIN)
            self._both.register(big, zmq.POLLIN)
            self._big = big
        return self._big

    def _fresh_link_if_idle(self) -> None:
        """Remote, before a request: a link idle for ``idle_reconnect_s`` with no reply outstanding is
        replaced by a new connection, so the request never meets the server's idle drop (see the
        module docstring)."""
        idle = self.idle_reconnect_s
        if idle is None or self._outstanding or time.monotonic() - self._last_io < idle:
            return
        self._close_socket()
        self._connect_socket()
        self.reconnects += 1

    @classmethod
    def remote(
        cls,
        endpoint: str,
        server_public_key: str | bytes,
        client_keys: str | os.PathLike[str] | CurveKeyPair | tuple[bytes | str, bytes | str] | None = None,
        timeout_s: float = 30.0,
        *,
        admin: RegistryAdminCapability | MonitorCapability | bytes | None = None,
        connect_timeout_s: float | None = None,
        idle_reconnect_s: float | None = DEFAULT_IDLE_RECONNECT_S,
    ) -> SupervisorClient:
        """A client of the supervisor listening on ``endpoint`` (``tcp://HOST:PORT``), over CURVE.

        ``server_public_key`` is the Z85 text from the supervisor's ``twt keys``
        (or ``supervisor.json``); ``client_keys`` a certificate file with our
        key pair (needed when the supervisor has an allow-list), or None for a
        fresh pair. ``admin`` is the admin capability for admin ops, which the
        supervisor accepts over TCP only with ``allow_remote_admin = true``, or the
        monitor capability (``twt capability --role monitor``) for the read-only ones
        (status, events, version), accepted without it.
        ``connect_timeout_s`` (default ``timeout_s``) bounds the wait for a
        first connection before :class:`SupervisorUnavailable`.
        ``idle_reconnect_s``: a link idle this long is replaced by a new one before the next
        request (at most half the server's ``tcp_idle_timeout_s``; None: never).
        """
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise InvalidArgument(f"remote endpoint must be tcp://HOST:PORT; got {endpoint!r}")
        try:
            server_key = parse_public_key(server_public_key)
            keys = load_client_keys(client_keys)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self = cls.__new__(cls)
        self.run_dir = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.info = {"frontend": endpoint, "server_public_key": server_key.decode("ascii")}
        if idle_reconnect_s is not None and (not isinstance(idle_reconnect_s, (int, float))
                                             or isinstance(idle_reconnect_s, bool) or not idle_reconnect_s > 0):
            raise InvalidArgument(f"idle_reconnect_s must be a positive number of seconds or None; "
                                  f"got {idle_reconnect_s!r}")
        self._open(endpoint, keys, server_key, idle_reconnect_s)
        # a remote peer cannot map this host's shared memory: bulk bytes always travel in frames
        self._bulk = BulkPath(self, enabled=False, threshold=DEFAULT_THRESHOLD, region_bytes=DEFAULT_REGION_BYTES)
        if admin is not None:
            cap = admin if not isinstance(admin, bytes) else capability_from_bytes(admin)
            if isinstance(cap, MonitorCapability):
                self._monitor_cap = cap
            else:
                self._admin = RegistryAdminCapability.from_bytes(cap.to_bytes())
        return self

    @property
    def is_remote(self) -> bool:
        return self._monitor is not None

    @property
    def link_drops(self) -> int:
        """Remote: how often this socket's established link dropped so far (0 for a local client)."""
        if self._monitor is not None:
            self._watch_link()
        return self._link_drops

    # ----------------------------------------------------------- plumbing

    @property
    def admin(self) -> RegistryAdminCapability:
        """The admin capability from ``<run_dir>/admin/admin.cap`` (read once)."""
        if self._admin is None:
            if self._monitor_cap is not None:
                raise InvalidArgument(
                    f"this client holds the monitor capability ({self.endpoint}): it grants the read-only ops "
                    "only (status, events, version); this one needs the admin capability")
            if self.is_remote:
                raise InvalidArgument(
                    f"a remote client has no admin.cap ({self.endpoint}): give the admin capability file with "
                    "--admin-cap FILE (twt), or admin= (SupervisorClient.remote); the supervisor must allow it "
                    "(allow_remote_admin = true). A tenant's own commands take --capability FILE instead"
                )
            try:
                self._admin = RegistryAdminCapability.from_bytes(
                    read_admin_capability(self.run_dir, self._expected_uid)
                )
            except FileNotFoundError:
                raise SupervisorUnavailable(
                    self.run_dir, "no admin/admin.cap (not running, or not the operator?)") from None
        return self._admin

    @property
    def reader(self) -> RegistryAdminCapability | MonitorCapability:
        """The capability for the read-only ops: the monitor capability this client was given, else
        the admin one (:attr:`admin`)."""
        if self._admin is None and self._monitor_cap is not None:
            return self._monitor_cap
        return self.admin

    def send(self, op: str, cap: Capability | bytes | None, args: Mapping[str, object] | None = None,
             body: bytes | memoryview | None = None) -> int:
        """Send one request without waiting; returns its rid (pair with :meth:`recv`).

        Locally, pipelined requests go by ``frontend.ipc``, the socket that takes frames of any
        size: the two local sockets are not ordered with each other, and on one socket a
        tenant's requests are served in the order sent - a pipelined write and the read behind
        it stay in that order. (A call that waits for its reply, :meth:`request`, goes by
        ``small.ipc`` when its frames fit and nothing sent by ``frontend.ipc`` is unanswered.)

        Raises :class:`~shared.errors.AdmissionRate` without sending while the supervisor's
        ``retry_after_s`` of an earlier rate refusal of the same tenant has not passed: it
        would refuse the request too, and past a few such answers a second it drops
        requests unanswered (``tenant_refusals_per_s``) - a caller that retries at once
        gets the refusal here, at no cost, instead of a request that never comes back."""
        return self._send(op, cap, args, body, pipelined=True)

    def _send(self, op: str, cap: Capability | bytes | None, args: Mapping[str, object] | None,
              body: bytes | memoryview | None, *, pipelined: bool) -> int:
        """:meth:`send`; ``pipelined`` False for a call that waits for its reply before the next."""
        if self._rate_wait:
            self.check_rate_wait(cap)
        rid = next(self._rids)
        header = proto.encode_request(rid, op, _cap_bytes(cap), args or {})
        if self._monitor is not None:
            self._fresh_link_if_idle()
            self._watch_link()
        limit = self._small_limit
        # small.ipc only for a waited-for call whose frames fit it, with nothing unanswered on
        # frontend.ipc: it cannot overtake a request sent before it (docs/PROTOCOL.md)
        big = limit is not None and (pipelined or bool(self._big_pending) or len(header) > limit
                                     or (body is not None and len(body) > limit))
        try:
            if big:
                sock = self._big_socket()
                if body is None:
                    sock.send(header, zmq.NOBLOCK)
                else:
                    sock.send_multipart([header, body], zmq.NOBLOCK, copy=len(body) < 65536)
                self._big_pending.add(rid)
            elif body is None:
                self._sock.send(header, zmq.NOBLOCK)
            else:
                self._sock.send_multipart([header, body], zmq.NOBLOCK, copy=len(body) < 65536)
        except zmq.Again:
            raise RequestTimeout(op, 0, message=f"cannot queue {op!r}: the send queue is full") from None
        if self._monitor is not None:
            self._outstanding[rid] = None
            self._last_io = time.monotonic()
        return rid

    def recv(self, timeout_s: float | None = None) -> tuple[int, bool, object, bytes | None]:
        """The next reply: (rid, ok, result-or-error-dict, body). Raises RequestTimeout, or
        ProtocolError for a reply that does not decode and names no request (one that
        names its request comes back as that request's ``protocol_error``)."""
        return self._recv_one(time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s), "recv")

    def _waiting(self, cap: Capability | bytes | None) -> tuple[float, dict[str, object]] | None:
        """(seconds left, the refusal) while this capability's tenant waits out a rate refusal,
        else None (an expired wait is forgotten here). The capability is parsed once, and only
        while some tenant waits: no cost on the path of a client that was never refused."""
        tenant = _tenant_of(cap) if self._rate_wait else None
        held = self._rate_wait.get(tenant) if tenant is not None else None
        if held is None or tenant is None:
            return None
        left = held[0] - time.monotonic()
        if left <= 0:
            del self._rate_wait[tenant]
            return None
        return left, held[1]

    def rate_wait_s(self, cap: Capability | bytes | None) -> float:
        """Seconds until this capability's tenant may send again after a rate refusal (0.0: now)."""
        waiting = self._waiting(cap)
        return waiting[0] if waiting is not None else 0.0

    def check_rate_wait(self, cap: Capability | bytes | None) -> None:
        """While this capability's tenant waits out a rate refusal, raise that refusal again
        (:class:`~shared.errors.AdmissionRate`, its ``retry_after_s`` now what is left); else nothing."""
        waiting = self._waiting(cap)
        if waiting is None:
            return
        left, err = waiting
        fields = err.get("fields")
        raise error_from_dict({**err, "fields": {**(fields if isinstance(fields, dict) else {}),
                                                 "retry_after_s": round(left, 6)}})

    def _note_refusal(self, payload: object) -> None:
        """A reply's error: when it is a rate refusal with ``retry_after_s``, its tenant waits that long."""
        if not isinstance(payload, dict) or payload.get("code") != "overloaded":
            return
        fields = payload.get("fields")
        if not isinstance(fields, dict) or fields.get("cause") != "rate":
            return
        after, tenant = fields.get("retry_after_s"), fields.get("tenant_id")
        if isinstance(after, (int, float)) and not isinstance(after, bool) and after > 0 and isinstance(tenant, str):
            self._rate_wait[tenant] = (time.monotonic() + min(float(after), 60.0), payload)

    def _watch_link(self) -> None:
        """Remote: read the socket monitor's queued events into the link state (never blocks)."""
        assert self._monitor is not None
        failed: int | None = None  # the last handshake failure not followed by a success
        while self._monitor.poll(0):
            event, _ = recv_monitor_event(self._monitor)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._link_up = True
                failed = None
            elif event == zmq.EVENT_DISCONNECTED:
                if self._link_up:
                    self._link_drops += 1
                    self._down_since = time.monotonic()
                self._link_up = False
                # the supervisor answers a request on the connection it came on: none sent before
                # this drop can be answered now (those already received are still read)
                self._outstanding.clear()
            elif event in _HANDSHAKE_FAILED:
                failed = event
        if failed is not None and not self._link_up:
            raise HandshakeFailed(self.endpoint, _HANDSHAKE_FAILED[failed])

    def _recv_remote(self, deadline: float, op: str) -> tuple[int, bool, object, bytes | None]:
        """Remote wait: the reply, or a typed error as soon as the link says it cannot come."""
        drops = self._link_drops
        sent_on_link = self._link_up
        self.last_request_unsent = False
        while True:
            self._watch_link()
            now = time.monotonic()
            connect_by = self._down_since + self.connect_timeout_s
            lost = self._link_drops != drops
            if (lost or (not self._link_up and now >= connect_by)) and self._sock.poll(0):
                if (reply := self._read_reply()) is not None:
                    return reply  # it arrived before the link dropped
                continue
            if lost:
                raise SupervisorUnavailable(self.endpoint, f"connection lost while waiting for the reply to {op!r}")
            if not self._link_up and now >= connect_by:
                # the request is still queued in our socket: no supervisor took it
                self.last_request_unsent = not sent_on_link
                raise SupervisorUnavailable(
                    self.endpoint, f"no connection for {self.connect_timeout_s:g} s (refused, unreachable or filtered)"
                )
            remaining = deadline - now
            if remaining <= 0:
                raise RequestTimeout(op, round(self.timeout_s, 3))
            wait = remaining if self._link_up else min(remaining, max(0.001, connect_by - now))
            ready = dict(self._poller.poll(max(1, int(wait * 1000))))
            if self._sock in ready and (reply := self._read_reply()) is not None:
                return reply

    def _read_reply(self, sock: zmq.Socket[bytes] | None = None) -> tuple[int, bool, object, bytes | None] | None:
        """The reply waiting on the socket (``sock``: the one that has it, if not ours). One that
        does not decode is never silence: it comes back as its request's ``protocol_error`` when
        its rid is readable, else :class:`ProtocolError` is raised to whoever waits."""
        frames = (sock or self._sock).recv_multipart()
        try:
            rid, ok, payload = proto.decode_reply(frames[0])
        except ProtocolError as exc:
            got = proto.peek_rid(frames[0])
            error = ProtocolError(
                exc.detail,
                message=f"a reply{'' if got is None else f' to request {got}'} ({len(frames[0]):,} B) "
                f"could not be decoded: {exc.detail}",
            )
            if got is None:
                raise error from None
            return got, False, error.to_dict(), None
        if not ok:
            self._note_refusal(payload)
        if sock is not None and sock is self._big:
            self._big_pending.discard(rid)
        if self._monitor is not None:
            self._outstanding.pop(rid, None)
            self._last_io = time.monotonic()
        return rid, ok, payload, frames[1] if len(frames) > 1 else None

    def _recv_one(self, deadline: float, op: str) -> tuple[int, bool, object, bytes | None]:
        if self._monitor is not None:
            return self._recv_remote(deadline, op)
        while True:
            remaining = deadline - time.monotonic()
            if self._both is not None:  # a reply leaves by the socket its request came on: either
                ready = self._both.poll(max(1, int(remaining * 1000))) if remaining > 0 else []
                if not ready:
                    raise RequestTimeout(op, round(self.timeout_s, 3))
                if (reply := self._read_reply(ready[0][0])) is not None:
                    return reply
                continue
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000))):
                raise RequestTimeout(op, round(self.timeout_s, 3))
            if (reply := self._read_reply()) is not None:
                return reply

    def request(self, op: str, cap: Capability | bytes | None, args: Mapping[str, object] | None = None,
                body: bytes | memoryview | None = None, *, timeout_s: float | None = None) -> tuple[object, bytes | None]:
        """One call: send, wait for its reply, raise its error. Returns (result, body)."""
        with self._lock:
            self._check_open()
            self._bulk.flush_leases()
            return self._request_locked(op, cap, args, body, timeout_s=timeout_s)

    def _check_open(self) -> None:
        if self._closed:
            raise SupervisorUnavailable(self.run_dir, "client is closed")

    def _request_locked(self, op: str, cap: Capability | bytes | None, args: Mapping[str, object] | None = None,
                        body: bytes | memoryview | None = None, *, timeout_s: float | None = None) -> tuple[object, bytes | None]:
        """:meth:`request` with ``self._lock`` held by the caller."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        rid = self._send(op, cap, args, body, pipelined=False)
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, ok, payload, out_body = self._recv_one(deadline, op)
            except RequestTimeout:
                self._outstanding.pop(rid, None)  # given up: its late reply is dropped
                self._big_pending.discard(rid)
                raise RequestTimeout(op, timeout) from None
            except SupervisorUnavailable:
                self._outstanding.pop(rid, None)  # its link is gone: no reply will come on it
                raise
            except ProtocolError as exc:  # undecodable and unattributable: ours is the one waiting
                self._outstanding.pop(rid, None)
                raise ProtocolError(exc.detail, message=f"{op}: {exc.message}") from None
            if got == rid:
                break
            # a late reply to an earlier, timed-out request: drop it
        if not ok:
            raise error_from_dict(payload if isinstance(payload, dict) else {"code": "internal", "message": str(payload), "fields": {}})
        return payload, out_body

    def _invoke_locked(self, cap: Capability | bytes | None, args: proto.WireArgs[R], *,
                       timeout_s: float | None = None) -> R:
        """:meth:`invoke` with ``self._lock`` held by the caller (the bulk path's region requests)."""
        return args.reply(self._request_locked(args.op, cap, args.to_wire(), timeout_s=timeout_s)[0])

    def call(self, op: str, cap: Capability | bytes | None, args: Mapping[str, object] | None = None, *,
             body: bytes | memoryview | None = None, timeout_s: float | None = None) -> object:
        """One call's decoded result (a msgpack map, unchecked: the typed methods decode it into records)."""
        return self.request(op, cap, args, body, timeout_s=timeout_s)[0]

    def invoke(self, cap: Capability | bytes | None, args: proto.WireArgs[R], *,
               body: bytes | memoryview | None = None, timeout_s: float | None = None) -> R:
        """The generic typed call: send a typed op's arguments (``client.invoke(cap,
        Echo.Args(text="hi"))``), with ``body`` as its body frame when the op takes one
        (``Write.Args(handle=h)``, ``body=data``), and decode its reply into the op's reply type
        (``Echo.Reply``); ProtocolError when the reply is not of that type. Every named method of
        this client is a wrapper of this call (or of :meth:`invoke_body`, for an op that answers
        with a body): it builds the op's arguments, invokes, and returns the reply or a part of it."""
        return args.reply(self._exchange(cap, args, body, timeout_s)[0])

    def invoke_body(self, cap: Capability | bytes | None, args: proto.WireArgs[R], *,
                    body: bytes | memoryview | None = None, timeout_s: float | None = None) -> tuple[R, bytes]:
        """:meth:`invoke` of an op that answers with a body frame (``read``): its typed reply and
        the body (empty when the reply has none)."""
        payload, out = self._exchange(cap, args, body, timeout_s)
        return args.reply(payload), out or b""

    def _exchange(self, cap: Capability | bytes | None, args: proto.WireArgs[R],
                  body: bytes | memoryview | None, timeout_s: float | None) -> tuple[object, bytes | None]:
        """The one typed request: the op's argument map from ``args``, its body frame, the reply's
        decoded payload and body. A body for an op whose definition takes none (``body_in``) is
        refused here, unsent, with InvalidArgument: the supervisor refuses it too, and a caller
        learns it without a round trip. Rate waits, reconnects and the deadline are
        :meth:`request`'s, as for every request."""
        if body is not None:
            spec = proto.OPS.get(args.op)
            if spec is None or not spec.body_in:
                raise InvalidArgument(f"{args.op} takes no body frame: send its arguments alone")
        return self.request(args.op, cap, args.to_wire(), body, timeout_s=timeout_s)

    def release_regions(self) -> None:
        """Release this client's shared-memory regions now (they count against their tenants'
        host quotas; the next bulk transfer makes a new one)."""
        with self._lock:
            self._check_open()
            self._bulk.close()

    def close(self) -> None:
        """Release this client's regions, then close its socket (and its link monitor)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._bulk.close()
            finally:
                self._closed = True
                self._close_socket()

    def __enter__(self) -> SupervisorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- admin

    def hello(self, admin: RegistryAdminCapability | MonitorCapability | None = None) -> HelloInfo:
        """Supervisor identity: pid, registry id, backend (and why), start method, uptime."""
        return self.invoke(admin or self.reader, proto.Hello.Args())

    def alive(self) -> AliveInfo:
        """``hello`` without a capability: protocol and readiness, nothing else (a liveness probe
        that needs no secret; docs/PROTOCOL.md "hello without a capability")."""
        return AliveInfo.from_wire(self._exchange(None, proto.Hello.Args(), None, None)[0])

    def register(self, admin: RegistryAdminCapability | None, spec: TenantSpec, *,
                 timeout_s: float | None = None) -> TenantCapability:
        """Register a tenant; returns once every instance is ready, with its capability."""
        reply = self.invoke(admin or self.admin, proto.Register.Args(spec=spec.to_dict()),
                            timeout_s=timeout_s or max(self.timeout_s, 60.0))
        return TenantCapability.from_bytes(reply.capability)

    def tenant_capability(self, admin: RegistryAdminCapability | None, tenant_id: str) -> TenantCapability:
        """The capability of a registered tenant (e.g. one from the config file) to hand to it."""
        reply = self.invoke(admin or self.admin, proto.Capability.Args(tenant=tenant_id))
        return TenantCapability.from_bytes(reply.capability)

    def role_capability(self, admin: RegistryAdminCapability | None, role: str = "monitor") -> MonitorCapability:
        """A role's capability: ``monitor``, the read-only ops (status, events, version), which the
        supervisor accepts over TCP without ``allow_remote_admin``; revoked by a key rotation."""
        reply = self.invoke(admin or self.admin, proto.Capability.Args(role=role))
        return MonitorCapability.from_bytes(reply.capability)

    def evict(self, admin: RegistryAdminCapability | None, tenant_id: str) -> EvictResult:
        """Stop the tenant's workers, revoke its capabilities, unlink its block (returns after the workers exit)."""
        return self.invoke(admin or self.admin, proto.Evict.Args(tenant=tenant_id),
                           timeout_s=max(self.timeout_s, 30.0))

    unregister = evict

    def set_quota(self, admin: RegistryAdminCapability | None, tenant_id: str, *,
                  memory_quota_bytes: int | str | _Unchanged = _UNCHANGED,
                  gpu_memory_bytes_cap: int | str | None | _Unchanged = _UNCHANGED,
                  recorded_cuda_mem_pool_quota: int | str | None | _Unchanged = _UNCHANGED,
                  gpu_time_weight: float | _Unchanged = _UNCHANGED,
                  gpu_time_cap: float | None | _Unchanged = _UNCHANGED,
                  idle_timeout_s: float | None | _Unchanged = _UNCHANGED) -> TenantRecord:
        """Change limits live (omitted ones stay; ``None`` removes the GPU cap, or the GPU-time cap;
        ``idle_timeout_s=None``: the tenant never parks)."""
        return self.invoke(admin or self.admin, proto.SetQuota.Args(
            tenant=tenant_id, memory_quota_bytes=_given(memory_quota_bytes),
            gpu_memory_bytes_cap=_given(gpu_memory_bytes_cap),
            recorded_cuda_mem_pool_quota=_given(recorded_cuda_mem_pool_quota),
            gpu_time_weight=_given(gpu_time_weight), gpu_time_cap=_given(gpu_time_cap),
            idle_timeout_s=_given(idle_timeout_s)))

    def status(self, admin: RegistryAdminCapability | MonitorCapability | None = None, *, limit: int | None = None,
               after: str | None = None, state: str | None = None) -> StatusRecord:
        """The supervisor, its devices, the summary of every tenant and their records by tenant id.

        Without ``limit``: every tenant (in ``state``, when given), the pages of up to
        ``STATUS_PAGE_MAX`` fetched one after the other and joined (``next`` is then None). With
        ``limit``: that one page, after tenant id ``after``; its ``next`` is the ``after`` of the
        next page. At 10,000 tenants one page and the summary are what a dashboard should read:
        every record costs the supervisor's loop ~0.1 ms to build.
        """
        cap = admin or self.reader

        def page(after: str | None, limit: int) -> StatusRecord:
            return self.invoke(cap, proto.Status.Args(limit=limit, after=proto.ABSENT if after is None else after,
                                                      state=proto.ABSENT if state is None else state))

        if limit is not None:
            return page(after, limit)
        first = page(after, STATUS_PAGE_MAX)
        tenants = list(first.tenants)
        cursor = first.next
        while cursor is not None:
            more = page(cursor, STATUS_PAGE_MAX)
            tenants.extend(more.tenants)
            if more.next is not None and more.next <= cursor:  # never loop on a confused reply
                raise ProtocolError(f"status: the next page starts at {more.next!r}, not after {cursor!r}")
            cursor = more.next
        return dataclasses.replace(first, tenants=tuple(tenants), next=None)

    def tenant_status(self, admin: RegistryAdminCapability | MonitorCapability | None, tenant_id: str) -> TenantRecord:
        return self.invoke(admin or self.reader, proto.TenantStatus.Args(tenant=tenant_id))

    def scale(self, admin: RegistryAdminCapability | None, tenant_id: str, instances: int) -> TenantRecord:
        """Run ``instances`` workers for the tenant (live; scaling down drains first)."""
        return self.invoke(admin or self.admin, proto.Scale.Args(tenant=tenant_id, instances=instances))

    def inject_fault(self, admin: RegistryAdminCapability | None, tenant_id: str, kind: str, *,
                     instance: int | None = None, **params: int | float | str | bool) -> FaultResult:
        """Break one worker of a tenant on purpose (docs/RELIABILITY.md lists the kinds).

        Returns once the fault is armed, or - for crash, segfault and exit -
        once the worker process is gone.
        """
        return self.invoke(admin or self.admin, proto.InjectFault.Args(
            tenant=tenant_id, kind=kind, params=dict(params), instance=proto.ABSENT if instance is None else instance))

    def reload(self, admin: RegistryAdminCapability | None = None) -> ReloadResult:
        """Read the supervisor's config file again and apply the difference (as SIGHUP does).

        Returns what was registered, changed, evicted, left unchanged, in conflict, and the
        settings not applied; a file that cannot be applied raises
        :class:`~shared.errors.ConfigError` and changes nothing.
        """
        return self.invoke(admin or self.admin, proto.Reload.Args(), timeout_s=max(self.timeout_s, 60.0))

    def reset(self, admin: RegistryAdminCapability | None, tenant_id: str) -> TenantRecord:
        """Clear a failed tenant and start its instances (same capability); returns once they are ready."""
        return self.invoke(admin or self.admin, proto.Reset.Args(tenant=tenant_id), timeout_s=max(self.timeout_s, 60.0))

    def restart_tenant(self, admin: RegistryAdminCapability | None, tenant_id: str) -> TenantRecord:
        """Restart a tenant's instances one at a time (new processes, same capability); returns when done."""
        return self.invoke(admin or self.admin, proto.Restart.Args(tenant=tenant_id),
                           timeout_s=max(self.timeout_s, 120.0))

    def rotate_key(self, admin: RegistryAdminCapability | None = None) -> RegistryAdminCapability:
        """Replace the registry key: every capability is revoked; returns the new admin capability
        (also written to ``admin.cap``, and used by this client from now on)."""
        reply = self.invoke(admin or self.admin, proto.RotateKey.Args())
        new = RegistryAdminCapability.from_bytes(reply.admin_capability)
        self._admin = new
        return new

    # ------------------------------------------------------------- tenant

    def ping(self, cap: TenantCapability) -> PingInfo:
        return self.invoke(cap, proto.Ping.Args())

    def quota(self, cap: TenantCapability) -> QuotaSnapshot:
        """The tenant's own quota snapshot (answered by the supervisor from shared memory)."""
        return self.invoke(cap, proto.Quota.Args())

    def alloc(self, cap: TenantCapability, nbytes: int, instance: int | None = None) -> int:
        """A device buffer of ``nbytes``; returns its handle. GpuMemoryExhausted when refused.

        ``instance``: allocate on that instance of the tenant (buffers a run
        uses together must live on one instance); default: the least loaded.
        """
        return self.invoke(cap, proto.Alloc.Args(nbytes=nbytes,
                                                 instance=proto.ABSENT if instance is None else instance)).handle

    def free(self, cap: TenantCapability, handle: int) -> int:
        return self.invoke(cap, proto.Free.Args(handle=handle)).freed

    def write(self, cap: TenantCapability, handle: int, data: object, offset: int = 0) -> int:
        """Copy ``data`` (bytes-like or a numpy array, in C order) into the buffer at ``offset``.

        Large payloads of a local client go through a shared-memory region
        (``write_region``), others in a frame (``write``): same result.
        """
        view = byte_view(data)
        raw = cap.to_bytes()
        if self._bulk.wants(raw, len(view)):
            with self._lock:
                self._check_open()
                if self._bulk.write(raw, handle, view, offset):
                    return len(view)
        return self.invoke(cap, proto.Write.Args(handle=handle, offset=offset), body=view).written

    def read(self, cap: TenantCapability, handle: int, nbytes: int, offset: int = 0) -> bytes:
        """``nbytes`` of the buffer at ``offset`` (:meth:`read_into` and :meth:`get_array`
        spare the copy into a new ``bytes``)."""
        raw = cap.to_bytes()
        if isinstance(nbytes, int) and self._bulk.wants(raw, nbytes):
            with self._lock:
                self._check_open()
                data = self._bulk.read_bytes(raw, handle, nbytes, offset)
            if data is not None:
                return data
        return self.invoke_body(cap, proto.Read.Args(handle=handle, offset=offset, nbytes=nbytes))[1]

    def read_into(self, cap: TenantCapability, handle: int, out: object, offset: int = 0) -> int:
        """Fill ``out`` (a writable, C-contiguous buffer or numpy array) from the buffer at ``offset``."""
        try:
            view = memoryview(cast("Buffer", out))  # memoryview() is the check (TypeError: no buffer)
        except TypeError:
            raise InvalidArgument(f"read_into needs a writable buffer, got {type(out).__name__}") from None
        if view.readonly or not view.c_contiguous:
            raise InvalidArgument("read_into needs a writable, C-contiguous buffer")
        if view.nbytes == 0:
            return 0
        view = view.cast("B")
        raw = cap.to_bytes()
        if self._bulk.wants(raw, len(view)):
            with self._lock:
                self._check_open()
                if self._bulk.read_into(raw, handle, view, offset):
                    return len(view)
        data = self.invoke_body(cap, proto.Read.Args(handle=handle, offset=offset, nbytes=len(view)))[1]
        view[: len(data)] = data
        return len(data)

    # ---- regions by hand (Triton's model; write/read/put_array/get_array use them by themselves)

    def region_create(self, cap: TenantCapability, nbytes: int) -> RegionGrant:
        """A shared-memory region of ``nbytes`` for this process, charged to the tenant's host
        quota; map it with ``shared.region.Region.attach(grant.name)``."""
        return self.invoke(cap, proto.RegionCreate.Args(nbytes=nbytes, pid=os.getpid()))

    def region_release(self, cap: TenantCapability, region: int) -> int:
        """Release a region made by :meth:`region_create`; the bytes it held."""
        return self.invoke(cap, proto.RegionRelease.Args(region=region)).released

    def write_region(self, cap: TenantCapability, handle: int, region: int, nbytes: int, *,
                     offset: int = 0, region_offset: int = 0) -> int:
        """Copy ``nbytes`` at ``region_offset`` of the region into the buffer at ``offset``."""
        return self.invoke(cap, proto.WriteRegion.Args(handle=handle, offset=offset, region=region,
                                                       region_offset=region_offset, nbytes=nbytes)).written

    def read_region(self, cap: TenantCapability, handle: int, region: int, nbytes: int, *,
                    offset: int = 0, region_offset: int = 0) -> int:
        """Copy ``nbytes`` of the buffer at ``offset`` into the region at ``region_offset``."""
        return self.invoke(cap, proto.ReadRegion.Args(handle=handle, offset=offset, region=region,
                                                      region_offset=region_offset, nbytes=nbytes)).nbytes

    def put_array(self, cap: TenantCapability, array: object) -> int:
        """A new device buffer holding ``array``'s bytes (C order); returns its handle."""
        view = byte_view(array)
        handle = self.alloc(cap, max(1, len(view)))
        try:
            if len(view):
                self.write(cap, handle, view)
        except BaseException:
            try:
                self.free(cap, handle)
            except TensorWasmError:
                pass
            raise
        return handle

    def empty_array(self, cap: TenantCapability, dtype: npt.DTypeLike, shape: int | Sequence[int]) -> npt.NDArray[np.generic]:
        """A new, uninitialised numpy array that lives in a shared-memory region of its own.

        Writing it (or a C-contiguous slice of it) with :meth:`write` or
        :meth:`put_array` costs no copy on this side: the worker copies from
        where it lies. Its region counts against the tenant's host quota until
        the array is garbage-collected. Without a region (remote client, quota)
        it is a plain ``numpy.empty``.
        """
        import numpy as np

        dt, dims, nbytes = _array_layout(dtype, shape)
        raw = cap.to_bytes()
        if nbytes and self._bulk.enabled:
            with self._lock:
                self._check_open()
                leased = self._bulk.lease(raw, None, nbytes)
            if leased is not None:
                view, keep = leased
                array = np.frombuffer(view, dtype=dt).reshape(dims)
                keep(array)
                return array
        return np.empty(dims, dtype=dt)

    def get_array(self, cap: TenantCapability, handle: int, dtype: npt.DTypeLike, shape: int | Sequence[int], *,
                  copy: bool = True, offset: int = 0) -> npt.NDArray[np.generic]:
        """The buffer's bytes at ``offset`` as a numpy array of ``dtype`` and ``shape``.

        ``copy=False`` asks for a zero-copy view: the array then lives in a
        shared-memory region of its own (charged to the tenant's host quota
        until the array is garbage-collected). A client without the region
        path (remote, or refused a region) returns a copy either way.
        """
        import numpy as np

        dt, dims, nbytes = _array_layout(dtype, shape)
        raw = cap.to_bytes()
        if not copy and nbytes and self._bulk.wants(raw, max(nbytes, self._bulk.threshold)):
            with self._lock:
                self._check_open()
                leased = self._bulk.lease(raw, handle, nbytes, offset)
            if leased is not None:
                view, keep = leased
                array = np.frombuffer(view, dtype=dt).reshape(dims)
                keep(array)
                return array
        out = np.empty(dims, dtype=dt)
        if nbytes:
            self.read_into(cap, handle, out, offset)
        return out

    def buffers(self, cap: TenantCapability) -> dict[int, int]:
        """handle -> size of the tenant's live buffers (across instances)."""
        pairs = self.invoke(cap, proto.Buffers.Args()).buffers
        if not all(isinstance(p, list) and len(p) == 2 and all(map(is_int, p)) for p in pairs):
            raise ProtocolError("the buffers reply is not a list of [handle, nbytes] pairs")
        return {h: n for h, n in pairs}

    def put_module(self, cap: TenantCapability, module: bytes) -> str:
        """Upload a WASM module once; later ``run_wasm`` calls can name it by digest."""
        return self.invoke(cap, proto.PutModule.Args(), body=module).digest

    def run_wasm(self, cap: TenantCapability, module: bytes | str, export: str,
                 args: Sequence[int | float | dict[str, int]] = (), *, fuel: int | None = None,
                 timeout_s: float | None = None,
                 request_timeout_s: float | None = None) -> RunResult:
        """Run ``export`` of a module (bytes, WAT text as bytes, or a digest from :meth:`put_module`).

        ``args`` items are ints, floats or ``{"handle": h}`` buffer references.
        Returns the results, the fuel used and the time it took (:class:`~shared.records.RunResult`).
        """
        body: bytes | None = None
        if isinstance(module, str):
            digest = module
        else:
            body = bytes(module)
            digest = hashlib.sha256(body).hexdigest()
        req = proto.RunWasm.Args(export=export, args=[_wasm_arg(a) for a in args],
                                 fuel=proto.ABSENT if fuel is None else fuel,
                                 timeout_s=proto.ABSENT if timeout_s is None else timeout_s, digest=digest)
        wait = request_timeout_s or max(self.timeout_s, (timeout_s or 0) + 10.0)
        return self.invoke(cap, req, body=body, timeout_s=wait)

    # ------------------------------------------------------------- events

    def events_page(self, cap: Capability | None, after: int | None = None, *, kinds: Sequence[str] = (),
                    max_events: int | None = None, log: str | None = None) -> dict[str, object]:
        """One page of the event log: the events after sequence number ``after`` (None: none, only
        the cursor of now) -> ``{events, next, missed, more, log}`` (``supervisor.observe.event_log``).
        ``cap``: the admin capability (None: this client's) sees every event, a tenant's its own."""
        args = proto.Events.Args(after=after, log=log, kinds=list(kinds) if kinds else proto.ABSENT,
                                 max=proto.ABSENT if max_events is None else max_events)
        result = self._exchange(cap or self.reader, args, None, None)[0]
        if not isinstance(result, dict):
            raise ProtocolError(f"the events reply is not a map: {type(result).__name__}")
        return result

    def events(self, kinds: Sequence[str] = (), *, timeout_s: float | None = None, replay: bool = False,
               cap: Capability | None = None) -> Generator[dict[str, object], None, None]:
        """Follow lifecycle events (``kinds`` filters; ``timeout_s`` ends quietly after silence;
        ``replay``: first the events the supervisor still holds), local or remote alike.

        ``cap``: a tenant capability follows that tenant's own events; default the admin
        capability (every event; remote: the supervisor needs ``allow_remote_admin``), or the monitor
        one this client was given (every event, remote without it). A gap
        comes as a ``{"event": "missed", ...}`` record (``supervisor.client.event_follow``).
        """
        return follow(self, cap or self.reader, kinds, timeout_s=timeout_s, replay=replay)


def _array_layout(dtype: npt.DTypeLike, shape: int | Sequence[int]) -> tuple[np.dtype[np.generic], tuple[int, ...], int]:
    """(numpy dtype, shape tuple, bytes) of an array request; InvalidArgument for a bad shape."""
    import numpy as np

    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"shape must not be negative, got {dims}")
    return dt, dims, int(np.prod(dims, dtype=np.int64)) * dt.itemsize


def _wasm_arg(value: object) -> int | float | dict[str, object]:
    if isinstance(value, bool):
        raise InvalidArgument("wasm arguments are ints, floats or {'handle': h}, not bool")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, dict) and set(value) == {"handle"}:
        return value
    raise InvalidArgument(f"unsupported wasm argument {value!r}: use ints, floats or {{'handle': h}}")
