"""The TCP frontend: one CURVE ROUTER socket bound to every ``listen`` endpoint.

    remote client ──DEALER (CURVE client)──► ROUTER tcp://HOST:PORT (CURVE server)
                                               │ libzmq: handshake, encryption, server authentication
                                               │ ZAP (zmq.auth thread): fewer than max_tcp_peers
                                               │   peers? client key in client_keys_dir (if set)?
                                               ▼
                                          the loop: the same decode, capability check, back-pressure,
                                          fairness and size limits as the ipc frontend; admin ops
                                          refused unless allow_remote_admin = true

What it owns: the socket, the ZAP authenticator thread, and the endpoints
as bound (port 0 resolved). What it may touch: nothing of the loop's; the
loop polls :attr:`socket` beside the ipc frontend (telling the two apart by
the first byte of a client key, :data:`TCP_INDEX`). Its connections are
counted by :class:`supervisor.admission.connections.FrontendConnections` from the
socket's monitor, in the same fd budget as the ipc ones:
every accepted connection, greeted or not, counts; one past the fd budget,
past ``max_tcp_peers_per_source`` for its address, or more than a few past
``max_tcp_peers`` is shut down at accept.

Threads: the ZAP thread owns only its ZAP socket and the allow-list it read;
it reads :attr:`peers` (an int the loop thread writes, read whole under the
GIL) to refuse handshakes past ``max_tcp_peers`` with a reason the client
reads; the count can lag the connections libzmq accepted by the monitor
events the loop has not read yet, so that refusal is approximate by as much,
and the shedding at accept is what bounds the file descriptors.

Unauthenticated peers never reach the loop: a peer that fails the handshake
is dropped by libzmq, and one that has not finished it within
``tcp_handshake_timeout_s`` (``ZMQ_HANDSHAKE_IVL``) is closed. ZMTP
heartbeats are off on this socket: with them on, libzmq 4.3.5 aborted on
``!_io_error`` (stream_engine_base.cpp:310) when keyless CURVE peers flooded
and closed (upstream zeromq/libzmq#4364). TCP keepalive
(tuned idle/interval/count) and ``TCP_USER_TIMEOUT`` drop a peer that vanished
without a FIN instead, and the loop's own deadlines answer every request. The
receive queue per peer is the ipc frontend's (a flood waits in its sender).

Completed handshakes do not hold a slot for good (any key completes one without
an allow-list): the loop notes each request's connection (``ZMQ_SRCFD``), closes
a session idle for ``tcp_idle_timeout_s`` with nothing in flight, and a
connection accepted at ``max_tcp_peers`` evicts the longest idle session
instead of being refused (:mod:`supervisor.admission.peers` has the rule; the
ZAP handler then finds room).
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

import zmq

from shared.config import SupervisorConfig
from shared.log import get_logger, log_event
from supervisor.admission.connections import FrontendConnections
from supervisor.admission.curve import CurveKeyPair, check_client_keys_dir

if TYPE_CHECKING:
    from supervisor.admission.zap_gate import ZapGate

__all__ = ["IPC_INDEX", "LOCAL_IO_AFFINITY", "SMALL_INDEX", "TCP_INDEX", "TCP_IO_AFFINITY", "TcpFrontend"]

_log = get_logger("supervisor.tcp")

#: first byte of a client key: which frontend socket the client came through
IPC_INDEX = 0
TCP_INDEX = 1
#: the local small-frame socket (``small.ipc``: supervisor.admission.frontend)
SMALL_INDEX = 2
#: ZMQ_AFFINITY masks when the context has two I/O threads: the first serves the local (ipc)
#: sockets, the second the CURVE TCP frontend
LOCAL_IO_AFFINITY = 1
TCP_IO_AFFINITY = 2
#: TCP keepalive: probe after 30 s idle, every 5 s, drop after 4 unanswered (~50 s)
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTVL_S = 5
KEEPALIVE_CNT = 4
#: TCP_USER_TIMEOUT: data unacknowledged this long drops the connection
TCP_MAXRT_MS = 60_000


class TcpFrontend:
    """Binds the CURVE ROUTER; raises OSError naming the endpoint when one cannot be bound."""

    def __init__(self, zctx: zmq.Context[zmq.Socket[bytes]], config: SupervisorConfig, keys: CurveKeyPair, hwm: int,
                 connections: FrontendConnections, *, rcvhwm: int | None = None) -> None:
        self.keys = keys
        self.endpoints: list[str] = []
        self.max_peers = config.max_tcp_peers
        self._connections = connections
        self.monitor: zmq.Socket[bytes] | None = None
        allowed = check_client_keys_dir(config.client_keys_dir) if config.client_keys_dir is not None else None
        s = zctx.socket(zmq.ROUTER)
        self.socket: zmq.Socket[bytes] = s
        # zmq.auth's thread (and the asyncio it runs on) is imported only by a supervisor that
        # listens on TCP: ~15 ms of every other supervisor's start-up
        from supervisor.admission.zap_gate import CURVE_ALLOW_ANY, ZapGate

        self._auth: ZapGate | None = ZapGate(zctx, self, config.max_tcp_peers)
        try:
            self._auth.start()  # before the bind: no handshake may pass unchecked
            if config.client_keys_dir is not None:
                self._auth.configure_curve(domain="*", location=config.client_keys_dir)
                log_event(_log, logging.INFO, "supervisor.tcp_allow_list", dir=config.client_keys_dir, keys=allowed)
            else:
                self._auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
            if zctx.get(zmq.IO_THREADS) > 1:  # the supervisor's: CURVE on an I/O thread of its own
                s.setsockopt(zmq.AFFINITY, TCP_IO_AFFINITY)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
            s.setsockopt(zmq.SNDHWM, hwm)
            s.setsockopt(zmq.RCVHWM, hwm if rcvhwm is None else rcvhwm)
            s.setsockopt(zmq.HANDSHAKE_IVL, max(1, round(config.tcp_handshake_timeout_s * 1000)))
            s.setsockopt(zmq.HEARTBEAT_IVL, 0)  # off: see the module docstring
            s.setsockopt(zmq.TCP_KEEPALIVE, 1)
            s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
            s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
            s.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
            s.setsockopt(zmq.TCP_MAXRT, TCP_MAXRT_MS)
            s.curve_server = True
            s.curve_secretkey = keys.secret
            s.curve_publickey = keys.public
            self.monitor = connections.watch_tcp(s)  # before the bind: every connection is counted
            for ep in config.listen:
                try:
                    s.bind(ep)
                except zmq.ZMQError as exc:
                    code = exc.errno if exc.errno in errno.errorcode else errno.EINVAL
                    raise OSError(code, f"cannot listen on {ep}: {exc.strerror}") from None
                bound = s.getsockopt_string(zmq.LAST_ENDPOINT)
                self.endpoints.append(bound)
                connections.tcp_ports.add(int(bound.rpartition(":")[2]))
        except BaseException:
            self.close()
            raise
        log_event(_log, logging.INFO, "supervisor.tcp_listening", endpoints=self.endpoints,
                  server_public_key=keys.public_text, allow_list=config.client_keys_dir is not None)

    @property
    def peers(self) -> int:
        """TCP connections now, in their handshake or authenticated (the loop thread
        writes the count; the ZAP thread reads it)."""
        return self._connections.gate.tcp

    def close(self) -> None:
        """Close the sockets and stop the ZAP thread (the loop's context is destroyed after)."""
        self.monitor = None  # closed by the connections' close (it owns the monitor)
        if not self.socket.closed:
            self.socket.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
