"""The metrics port's HTTP server: one thread, one event loop, a fixed number of connections.

It serves ``/metrics`` and the probes to anyone who can reach the port, so it
must not be a way to hurt the supervisor. A thread per connection with a
10 s idle timeout was: ~1,000 slow connections under a 1,024-fd limit left
libzmq no descriptor for its next accept, and libzmq aborts the process on
EMFILE (every tenant down); each unfinished 64 KiB header pinned ~6 MB.
Here every cost is bounded before it is paid::

    listener ──accept──► at max_connections? ──yes──► 503 (best effort), closed at once: refused "max_connections"
                               │ no
                               ▼
    READING   the request head, at most MAX_HEAD_BYTES, complete within timeout_s of the accept
              (a byte a second is cut at the deadline: refused "deadline"; too big: 431)
    WAITING   for a fresh render (supervisor.observe.scrape_cache); unregistered from the selector
    WRITING   the answer (headers + the render's shared bytes: no copy per client), within timeout_s
    DRAINING  our side shut down, the peer's leftovers read and dropped for at most LINGER_S,
              so it reads the answer before our close (a close with unread bytes is a reset)

* **Descriptors**: the listener, the selector, the wake-up pair and the
  connections are reserved in the supervisor's fd budget
  (:func:`supervisor.host.fdlimit.reserve_fds`): the frontend's budget
  leaves them out, so the metrics port can never take the descriptor libzmq
  needs. ``max_connections`` is held to :func:`~supervisor.host.fdlimit.max_reservation`
  of the soft limit (re-read every second, as the frontend does).
* **Memory**: at most ``max_connections`` x :data:`MAX_HEAD_BYTES` of request
  heads; answers share the render's bytes.
* **CPU**: rendering is the cache's, at a bounded rate; this thread parses
  small heads and copies nothing big.
* **Authentication**: paths marked ``protected`` need ``Authorization: Bearer
  <token>`` when a :class:`~supervisor.observe.http_auth.BearerToken` is given (401 otherwise); the probes
  stay open for the kubelet.

HTTP/1.0 and 1.1 ``GET`` / ``HEAD``, one request per connection
(``Connection: close``); the query string is ignored.

Owns: the listener, the selector, the wake-up pair, every connection, the fd
reservation, and (through its factory) the :class:`~supervisor.observe.scrape_cache.ScrapeCache`.

Threads: the server's own thread runs the loop and owns every socket; any
thread may call :meth:`HttpServer.wake` and :meth:`HttpServer.close`. The
counters in :class:`HttpStats` are written by the loop thread only and read
by the render thread (ints and dict lookups: atomic under the GIL).
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

from shared.log import get_logger, log_event
from supervisor.host.fdlimit import FdReservation, max_reservation, reserve_fds, soft_fd_limit
from supervisor.observe.http_auth import BearerToken
from supervisor.observe.scrape_cache import Rendered, ScrapeCache

__all__ = [
    "LINGER_S",
    "MAX_HEAD_BYTES",
    "OVERHEAD_FDS",
    "REFUSAL_REASONS",
    "HttpServer",
    "HttpStats",
    "Response",
    "Route",
]

_log = get_logger("supervisor.observe.metrics")

#: the request line and headers together: past it 431 (a scrape's head is a few hundred bytes)
MAX_HEAD_BYTES = 8192
#: after the answer, how long the peer's leftover bytes are read and dropped before the close
LINGER_S = 1.0
#: descriptors the server holds besides its connections: listener, selector (epoll), wake-up pair,
#: and one accepted past the bound for the moment it takes to close it
OVERHEAD_FDS = 5
#: why a connection ended without the answer it asked for (``twt_metrics_http_refused_total{reason}``)
REFUSAL_REASONS = ("max_connections", "deadline", "head_too_large", "bad_request", "unauthorized", "accept_failed")
#: accepts per wake-up, so a connection flood cannot keep the loop from its connections
_ACCEPTS_PER_TURN = 64
#: after an accept failed (EMFILE, ENFILE, ENOMEM ...), the listener rests this long
_ACCEPT_PAUSE_S = 0.25
#: at most one "accept failed" log line this often
_LOG_EVERY_S = 10.0
_READ_CHUNK = 4096
#: bytes read and dropped while draining, at most
_DRAIN_BYTES = 64 << 10
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 46\r\n"
         b"Connection: close\r\nRetry-After: 1\r\n\r\nmetrics server busy: too many connections now\n")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class Response:
    """What a route answers: a status code, the body, its type, and extra headers."""

    code: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Route:
    """A path: how to answer it from a fresh render; ``protected`` needs the bearer token (when set)."""

    answer: Callable[[Rendered], Response]
    protected: bool = False


@dataclass
class HttpStats:
    """The server's counters (loop thread writes, anyone reads)."""

    #: connections open now, and the bound in force
    connections: int = 0
    limit: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    #: answers sent, by status code
    responses: dict[int, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


_READING, _WAITING, _WRITING, _DRAINING = range(4)
_T = TypeVar("_T")


class _Conn:
    """One connection and where it stands."""

    __slots__ = ("after", "buf", "deadline", "drained", "method", "out", "path", "sock", "state")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.state = _READING
        self.deadline = deadline
        self.buf = bytearray()
        self.out: list[memoryview] = []
        self.method = "GET"
        self.path = "/"
        self.after = 0  # WAITING: answered by the first render numbered above this
        self.drained = 0


class HttpServer:
    """The server, started in the constructor (a bad or busy address raises ``OSError`` there)."""

    def __init__(self, host: str, port: int, routes: Mapping[str, Route], cache_factory: Callable[
            [Callable[[], None]], ScrapeCache], *, max_connections: int, timeout_s: float,
            token: BearerToken | None = None, not_found: Callable[[str], Response] | None = None,
            clock: Callable[[], float] = time.monotonic, backlog: int = 128) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.routes = dict(routes)
        self.token = token
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.stats = HttpStats()
        self._not_found = not_found or (lambda path: Response(404, f"not found: {path}\n".encode()))
        self._clock = clock
        self._closing = False
        self._conns: dict[int, _Conn] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._reservation: FdReservation = reserve_fds("metrics HTTP server", 0)
        self._soft = -1
        self._refresh_limit()
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(backlog)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            self._reservation.release()
            raise
        self._listener = listener
        self.host = host
        self.port: int = listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._listening = True
        self._resume_at = 0.0
        self._accept_logged = -_LOG_EVERY_S
        self._next_limit_check = clock() + 1.0
        self.cache = cache_factory(self.wake)
        self._thread = threading.Thread(target=self._serve, name="twt-metrics", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ any thread

    def wake(self) -> None:
        """Have the loop look at the latest render (and at :attr:`_closing`) now."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already (or we are closing)

    def close(self) -> None:
        """Stop serving, close every connection and the listener, give the reservation back."""
        if self._closing:
            return
        self._closing = True
        self.wake()
        self._thread.join(5.0)
        self.cache.close()
        self._reservation.release()

    # ------------------------------------------------------------ loop thread

    def _refresh_limit(self) -> None:
        """The bound in force: ``max_connections``, held to an eighth of the soft fd limit."""
        soft = soft_fd_limit()
        if soft == self._soft:
            return
        self._soft = soft
        limit = max(1, min(self.max_connections, max_reservation(soft) - OVERHEAD_FDS))
        if limit < self.max_connections and self.stats.limit != limit:
            log_event(_log, logging.WARNING, "metrics.connections_limited", max_connections=self.max_connections,
                      limit=limit, fd_limit=soft, hint="an eighth of the fd limit; raise LimitNOFILE")
        self.stats.limit = limit
        self._reservation.resize(limit + OVERHEAD_FDS)

    def _serve(self) -> None:
        try:
            while not self._closing:
                now = self._clock()
                timeout = 1.0
                for conn in self._conns.values():
                    timeout = min(timeout, conn.deadline - now)
                if not self._listening:
                    timeout = min(timeout, self._resume_at - now)
                for key, mask in self._sel.select(max(0.0, timeout)):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        self._drain_wake()
                    else:
                        target = self._conns.get(key.fd)
                        if target is not None:
                            self._guarded(target, self._on_event, mask)
                self._expire(self._clock())
        except Exception as exc:  # noqa: BLE001 - logged; the supervisor keeps serving its tenants
            log_event(_log, logging.ERROR, "metrics.server_failed", error=repr(exc))
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, _addr = self._listener.accept()
            except BlockingIOError:
                return
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE / ENFILE / ENOBUFS / ENOMEM: rest, never spin
                self.stats.refuse("accept_failed")
                now = self._clock()
                if now - self._accept_logged >= _LOG_EVERY_S:
                    self._accept_logged = now
                    log_event(_log, logging.WARNING, "metrics.accept_failed",
                              error=errno.errorcode.get(exc.errno or 0, str(exc)),
                              failed=self.stats.refused["accept_failed"])
                self._sel.unregister(self._listener)
                self._listening = False
                self._resume_at = self._clock() + _ACCEPT_PAUSE_S
                return
            sock.setblocking(False)
            if len(self._conns) >= self.stats.limit:
                self.stats.refuse("max_connections")
                try:
                    sock.send(_BUSY)
                except OSError:
                    pass
                sock.close()
                continue
            conn = _Conn(sock, self._clock() + self.timeout_s)
            self._conns[sock.fileno()] = conn
            self.stats.connections = len(self._conns)
            self._sel.register(sock, selectors.EVENT_READ, None)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(512):
                pass
        except (BlockingIOError, OSError):
            pass
        latest = self.cache.latest
        if latest is None:
            return
        for conn in list(self._conns.values()):
            if conn.state == _WAITING and latest.number > conn.after:
                self._guarded(conn, self._answer, latest)

    def _guarded(self, conn: _Conn, step: Callable[[_Conn, _T], None], arg: _T) -> None:
        """``step(conn, arg)``; a bug there costs that connection (closed, logged), never the server."""
        try:
            step(conn, arg)
        except Exception as exc:  # noqa: BLE001 - one connection's bug must not stop the port
            log_event(_log, logging.ERROR, "metrics.connection_failed", error=repr(exc), path=conn.path[:200])
            self._close(conn)

    def _on_event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            if conn.state == _READING:
                self._read_head(conn)
            elif conn.state == _DRAINING:
                self._drain(conn)
        if mask & selectors.EVENT_WRITE and conn.state == _WRITING:
            self._write(conn)

    def _recv(self, conn: _Conn) -> bytes | None:
        """Bytes from the peer; b"" at its end; None when none are there yet."""
        try:
            return conn.sock.recv(_READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def _read_head(self, conn: _Conn) -> None:
        data = self._recv(conn)
        if data is None:
            return
        if not data:
            self._close(conn)  # the peer left before asking
            return
        start = max(0, len(conn.buf) - 3)
        conn.buf += data
        end = conn.buf.find(b"\r\n\r\n", start)
        sep = 4
        if end < 0:
            end, sep = conn.buf.find(b"\n\n", start), 2
        if end < 0 or end + sep > MAX_HEAD_BYTES:
            if len(conn.buf) > MAX_HEAD_BYTES:
                self.stats.refuse("head_too_large")
                self._send(conn, Response(431, f"request head over {MAX_HEAD_BYTES} bytes\n".encode()))
            return
        head = bytes(conn.buf[:end]).decode("latin-1")
        conn.buf = bytearray()
        self._route(conn, head)

    def _route(self, conn: _Conn, head: str) -> None:
        lines = head.replace("\r\n", "\n").split("\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.stats.refuse("bad_request")
            self._send(conn, Response(400, b"bad request line\n"))
            return
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            self.stats.refuse("bad_request")
            self._send(conn, Response(405, b"only GET and HEAD\n", headers=(("Allow", "GET, HEAD"),)))
            return
        conn.method = method
        try:
            path = urlsplit(target).path or "/"
        except ValueError:
            path = ""
        conn.path = path
        route = self.routes.get(path)
        if route is None:
            self._send(conn, self._not_found(path[:200]))
            return
        if route.protected and self.token is not None:
            authorization = None
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep and name.strip().lower() == "authorization":
                    authorization = value
            if not self.token.accepts(authorization):
                self.stats.refuse("unauthorized")
                self._send(conn, Response(401, b"unauthorized: send Authorization: Bearer <token>\n",
                                          headers=(("WWW-Authenticate", 'Bearer realm="twt-metrics"'),)))
                return
        now = self._clock()
        conn.deadline = now + self.timeout_s
        fresh = self.cache.fresh(now)
        if fresh is not None:
            self._answer(conn, fresh)
            return
        latest = self.cache.latest
        conn.after = latest.number if latest is not None else 0
        conn.state = _WAITING
        self._sel.unregister(conn.sock)
        self.cache.want()

    def _answer(self, conn: _Conn, rendered: Rendered) -> None:
        route = self.routes[conn.path]
        if rendered.error is not None and route.protected:
            response = Response(500, f"metrics render failed: {rendered.error[:200]}\n".encode())
        else:
            response = route.answer(rendered)
        self._send(conn, response)

    def _send(self, conn: _Conn, response: Response) -> None:
        """Queue ``response`` (no body for HEAD) and start writing it."""
        self.stats.responses[response.code] = self.stats.responses.get(response.code, 0) + 1
        extra = "".join(f"{k}: {v}\r\n" for k, v in response.headers)
        head = (f"HTTP/1.1 {response.code} {_REASONS.get(response.code, 'Unknown')}\r\n"
                f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
                f"Cache-Control: no-store\r\nConnection: close\r\n{extra}\r\n").encode("latin-1")
        conn.out = [memoryview(head)]
        if conn.method != "HEAD" and response.body:
            conn.out.append(memoryview(response.body))
        was_registered = conn.state != _WAITING
        conn.state = _WRITING
        conn.deadline = self._clock() + self.timeout_s
        if was_registered:
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, None)
        else:
            self._sel.register(conn.sock, selectors.EVENT_WRITE, None)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.sendmsg(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        while sent and conn.out:
            first = conn.out[0]
            if sent >= len(first):
                sent -= len(first)
                conn.out.pop(0)
            else:
                conn.out[0] = first[sent:]
                sent = 0
        if conn.out:
            return
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state = _DRAINING
        conn.deadline = self._clock() + min(LINGER_S, self.timeout_s)
        self._sel.modify(conn.sock, selectors.EVENT_READ, None)

    def _drain(self, conn: _Conn) -> None:
        data = self._recv(conn)
        if data is None:
            return
        conn.drained += len(data)
        if not data or conn.drained > _DRAIN_BYTES:
            self._close(conn)

    def _expire(self, now: float) -> None:
        if not self._listening and now >= self._resume_at:
            self._sel.register(self._listener, selectors.EVENT_READ, None)
            self._listening = True
        if now >= self._next_limit_check:
            self._next_limit_check = now + 1.0
            self._refresh_limit()
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            if conn.state != _DRAINING:
                self.stats.refuse("deadline")
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return  # closed already
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass  # WAITING: not registered
        self._conns.pop(fd, None)
        self.stats.connections = len(self._conns)
        conn.sock.close()
