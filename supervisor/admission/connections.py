"""The frontend's connections, ipc and TCP, counted and shed before the fd limit.

libzmq accepts a client's connection on its I/O thread (one fd each) and
aborts the whole process when an ipc ``accept`` fails with EMFILE. So the
supervisor watches each frontend socket's monitor (``frontend.ipc``, the
small-frame ``small.ipc`` and the TCP one): every ACCEPTED event
carries the new connection's fd, every DISCONNECTED one ends a connection.
One :class:`~supervisor.admission.peers.ConnectionGate` counts both transports against
one budget (:func:`supervisor.host.fdlimit.fd_budget` of the soft limit in force,
re-read every second so a lowered limit is honoured); TCP connections are
also held to ``max_tcp_peers`` and ``max_tcp_peers_per_source``, counted at
accept whether or not they ever send a greeting. A connection past a bound is
shut down at once (:func:`~supervisor.admission.peers.shed` / ``shed_tcp``): the client
sees its connection closed and retries, and every client already connected
keeps working. Unbinding the endpoint instead would also drop those. A TCP
connection accepted at ``max_tcp_peers`` first evicts an idle session, and the
frontend's timer closes sessions idle for ``tcp_idle_timeout_s``
(:meth:`FrontendConnections.expire_idle`; the rules are the gate's).

The monitors' queues are deep (:data:`MONITOR_HWM` events): a lost ACCEPTED
would leave a connection uncounted, a lost DISCONNECTED a slot taken (until
its fd is reused, which the gate notices).

Owns: the monitor sockets and the gate. Loop thread only (``on_readable`` /
``on_tcp_readable`` are registered with the loop).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Container
from typing import TypedDict

import zmq

from shared.log import get_logger, log_event
from shared.zmq_monitor import recv_monitor_event
from supervisor.host.fdlimit import fd_budget
from supervisor.admission.peers import ConnectionGate, shed, shed_tcp, source_key, tcp_peer_of

__all__ = ["ConnectionStatus", "FrontendConnections", "watch"]


class ConnectionStatus(TypedDict):
    """The frontend's connection counters in a status (fields of ``shared.records.SupervisorRecord``)."""

    fd_limit: int
    connections: int
    connection_budget: int
    connections_shed: int
    connections_shed_by: dict[str, int]
    tcp_connections: int
    tcp_sources: int


_log = get_logger("supervisor.admission.connections")
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
#: monitor events handled per loop turn (the rest wait in the monitor's queue)
EVENTS_PER_TURN = 256
#: events a monitor queues before libzmq drops them (default: 1,000)
MONITOR_HWM = 100_000
#: at most one "shedding" log line per reason this often
_LOG_EVERY_S = 10.0
#: rounds of EVENTS_PER_TURN events :meth:`FrontendConnections.settle` reads at most
_SETTLE_ROUNDS = 16


def _nobody() -> Container[bytes]:
    return ()


def watch(sock: zmq.Socket[bytes], events: int = _EVENTS) -> zmq.Socket[bytes]:
    """A monitor socket for ``sock`` with a deep queue (pyzmq's ``get_monitor_socket``
    keeps libzmq's default of 1,000 events). Call it before ``bind``: a connection
    accepted before it would never be counted."""
    addr = f"inproc://twt-monitor-{id(sock):x}-{time.monotonic_ns():x}"
    sock.monitor(addr, events)
    pair: zmq.Socket[bytes] = sock.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.setsockopt(zmq.RCVHWM, MONITOR_HWM)
    pair.connect(addr)
    return pair


class FrontendConnections:
    """Counts the frontend's connections and sheds those past the bounds."""

    def __init__(self, sock: zmq.Socket[bytes], path: str, *, max_tcp_peers: int = 1 << 30,
                 max_tcp_peers_per_source: int = 1 << 30, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        #: the client keys with a request in flight (the frontend's answer, given once it exists):
        #: a session with one is never dropped for idleness nor evicted
        self.busy: Callable[[], Container[bytes]] = _nobody
        self.monitor: zmq.Socket[bytes] = watch(sock)
        self.tcp_monitor: zmq.Socket[bytes] | None = None
        #: the small-frame ipc socket's monitor and path, once watched (:meth:`watch_small`)
        self.small_monitor: zmq.Socket[bytes] | None = None
        self.small_path = ""
        self._tcp_sock: zmq.Socket[bytes] | None = None
        #: the local ports of the TCP listeners (a shed fd must still be one of theirs)
        self.tcp_ports: set[int] = set()
        #: the soft limit the budget was computed from
        self.limit = self.soft_limit()
        self.gate = ConnectionGate(fd_budget(self.limit), max_tcp_peers, max_tcp_peers_per_source)
        self._logged: dict[str, float] = {}

    @staticmethod
    def soft_limit() -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft != resource.RLIM_INFINITY else 1 << 20

    def refresh_limit(self) -> int:
        """Re-read the soft limit (an operator may lower it with prlimit); returns it."""
        self.limit = soft = self.soft_limit()
        self.gate.budget = fd_budget(soft)
        return soft

    def watch_tcp(self, sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        """Count the TCP frontend's connections too (call before it binds; then add each
        bound port to :attr:`tcp_ports`). Returns the monitor socket for the loop."""
        self._tcp_sock = sock
        self.tcp_monitor = watch(sock)
        return self.tcp_monitor

    def watch_small(self, sock: zmq.Socket[bytes], path: str) -> zmq.Socket[bytes]:
        """Count the local small-frame socket's connections (``small.ipc``, at ``path``) in the same
        budget (call before it binds). Returns the monitor socket for the loop (:meth:`on_small_readable`)."""
        self.small_path = path
        self.small_monitor = watch(sock)
        return self.small_monitor

    def on_readable(self) -> None:
        """Handle what the ipc monitor reported (registered with the loop): at most
        ``EVENTS_PER_TURN``, so a reconnect storm cannot keep the loop here."""
        self._ipc_events(self.monitor, self.path)

    def on_small_readable(self) -> None:
        """The small-frame ipc socket's monitor events (registered with the loop), as :meth:`on_readable`."""
        assert self.small_monitor is not None
        self._ipc_events(self.small_monitor, self.small_path)

    def _ipc_events(self, monitor: zmq.Socket[bytes], path: str) -> None:
        for _ in range(EVENTS_PER_TURN):
            try:
                kind, fd = recv_monitor_event(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if kind == zmq.EVENT_ACCEPTED:
                reason = self.gate.accepted(fd)
                if reason is not None:
                    shed(fd, path)
                    self._log_shed(reason)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.gate.disconnected(fd)

    def on_tcp_readable(self) -> None:
        """The TCP monitor's events (registered with the loop), ``EVENTS_PER_TURN`` at most."""
        assert self.tcp_monitor is not None
        for _ in range(EVENTS_PER_TURN):
            try:
                kind, fd = recv_monitor_event(self.tcp_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if kind == zmq.EVENT_ACCEPTED:
                peer = tcp_peer_of(fd, self.tcp_ports)
                if peer is None:
                    continue  # closed already (its DISCONNECTED follows) or the fd reused
                source, now = source_key(peer[0]), self.clock()
                if self.gate.full_for(source):  # at max_tcp_peers: evict an idle session for it
                    victim = self.gate.victim(now, self.busy)
                    if victim is not None:
                        self.gate.drop(victim[0], "evicted")
                        shed_tcp(victim[0], self.tcp_ports, victim[1])
                        self._log_shed("evicted", source=victim[1][0] if victim[1] else "", by=peer[0])
                reason = self.gate.accepted(fd, tcp=True, source=source, peer=peer, now=now)
                if reason is not None:
                    shed_tcp(fd, self.tcp_ports, peer)
                    self._log_shed(reason, source=peer[0])
            elif kind == zmq.EVENT_DISCONNECTED:
                self.gate.disconnected(fd, tcp=True)

    def settle(self) -> None:
        """Read the TCP monitor's queued events now (a message came on a connection whose ACCEPTED
        is still queued: libzmq reports it before the connection can carry a message)."""
        if self.tcp_monitor is None:
            return
        for _ in range(_SETTLE_ROUNDS):
            if not self.tcp_monitor.poll(0):
                return
            self.on_tcp_readable()

    def expire_idle(self, idle_s: float) -> int:
        """Close the TCP sessions idle for ``idle_s`` (no request, none in flight: see
        :meth:`ConnectionGate.expire`); how many. The monitor's events are read first, so the
        fds are current."""
        self.settle()
        dropped = self.gate.expire(self.clock(), idle_s, self.busy)
        for fd, peer in dropped:
            shed_tcp(fd, self.tcp_ports, peer)
        if dropped:
            self._log_shed("idle", logging.INFO, sessions=len(dropped), idle_s=idle_s)
        return len(dropped)

    def _log_shed(self, reason: str, level: int = logging.WARNING, **fields: object) -> None:
        now = time.monotonic()
        if now - self._logged.get(reason, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[reason] = now
            gate = self.gate
            log_event(_log, level, "supervisor.connection_shed", reason=reason,
                      connections=gate.connected, budget=gate.budget, tcp=gate.tcp, max_tcp_peers=gate.max_tcp,
                      shed=gate.shed_by.get(reason, 0), **fields)

    def status(self) -> ConnectionStatus:
        gate = self.gate
        return {
            "fd_limit": self.limit,
            "connections": gate.connected,
            "connection_budget": gate.budget,
            "connections_shed": gate.shed,
            "connections_shed_by": dict(gate.shed_by),
            "tcp_connections": gate.tcp,
            "tcp_sources": gate.sources(),
        }

    def close(self) -> None:
        if self._tcp_sock is not None and self.tcp_monitor is not None:
            if not self._tcp_sock.closed:
                self._tcp_sock.monitor(None, 0)
            self.tcp_monitor.close(0)
            self.tcp_monitor = None
        if self.small_monitor is not None:
            self.small_monitor.close(0)
            self.small_monitor = None
        self.monitor.close(0)
