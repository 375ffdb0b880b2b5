"""Metric hooks of the supervisor loop.

The loop calls these on its hot path, so the default :class:`NullMetrics`
does nothing; ``--metrics-addr`` swaps in the Prometheus implementation
(:mod:`supervisor.prometheus`), whose HTTP thread only reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

from shared.quota import QuotaSnapshot

__all__ = ["Metrics", "MetricsSource", "NullMetrics", "TenantGauges"]


@dataclass(frozen=True, slots=True)
class TenantGauges:
    """One tenant's gauges for a scrape: built on the loop thread, handed over whole, only read after."""

    quota: QuotaSnapshot
    instances_up: int
    state: str


#: what the exporter calls at scrape time: tenant id -> its gauges
MetricsSource = Callable[[], Mapping[str, TenantGauges]]


class Metrics:
    """Interface: what the supervisor loop reports."""

    def request_done(self, tenant: str, op: str, outcome: str, seconds: float) -> None:
        """A client request was answered; ``outcome`` is "ok" or the error code."""

    def worker_exit(self, tenant: str | None, cause: str) -> None:
        """A worker process ended; ``cause`` is "exit", "signal", "heartbeat", "deadline", "rss", "stop"."""

    def restart(self, tenant: str) -> None:
        """An instance of ``tenant`` is being restarted."""

    def bind_source(self, snapshot: MetricsSource) -> None:
        """Give the exporter a way to read per-tenant gauges at scrape time."""

    def close(self) -> None:
        """Stop any exporter thread."""


class NullMetrics(Metrics):
    """Metrics switched off (the default)."""
