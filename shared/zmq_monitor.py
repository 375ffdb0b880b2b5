"""Reading libzmq's socket-monitor events (``zmq_socket_monitor``): the supervisor's connection
gate and the remote client's link state both watch a monitor socket.

A monitor message is two frames: 6 bytes (a native-endian u16 event id, then an i32 value: the
file descriptor for ACCEPTED / DISCONNECTED, an errno for failures), then the endpoint. Read here
with one ``struct`` call rather than with pyzmq's ``zmq.utils.monitor``: that module imports
``asyncio`` and ``ssl`` (about 16 ms of every supervisor's start-up, which the test suite pays a few
hundred times per run) and wraps each value in an enum.
"""

from __future__ import annotations

import struct

import zmq

__all__ = ["monitor_event", "recv_monitor_event"]

_HEAD = struct.Struct("=Hi")


def recv_monitor_event(sock: zmq.Socket[bytes], flags: int = 0) -> tuple[int, int]:
    """``(event id, value)`` of the next message on monitor socket ``sock`` (``zmq.Again`` with
    ``zmq.NOBLOCK`` when none waits). A message not in libzmq's format is a ``RuntimeError``
    (only libzmq writes to a monitor socket: it would be a bug there, not an input)."""
    return monitor_event(sock.recv_multipart(flags))


def monitor_event(frames: list[bytes]) -> tuple[int, int]:
    """``(event id, value)`` of a monitor message already read (its frames, as
    :func:`recv_monitor_event` reads them)."""
    if len(frames) != 2 or len(frames[0]) != _HEAD.size:
        raise RuntimeError(f"not a zmq monitor event: {frames!r}")
    event, value = _HEAD.unpack(frames[0])
    return event, value
