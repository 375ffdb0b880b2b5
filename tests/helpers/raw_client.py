"""A raw DEALER on a supervisor's frontend, for tests that misbehave on purpose.

``SupervisorClient`` reads every reply and never pipelines past what it
awaits; the slow-reader, held-bytes and hardening tests need a socket that
sends many requests and reads (or never reads) the replies itself.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

from shared import protocol as proto
from shared.capability import TenantCapability


def dealer(run_dir: str, **opts: int) -> zmq.Socket[Any]:
    """A DEALER connected to ``run_dir``'s frontend; ``opts`` are zmq socket options by name (RCVHWM=...)."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect("ipc://" + os.path.join(run_dir, "frontend.ipc"))
    return sock


def request(rid: int, op: str, cap: TenantCapability, args: dict[str, Any] | None = None) -> bytes:
    """The header frame of a tenant request."""
    return proto.encode_request(rid, op, cap.to_bytes(), args or {})
