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

The guard thread (:mod:`supervisor.admission.fd_guard`), not the loop, reads the
monitors: it counts every live connection, renames the ipc paths away near the budget
(libzmq's I/O thread accepts whether the loop keeps up or not) and sheds the connections
that feed a message that never ends past ``frontend_memory_bytes``; each event it forwards
to the loop's gate unchanged. Each ipc listener's backlog is
:data:`~supervisor.admission.fd_guard.IPC_BACKLOG`.

Owns: the monitor sockets (the loop's ends), the guard thread's start and stop, and the gate.
The gate, ``on_readable`` / ``on_tcp_readable`` (registered with the loop): loop thread only;
:meth:`FrontendConnections.close` stops the guard.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable, Container
from typing import TypedDict

import zmq

from shared.log import get_logger, log_event
from shared.zmq_monitor import monitor_event
from supervisor.host.fdlimit import fd_budget
from supervisor.admission.fd_guard import EVENTS_PER_TURN, IPC_BACKLOG, SYNC, PathGuard, clean_paused, nobody
from supervisor.admission.peers import ConnectionGate, shed, shed_tcp, source_key, tcp_peer_of

__all__ = ["ConnectionStatus", "FrontendConnections"]


class ConnectionStatus(TypedDict):
    """The frontend's connection counters in a status (fields of ``shared.records.SupervisorRecord``)."""

    fd_limit: int
    connections: int
    connection_budget: int
    connections_shed: int
    connections_shed_by: dict[str, int]
    tcp_connections: int
    tcp_sources: int
    frontend_paused: bool
    frontend_pauses: int


_log = get_logger("supervisor.admission.connections")
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
#: events a monitor queues before libzmq drops them (default: 1,000)
MONITOR_HWM = 100_000
#: at most one "shedding" log line per reason this often
_LOG_EVERY_S = 10.0
#: rounds of EVENTS_PER_TURN events :meth:`FrontendConnections.settle` reads at most
_SETTLE_ROUNDS = 16
#: the longest :meth:`FrontendConnections.settle` waits for the guard's SYNC (the loop blocks, GIL released)
SETTLE_WAIT_MS = 2000


class FrontendConnections:
    """Counts the frontend's connections and sheds those past the bounds."""

    def __init__(self, sock: zmq.Socket[bytes], path: str, *, max_tcp_peers: int = 1 << 30,
                 max_tcp_peers_per_source: int = 1 << 30, clock: Callable[[], float] = time.monotonic,
                 pause: bool = True, memory_bytes: int = 0) -> None:
        """``pause``: rename the ipc paths away near the budget (False: only shed past it).
        ``memory_bytes``: the process's memory bound over its baseline, past which connections that
        complete no message are shed (0: none; see :mod:`supervisor.admission.fd_guard`)."""
        self.path = path
        self.clock = clock
        #: the client keys with a request in flight (the frontend's answer, given once it exists):
        #: a session with one is never dropped for idleness nor evicted
        self.busy: Callable[[], Container[bytes]] = nobody
        #: the guard thread: reads the monitors, pauses the ipc paths near the budget
        self.guard = PathGuard(lambda: self.gate.budget, os.path.dirname(path), pause, memory_bytes)
        clean_paused(self.guard.run_dir)  # a crashed supervisor's
        #: the sockets whose monitors the guard reads (stopped before the guard: :meth:`close`)
        self._watched: list[zmq.Socket[bytes]] = []
        self.monitor: zmq.Socket[bytes] = self._guarded(sock, path)
        self.tcp_monitor: zmq.Socket[bytes] | None = None
        #: the small-frame ipc socket's monitor and path, once watched (:meth:`watch_small`)
        self.small_monitor: zmq.Socket[bytes] | None = None
        self.small_path = ""
        self._tcp_sock: zmq.Socket[bytes] | None = None
        #: the local ports of the TCP listeners (a shed fd must still be one of theirs)
        self.tcp_ports: set[int] = set()
        self.guard.tcp_ports = self.tcp_ports
        #: the loop's view of the guard's table (see :meth:`completed`)
        self.seen = self.guard.completed
        #: the soft limit the budget was computed from
        self.limit = self.soft_limit()
        self.gate = ConnectionGate(fd_budget(self.limit), max_tcp_peers, max_tcp_peers_per_source)
        self._logged: dict[str, float] = {}
        self.guard.start()

    def _guarded(self, sock: zmq.Socket[bytes], path: str | None) -> zmq.Socket[bytes]:
        """Watch ``sock`` through the guard thread (before it binds): the socket the loop reads its
        monitor's events from, forwarded. ``path``: an ipc listener's, paused near the budget."""
        self._watched.append(sock)
        if path is not None:
            sock.setsockopt(zmq.BACKLOG, IPC_BACKLOG)
            self.guard.paths.append(path)
        ctx = sock.context
        addr = f"inproc://twt-monitor-{id(sock):x}-{time.monotonic_ns():x}"
        sock.monitor(addr, _EVENTS)
        monitor: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)  # the guard's (see PathGuard)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.setsockopt(zmq.RCVHWM, MONITOR_HWM)
        monitor.connect(addr)
        forward: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)
        forward.setsockopt(zmq.LINGER, 0)
        forward.setsockopt(zmq.SNDHWM, MONITOR_HWM)
        forward.bind(addr + "-fwd")
        out: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)  # the loop's
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.RCVHWM, MONITOR_HWM)
        out.connect(addr + "-fwd")
        self.guard.adopt(monitor, forward, path)
        return out

    def completed(self, fd: int, now: float, prefix: bytes, routing_id: zmq.Frame) -> None:
        """A message from ``prefix + routing_id`` completed on connection ``fd`` (its ``ZMQ_SRCFD``) at
        ``now`` (``time.monotonic``): it is not the one sending a message that never ends."""
        self.seen[fd] = (now, prefix, routing_id)

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
        self.tcp_monitor = self._guarded(sock, None)
        return self.tcp_monitor

    def watch_small(self, sock: zmq.Socket[bytes], path: str) -> zmq.Socket[bytes]:
        """Count the local small-frame socket's connections (``small.ipc``, at ``path``) in the same
        budget (call before it binds). Returns the monitor socket for the loop (:meth:`on_small_readable`)."""
        self.small_path = path
        self.small_monitor = self._guarded(sock, path)
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
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames == [SYNC]:
                continue
            kind, fd = monitor_event(frames)
            if kind == zmq.EVENT_ACCEPTED:
                reason = self.gate.accepted(fd)
                if reason is not None:
                    shed(fd, path)
                    self._log_shed(reason)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.gate.disconnected(fd)

    def on_tcp_readable(self) -> None:
        """The TCP monitor's events (registered with the loop), ``EVENTS_PER_TURN`` at most."""
        self._tcp_events()

    def _tcp_events(self) -> bool:
        """:meth:`on_tcp_readable`'s turn. True: the guard's :data:`SYNC` was among the events (the
        turn ends there: :meth:`settle`)."""
        assert self.tcp_monitor is not None
        for _ in range(EVENTS_PER_TURN):
            try:
                frames = self.tcp_monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if frames == [SYNC]:
                return True
            kind, fd = monitor_event(frames)
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
        return False

    def settle(self) -> None:
        """Read every TCP event libzmq has reported so far, now (a message came on a connection whose
        ACCEPTED is not read yet: libzmq reports it before the connection can carry a message). The
        events pass through the guard thread, so the guard is asked to forward all it holds and a
        :data:`SYNC` after them; the loop reads up to that mark (waiting at most
        :data:`SETTLE_WAIT_MS`: a guard starved that long leaves it as before, best effort)."""
        monitor = self.tcp_monitor
        if monitor is None:
            return
        if not self.guard.sync():
            for _ in range(_SETTLE_ROUNDS):
                if not monitor.poll(0):
                    return
                self.on_tcp_readable()
            return
        deadline = time.monotonic() + SETTLE_WAIT_MS / 1000
        while (left := deadline - time.monotonic()) > 0:
            if monitor.poll(max(1, int(left * 1000))) and self._tcp_events():
                return

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
        by = dict(gate.shed_by)
        if self.guard.memory_shed:
            by["memory"] = self.guard.memory_shed
        return {
            "fd_limit": self.limit,
            "connections": gate.connected,
            "connection_budget": gate.budget,
            "connections_shed": sum(by.values()),
            "connections_shed_by": by,
            "tcp_connections": gate.tcp,
            "tcp_sources": gate.sources(),
            "frontend_paused": self.guard.paused,
            "frontend_pauses": self.guard.pauses,
        }

    def close(self) -> None:
        # libzmq's monitors stop first, while the guard still reads them: an event sent to a monitor
        # whose reader is closed blocks libzmq's I/O thread (a PAIR without a peer) while it holds the
        # socket's monitor lock, and stopping the monitor then waits for that lock for ever
        for sock in self._watched:
            if not sock.closed:
                sock.monitor(None, 0)
        self.guard.stop()
        if self._tcp_sock is not None and self.tcp_monitor is not None:
            self.tcp_monitor.close(0)
            self.tcp_monitor = None
        if self.small_monitor is not None:
            self.small_monitor.close(0)
            self.small_monitor = None
        self.monitor.close(0)
