"""Metric hooks of the router loop, and the snapshot it hands to the exporter.

The loop calls the hooks on its hot path, so the default :class:`NullMetrics`
does nothing; ``--metrics-addr`` swaps in the Prometheus implementation
(:mod:`supervisor.prometheus`), whose HTTP thread only reads.

State the exporter shows at scrape time (per-tenant bytes, wanted instances,
warm pool, device budgets) travels as one :class:`MetricsSnapshot`, built on
the loop thread by :func:`build_snapshot` and swapped in whole, so the HTTP
thread never touches a quota block or a loop structure::

    loop thread: _refresh_metrics() ── build_snapshot(core) ──► cache ◄── HTTP thread (scrape, /healthz, /readyz)

A new snapshot object is also the loop's heartbeat for ``/healthz``: the
exporter notes when it last saw one (see :mod:`supervisor.health`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = [
    "Metrics",
    "MetricsSnapshot",
    "NullMetrics",
    "as_snapshot",
    "build_snapshot",
    "build_version",
]


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the loop publishes for the exporter; ``None`` means "this loop does not say".

    ``tenants`` maps a tenant id to its record: ``quota`` (a ``QuotaSnapshot``),
    ``instances_up``, ``state`` and ``wanted``, as dict keys or as attributes of
    a typed record (the exporter reads either). ``devices`` holds :meth:`Placement.status`
    records (``index``, ``budget_limit_bytes``, ``budget_used_bytes`` ...).
    """

    tenants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    pool_idle: int | None = None
    pool_starting: int | None = None
    pool_size: int | None = None
    backend: str | None = None
    devices: tuple[Mapping[str, Any], ...] = ()


def build_version() -> str:
    """This build's version (the installed distribution's, from ``pyproject.toml``); ``unknown`` in a bare checkout.

    What ``twt --version`` prints and ``twt_build_info`` carries.
    """
    from importlib import metadata

    try:
        return metadata.version("tensor-wasm-tenant")
    except metadata.PackageNotFoundError:
        return "unknown"


def as_snapshot(value: MetricsSnapshot | Mapping[str, Mapping[str, Any]]) -> MetricsSnapshot:
    """Accept a :class:`MetricsSnapshot`, or the plain ``{tenant: record}`` dict older loops publish."""
    if isinstance(value, MetricsSnapshot):
        return value
    if isinstance(value, Mapping):
        return MetricsSnapshot(tenants=value)
    raise TypeError(f"a metrics snapshot must be a MetricsSnapshot or a mapping, not {type(value).__name__}")


def build_snapshot(core: Any) -> MetricsSnapshot:
    """Loop thread only: the exporter's view of the supervisor ``core`` (tenants, pool, devices).

    The loop's ``_refresh_metrics`` is then one line:
    ``self._metrics_cache = build_snapshot(self); self._metrics_done.set()``.
    """
    tenants: dict[str, dict[str, Any]] = {}
    for tid, rt in core.tenants.items():
        if rt.block.closed:
            continue
        tenants[tid] = {
            "quota": rt.block.snapshot(),
            "instances_up": len(rt.live_slots()),
            "wanted": sum(1 for s in rt.slots if not s.draining),
            "state": rt.state.value,
        }
    placement = getattr(core, "placement", None)
    devices: tuple[Mapping[str, Any], ...] = ()
    if placement is not None:
        devices = tuple(placement.status())
    return MetricsSnapshot(
        tenants=tenants,
        pool_idle=len(core.pool),
        pool_starting=int(core.pool_starting),
        pool_size=int(core.config.pool_size),
        backend=str(core.backend_name),
        devices=devices,
    )


class Metrics:
    """Interface: what the router reports."""

    def request_done(self, tenant: str, op: str, outcome: str, seconds: float) -> None:
        """A client request was answered; ``outcome`` is "ok" or the error code."""

    def worker_exit(self, tenant: str | None, cause: str) -> None:
        """A worker process ended; ``cause`` is "exit", "signal", "heartbeat", "deadline", "rss", "stop"."""

    def restart(self, tenant: str) -> None:
        """An instance of ``tenant`` is being restarted."""

    def bind_source(self, snapshot: Callable[[], Any]) -> None:
        """Give the exporter a way to read the :class:`MetricsSnapshot` (or tenants dict) at scrape time."""

    def mark_ready(self) -> None:
        """Start-up is complete: backend chosen, configured tenants registered (``/readyz``)."""

    def close(self) -> None:
        """Stop any exporter thread."""


class NullMetrics(Metrics):
    """Metrics switched off (the default)."""
