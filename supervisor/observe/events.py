"""Lifecycle events: published on the PUB socket and logged as structured events.

Every event is one msgpack map with at least ``event`` and ``ts``; the topic
frame is ``event.<name>`` so ``twt events --filter exit`` subscribes to one
kind. The kinds, the level each is logged at and whether a tenant sees it
are the rows of :data:`shared.kinds.EVENT_KINDS`.

Every event is also kept, numbered, in the bounded event log
(:mod:`supervisor.observe.event_log`) that the ``events`` op serves to clients that
cannot subscribe here (remote operators over TCP, tenants following their own).
"""

from __future__ import annotations

import logging
import time

import msgpack
import zmq

from shared.kinds import EVENT_KINDS
from shared.log import get_logger, log_event
from supervisor.observe.event_log import EventLog

__all__ = ["EventBus", "TOPIC_PREFIX", "decode_event"]

TOPIC_PREFIX = b"event."
_log = get_logger("supervisor.observe.events")


class EventBus:
    """Publishes events without ever blocking the supervisor loop."""

    def __init__(self, sock: zmq.Socket[bytes] | None, log: EventLog | None = None) -> None:
        self.sock = sock
        self.log = log
        self.published = 0

    def emit(self, event: str, **fields: object) -> None:
        record = {"event": event, "ts": round(time.time(), 6), **fields}
        kind = EVENT_KINDS.get(event)
        level = logging.INFO if fields.get("expected") or kind is None else kind.level
        log_event(_log, level, f"event.{event}", **fields)
        if self.sock is None and self.log is None:
            return
        body = msgpack.packb(record, use_bin_type=True, default=str)
        if self.log is not None:
            self.log.append(event, record, body)
        if self.sock is not None:
            try:
                self.sock.send_multipart([TOPIC_PREFIX + event.encode(), body], zmq.NOBLOCK)
                self.published += 1
            except zmq.Again:
                pass  # a slow subscriber loses events, the supervisor never waits


def decode_event(frames: list[bytes]) -> dict[str, object]:
    """The record of one published event (``[topic, body]``)."""
    if len(frames[-1]) > 1 << 20:
        raise ValueError("event body too large")
    data = msgpack.unpackb(frames[-1], raw=False)
    if not isinstance(data, dict):
        raise ValueError("event body is not a map")
    return data
