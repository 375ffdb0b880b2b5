"""Prometheus exporter: ``twt supervise --metrics-addr HOST:PORT`` serves ``/metrics``.

Two kinds of series, both exposed by prometheus-client (no hand-written
exposition)::

    supervisor loop (one thread) ──inc/observe──► client Counters / Histogram ──┐
                                                                                ├─► CollectorRegistry ─► HTTP
    snapshot (loop, every 1 s) ◄──read at scrape time── _StateCollector ─────────┘    thread (GET /metrics)

* **Events the loop reports** through the :class:`~supervisor.observe.metrics.Metrics`
  hooks: requests by tenant, op and outcome, request latency by op, worker
  exits by cause, restarts. Their children are cached per label set, so the
  hot path is a dict lookup and one uncontended lock per update.
* **State read at scrape time** by a custom collector from the snapshot
  function the supervisor binds (:meth:`PrometheusMetrics.bind_source`):
  per-tenant host/GPU bytes in use, limits, high-water marks, instances up
  and wanted, state (one series per state), the refusal/underflow counters
  kept in each tenant's shared-memory block, the warm pool and the
  device-wide budgets, as last refreshed by the loop (every second). A tenant
  without a worker (``QUIET_STATES``: stopped, parked) has no series of its
  own: it is counted in ``twt_tenants_by_state`` (its host bytes summed in
  ``twt_tenants_host_in_use_bytes``), so 10,000 registered tenants cost a
  scrape what the few with workers cost.

Threads: the HTTP server (:mod:`supervisor.observe.http_server`: one thread,
bounded connections, deadlines, fds reserved in the supervisor's budget) and
the render thread (:mod:`supervisor.observe.scrape_cache`: at most
``renders_per_s`` renders a second; scrapes in between get the latest page)
only read. The event hooks are called on the loop thread and update
prometheus_client's children, which take their own locks. The per-tenant
snapshot is never built here: a render asks the loop through
:meth:`Supervisor.metrics_snapshot` (a :class:`supervisor.runtime.loop.Handoff`)
and gets an immutable :class:`~supervisor.observe.metrics.MetricsSnapshot` of
typed records, so no quota block is touched off the loop thread (closing a
block while another thread reads it fails).

``HOST:PORT`` with
port 0 binds a free port (tests); the bound one is :attr:`PrometheusMetrics.port`
and is logged as ``metrics.listening``.

The latency histogram is labelled by op only: a per-tenant histogram would
cost tenants x ops x buckets series (tens of thousands on a node with
hundreds of tenants); per-tenant request counts are in ``twt_requests_total``.
"""

from __future__ import annotations

import errno
import logging
import platform
from collections import Counter as Counter_
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from shared.config import parse_host_port
from shared.log import get_logger, log_event
from shared.protocol import PROTOCOL_VERSION
from shared.quota import GPU_WAIT_BUCKETS_S
from supervisor.observe.health import Health, Verdict
from supervisor.observe.http_auth import BearerToken
from supervisor.observe.http_server import HttpServer, Response, Route
from supervisor.observe.metrics import (
    NO_TENANT,
    QUIET_STATES,
    FrontendCounters,
    Metrics,
    MetricsSnapshot,
    MetricsSource,
    TenantLabels,
    build_version,
)
from supervisor.observe.scrape_cache import Rendered, ScrapeCache
from supervisor.runtime.tenants import TenantState

if TYPE_CHECKING:
    from shared.config import SupervisorConfig

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_RENDERS_PER_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "HEALTHZ_PATH",
    "LATENCY_BUCKETS",
    "METRICS_PATH",
    "NO_TENANT",
    "READYZ_PATH",
    "TENANT_STATES",
    "PrometheusMetrics",
    "TenantLabels",
    "parse_metrics_addr",
]

_log = get_logger("supervisor.observe.metrics")

#: request latency buckets (seconds): a ping is ~100 us, a WASM run may take seconds
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)
#: the metrics port's bounds (``metrics_max_connections``, ``metrics_request_timeout_s``,
#: ``metrics_renders_per_s`` in shared.config; the same defaults)
DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_REQUEST_TIMEOUT_S = 5.0
DEFAULT_RENDERS_PER_S = 1.0
#: the port the docs, the systemd unit and deploy/k8s use (nothing binds it unless configured)
DEFAULT_METRICS_PORT = 9464
METRICS_PATH = "/metrics"
HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"


def parse_metrics_addr(addr: str) -> tuple[str, int]:
    """``--metrics-addr``: :func:`shared.config.parse_host_port`."""
    return parse_host_port(addr, "metrics address")


#: every tenant state, one ``twt_tenant_state`` series each (1 for the current one, 0 for the rest)
TENANT_STATES = tuple(state.value for state in TenantState)


def _gauge(name: str, text: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, labels=labels)


class _StateCollector:
    """Series read from the loop's snapshot at scrape time: tenants, pool, device budgets."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self._owner = owner

    def describe(self) -> list[Metric]:
        return []  # generated at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        snap = self._owner._read_snapshot()
        tenants = snap.tenants
        t = ["tenant"]
        g = {
            "host_in_use": _gauge("twt_tenant_host_in_use_bytes", "Host bytes the tenant holds now (all instances)", t),
            "host_limit": _gauge("twt_tenant_host_limit_bytes", "The tenant's host memory quota (memory_quota_bytes)", t),
            "host_high": _gauge("twt_tenant_host_high_water_bytes", "Most host bytes the tenant has held at once", t),
            "gpu_in_use": _gauge("twt_tenant_gpu_in_use_bytes", "GPU bytes the tenant holds now (all instances)", t),
            "gpu_limit": _gauge("twt_tenant_gpu_limit_bytes",
                                "The tenant's GPU cap (gpu_memory_bytes_cap); +Inf when uncapped", t),
            "gpu_high": _gauge("twt_tenant_gpu_high_water_bytes", "Most GPU bytes the tenant has held at once", t),
            "up": _gauge("twt_tenant_instances_up", "Worker instances of the tenant that are ready to serve", t),
            "wanted": _gauge("twt_tenant_instances_wanted",
                             "Worker instances the tenant should have (its instances setting, minus draining)", t),
        }
        state = _gauge("twt_tenant_state", "1 for the tenant's current state, 0 for every other state",
                       ["tenant", "state"])
        refusals = CounterMetricFamily("twt_tenant_quota_refusals",
                                       "Allocations refused by the tenant's quota (shared-memory counter)",
                                       labels=["tenant", "resource"])
        underflows = CounterMetricFamily("twt_tenant_quota_underflows",
                                         "Releases of more bytes than were held (a bug; never wrapped)",
                                         labels=["tenant", "resource"])
        gpu_time = CounterMetricFamily("twt_tenant_gpu_time_seconds",
                                       "Device time accounted to the tenant (measured per op while it held the "
                                       "device: CUDA events, or the stub's held time)", labels=t)
        gpu_wait = HistogramMetricFamily("twt_tenant_gpu_wait_seconds",
                                         "Per device op: how long it waited for the device lease", labels=t)
        throttled = CounterMetricFamily("twt_tenant_gpu_throttled",
                                        "Times the tenant's gpu_time_cap held it back", labels=t)
        weight = _gauge("twt_tenant_gpu_time_weight", "The tenant's GPU-time weight (gpu_time_weight)", t)
        time_cap = _gauge("twt_tenant_gpu_time_cap",
                          "The tenant's GPU-time ceiling (gpu_time_cap, a fraction); +Inf when uncapped", t)
        # every tenant counted by state; per-tenant series only for tenants in ``tenants`` (a
        # tenant in a QUIET_STATES state, without a worker, is left out of it by the loop)
        states = dict(snap.states) if snap.states else dict(Counter_(rec.state for rec in tenants.values()))
        count = _gauge("twt_tenants", "Tenants registered with this supervisor", [])
        count.add_metric([], sum(states.values()))
        by_state = _gauge("twt_tenants_by_state", "Tenants registered with this supervisor, by state (tenants "
                          "stopped or parked - no worker - have no per-tenant series: they are counted here)", ["state"])
        for name in (*TENANT_STATES, *sorted(set(states) - set(TENANT_STATES))):
            by_state.add_metric([name], states.get(name, 0))
        quiet_host = _gauge("twt_tenants_host_in_use_bytes", "Host bytes held by the tenants without per-tenant "
                            "series (stopped, parked: a parked tenant's buffer copies), by state", ["state"])
        for name in sorted(QUIET_STATES):
            quiet_host.add_metric([name], snap.quiet_host_bytes.get(name, 0))
        for tid, rec in sorted(tenants.items()):
            quota = rec.quota
            label = self._owner.label(str(tid))
            who = [label]
            cap = quota.gpu_memory_bytes_cap
            g["host_in_use"].add_metric(who, quota.bytes_in_use)
            g["host_limit"].add_metric(who, quota.memory_quota_bytes)
            g["host_high"].add_metric(who, quota.cpu_high_water)
            g["gpu_in_use"].add_metric(who, quota.gpu_bytes_in_use)
            g["gpu_limit"].add_metric(who, float("inf") if cap is None else cap)
            g["gpu_high"].add_metric(who, quota.gpu_high_water)
            g["up"].add_metric(who, rec.instances_up)
            if rec.wanted is not None:
                g["wanted"].add_metric(who, rec.wanted)
            current = rec.state
            for name in (TENANT_STATES if current in TENANT_STATES else (*TENANT_STATES, current)):
                state.add_metric([label, name], 1 if name == current else 0)
            for resource, refused, under in (("host", quota.cpu_refusals, quota.cpu_underflows),
                                             ("gpu", quota.gpu_refusals, quota.gpu_underflows)):
                refusals.add_metric([label, resource], refused)
                underflows.add_metric([label, resource], under)
            gpu_time.add_metric(who, quota.gpu_time_ns / 1e9)
            cumulative, buckets = 0, []
            for bound, n in zip((*GPU_WAIT_BUCKETS_S, float("inf")), quota.gpu_wait_bins):
                cumulative += n
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            gpu_wait.add_metric(who, buckets, quota.gpu_wait_ns / 1e9)
            throttled.add_metric(who, quota.gpu_throttled)
            if rec.gpu_time_weight is not None:
                weight.add_metric(who, rec.gpu_time_weight)
                time_cap.add_metric(who, float("inf") if rec.gpu_time_cap is None else rec.gpu_time_cap)
        yield count
        yield by_state
        yield quiet_host
        yield from g.values()
        yield state
        yield refusals
        yield underflows
        yield gpu_time
        yield gpu_wait
        yield throttled
        yield weight
        yield time_cap
        yield from self._pool_and_devices(snap)
        if snap.frontend is not None:
            yield from self._frontend(snap.frontend)

    def _frontend(self, fc: FrontendCounters) -> Iterator[Metric]:
        """The frontend's guard: admission refusals, dropped unauthenticated requests, connections."""
        refused = CounterMetricFamily("twt_admission_refused",
                                      "Requests refused Overloaded by admission (the tenant's requests_per_s or "
                                      "bytes_per_s)", labels=["tenant", "limit"])
        for tenant, what, n in fc.admission_refused:
            refused.add_metric([self._owner.label(tenant), what], n)
        yield refused
        unanswered = CounterMetricFamily("twt_admission_unanswered",
                                         "Of the requests refused by admission, those dropped unanswered: past the "
                                         "tenant's answers to refusals (tenant_refusals_per_s)", labels=["tenant"])
        for tenant, n in fc.admission_unanswered:
            unanswered.add_metric([self._owner.label(tenant)], n)
        yield unanswered
        yield CounterMetricFamily("twt_tcp_pauses", "Times the TCP frontend was not read for a while: it read and "
                                  "dropped more than tcp_drops_per_s", value=fc.tcp_pauses)
        yield CounterMetricFamily("twt_tcp_paused_seconds", "Seconds the TCP frontend was not read (its pauses "
                                  "as planned)", value=fc.tcp_paused_s)
        yield CounterMetricFamily("twt_yield_holds", "Times a tenant over its rate was held (its socket unread, "
                                  "its queued requests kept) while another tenant's request was in flight",
                                  value=fc.yield_holds)
        yield CounterMetricFamily("twt_yield_full_holds", "Of those holds, the ones that ran their longest "
                                  "(then none begins for as long again)", value=fc.yield_full_holds)
        yield CounterMetricFamily("twt_yield_budget_holds", "Times a tenant over its rate was held past its "
                                  "contended budget (half its rate while another tenant is active)",
                                  value=fc.yield_budget_holds)
        yield CounterMetricFamily("twt_rate_pauses", "Times frontend.ipc was not read while a tenant refused for "
                                  "its rate there waited for its bucket", value=fc.rate_pauses)
        dropped = CounterMetricFamily("twt_unauthenticated_dropped",
                                      "Requests without a verified capability dropped unanswered, by reason "
                                      "(peer_rate, unread_replies, backlog_bytes)", labels=["reason"])
        for reason, n in fc.unauthenticated_dropped:
            dropped.add_metric([reason], n)
        yield dropped
        shed = CounterMetricFamily("twt_connections_shed",
                                   "Frontend connections shut down, by reason (at accept: fd_budget, "
                                   "per_source, max_tcp_peers; TCP sessions: idle, evicted; memory: no "
                                   "message completed while memory passed frontend_memory_bytes)",
                                   labels=["reason"])
        for reason, n in fc.connections_shed:
            shed.add_metric([reason], n)
        yield shed
        conns = _gauge("twt_frontend_connections", "Frontend connections now, by transport", ["transport"])
        conns.add_metric(["ipc"], fc.connections - fc.tcp_connections)
        conns.add_metric(["tcp"], fc.tcp_connections)
        yield conns
        budget = _gauge("twt_frontend_connection_budget",
                        "Frontend connections (ipc and TCP together) allowed by the fd budget", [])
        budget.add_metric([], fc.connection_budget)
        yield budget
        paused = _gauge("twt_frontend_paused", "1 while frontend.ipc and small.ipc are renamed away "
                        "(connections near the fd budget)", [])
        paused.add_metric([], int(fc.frontend_paused))
        yield paused
        yield CounterMetricFamily("twt_frontend_pauses", "Times frontend.ipc and small.ipc were renamed away "
                                  "for the fd budget", value=fc.frontend_pauses)

    @staticmethod
    def _pool_and_devices(snap: MetricsSnapshot) -> Iterator[Metric]:
        if snap.pool_size is not None:
            pool = _gauge("twt_pool_workers", "Warm pool workers by state (idle: ready to bind; starting)", ["state"])
            pool.add_metric(["idle"], snap.pool_idle or 0)
            pool.add_metric(["starting"], snap.pool_starting or 0)
            yield pool
            target = _gauge("twt_pool_size_workers", "Idle workers the warm pool keeps ready (pool_size)", [])
            target.add_metric([], snap.pool_size)
            yield target
        if snap.devices:
            d = ["device"]
            limit = _gauge("twt_device_budget_limit_bytes",
                           "Device-wide GPU budget: what all tenants on the device may hold (capacity - reserve)", d)
            used = _gauge("twt_device_budget_used_bytes", "GPU bytes held by all tenants on the device", d)
            refused = CounterMetricFamily("twt_device_budget_refusals",
                                          "Allocations the device-wide budget refused", labels=d)
            for dev in snap.devices:
                idx = [str(dev.index)]
                limit.add_metric(idx, dev.budget_limit_bytes)
                used.add_metric(idx, dev.budget_used_bytes)
                refused.add_metric(idx, dev.budget_refusals)
            yield limit
            yield used
            yield refused


class _HttpCollector:
    """The metrics port's own counters: connections, refusals, answers and renders."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self._owner = owner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        server = self._owner._server
        stats = server.stats
        yield GaugeMetricFamily("twt_metrics_http_connections", "Connections to the metrics port now",
                                value=stats.connections)
        yield GaugeMetricFamily("twt_metrics_http_connection_limit", "Connections the metrics port holds at once "
                                "(metrics_max_connections, at most an eighth of the fd limit)", value=stats.limit)
        refused = CounterMetricFamily("twt_metrics_http_refused",
                                      "Metrics-port connections ended without what they asked for, by reason "
                                      "(max_connections, deadline, head_too_large, bad_request, unauthorized, "
                                      "accept_failed)", labels=["reason"])
        for reason, n in sorted(stats.refused.items()):
            refused.add_metric([reason], n)
        yield refused
        answered = CounterMetricFamily("twt_metrics_http_responses", "Metrics-port answers by HTTP status code",
                                       labels=["code"])
        for code, n in sorted(stats.responses.items()):  # one C call: atomic under the GIL
            answered.add_metric([str(code)], n)
        yield answered
        cache = server.cache
        yield CounterMetricFamily("twt_metrics_renders", "Renders of the metrics page (at most metrics_renders_per_s "
                                  "a second; scrapes in between get the latest)", value=cache.renders)
        latest = cache.latest
        if latest is not None:
            yield GaugeMetricFamily("twt_metrics_last_render_seconds", "How long the previous render took "
                                    "(the loop's snapshot included)", value=latest.seconds)


class PrometheusMetrics(Metrics):
    """The :class:`~supervisor.observe.metrics.Metrics` hooks, exported over HTTP at ``addr``.

    Paths: ``/metrics`` (also ``/``), ``/healthz`` and ``/readyz`` (see
    :mod:`supervisor.observe.health`); anything else is 404. With ``token_file``
    (``metrics_token_file``) ``/metrics`` needs ``Authorization: Bearer <token>``;
    the probes never do. The server starts in the constructor, so a bad or busy
    address fails ``twt supervise`` at once (``OSError`` naming the address) -
    after the run dir is locked. Its bounds (``max_connections``,
    ``request_timeout_s``, ``renders_per_s``) are :mod:`supervisor.observe.http_server`'s
    and :mod:`supervisor.observe.scrape_cache`'s.
    """

    def __init__(self, addr: str, *, registry: CollectorRegistry | None = None, process_metrics: bool = True,
                 health: Health | None = None, tenant_names: bool = True,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 renders_per_s: float = DEFAULT_RENDERS_PER_S, token_file: str | None = None) -> None:
        host, port = parse_metrics_addr(addr)
        token = BearerToken(token_file) if token_file is not None else None  # ConfigError before anything binds
        #: until the supervisor hands over the labels keyed by its state (:meth:`use_tenant_labels`)
        self.label = TenantLabels(tenant_names)
        disable_created_metrics()  # type: ignore[no-untyped-call] # no *_created series: one per counter child, never queried
        self.registry = registry or CollectorRegistry()
        self.health = health or Health()
        self._source: MetricsSource | None = None
        reg = self.registry
        info = Gauge("twt_build_info", "Always 1; the labels say which build is running",
                     ["version", "python", "protocol"], registry=reg)
        info.labels(build_version(), platform.python_version(), str(PROTOCOL_VERSION)).set(1)
        self._requests = Counter("twt_requests", "Client requests answered, by tenant, op and outcome "
                                 "(outcome: ok or the error code)", ["tenant", "op", "outcome"], registry=reg)
        self._latency = Histogram("twt_request_duration_seconds",
                                  "Time from a request's arrival to its answer, by op", ["op"],
                                  buckets=LATENCY_BUCKETS, registry=reg)
        self._exits = Counter("twt_worker_exits", "Worker processes that ended, by tenant and cause "
                              "(exit, signal, heartbeat, deadline, rss, stop); pool workers have tenant=\"\"",
                              ["tenant", "cause"], registry=reg)
        self._restarts = Counter("twt_restarts", "Instance restarts by the restart policy", ["tenant"], registry=reg)
        # registered before the error counter, so a scrape already shows its own failure
        reg.register(_StateCollector(self))
        self._snapshot_errors = Counter("twt_metrics_snapshot_errors",
                                        "Scrapes whose per-tenant snapshot could not be read", registry=reg)
        reg.register(_HttpCollector(self))
        if process_metrics:
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
        # label children, created once per label set (the loop thread is the only writer)
        self._req_children: dict[tuple[str, str, str], Counter] = {}
        self._lat_children: dict[str, Histogram] = {}
        self._closed = False
        page = Route(self._page, protected=True)
        routes = {METRICS_PATH: page, "/": page, HEALTHZ_PATH: Route(self._probe(self.health.live)),
                  READYZ_PATH: Route(self._probe(self.health.ready))}
        try:
            self._server = HttpServer(
                host, port, routes,
                lambda notify: ScrapeCache(self._render, renders_per_s, notify),
                max_connections=max_connections, timeout_s=request_timeout_s, token=token,
                not_found=self._not_found,
            )
        except OSError as exc:
            why = ("the port is in use (another supervisor or program); choose another --metrics-addr"
                   if exc.errno == errno.EADDRINUSE else str(exc.strerror or exc))
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {why}") from None
        self.host = host
        self.port: int = self._server.port
        log_event(_log, logging.INFO, "metrics.listening", host=host, port=self.port, url=self.url,
                  token=token is not None, max_connections=self._server.stats.limit,
                  renders_per_s=renders_per_s)

    @classmethod
    def from_config(cls, config: SupervisorConfig) -> PrometheusMetrics:
        """The exporter ``twt supervise`` runs: ``metrics_addr`` and the ``metrics_*`` settings."""
        if config.metrics_addr is None:
            raise ValueError("metrics_addr is not set: there is no metrics port to serve")
        return cls(config.metrics_addr, tenant_names=config.metrics_tenant_names,
                   max_connections=config.metrics_max_connections,
                   request_timeout_s=config.metrics_request_timeout_s,
                   renders_per_s=config.metrics_renders_per_s, token_file=config.metrics_token_file)

    @property
    def renders(self) -> int:
        """Renders of the page so far (``twt_metrics_renders_total``)."""
        return self._server.cache.renders

    @property
    def http(self) -> HttpServer:
        """The HTTP server (its :class:`~supervisor.observe.http_server.HttpStats` in ``.stats``)."""
        return self._server

    def use_tenant_labels(self, labels: TenantLabels) -> None:
        """Label tenants as ``labels`` does: pseudonyms keyed by the state database, stable across restarts."""
        self.label = labels

    def _render(self) -> bytes:
        """The render thread: the whole page (the collectors ask the loop for its snapshot, which
        also feeds the probes' health state)."""
        return generate_latest(self.registry)

    @staticmethod
    def _page(rendered: Rendered) -> Response:
        return Response(200, rendered.body, CONTENT_TYPE_PLAIN_0_0_4)  # what every Prometheus reads

    @staticmethod
    def _probe(verdict: Callable[[], Verdict]) -> Callable[[Rendered], Response]:
        """A probe answers from the health state the latest render observed: a loop that publishes
        no new snapshot makes ``/healthz`` fail."""

        def answer(_rendered: Rendered) -> Response:
            v = verdict()
            return Response(200 if v.ok else 503, v.body)

        return answer

    @staticmethod
    def _not_found(path: str) -> Response:
        return Response(404, f"not found: {path} (try {METRICS_PATH}, {HEALTHZ_PATH} or {READYZ_PATH})\n".encode())

    def _read_snapshot(self) -> MetricsSnapshot:
        """The loop's latest snapshot (an empty one when unbound or unreadable); feeds the health state."""
        source = self._source
        if source is None:
            return MetricsSnapshot()
        try:
            return self.health.observe(source())
        except Exception as exc:  # noqa: BLE001 - a scrape must never take the exporter down
            self._snapshot_errors.inc()
            log_event(_log, logging.WARNING, "metrics.snapshot_failed", error=repr(exc))
            return MetricsSnapshot()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    # ------------------------------------------------------ Metrics hooks

    def request_done(self, tenant: str, op: str, outcome: str, seconds: float) -> None:
        key = (self.label(tenant), op, outcome)
        child = self._req_children.get(key)
        if child is None:
            child = self._req_children[key] = self._requests.labels(*key)
        child.inc()
        lat = self._lat_children.get(op)
        if lat is None:
            lat = self._lat_children[op] = self._latency.labels(op)
        lat.observe(max(0.0, seconds))

    def worker_exit(self, tenant: str | None, cause: str) -> None:
        self._exits.labels(self.label(tenant), cause).inc()

    def restart(self, tenant: str) -> None:
        self._restarts.labels(self.label(tenant)).inc()

    #: twt_backend_info, made at the first backend_info
    _backend_gauge: Gauge | None = None

    def backend_info(self, backend: str, devices: Sequence[str], driver_version: str, cuda_version: str) -> None:
        # set once at start, like twt_build_info: which backend, device and driver serve (a stub where a
        # GPU was meant shows here; deploy/ configures backend = "cuda" so that never happens silently)
        info = self._backend_gauge
        if info is None:
            info = self._backend_gauge = Gauge(
                "twt_backend_info", "Always 1; the labels say which backend, device and driver serve",
                ["backend", "device", "driver_version", "cuda_version"], registry=self.registry)
        info.clear()
        for device in devices or ("none",):
            info.labels(backend, device, driver_version, cuda_version).set(1)

    def bind_source(self, snapshot: MetricsSource) -> None:
        self._source = snapshot

    def mark_ready(self) -> None:
        self.health.mark_ready()

    def mark_draining(self) -> None:
        self.health.mark_draining()

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        log_event(_log, logging.DEBUG, "metrics.stopped", port=self.port)
