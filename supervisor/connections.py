"""The frontend's connections, counted and shed before the fd limit (issue 12, finding 1).

libzmq accepts a client's ipc connection on its I/O thread (one fd each) and
aborts the whole process when ``accept`` fails with EMFILE. So the
supervisor watches its frontend socket's monitor: every ACCEPTED event
carries the new connection's fd, every DISCONNECTED one ends a connection.
Past the budget (:func:`supervisor.fdlimit.fd_budget` of the soft limit in
force, re-read every second so a lowered limit is honoured) the new
connection is shut down at once (:func:`supervisor.peers.shed`): the client
sees its connection refused and retries, and every client already connected
keeps working. Unbinding the endpoint instead would also drop those.

Owns: the monitor socket and the :class:`~supervisor.peers.ConnectionGate`.
Loop thread only (``on_readable`` is registered with the loop).
"""

from __future__ import annotations

import resource
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from supervisor.fdlimit import fd_budget
from supervisor.peers import ConnectionGate, shed

__all__ = ["FrontendConnections"]

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
#: monitor events handled per loop turn (the rest wait in the monitor's queue)
EVENTS_PER_TURN = 256


class FrontendConnections:
    """Counts the frontend's connections and sheds those past the fd budget."""

    def __init__(self, sock: zmq.Socket[Any], path: str) -> None:
        self.path = path
        self.monitor: zmq.Socket[Any] = sock.get_monitor_socket(_EVENTS)
        #: the soft limit the budget was computed from
        self.limit = self.soft_limit()
        self.gate = ConnectionGate(fd_budget(self.limit))

    @staticmethod
    def soft_limit() -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft != resource.RLIM_INFINITY else 1 << 20

    def refresh_limit(self) -> int:
        """Re-read the soft limit (an operator may lower it with prlimit); returns it."""
        self.limit = soft = self.soft_limit()
        self.gate.budget = fd_budget(soft)
        return soft

    def on_readable(self) -> None:
        """Handle what the monitor reported (registered with the loop): at most
        ``EVENTS_PER_TURN``, so a reconnect storm cannot keep the loop here."""
        for _ in range(EVENTS_PER_TURN):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                if self.gate.accepted():
                    shed(int(event["value"]), self.path)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.gate.disconnected()

    def close(self) -> None:
        self.monitor.close(0)
