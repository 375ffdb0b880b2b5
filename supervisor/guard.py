"""The frontend's guard: what bounds the supervisor against its clients.

One object the frontend owns, holding the policies of
:mod:`supervisor.budgets`, :mod:`supervisor.peers`,
:mod:`supervisor.fairness` and :mod:`supervisor.connections`, and the
counters status reports:

* ``held``: bytes held per tenant and in total (replies, parked bodies,
  modules), refused with ``Overloaded`` past the budgets;
* ``errors``: the error replies an unauthenticated peer has not read yet
  (bounded), each cut short (no echo of unbounded input);
* ``fair``: the order a loop turn serves what it read, and its backlog;
* ``connections``: the frontend's connections against the fd budget.

Loop thread only.
"""

from __future__ import annotations

from typing import Any

from shared.config import SupervisorConfig
from shared.errors import TensorWasmError
from supervisor.budgets import HeldBytes
from supervisor.connections import FrontendConnections
from supervisor.fairness import FairTurn
from supervisor.peers import MAX_ERROR_TEXT, UnreadErrors, short

__all__ = ["FrontendGuard"]


class FrontendGuard:
    """Bounds of the frontend (see the module docstring)."""

    def __init__(self, config: SupervisorConfig, connections: FrontendConnections | None = None) -> None:
        self.held = HeldBytes(config.max_tenant_held_bytes, config.max_held_bytes)
        self.errors = UnreadErrors()
        self.fair: FairTurn[Any] = FairTurn(size_of=lambda msg: int(getattr(msg, "size", 0)))
        self.connections = connections

    def unauthenticated_error(self, client: bytes, exc: TensorWasmError) -> dict[str, Any] | None:
        """The error reply for a request without a verified capability, or None to drop it
        (the peer has too many such replies unread). Every text in it is cut short; send
        it tracked and hand the tracker to ``errors.sent``."""
        if not self.errors.allow(client):
            return None
        err = exc.to_dict()
        err["message"] = short(str(err.get("message", "")))
        err["fields"] = {
            k: short(v, MAX_ERROR_TEXT // 2) if isinstance(v, str) else v for k, v in dict(err.get("fields") or {}).items()
        }
        return err

    def refresh(self) -> None:
        """Housekeeping: re-read the fd limit (an operator may lower it with prlimit)."""
        if self.connections is not None:
            self.connections.refresh_limit()

    @property
    def dropped(self) -> int:
        """Unauthenticated requests dropped unanswered (unread replies, or the backlog full)."""
        return self.errors.dropped + self.fair.dropped

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "held_bytes": self.held.snapshot(),
            "unauthenticated_dropped": self.dropped,
            "unauthenticated_backlog": len(self.fair.backlog),
        }
        if self.connections is not None:
            gate = self.connections.gate
            out.update(
                fd_limit=self.connections.limit,
                connections=gate.connected,
                connection_budget=gate.budget,
                connections_shed=gate.shed,
            )
        return out
