"""What the frontend knows of its peers: connections against the fd budget, and
the error replies an unauthenticated peer may still be sent.

Connections. libzmq accepts ipc connections on its own I/O thread, one file
descriptor each, and aborts the process when accept fails with EMFILE. It has
no connection limit (and unbinding the endpoint would also drop every
connected client), so the frontend watches its socket's monitor (ACCEPTED /
DISCONNECTED, with the connection's fd) and shuts down each connection
accepted past the budget (:func:`supervisor.fdlimit.fd_budget`, half of the
fds left): libzmq sees the peer gone and closes it, the client sees a refused
connection (and retries), and every connected client keeps working.
:class:`ConnectionGate` is the count and the decision; :func:`shed` the act.

Unauthenticated peers. A request without a verified capability - garbage,
forged or foreign tokens - is answered with a small typed error, but a peer
that sends them and never reads would make the supervisor queue one reply
per request (libzmq bounds a peer's queue in messages, not bytes). So those
replies are sent tracked, and a peer with ``max_unread`` of them still held
by libzmq (not yet taken by the peer) gets no more until it reads: the rest
are dropped unanswered (counted). A peer that reads its replies gets them
all. The table of peers is itself bounded (least recently seen forgotten).

Loop thread only.
"""

from __future__ import annotations

import os
import socket
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConnectionGate", "UnreadErrors", "shed", "short"]

#: the longest text an error to an unauthenticated peer carries
MAX_ERROR_TEXT = 200


def short(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` cut to ``limit`` characters: errors never echo unbounded input."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class UnreadErrors:
    """Per peer, the error replies to unauthenticated requests it has not taken yet."""

    max_unread: int = 64
    max_peers: int = 4096
    dropped: int = field(default=0, init=False)
    _peers: OrderedDict[bytes, deque[Any]] = field(default_factory=OrderedDict, init=False)

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

    def sent(self, peer: bytes, tracker: Any) -> None:
        """Remember a reply sent to ``peer`` (a ``zmq.MessageTracker``: ``done`` once taken)."""
        queue = self._peers.get(peer)
        if queue is not None and tracker is not None:
            queue.append(tracker)

    def __len__(self) -> int:
        return len(self._peers)


@dataclass
class ConnectionGate:
    """Connected peers against a budget: which new connection to shed."""

    budget: int
    connected: int = field(default=0, init=False)
    shed: int = field(default=0, init=False)

    def accepted(self) -> bool:
        """One more connection; True when it is past the budget and must be shed."""
        self.connected += 1
        if self.connected > self.budget:
            self.shed += 1
            return True
        return False

    def disconnected(self) -> None:
        self.connected = max(0, self.connected - 1)


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
