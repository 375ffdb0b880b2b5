"""The frontend's guard counters, as a record: what the metrics exporter shows of admission.

Filled by :meth:`supervisor.admission.guard.FrontendGuard.counters` and read by
:mod:`supervisor.observe.metrics` (its snapshot) and the Prometheus exporter; a plain
record here, so the admission parts import nothing of the exporter's.

Owns: nothing (an immutable record).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FrontendCounters"]


@dataclass(frozen=True, slots=True)
class FrontendCounters:
    """The frontend's guard counters (supervisor.admission.guard): admission refusals by tenant and
    what was exceeded, unauthenticated requests dropped and connections shed by reason,
    connections now and their budget, the TCP frontend's pauses and the over-rate tenants' holds."""

    admission_refused: tuple[tuple[str, str, int], ...] = ()  # (tenant, "requests" | "bytes", count)
    admission_unanswered: tuple[tuple[str, int], ...] = ()  # (tenant, count): refused and dropped unanswered
    unauthenticated_dropped: tuple[tuple[str, int], ...] = ()  # (reason, count)
    connections_shed: tuple[tuple[str, int], ...] = ()  # (reason, count)
    connections: int = 0
    tcp_connections: int = 0
    connection_budget: int = 0
    frontend_paused: bool = False  # the ipc paths renamed away for fds (supervisor.admission.fd_guard)
    frontend_pauses: int = 0
    tcp_pauses: int = 0  # the TCP frontend not read for a while (supervisor.admission.pacing)
    tcp_paused_s: float = 0.0
    #: an over-rate tenant held while another tenant's request was in flight; of those, the holds that
    #: ran their longest; holds for a contended budget (supervisor.admission.yielding)
    yield_holds: int = 0
    yield_full_holds: int = 0
    yield_budget_holds: int = 0
    rate_pauses: int = 0  # frontend.ipc not read while a tenant refused for its rate waits for its bucket
