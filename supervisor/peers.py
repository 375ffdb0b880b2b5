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
per request (libzmq bounds a peer's queue in messages, not bytes). Each such
peer has a token bucket (:class:`ErrorBudget`): ``burst`` replies at once,
``rate`` per second after that; beyond it requests are dropped unanswered
(counted). The table of buckets is itself bounded (least recently seen
peers forgotten first).

Loop thread only; the clock is injectable for tests.
"""

from __future__ import annotations

import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["ConnectionGate", "ErrorBudget", "shed", "short"]

#: the longest text an error to an unauthenticated peer carries
MAX_ERROR_TEXT = 200


def short(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` cut to ``limit`` characters: errors never echo unbounded input."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class ErrorBudget:
    """Per-peer token buckets for error replies to unauthenticated requests."""

    burst: float = 64.0
    rate: float = 64.0
    max_peers: int = 4096
    clock: Callable[[], float] = time.monotonic
    dropped: int = field(default=0, init=False)
    _buckets: OrderedDict[bytes, tuple[float, float]] = field(default_factory=OrderedDict, init=False)

    def allow(self, peer: bytes) -> bool:
        """True when ``peer`` may be sent one more error reply now (and take it)."""
        now = self.clock()
        tokens, last = self._buckets.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        else:
            self.dropped += 1
        self._buckets[peer] = (tokens, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


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
