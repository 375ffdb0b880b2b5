"""ZAP for the CURVE TCP frontend (:mod:`supervisor.admission.tcp_frontend`): pyzmq's
authenticator thread with the frontend's peer budget checked before the allow-list.

The budget is full here only when the loop found no session to evict for the new connection
at its accept (:meth:`supervisor.admission.peers.ConnectionGate.victim`: an evicted session's
slot is given back at once), or has not read its ACCEPTED yet (then it is not counted either).

A module of its own so that ``zmq.auth`` (its thread runs an asyncio loop) is imported only by a
supervisor that listens on TCP.
"""

from __future__ import annotations

from typing import Protocol

import zmq
from zmq.auth import CURVE_ALLOW_ANY
from zmq.auth.thread import ThreadAuthenticator

from shared.log import get_logger

__all__ = ["CURVE_ALLOW_ANY", "Counted", "ZapGate"]


class Counted(Protocol):
    """What the gate reads of its frontend: how many TCP peers are connected now."""

    @property
    def peers(self) -> int: ...


class ZapGate(ThreadAuthenticator):
    """ZAP for the TCP frontend: the peer budget first, then the allow-list (or any key)."""

    def __init__(self, zctx: zmq.Context[zmq.Socket[bytes]], frontend: Counted, max_peers: int) -> None:
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
