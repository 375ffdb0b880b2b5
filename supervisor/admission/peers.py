"""What the frontend knows of its peers: connections against the fd budget, and
the error replies an unauthenticated peer may still be sent.

Connections. libzmq accepts ipc and TCP connections on its own I/O thread, one
file descriptor each, and aborts the process when an ipc accept fails with
EMFILE. It has no connection limit (and unbinding an endpoint would also drop
every connected client), so the frontend watches its sockets' monitors
(ACCEPTED / DISCONNECTED, with the connection's fd) and shuts down each
connection accepted past a bound: the fd budget
(:func:`supervisor.admission.fdlimit.fd_budget`, half of the fds left) for ipc and TCP
together, and for TCP also ``max_tcp_peers`` and ``max_tcp_peers_per_source``,
counted at accept - a raw TCP connection that never sends the ZMTP greeting
never reaches ZAP, so only the accept can see it (issue 30, finding 1). libzmq
sees the peer gone and closes it, the client sees a refused connection (and
retries), and every connected client keeps working. :class:`ConnectionGate` is
the count and the decision; :func:`shed` / :func:`shed_tcp` the act.

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
replies under load); 1,024 small replies are ~300 KiB per peer. The table of peers is itself
bounded (least recently seen forgotten).

Loop thread only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field

import zmq

__all__ = ["ConnectionGate", "UnreadErrors", "shed", "shed_tcp", "short", "source_key", "tcp_peer"]

#: the longest text an error to an unauthenticated peer carries
MAX_ERROR_TEXT = 200


def short(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` cut to ``limit`` characters: errors never echo unbounded input."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class UnreadErrors:
    """Per peer, the error replies to unauthenticated requests it has not taken yet."""

    max_unread: int = 1024
    max_peers: int = 4096
    dropped: int = field(default=0, init=False)
    _peers: OrderedDict[bytes, deque[zmq.MessageTracker]] = field(default_factory=OrderedDict, init=False)

    def allow(self, peer: bytes) -> bool:
        """True when ``peer`` may be sent one more error reply now."""
        queue = self._peers.pop(peer, None)
        if queue is None:
            queue = deque()
        while queue and queue[0].done:
            queue.popleft()
        self._peers[peer] = queue
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        if len(queue) >= self.max_unread:
            self.dropped += 1
            return False
        return True

    def sent(self, peer: bytes, tracker: zmq.MessageTracker | None) -> None:
        """Remember a reply sent to ``peer`` (a ``zmq.MessageTracker``: ``done`` once taken)."""
        queue = self._peers.get(peer)
        if queue is not None and tracker is not None:
            queue.append(tracker)

    def __len__(self) -> int:
        return len(self._peers)


#: why a connection was shed (a key of :attr:`ConnectionGate.shed_by`)
ShedReason = str


@dataclass
class _Conn:
    tcp: bool
    source: str  # the peer's address (IPv6: its /64), "" for ipc


@dataclass
class ConnectionGate:
    """Every frontend connection (ipc and TCP) against one fd budget (of which TCP may
    take three quarters), and TCP connections against ``max_tcp`` (+ ``tcp_slack``)
    and ``max_per_source``.

    Keyed by (transport, fd) as the socket monitors report them: an ACCEPTED for a
    key already held replaces it (its DISCONNECTED was lost), a DISCONNECTED for a
    key not held is ignored, so the count never drifts for good.
    ``accepted`` answers the reason to shed the new connection, or None to keep it.

    TCP past ``max_tcp``: the first ``tcp_slack`` extra connections are kept so that
    the ZAP handler can refuse their handshake with a reason the client reads
    (:class:`~shared.errors.HandshakeFailed` naming ``max_tcp_peers``); past that
    they are shed at once, greeted or not.
    """

    budget: int
    max_tcp: int = 1 << 30
    max_per_source: int = 1 << 30
    tcp_slack: int = 8
    shed_by: dict[ShedReason, int] = field(default_factory=dict, init=False)
    tcp: int = field(default=0, init=False)
    _conns: dict[tuple[bool, int], _Conn] = field(default_factory=dict, init=False)
    _per_source: dict[str, int] = field(default_factory=dict, init=False)

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

    def accepted(self, fd: int = -1, *, tcp: bool = False, source: str = "") -> ShedReason | None:
        """A connection was accepted; the reason it must be shed, or None (it is counted)."""
        key = (tcp, fd)
        if key in self._conns:
            self._forget(key)
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
        self._conns[key] = _Conn(tcp, source)
        if tcp:
            self.tcp += 1
            self._per_source[source] = self._per_source.get(source, 0) + 1
        return None

    def disconnected(self, fd: int = -1, *, tcp: bool = False) -> None:
        self._forget((tcp, fd))

    def _forget(self, key: tuple[bool, int]) -> None:
        conn = self._conns.pop(key, None)
        if conn is None or not conn.tcp:
            return
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
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        if sock.getsockname()[1] not in ports:
            return None
        return str(sock.getpeername()[0])
    except OSError:
        return None
    finally:
        sock.close()  # our duplicate only


def shed_tcp(fd: int, ports: Collection[int]) -> bool:
    """Shut down the accepted TCP connection ``fd`` if it is still one of ``ports``' (libzmq
    closes it on seeing EOF, its handshake done or not); False when it is gone or reused."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.getsockname()[1] not in ports:
            return False
        sock.getpeername()  # a connection, not a listener
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def shed(fd: int, path: str) -> bool:
    """Shut down the accepted connection ``fd`` if it is still one of ``path``'s (libzmq
    closes it on seeing EOF); False when the fd is gone or now something else."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.family != socket.AF_UNIX or sock.getsockname() != path:
            return False  # closed and reused for something else meanwhile: leave it alone
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()  # our duplicate only
