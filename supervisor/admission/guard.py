"""The frontend's guard: what bounds the supervisor against its clients.

One object the frontend owns, holding the policies of
:mod:`supervisor.routing.budgets`, :mod:`supervisor.admission.peers`,
:mod:`supervisor.admission.fairness` and :mod:`supervisor.admission.connections`, and the
counters status reports:

* ``held``: bytes held per tenant and in total (replies, parked bodies,
  modules), refused with ``Overloaded`` past the budgets;
* ``errors``: the error replies an unauthenticated peer has not read yet
  (bounded), each cut short (no echo of unbounded input);
* ``fair``: the order a loop turn serves what it read, and its backlog;
* ``admission``: requests and bytes per second per tenant, and per peer for
  the unauthenticated (token buckets);
* ``pacer``: the TCP frontend's debt of dropped messages (paused past it);
* ``yielding``: the tenants over their rate, held while another tenant is active (and its holds);
* ``connections``: the frontend's connections (ipc and TCP) against the fd
  budget and the TCP bounds.

Loop thread only.
"""

from __future__ import annotations

from typing import Any

from shared.config import SupervisorConfig
from shared.errors import TensorWasmError
from supervisor.admission.pacing import Pacer
from supervisor.admission.yielding import Yielding
from supervisor.admission.rates import Admission, AdmissionStatus
from supervisor.routing.budgets import HeldBytes
from supervisor.admission.connections import ConnectionStatus, FrontendConnections
from supervisor.admission.fairness import FairTurn
from supervisor.admission.counters import FrontendCounters
from supervisor.admission.peers import MAX_ERROR_TEXT, UnreadErrors, short

__all__ = ["FrontendGuard", "GuardStatus", "WatchedGuardStatus"]


class GuardStatus(AdmissionStatus):
    """The guard's counters in a status, spread into ``shared.records.SupervisorRecord(**...)``
    (whose fields they are: mypy checks each key against it)."""

    held_bytes: dict[str, int]
    tcp_pauses: int
    tcp_paused_s: float
    yield_holds: int
    yield_full_holds: int
    yield_budget_holds: int
    rate_pauses: int
    unauthenticated_dropped: int
    unauthenticated_dropped_by: dict[str, int]
    unauthenticated_backlog: int


class WatchedGuardStatus(GuardStatus, ConnectionStatus):
    """:class:`GuardStatus` and the connection counters, when the supervisor watches its connections."""


class FrontendGuard:
    """Bounds of the frontend (see the module docstring)."""

    def __init__(self, config: SupervisorConfig, connections: FrontendConnections | None = None) -> None:
        self.held = HeldBytes(config.max_tenant_held_bytes, config.max_held_bytes)
        self.errors = UnreadErrors()
        # the frontend's queued requests (its own message class: naming it here would import the
        # frontend, which imports this module); the frontend pushes and takes them
        self.fair: FairTurn[Any] = FairTurn(size_of=lambda msg: int(getattr(msg, "size", 0)))
        self.admission = Admission.from_config(config)
        #: the TCP frontend's debt of dropped messages (paused past it)
        self.pacer = Pacer(config.tcp_drops_per_s)
        #: the over-rate tenants, held while another tenant is active (supervisor.admission.yielding)
        self.yielding = Yielding()
        self.connections = connections

    def unauthenticated_error(self, client: bytes, exc: TensorWasmError) -> dict[str, object] | None:
        """The error reply for a request without a verified capability, or None to drop it
        (the peer has too many such replies unread). Every text in it is cut short; send
        it tracked and hand the tracker to ``errors.sent``."""
        if not self.errors.allow(client):
            return None
        err = exc.to_dict()
        err["message"] = short(exc.message)
        fields = err["fields"]
        if isinstance(fields, dict):
            err["fields"] = {k: short(v, MAX_ERROR_TEXT // 2) if isinstance(v, str) else v for k, v in fields.items()}
        return err

    def refresh(self) -> None:
        """Housekeeping: re-read the fd limit (an operator may lower it with prlimit)."""
        if self.connections is not None:
            self.connections.refresh_limit()

    @property
    def dropped(self) -> int:
        """Unauthenticated requests dropped unanswered (unread replies, the backlog full, or
        their peer's rate)."""
        return self.errors.dropped + self.fair.dropped + self.admission.dropped

    def dropped_by(self) -> dict[str, int]:
        """:attr:`dropped` by reason."""
        return {"unread_replies": self.errors.dropped, "backlog_bytes": self.fair.dropped,
                "peer_rate": self.admission.dropped}

    def counters(self) -> FrontendCounters:
        """The counters the metrics exporter shows (supervisor.observe.prometheus)."""
        gate = self.connections.gate if self.connections is not None else None
        return FrontendCounters(
            admission_refused=tuple((t, what, n) for (t, what), n in sorted(self.admission.refused.items())),
            admission_unanswered=tuple(sorted(self.admission.unanswered.items())),
            unauthenticated_dropped=tuple(sorted(self.dropped_by().items())),
            connections_shed=tuple(sorted(gate.shed_by.items())) if gate is not None else (),
            connections=gate.connected if gate is not None else 0,
            tcp_connections=gate.tcp if gate is not None else 0,
            connection_budget=gate.budget if gate is not None else 0,
            frontend_paused=self.connections.guard.paused if self.connections is not None else False,
            frontend_pauses=self.connections.guard.pauses if self.connections is not None else 0,
            tcp_pauses=self.pacer.pauses,
            tcp_paused_s=self.pacer.paused_s,
            yield_holds=self.yielding.holds,
            yield_full_holds=self.yielding.full_holds,
            yield_budget_holds=self.yielding.budget_holds,
            rate_pauses=self.yielding.rate_pauses,
        )

    def status(self) -> GuardStatus | WatchedGuardStatus:
        out: GuardStatus = {
            "held_bytes": self.held.snapshot(),
            "unauthenticated_dropped": self.dropped,
            "unauthenticated_dropped_by": self.dropped_by(),
            # the name is older than the queue: every request read and not yet served
            "unauthenticated_backlog": self.fair.backlog,
            "tcp_pauses": self.pacer.pauses,
            "tcp_paused_s": round(self.pacer.paused_s, 6),
            "yield_holds": self.yielding.holds,
            "yield_full_holds": self.yielding.full_holds,
            "yield_budget_holds": self.yielding.budget_holds,
            "rate_pauses": self.yielding.rate_pauses,
            **self.admission.status(),
        }
        if self.connections is None:
            return out
        watched: WatchedGuardStatus = {**out, **self.connections.status()}
        return watched
