"""A client request as the supervisor holds it, before it is answered: plain records.

    client request ──► Dispatcher┬─► Parked    no instance of its tenant is ready yet: waits in
                                 │     │       ``TenantRuntime.parked`` (supervisor.runtime.tenants)
                                 │     ▼ an instance is ready
                                 └─► Pending   forwarded to a worker: in ``WorkerHandle.in_flight``
                                       │       (supervisor.runtime.workers), keyed by the supervisor's rid
                                       ▼
                  PendingTable.finish (supervisor.routing.pending): the reply, the metric, the held bytes

A ``Pending`` also stands for the supervisor's own requests to a worker
(a bind: answered to its ``callback``) and, for a moment, for a request the
loop answers itself (``PendingTable.answer`` / ``refuse``).

The records carry data only: the tables that own them (the tenant's parked
queue, the worker's in-flight map, :class:`supervisor.routing.pending.PendingTable`)
import them from here, so none of those modules needs another's to name
what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

__all__ = ["Parked", "Pending"]


@dataclass(eq=False)
class Pending:
    """A request the supervisor has not answered yet."""

    client: bytes | None  # frontend identity; None for the supervisor's own requests
    client_rid: int
    op: str
    tenant: str
    instance: int
    started: float
    deadline: float
    #: the supervisor's own requests (bind, buffers fan-out) are answered to this instead of a client
    callback: Callable[[bool, object], None] | None = None
    forwarded: bool = False  # in the table (counted in its tenant's in_flight)
    #: reply bytes reserved for it at admission (supervisor.routing.budgets); Replies gives them back
    held: int = 0
    #: the supervisor's own requests whose reply has a body (parking's export_chunk) get it here first
    on_body: Callable[[zmq.Frame | bytes | memoryview | None], None] | None = None


@dataclass(eq=False)
class Parked:
    """A request waiting for an instance to become ready (e.g. during a restart, or while its
    parked tenant activates: a *waiting request*, not to be confused with a parked tenant,
    ``TenantState.PARKED``)."""

    client: bytes
    rid: int
    op: str
    args: dict[str, object]
    body: zmq.Frame | bytes | None  # its body frame, or the module a run names by digest
    started: float
    deadline: float
    instance: int | None  # a handle-bound request must go to this instance
    #: bytes reserved for it in the supervisor's held-bytes budgets (supervisor.routing.budgets):
    #: its reply (kind "replies", handed to its Pending) and its body while parked ("parked")
    held_reply: int = 0
    held_body: int = 0
