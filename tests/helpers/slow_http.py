"""Many HTTP clients that never finish their request, on non-blocking sockets from one thread.

What an attacker of the metrics port does: open connections and send a head
that never ends (a slowloris), or a head far past any sane size. Each client
sends its bytes once, then reads until the server closes the connection;
:class:`SlowClients` reports how each one ended, and holds every socket until
:meth:`SlowClients.close` (or the context manager's exit).
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Outcome", "SlowClients"]


@dataclass
class Outcome:
    """One client: the status code the server answered (None: none), whether it has ended (closed or
    reset by the server, or refused), and how many of its bytes were sent."""

    sent: int = 0
    code: int | None = None
    ended: bool = False
    received: bytearray = field(default_factory=bytearray)


class SlowClients:
    """``count`` connections to ``addr``, each sending ``payload`` and never the end of its head."""

    def __init__(self, addr: tuple[str, int], count: int, payload: bytes) -> None:
        self.addr = addr
        self.payload = payload
        self._sel = selectors.DefaultSelector()
        self._socks: list[socket.socket] = []
        self.outcomes: list[Outcome] = []
        try:
            for i in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._socks.append(s)
                s.setblocking(False)
                outcome = Outcome()
                self.outcomes.append(outcome)
                rc = s.connect_ex(addr)
                if rc not in (0, errno.EINPROGRESS):
                    outcome.ended = True
                    continue
                self._sel.register(s, selectors.EVENT_WRITE, i)
        except BaseException:
            self.close()
            raise

    def pump(self, seconds: float) -> None:
        """Send and read for ``seconds`` (or until every client has ended)."""
        deadline = time.monotonic() + seconds
        while not self.all_ended() and (left := deadline - time.monotonic()) > 0:
            for key, mask in self._sel.select(min(left, 0.1)):
                i = key.data
                sock = self._socks[i]
                out = self.outcomes[i]
                if mask & selectors.EVENT_WRITE and out.sent < len(self.payload):
                    try:
                        out.sent += sock.send(self.payload[out.sent:])
                    except BlockingIOError:
                        pass
                    except OSError:
                        self._end(i)
                        continue
                    if out.sent >= len(self.payload):
                        self._sel.modify(sock, selectors.EVENT_READ, i)
                    else:
                        self._sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, i)
                if mask & selectors.EVENT_READ:
                    try:
                        data = sock.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        self._end(i)
                        continue
                    if not data:
                        self._end(i)
                        continue
                    out.received += data[: 4096 - len(out.received)]
                    if out.code is None and out.received.startswith(b"HTTP/1.") and len(out.received) >= 12:
                        out.code = int(out.received[9:12])

    def pump_until(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Pump until ``done()``; an AssertionError naming ``what`` after ``timeout_s`` (a hang guard)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
            self.pump(0.2)

    def _end(self, i: int) -> None:
        self.outcomes[i].ended = True
        try:
            self._sel.unregister(self._socks[i])
        except (KeyError, ValueError):
            pass

    def ended(self) -> int:
        return sum(1 for o in self.outcomes if o.ended)

    def all_ended(self) -> bool:
        return all(o.ended for o in self.outcomes)

    def codes(self) -> dict[int | None, int]:
        out: dict[int | None, int] = {}
        for o in self.outcomes:
            out[o.code] = out.get(o.code, 0) + 1
        return out

    def close(self) -> None:
        self._sel.close()
        for s in self._socks:
            s.close()

    def __enter__(self) -> SlowClients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
