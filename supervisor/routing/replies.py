"""Sending answers to clients on the frontend sockets, and bounding what queues for them.

Owns: the frontend ROUTER sockets' *send* side (the two ipc ones, and the CURVE
TCP one when ``listen`` is set) and, per client, the big
reply bodies libzmq still holds (ZMQ bounds a peer's queue in messages, not
bytes). Touches nothing else; only :class:`supervisor.routing.pending.PendingTable`
and the frontend's admission check (:meth:`Replies.queued_bytes`) call it.
Loop thread only.

Sends never block: a client that is gone (EHOSTUNREACH) or not reading
(EAGAIN) loses its reply rather than stalling every other tenant.

A client key is one byte - the index of the socket the request came in on
(:data:`supervisor.admission.tcp_frontend.IPC_INDEX` / ``TCP_INDEX`` / ``SMALL_INDEX``) - followed by the
peer's ZeroMQ identity, so a reply leaves by the socket its request used.
Peers choose their identity, never the prefix: no client can be sent another
frontend's replies.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping

import zmq

from shared import protocol as proto
from shared.log import get_logger, log_event
from supervisor.routing.budgets import HeldBytes, Kind

__all__ = ["Replies"]

_log = get_logger("supervisor")

#: reply bodies from this size on are tracked per client (see :meth:`Replies.ok`)
TRACK_BYTES = 64 << 10

#: plain ints: pyzmq's flags are enum.Flag members, and ``send_multipart`` ORs SNDMORE into each
#: frame's and type-checks every frame - three times the cost of two plain ``send`` calls
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)


class Replies:
    """The frontend's send side (see the module docstring)."""

    def __init__(self, sockets: Mapping[int, zmq.Socket[bytes]] | list[zmq.Socket[bytes]], held: HeldBytes) -> None:
        self.sockets = sockets  # index = the first byte of a client key
        self.held = held
        #: per client: (tracker, body bytes, tenant, reserved bytes to give back once sent)
        self._queues: dict[bytes, collections.deque[tuple[zmq.MessageTracker, int, str, int]]] = {}

    def release(self, tenant: str, kind: Kind, n: int) -> None:
        """Give back bytes reserved in the held-bytes budgets (supervisor.routing.budgets)."""
        if n:
            self.held.release(tenant, kind, n)

    def ok(self, client: bytes | None, rid: int, result: object, body: zmq.Frame | bytes | memoryview | None = None, *,
           tenant: str = "", held: int = 0) -> bool:
        """Answer ``result`` (and ``body``). ``held``: reply bytes reserved for this request
        at admission; given back once libzmq lets go of a big body, else at once. False when
        the reply could not be queued (the client is gone, or not reading): it was not told."""
        if client is None:
            self.release(tenant, "replies", held)
            return True
        header = proto.encode_reply(rid, True, result)
        try:
            sock, ident = self.sockets[client[0]], client[1:]
            if body is None:  # the identity frame and the header, as send_multipart sends them
                send = sock.send
                send(ident, _MORE)
                send(header, _NOBLOCK)
            elif len(body) < TRACK_BYTES:
                sock.send_multipart([ident, header, body], _NOBLOCK, copy=False)
            else:
                # remember big bodies until libzmq lets go of them, so a client that does
                # not read is refused more of them instead of growing our memory
                view = body.buffer if isinstance(body, zmq.Frame) else memoryview(body)
                tracked = zmq.Frame(view, track=True)  # zero-copy: refers to the received frame
                tracker = sock.send_multipart([ident, header, tracked], zmq.NOBLOCK, copy=False, track=True)
                if tracker is not None:
                    self._queues.setdefault(client, collections.deque()).append((tracker, len(body), tenant, held))
                    return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (client gone) / EAGAIN (client not reading)
            log_event(_log, logging.DEBUG, "supervisor.reply_dropped", rid=rid, error=exc.strerror)
            if held:
                self.held.release(tenant, "replies", held)
            return False
        if held:
            self.held.release(tenant, "replies", held)
        return True

    def error_tracked(self, client: bytes, rid: int, err: dict[str, object],
                      track: bool = True) -> zmq.MessageTracker | bool:
        """An error reply whose tracker tells when libzmq let go of it; ``track`` False: a plain
        send, True back when it was queued (False: not queued, whichever way it was sent).

        ``copy=False`` matters: pyzmq copies a frame below its copy threshold (64 KiB) and hands
        back a tracker that is done at once, so a small reply (every one of these) would never
        count as unread and the per-peer bound (:class:`supervisor.admission.peers.UnreadErrors`)
        would never hold. A zero-copy frame is done only once libzmq has written it to the
        connection - what a peer that stops reading prevents. It costs a ``threading.Event`` and
        a message to pyzmq's garbage thread, so the bound tracks one reply in
        :data:`supervisor.admission.peers.TRACK_EVERY` and sends the others plainly."""
        return self._unauthenticated(client, proto.encode_reply(rid, False, err), track)

    def ok_tracked(self, client: bytes, rid: int, result: object, track: bool = True) -> zmq.MessageTracker | bool:
        """A small answer to a peer without a verified capability (``hello``'s liveness part),
        sent as :meth:`error_tracked` sends, so it shares that bound on a peer's replies."""
        return self._unauthenticated(client, proto.encode_reply(rid, True, result), track)

    def _unauthenticated(self, client: bytes, reply: bytes, track: bool) -> zmq.MessageTracker | bool:
        try:
            sock = self.sockets[client[0]]
            if not track:
                sock.send(client[1:], _MORE)
                sock.send(reply, _NOBLOCK)
                return True
            tracker: zmq.MessageTracker | None = sock.send_multipart(
                [client[1:], zmq.Frame(reply, track=True, copy=False)], zmq.NOBLOCK, copy=False, track=True)
            return False if tracker is None else tracker
        except zmq.ZMQError:
            return False  # gone, or not reading at all: nothing queued

    def error(self, client: bytes | None, rid: int, err: object) -> None:
        """An error reply: ``err`` is an error map (a worker's is relayed as it came; the client checks it)."""
        if client is None:
            return
        try:
            send = self.sockets[client[0]].send
            header = proto.encode_reply(rid, False, err)
            send(client[1:], _MORE)
            send(header, _NOBLOCK)
        except zmq.ZMQError as exc:
            log_event(_log, logging.DEBUG, "supervisor.reply_dropped", rid=rid, error=exc.strerror)

    def queued_bytes(self, client: bytes) -> int:
        """Bytes of big reply bodies sent to ``client`` that libzmq still holds."""
        queue = self._queues.get(client)
        if not queue:
            return 0
        while queue and queue[0][0].done:
            _, _, tenant, held = queue.popleft()
            self.release(tenant, "replies", held)
        if not queue:
            del self._queues[client]
            return 0
        return sum(entry[1] for entry in queue)

    def prune(self) -> None:
        """Housekeeping: forget clients whose big replies have all left."""
        for client in list(self._queues):
            self.queued_bytes(client)
