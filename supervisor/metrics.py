"""Metric hooks of the supervisor loop, and the snapshot it hands to the exporter.

The loop calls the hooks on its hot path, so the default :class:`NullMetrics`
does nothing; ``--metrics-addr`` swaps in the Prometheus implementation
(:mod:`supervisor.prometheus`), whose HTTP thread only reads.

State the exporter shows at scrape time (per-tenant bytes, wanted instances,
warm pool, device budgets) travels as one :class:`MetricsSnapshot` of typed
records, built on the loop thread (``Supervisor._refresh_metrics``) and handed
over whole through :class:`supervisor.loop.Handoff`, so the HTTP thread never
touches a quota block or a loop structure::

    loop thread: _refresh_metrics() ── MetricsSnapshot ──► Handoff ◄── HTTP thread (scrape, /healthz, /readyz)

A new snapshot object is also the loop's heartbeat for ``/healthz``: the
exporter notes when it last saw one (see :mod:`supervisor.health`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Union

from shared.quota import QuotaSnapshot

__all__ = [
    "DeviceGauges",
    "Metrics",
    "MetricsSnapshot",
    "MetricsSource",
    "NullMetrics",
    "TenantGauges",
    "as_snapshot",
    "build_version",
]


@dataclass(frozen=True, slots=True)
class TenantGauges:
    """One tenant's gauges for a scrape: built on the loop thread, handed over whole, only read after.

    ``wanted``: the instances the tenant should have (not draining); ``None``
    when the loop does not say.
    """

    quota: QuotaSnapshot
    instances_up: int
    state: str
    wanted: int | None = None
    #: the GPU-time policy (``gpu_time_weight``, ``gpu_time_cap``: None when uncapped)
    gpu_time_weight: float | None = None
    gpu_time_cap: float | None = None


@dataclass(frozen=True, slots=True)
class DeviceGauges:
    """One GPU's device-wide budget (from :meth:`Placement.status`)."""

    index: int
    budget_limit_bytes: int
    budget_used_bytes: int
    budget_refusals: int


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the loop publishes for the exporter; ``None`` means "this loop does not say"."""

    tenants: Mapping[str, TenantGauges] = field(default_factory=dict)
    pool_idle: int | None = None
    pool_starting: int | None = None
    pool_size: int | None = None
    backend: str | None = None
    devices: tuple[DeviceGauges, ...] = ()


#: what the exporter calls at scrape time: the snapshot, or just tenant id -> its gauges
MetricsSource = Callable[[], Union[MetricsSnapshot, Mapping[str, TenantGauges]]]


def as_snapshot(value: MetricsSnapshot | Mapping[str, TenantGauges]) -> MetricsSnapshot:
    """Accept a :class:`MetricsSnapshot`, or a plain ``{tenant: TenantGauges}`` mapping."""
    if isinstance(value, MetricsSnapshot):
        return value
    if isinstance(value, Mapping):
        return MetricsSnapshot(tenants=value)
    raise TypeError(f"a metrics snapshot must be a MetricsSnapshot or a mapping, not {type(value).__name__}")


def build_version() -> str:
    """This build's version (the installed distribution's, from ``pyproject.toml``); ``unknown`` in a bare checkout.

    What ``twt --version`` prints and ``twt_build_info`` carries.
    """
    from importlib import metadata

    try:
        return metadata.version("tensor-wasm-tenant")
    except metadata.PackageNotFoundError:
        return "unknown"


class Metrics:
    """Interface: what the supervisor loop reports."""

    def request_done(self, tenant: str, op: str, outcome: str, seconds: float) -> None:
        """A client request was answered; ``outcome`` is "ok" or the error code."""

    def worker_exit(self, tenant: str | None, cause: str) -> None:
        """A worker process ended; ``cause`` is "exit", "signal", "heartbeat", "deadline", "rss", "stop"."""

    def restart(self, tenant: str) -> None:
        """An instance of ``tenant`` is being restarted."""

    def bind_source(self, snapshot: MetricsSource) -> None:
        """Give the exporter a way to read the :class:`MetricsSnapshot` at scrape time."""

    def mark_ready(self) -> None:
        """Start-up is complete: backend chosen, configured tenants registered (``/readyz``)."""

    def close(self) -> None:
        """Stop any exporter thread."""


class NullMetrics(Metrics):
    """Metrics switched off (the default)."""
