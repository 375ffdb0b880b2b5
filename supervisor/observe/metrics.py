"""Metric hooks of the supervisor loop, and the snapshot it hands to the exporter.

The loop calls the hooks on its hot path, so the default :class:`NullMetrics`
does nothing; ``--metrics-addr`` swaps in the Prometheus implementation
(:mod:`supervisor.observe.prometheus`), whose HTTP and render threads only read.

State the exporter shows at scrape time (per-tenant bytes, wanted instances,
warm pool, device budgets) travels as one :class:`MetricsSnapshot` of typed
records, built on the loop thread (``Supervisor._refresh_metrics``) and handed
over whole through :class:`supervisor.runtime.loop.Handoff`, so the exporter never
touches a quota block or a loop structure::

    loop thread: _refresh_metrics() ── MetricsSnapshot ──► Handoff ◄── render thread (at most metrics_renders_per_s
                                                                        a second; scrapes and probes read its page)

A new snapshot object is also the loop's heartbeat for ``/healthz``: the
exporter notes when it last saw one (see :mod:`supervisor.observe.health`).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol
from collections.abc import Callable

from shared.quota import QuotaSnapshot
from supervisor.admission.counters import FrontendCounters

__all__ = [
    "LABEL_KEY_NAME",
    "NO_TENANT",
    "DeviceGauges",
    "FrontendCounters",
    "Metrics",
    "MetricsSnapshot",
    "MetricsSource",
    "NullMetrics",
    "QUIET_STATES",
    "TenantGauges",
    "TenantLabels",
    "as_snapshot",
    "build_version",
    "tenant_label_key",
]

#: label of events that belong to no tenant (an idle pool worker's exit), and of requests
#: whose capability was not verified (their claimed tenant is never a label)
NO_TENANT = ""
#: the state database's key material that keys the tenant label pseudonyms
LABEL_KEY_NAME = "metrics.label_key"


class _KeyStore(Protocol):
    """What :func:`tenant_label_key` needs of ``supervisor.store.state.StateStore`` (named key material)."""

    def get_key(self, name: str) -> bytes | None: ...

    def put_key(self, name: str, material: bytes) -> None: ...


def tenant_label_key(state: _KeyStore) -> bytes:
    """The pseudonyms' key: kept in the state database (made on the first start), so a tenant keeps
    its label across restarts - dashboards and alerts follow one series, not one per start."""
    key = state.get_key(LABEL_KEY_NAME)
    if key is None or len(key) < 16:
        key = secrets.token_bytes(32)
        state.put_key(LABEL_KEY_NAME, key)
    return key


class TenantLabels:
    """Tenant names as metric labels, or stable pseudonyms (``t-<hex>``).

    Whoever can reach ``/metrics`` learns the tenants' names only when the
    operator chose so (``metrics_tenant_names``): a pseudonym is an HMAC of
    the name under a key that never leaves the supervisor's state database
    (:func:`tenant_label_key`; a random one per process when none is given).
    The same name gets the same label after a restart; ``twt status --json``
    shows each tenant's (``metrics_label``), so an operator can map one back.
    """

    def __init__(self, reveal: bool, key: bytes | None = None) -> None:
        self.reveal = reveal
        self._key = key if key is not None else secrets.token_bytes(16)
        self._cache: dict[str, str] = {}

    def __call__(self, tenant: str | None) -> str:
        if not tenant:
            return NO_TENANT
        if self.reveal:
            return tenant
        label = self._cache.get(tenant)
        if label is None:
            if len(self._cache) > 65536:
                self._cache.clear()
            label = self._cache[tenant] = "t-" + hmac.new(self._key, tenant.encode(), "sha256").hexdigest()[:12]
        return label


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
    #: every registered tenant by state, those in ``tenants`` and those left out of it (a tenant in a
    #: :data:`QUIET_STATES` state exports no series of its own); empty: count ``tenants``
    states: Mapping[str, int] = field(default_factory=dict)
    #: host bytes held by the tenants left out of ``tenants``, by state (a parked tenant's buffer copies)
    quiet_host_bytes: Mapping[str, int] = field(default_factory=dict)
    pool_idle: int | None = None
    pool_starting: int | None = None
    pool_size: int | None = None
    backend: str | None = None
    devices: tuple[DeviceGauges, ...] = ()
    frontend: FrontendCounters | None = None


#: tenant states without per-tenant series on /metrics: such a tenant has no worker, so its gauges do
#: not move; it is counted in ``twt_tenants_by_state`` and its host bytes summed per state instead.
#: 10,000 registered tenants, nearly all of them stopped or parked, then cost a scrape what the few
#: with workers cost (docs/OPERATIONS.md)
QUIET_STATES: Final = frozenset({"stopped", "parked"})


#: what the exporter calls at scrape time: the snapshot, or just tenant id -> its gauges
MetricsSource = Callable[[], MetricsSnapshot | Mapping[str, TenantGauges]]


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
        """A client request was answered; ``outcome`` is "ok" or the error code (or "unanswered":
        refused for its rate past the answers to that, dropped without a reply)."""

    def worker_exit(self, tenant: str | None, cause: str) -> None:
        """A worker process ended; ``cause`` is "exit", "signal", "heartbeat", "deadline", "rss", "stop"."""

    def restart(self, tenant: str) -> None:
        """An instance of ``tenant`` is being restarted."""

    def backend_info(self, backend: str, devices: Sequence[str], driver_version: str, cuda_version: str) -> None:
        """The backend chosen at start: ``twt_backend_info``, one series per device (``INDEX:NAME``)."""

    #: whether an exporter reads :class:`MetricsSnapshot` s (``bind_source``): the loop then keeps
    #: one fresh every second; without one (:class:`NullMetrics`) it builds none
    reads_snapshots: bool = True

    def bind_source(self, snapshot: MetricsSource) -> None:
        """Give the exporter a way to read the :class:`MetricsSnapshot` at scrape time."""

    def use_tenant_labels(self, labels: TenantLabels) -> None:
        """Label tenants with ``labels`` from now on (the supervisor's, keyed by its state database)."""

    def mark_ready(self) -> None:
        """Start-up is complete: backend chosen, configured tenants registered (``/readyz``)."""

    def mark_draining(self) -> None:
        """A stop began: no new work is admitted (``/readyz`` says not ready, and why)."""

    def close(self) -> None:
        """Stop any exporter thread."""


class NullMetrics(Metrics):
    """Metrics switched off (the default)."""

    reads_snapshots = False
