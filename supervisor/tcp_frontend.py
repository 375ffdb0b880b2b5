"""The TCP frontend: one CURVE ROUTER socket bound to every ``listen`` endpoint.

    remote client ──DEALER (CURVE client)──► ROUTER tcp://HOST:PORT (CURVE server)
                                               │ libzmq: handshake, encryption, server authentication
                                               │ ZAP (zmq.auth thread): fewer than max_tcp_peers
                                               │   peers? client key in client_keys_dir (if set)?
                                               ▼
                                          the loop: the same decode, capability check, back-pressure,
                                          fairness and size limits as the ipc frontend; admin ops
                                          refused unless allow_remote_admin = true

What it owns: the socket, its monitor socket and the count of connections
it keeps, the ZAP authenticator thread, and the endpoints as bound
(port 0 resolved). What it may touch: nothing of the loop's; the loop polls
:attr:`socket` beside the ipc frontend (telling the two apart by the first
byte of a client key, :data:`TCP_INDEX`) and :attr:`monitor`, whose events
(:meth:`on_monitor`) keep the peer count.

Threads: the ZAP thread owns only its ZAP socket and the allow-list it read;
it reads :attr:`peers` (an int the loop thread writes, read whole under the
GIL) to refuse handshakes past ``max_tcp_peers``. The count can lag the
connections libzmq accepted by the monitor events the loop has not read
yet, so the bound is approximate by that much - and it is what keeps the
supervisor's file descriptors (and the per-peer queues libzmq keeps)
bounded. A connection that never completes its handshake holds a slot for
at most ``HANDSHAKE_IVL``.

Unauthenticated peers never reach the loop: a peer that fails the handshake
is dropped by libzmq, and a stalled handshake ends after ``HANDSHAKE_IVL``.
ZMTP heartbeats drop a peer that vanished without a FIN (power loss), so its
queues are freed.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from shared.config import SupervisorConfig
from shared.log import get_logger, log_event
from supervisor.curve import CurveKeyPair, check_client_keys_dir

__all__ = ["IPC_INDEX", "TCP_INDEX", "TcpFrontend"]

_log = get_logger("supervisor.tcp")

#: first byte of a client key: which frontend socket the client came through
IPC_INDEX = 0
TCP_INDEX = 1
#: a CURVE handshake must finish within this (libzmq default: 30 s)
HANDSHAKE_IVL_MS = 10_000
#: ZMTP heartbeats: a silent peer is dropped after the timeout
HEARTBEAT_IVL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 6_000


class _Gate(ThreadAuthenticator):
    """ZAP for the TCP frontend: the peer budget first, then the allow-list (or any key)."""

    def __init__(self, zctx: zmq.Context[Any], frontend: TcpFrontend, max_peers: int) -> None:
        super().__init__(zctx, log=get_logger("supervisor.zap"))
        self._frontend = frontend
        self._max_peers = max_peers
        self.refused = 0  # handshakes refused for the budget (ZAP thread writes, anyone reads)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        # the connection asking is counted already (accepted before its handshake can end)
        if self._frontend.peers > self._max_peers:
            self.refused += 1
            return False, b"too many peers"
        return await super()._authenticate_curve(domain, client_key)


class TcpFrontend:
    """Binds the CURVE ROUTER; raises OSError naming the endpoint when one cannot be bound."""

    def __init__(self, zctx: zmq.Context[Any], config: SupervisorConfig, keys: CurveKeyPair, hwm: int) -> None:
        self.keys = keys
        self.endpoints: list[str] = []
        self.max_peers = config.max_tcp_peers
        #: TCP connections now, authenticated or in their handshake (loop thread writes; ZAP thread reads)
        self.peers = 0
        self._peer_fds: set[int] = set()
        self._full_logged = False
        self.monitor: zmq.Socket[Any] | None = None
        allowed = check_client_keys_dir(config.client_keys_dir) if config.client_keys_dir is not None else None
        s = zctx.socket(zmq.ROUTER)
        self.socket: zmq.Socket[Any] = s
        self._auth: _Gate | None = _Gate(zctx, self, config.max_tcp_peers)
        try:
            self._auth.start()  # before the bind: no handshake may pass unchecked
            if config.client_keys_dir is not None:
                self._auth.configure_curve(domain="*", location=config.client_keys_dir)
                log_event(_log, logging.INFO, "supervisor.tcp_allow_list", dir=config.client_keys_dir, keys=allowed)
            else:
                self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
            s.setsockopt(zmq.SNDHWM, hwm)
            s.setsockopt(zmq.RCVHWM, hwm)
            s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            s.setsockopt(zmq.TCP_KEEPALIVE, 1)
            s.curve_server = True
            s.curve_secretkey = keys.secret
            s.curve_publickey = keys.public
            for ep in config.listen:
                try:
                    s.bind(ep)
                except zmq.ZMQError as exc:
                    code = exc.errno if exc.errno in errno.errorcode else errno.EINVAL
                    raise OSError(code, f"cannot listen on {ep}: {exc.strerror}") from None
                self.endpoints.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
            self.monitor = s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        except BaseException:
            self.close()
            raise
        log_event(_log, logging.INFO, "supervisor.tcp_listening", endpoints=self.endpoints,
                  server_public_key=keys.public_text, allow_list=config.client_keys_dir is not None)

    def on_monitor(self) -> None:
        """Loop thread: count the TCP connections (by fd) from the socket's monitor events."""
        assert self.monitor is not None
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])  # accepted and disconnected both carry the connection's fd
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._peer_fds.add(fd)
            else:
                self._peer_fds.discard(fd)
            self.peers = len(self._peer_fds)
        full = self.peers >= self.max_peers
        if full != self._full_logged:
            self._full_logged = full
            log_event(_log, logging.WARNING if full else logging.INFO, "supervisor.tcp_peers",
                      peers=self.peers, max_tcp_peers=self.max_peers, refusing_new=full)

    def close(self) -> None:
        """Close the sockets and stop the ZAP thread (the loop's context is destroyed after)."""
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
        if not self.socket.closed:
            self.socket.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
