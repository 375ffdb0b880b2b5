"""What the frontend knows of its peers: connections against the fd budget, and
the error replies an unauthenticated peer may still be sent.

Connections. libzmq accepts ipc and TCP connections on its own I/O thread, one
file descriptor each, and aborts the process when an ipc accept fails with
EMFILE. It has no connection limit (and unbinding an endpoint would also drop
every connected client), so the frontend watches its sockets' monitors
(ACCEPTED / DISCONNECTED, with the connection's fd) and shuts down each
connection accepted past a bound: the fd budget
(:func:`supervisor.host.fdlimit.fd_budget`, half of the fds left) for ipc and TCP
together, and for TCP also ``max_tcp_peers`` and ``max_tcp_peers_per_source``,
counted at accept - a raw TCP connection that never sends the ZMTP greeting
never reaches ZAP, so only the accept can see it. libzmq
sees the peer gone and closes it, the client sees a refused connection (and
retries), and every connected client keeps working. :class:`ConnectionGate` is
the count and the decision; :func:`shed` / :func:`shed_tcp` the act (on libzmq's
fd itself, never a duplicate: a shed must work at the fd limit). The events reach
the gate through the guard thread (``supervisor.admission.fd_guard``), which also
renames the ipc paths away near the budget however far the loop lags.

Unauthenticated peers. A request without a verified capability - garbage,
forged or foreign tokens - is answered with a small typed error, but a peer
that sends them and never reads would make the supervisor queue one reply
per request (libzmq bounds a peer's queue in messages, not bytes). So those
replies are sent tracked (zero-copy frames, whose tracker is done once libzmq
has written them out), and a peer with ``max_unread`` of them still held by
libzmq - its own socket buffers full, because it stopped reading - gets no
more until it reads: the rest are dropped unanswered (counted). A peer that
reads its replies gets them all: its own libzmq takes them off the connection
whether or not the application has called recv yet, so only a peer whose
buffers are full meets the bound. 1,024, not less: a tracker is done only once
pyzmq's garbage thread has seen libzmq release the frame, and that thread needs
the GIL the loop holds, so on a loaded host trackers lag the loop by many turns
of 16 replies (at 256, 300 pipelined forged requests from a reading peer lost
replies under load); 1,024 small replies are ~300 KiB per peer. Only every
:data:`TRACK_EVERY`-th reply to a peer carries a tracker; the others are plain
sends, counted unread until a tracked one sent after them is done (a peer's
replies leave through one pipe, in order): a tracked frame costs a
``threading.Event`` and a message to pyzmq's garbage thread, most of what an
answered forged request cost the loop (a flood of 110,000 of them:
tests/reliability/test_frontend_flood.py), and the count stays conservative -
never fewer than what libzmq still holds, at most ``TRACK_EVERY - 1`` more. The table of peers is itself
bounded (least recently seen forgotten).

Idle TCP sessions. A completed CURVE handshake needs no allow-listed key (by default), so
sessions that hold a slot and send nothing would lock remote clients out for good. The gate
keeps, per TCP connection, when it last carried a request (its accept until then) and, once
one came, its client key (the frontend's ``TCP_INDEX`` + routing id: the frontend reads the
connection's fd from each message, ``ZMQ_SRCFD``) and whether a capability the supervisor
verified came on it. Two rules free slots:

* **idle**: a connection that carried no request for ``tcp_idle_timeout_s`` and has none in
  flight (the frontend's sweep tells the gate which clients have) is closed;
* **eviction**: a connection accepted while ``max_tcp_peers`` are held evicts one held
  connection instead of being refused: the longest idle of those that never carried a
  verified capability (anonymous sessions, handshakes still running), else the longest idle
  of the tenants' sessions if it has been idle at least :data:`EVICT_MIN_IDLE_S` and has
  nothing in flight. Only when neither exists is the new one refused (ZAP, then shed).

A dropped session's slot is free at once (its DISCONNECTED event, later, is ignored). Its
messages that libzmq had read but the loop had not are never served (:meth:`ConnectionGate.seen`
answers ``"dropped"``): a request sent on a session as the supervisor dropped it is not
executed (nor answered). ``SupervisorClient`` keeps its requests off such sessions: it opens a
new connection before a request once its link has been idle (see ``supervisor.client.api``).

Loop thread only.
"""

from __future__ import annotations

import ipaddress
import socket
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass, field
from typing import Literal

import zmq

__all__ = ["EVICT_MIN_IDLE_S", "TRACK_EVERY", "ConnectionGate", "Seen", "UnreadErrors", "shed", "shed_tcp", "short", "source_key",
           "tcp_peer", "tcp_peer_of"]

#: the longest text an error to an unauthenticated peer carries
MAX_ERROR_TEXT = 200


def short(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` cut to ``limit`` characters: errors never echo unbounded input."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: one reply in this many to an unauthenticated peer is sent tracked (see the module docstring)
TRACK_EVERY = 16


class _Unread:
    """One peer's replies that libzmq may still hold."""

    __slots__ = ("count", "since", "trackers")

    def __init__(self) -> None:
        self.count = 0  # replies sent and not known to be written out
        self.since = 0  # of them, those sent untracked after the last tracked one
        #: (tracker, replies it covers: itself and the untracked ones sent before it)
        self.trackers: deque[tuple[zmq.MessageTracker, int]] = deque()


@dataclass
class UnreadErrors:
    """Per peer, the error replies to unauthenticated requests it has not taken yet."""

    max_unread: int = 1024
    max_peers: int = 4096
    dropped: int = field(default=0, init=False)
    _peers: OrderedDict[bytes, _Unread] = field(default_factory=OrderedDict, init=False)

    def allow(self, peer: bytes) -> bool:
        """True when ``peer`` may be sent one more error reply now."""
        state = self._peers.pop(peer, None)
        if state is None:
            state = _Unread()
        trackers = state.trackers
        while trackers and trackers[0][0].done:
            state.count -= trackers.popleft()[1]
        self._peers[peer] = state
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        if state.count >= self.max_unread:
            self.dropped += 1
            return False
        return True

    def track(self, peer: bytes) -> bool:
        """Whether the reply about to be sent to ``peer`` (just allowed) must carry a tracker."""
        state = self._peers.get(peer)
        return state is None or state.since + 1 >= TRACK_EVERY

    def sent(self, peer: bytes, tracker: zmq.MessageTracker | bool | None) -> None:
        """Remember a reply sent to ``peer``: its ``zmq.MessageTracker`` (``done`` once taken), True
        when it was sent untracked (:meth:`track` said so), False or None when it was not queued."""
        state = self._peers.get(peer)
        if state is None or tracker is None or tracker is False:
            return
        state.count += 1
        if tracker is True:
            state.since += 1
        else:
            state.trackers.append((tracker, state.since + 1))
            state.since = 0

    def __len__(self) -> int:
        return len(self._peers)


#: why a connection was shed (a key of :attr:`ConnectionGate.shed_by`): fd_budget, per_source,
#: max_tcp_peers (at accept), idle (tcp_idle_timeout_s), evicted (for a new connection at the cap)
ShedReason = str
#: what :meth:`ConnectionGate.seen` says of a TCP message: serve it ("ok"), its connection is not
#: known yet (read the monitor's events, then ask again), or its session was dropped (discard it)
Seen = Literal["ok", "unknown", "dropped"]
#: a tenant's session (one that carried a verified capability) is evicted for a new connection
#: only once it has been idle this long: a connection flood never closes an active client's link
EVICT_MIN_IDLE_S = 1.0
#: dropped sessions whose late messages are still recognised (routing ids are never reused)
_DROPPED_CLIENTS = 4096
#: a peer's address and port, as getpeername() gives them
Peer = tuple[str, int]


@dataclass
class _Conn:
    tcp: bool
    source: str  # the peer's address (IPv6: its /64), "" for ipc
    peer: Peer | None = None  # TCP: (address, port), so a shed never hits a reused fd's new peer
    active_at: float = 0.0  # TCP: accepted, or its last request read (the loop's clock)
    client: bytes | None = None  # TCP: the frontend's client key of its last request
    verified: bool = False  # TCP: a verified capability came on it (a tenant's or the admin's session)


@dataclass
class ConnectionGate:
    """Every frontend connection (ipc and TCP) against one fd budget (of which TCP may
    take three quarters), and TCP connections against ``max_tcp`` (+ ``tcp_slack``)
    and ``max_per_source``.

    Keyed by (transport, fd) as the socket monitors report them: an ACCEPTED for a
    key already held replaces it (its DISCONNECTED was lost), a DISCONNECTED for a
    key not held is ignored, so the count never drifts for good.
    ``accepted`` answers the reason to shed the new connection, or None to keep it.

    TCP past ``max_tcp``: the caller first evicts a held session (:meth:`victim`,
    :meth:`drop`); when there is none to evict, the first ``tcp_slack`` extra
    connections are kept so that the ZAP handler can refuse their handshake with a
    reason the client reads (:class:`~shared.errors.HandshakeFailed` naming
    ``max_tcp_peers``); past that they are shed at once, greeted or not.

    TCP sessions' activity (see the module docstring): :meth:`seen` for each request,
    :meth:`verified` once a capability was verified on one, :meth:`expire` for the idle
    rule, :meth:`victim` for the eviction. Two orders of the TCP connections, least
    recently active first (anonymous ones, tenants' ones), make both O(1) per step.
    """

    budget: int
    max_tcp: int = 1 << 30
    max_per_source: int = 1 << 30
    tcp_slack: int = 8
    shed_by: dict[ShedReason, int] = field(default_factory=dict, init=False)
    tcp: int = field(default=0, init=False)
    _conns: dict[tuple[bool, int], _Conn] = field(default_factory=dict, init=False)
    _per_source: dict[str, int] = field(default_factory=dict, init=False)
    #: TCP fds by last activity, oldest first: [anonymous sessions, tenants' sessions]
    _order: tuple[OrderedDict[int, None], OrderedDict[int, None]] = field(
        default_factory=lambda: (OrderedDict(), OrderedDict()), init=False)
    #: client key -> the fd of the TCP connection its requests came on
    _by_client: dict[bytes, int] = field(default_factory=dict, init=False)
    #: fds of sessions the supervisor dropped, until the fd is accepted again
    _dropped_fds: set[int] = field(default_factory=set, init=False)
    #: client keys of sessions the supervisor dropped -> their fd (bounded: the oldest forgotten)
    _dropped_clients: OrderedDict[bytes, int] = field(default_factory=OrderedDict, init=False)

    @property
    def connected(self) -> int:
        return len(self._conns)

    @property
    def tcp_budget(self) -> int:
        """TCP connections may take three quarters of the fd budget: the rest stays for
        local (ipc) clients, however many remote connections arrive."""
        return self.budget - self.budget // 4

    @property
    def shed(self) -> int:
        return sum(self.shed_by.values())

    def accepted(self, fd: int = -1, *, tcp: bool = False, source: str = "", peer: Peer | None = None,
                 now: float = 0.0) -> ShedReason | None:
        """A connection was accepted (at ``now``); the reason it must be shed, or None (it is counted)."""
        key = (tcp, fd)
        if key in self._conns:
            self._forget(key)
        if tcp:
            self._dropped_fds.discard(fd)  # a new connection: its messages are served
        reason: ShedReason | None = None
        if len(self._conns) >= self.budget or (tcp and self.tcp >= self.tcp_budget):
            reason = "fd_budget"
        elif tcp and self._per_source.get(source, 0) >= self.max_per_source:
            reason = "per_source"
        elif tcp and self.tcp >= self.max_tcp + self.tcp_slack:
            reason = "max_tcp_peers"
        if reason is not None:
            self.shed_by[reason] = self.shed_by.get(reason, 0) + 1
            return reason
        self._conns[key] = _Conn(tcp, source, peer, now)
        if tcp:
            self.tcp += 1
            self._per_source[source] = self._per_source.get(source, 0) + 1
            self._order[0][fd] = None
        return None

    def disconnected(self, fd: int = -1, *, tcp: bool = False) -> None:
        self._forget((tcp, fd))

    def full_for(self, source: str) -> bool:
        """A TCP connection from ``source`` would be kept but for ``max_tcp``: the case where a
        held session is evicted for it (:meth:`victim`) rather than the new one refused."""
        return (self.tcp >= self.max_tcp and len(self._conns) < self.budget and self.tcp < self.tcp_budget
                and self._per_source.get(source, 0) < self.max_per_source)

    # ------------------------------------------------------------ TCP sessions' activity

    def seen(self, fd: int, client: bytes, now: float) -> Seen:
        """A request from ``client`` came on TCP connection ``fd`` (its ``ZMQ_SRCFD``) at ``now``.

        "dropped": its session was dropped by the supervisor - discard the request unserved.
        "unknown": no ACCEPTED for ``fd`` was read yet (the monitor lags the socket).
        Past either, read the monitor's events and ask again (a connection accepted since may
        explain it); still "unknown" then, serve it (nothing recorded).

        A late request of a dropped session is recognised by its client key and fd; when that
        fd was accepted again meanwhile and the new connection has sent nothing yet, it cannot
        be told from the new connection's own first request, and is served.
        """
        conn = self._conns.get((True, fd))
        old_fd = self._dropped_clients.get(client) if self._dropped_clients else None
        if old_fd is not None:
            if old_fd == fd and (conn is None or conn.client not in (None, client)):
                return "dropped"  # the dropped connection's own late request
            # the same routing id on a connection accepted since: a client that sets its own
            # (ZMQ_ROUTING_ID) and reconnected - served from now on
            del self._dropped_clients[client]
        if conn is None:
            return "dropped" if fd in self._dropped_fds else "unknown"
        if conn.client != client:
            if conn.client is not None and self._by_client.get(conn.client) == fd:
                del self._by_client[conn.client]
            conn.client = client
            self._by_client[client] = fd
        conn.active_at = now
        self._order[conn.verified].move_to_end(fd)
        return "ok"

    def dropped(self, client: bytes) -> bool:
        """``client``'s session was dropped by the supervisor: a request of it read before the drop
        and still waiting for its turn is discarded, never served."""
        return client in self._dropped_clients

    def verified(self, client: bytes) -> None:
        """A capability the supervisor verified came from ``client``: its session is a tenant's
        (or the admin's), evicted only after the anonymous ones and never while active."""
        fd = self._by_client.get(client)
        if fd is None:
            return
        conn = self._conns.get((True, fd))
        if conn is None or conn.verified:
            return
        conn.verified = True
        self._order[0].pop(fd, None)
        self._order[1][fd] = None

    def expire(self, now: float, idle_s: float, busy: Callable[[], Container[bytes]]) -> list[tuple[int, Peer | None]]:
        """Drop the TCP sessions with no request for ``idle_s`` and none in flight; returns their
        ``(fd, peer)`` for the caller to shut down (counted as shed for "idle"). ``busy()``: the
        client keys with a request in flight (asked only when some session is idle that long);
        such a session counts as active now."""
        out: list[tuple[int, Peer | None]] = []
        in_flight: Container[bytes] | None = None
        for order in self._order:
            for fd in list(order):
                conn = self._conns[(True, fd)]
                if now - conn.active_at < idle_s:
                    break  # the rest were active later
                if conn.client is not None:
                    if in_flight is None:
                        in_flight = busy()
                    if conn.client in in_flight:
                        conn.active_at = now
                        order.move_to_end(fd)
                        continue
                out.append((fd, conn.peer))
        for fd, _ in out:
            self.drop(fd, "idle")
        return out

    def victim(self, now: float, busy: Callable[[], Container[bytes]]) -> tuple[int, Peer | None] | None:
        """The session a new connection at the cap evicts (see the module docstring), or None:
        the longest idle anonymous one, else the longest idle tenant's one idle at least
        :data:`EVICT_MIN_IDLE_S` with no request in flight (``busy()``: the client keys that have one)."""
        for fd in self._order[0]:
            return fd, self._conns[(True, fd)].peer
        in_flight: Container[bytes] | None = None
        for fd in self._order[1]:
            conn = self._conns[(True, fd)]
            if now - conn.active_at < EVICT_MIN_IDLE_S:
                return None  # the rest were active later still
            if conn.client is not None:
                if in_flight is None:
                    in_flight = busy()
                if conn.client in in_flight:
                    continue
            return fd, conn.peer
        return None

    def drop(self, fd: int, reason: ShedReason) -> None:
        """The supervisor drops TCP session ``fd`` (the caller shuts it down): its slot is free now,
        and its requests not yet read are discarded (:meth:`seen`)."""
        conn = self._conns.get((True, fd))
        if conn is None:
            return
        self._forget((True, fd))
        self._dropped_fds.add(fd)
        if conn.client is not None:
            self._dropped_clients[conn.client] = fd
            while len(self._dropped_clients) > _DROPPED_CLIENTS:
                self._dropped_clients.popitem(last=False)
        self.shed_by[reason] = self.shed_by.get(reason, 0) + 1

    def _forget(self, key: tuple[bool, int]) -> None:
        conn = self._conns.pop(key, None)
        if conn is None or not conn.tcp:
            return
        fd = key[1]
        self._order[conn.verified].pop(fd, None)
        if conn.client is not None and self._by_client.get(conn.client) == fd:
            del self._by_client[conn.client]
        self.tcp -= 1
        left = self._per_source.get(conn.source, 0) - 1
        if left > 0:
            self._per_source[conn.source] = left
        else:
            self._per_source.pop(conn.source, None)

    def sources(self) -> int:
        """TCP source addresses connected now."""
        return len(self._per_source)


def source_key(address: str) -> str:
    """The per-source cap's key of a peer address: IPv4 as it is, IPv6 by its /64 (one
    host often holds a whole /64), an IPv4-mapped IPv6 address as its IPv4 address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


def tcp_peer(fd: int, ports: Collection[int]) -> str | None:
    """The source address of ``fd`` if it is a TCP connection accepted on one of ``ports``;
    None when the fd is gone or is something else now (closed and reused)."""
    peer = tcp_peer_of(fd, ports)
    return None if peer is None else peer[0]


def _borrow(fd: int) -> socket.socket | None:
    """A socket object on libzmq's ``fd`` itself, no duplicate (``os.dup`` needs a free fd, and
    a shed matters most at the fd limit): the caller must ``detach()`` it, never close it.
    None when ``fd`` is closed or not a socket."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None


def tcp_peer_of(fd: int, ports: Collection[int]) -> Peer | None:
    """``(address, port)`` of the peer of ``fd`` if it is a TCP connection accepted on one of
    ``ports``; None when the fd is gone or is something else now (closed and reused)."""
    sock = _borrow(fd)
    if sock is None:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        if sock.getsockname()[1] not in ports:
            return None
        name = sock.getpeername()
        return str(name[0]), int(name[1])
    except OSError:
        return None
    finally:
        sock.detach()  # libzmq's fd: never closed here


def shed_tcp(fd: int, ports: Collection[int], peer: Peer | None = None) -> bool:
    """Shut down the accepted TCP connection ``fd`` if it is still one of ``ports``' (and, given
    ``peer``, still that peer's: the fd may have been closed and reused by a new connection);
    libzmq closes it on seeing EOF, its handshake done or not. False when it is gone or reused."""
    sock = _borrow(fd)
    if sock is None:
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.getsockname()[1] not in ports:
            return False
        name = sock.getpeername()  # a connection, not a listener
        if peer is not None and (str(name[0]), int(name[1])) != peer:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


def shed(fd: int, path: str) -> bool:
    """Shut down the accepted connection ``fd`` if it is still one of ``path``'s (libzmq
    closes it on seeing EOF); False when the fd is gone or now something else. An accepted
    unix connection keeps its listener's bound name through a pause's rename."""
    sock = _borrow(fd)
    if sock is None:
        return False
    try:
        if sock.family != socket.AF_UNIX or sock.getsockname() != path:
            return False  # closed and reused for something else meanwhile: leave it alone
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()  # libzmq's fd: never closed here
