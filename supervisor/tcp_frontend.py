"""The TCP frontend: one CURVE ROUTER socket bound to every ``listen`` endpoint.

    remote client ──DEALER (CURVE client)──► ROUTER tcp://HOST:PORT (CURVE server)
                                               │ libzmq: handshake, encryption, server authentication
                                               │ ZAP (zmq.auth thread): client key in client_keys_dir?
                                               ▼
                                          the loop: the same decode, capability check, back-pressure,
                                          fairness and size limits as the ipc frontend; admin ops
                                          refused unless allow_remote_admin = true

What it owns: the socket, the optional ZAP authenticator thread (it owns only
its own ZAP socket and reads the allow-list; it never touches loop state) and
the endpoints as bound (port 0 resolved). What it may touch: nothing of the
loop's; the loop polls :attr:`socket` beside the ipc frontend and tells the
two apart by the first byte of a client key (:data:`TCP_INDEX`).

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


class TcpFrontend:
    """Binds the CURVE ROUTER; raises OSError naming the endpoint when one cannot be bound."""

    def __init__(self, zctx: zmq.Context[Any], config: SupervisorConfig, keys: CurveKeyPair, hwm: int) -> None:
        self.keys = keys
        self.endpoints: list[str] = []
        self._auth: Any = None
        if config.client_keys_dir is not None:
            count = check_client_keys_dir(config.client_keys_dir)
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(zctx, log=get_logger("supervisor.zap"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=config.client_keys_dir)
            log_event(_log, logging.INFO, "supervisor.tcp_allow_list", dir=config.client_keys_dir, keys=count)
        s = zctx.socket(zmq.ROUTER)
        self.socket: zmq.Socket[Any] = s
        try:
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
        except BaseException:
            self.close()
            raise
        log_event(_log, logging.INFO, "supervisor.tcp_listening", endpoints=self.endpoints,
                  server_public_key=keys.public_text, allow_list=config.client_keys_dir is not None)

    def close(self) -> None:
        """Close the socket and stop the ZAP thread (the loop's context is destroyed after)."""
        if not self.socket.closed:
            self.socket.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
