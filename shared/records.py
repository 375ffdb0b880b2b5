"""Typed records of the client protocol's replies: status, tenants, instances, results.

Each record is a frozen dataclass with one encoder (:meth:`Record.to_wire`,
a msgpack-ready dict) and one checked decoder (:meth:`Record.from_wire`,
see :mod:`shared.wire`), so the supervisor builds them with checked fields
and :class:`supervisor.client.api.SupervisorClient`, the CLI, the chaos campaign
and the Prometheus exporter read typed attributes instead of ``.get("...")``
on a dict. Records nest records (a tenant's spec is a
:class:`~shared.spec.TenantSpec`, its quota a
:class:`~shared.quota.QuotaSnapshot`, an instance's last exit an
:class:`ExitRecord`, a device a :class:`DeviceRecord`).

Decoding ignores keys a record does not know (an older reader of a newer
supervisor) and fills fields a message lacks from their defaults; a field
without a default that is missing, or a value of the wrong type, raises
:class:`~shared.errors.ProtocolError`.

The messages between a supervisor and its workers are records too, in
:mod:`shared.worker_link`: a worker imports only those (each frozen dataclass
costs ~0.6 ms to build at import, in every process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from shared.quota import QuotaSnapshot
from shared.spec import TenantSpec
from shared.wire import Record

__all__ = [
    "AliveInfo",
    "DeviceRecord",
    "EventsPage",
    "EvictResult",
    "ExitRecord",
    "FaultResult",
    "HelloInfo",
    "InstanceRecord",
    "PingInfo",
    "PoolRecord",
    "ProbedDevice",
    "QuotaSnapshot",
    "TenantRow",
    "Record",
    "RegionGrant",
    "RegionRecord",
    "ReloadChange",
    "ReloadResult",
    "RunResult",
    "STATUS_PAGE_DEFAULT",
    "STATUS_PAGE_MAX",
    "StatusRecord",
    "StatusSummary",
    "SupervisorRecord",
    "TenantRecord",
    "TenantSpec",
]

# ------------------------------------------------------------------ status (admin replies)


@dataclass(frozen=True, slots=True)
class HelloInfo(Record):
    """The ``hello`` reply, and the head of every status."""

    pid: int
    registry_id: str
    backend: str
    backend_reason: str
    start_method: str
    protocol: int
    uptime_s: float


@dataclass(frozen=True, slots=True)
class AliveInfo(Record):
    """The ``hello`` reply without a capability: the liveness probe that needs no secret."""

    protocol: int
    ready: bool


@dataclass(frozen=True, slots=True)
class ExitRecord(Record):
    """How an instance's last worker ended (``InstanceRecord.last_exit``)."""

    exit_code: int | None
    signal: int | None
    reason: str
    at: float  # time.time() of the exit


@dataclass(frozen=True, slots=True)
class InstanceRecord(Record):
    """One instance slot of a tenant."""

    index: int
    pid: int | None
    state: str  # a WorkerState value, or "restarting" / "down" without a worker
    in_flight: int
    incarnation: int
    restarts: int
    uptime_s: float | None
    draining: bool
    last_exit: ExitRecord | None


@dataclass(frozen=True, slots=True)
class RegionRecord(Record):
    """One shared-memory region of a tenant (supervisor.routing.regions): id, bytes charged, client pid."""

    region: int
    nbytes: int
    pid: int
    age_s: float


@dataclass(frozen=True, slots=True)
class TenantRecord(Record):
    """A tenant as ``status`` and ``tenant_status`` report it (docs/PROTOCOL.md)."""

    tenant_id: str
    state: str
    generation: int
    failed_reason: str | None = None
    pids: tuple[int, ...] = ()
    instances: tuple[InstanceRecord, ...] = field(default=())
    restarts: int = 0
    in_flight: int = 0
    parked: int = 0
    uptime_s: float = 0.0
    backend: str = ""
    device: int = 0
    isolation: str = ""
    spec: TenantSpec | None = None  # None only from a supervisor too old to send it
    bytes_in_use: int = 0
    memory_quota_bytes: int = 0
    gpu_bytes_in_use: int = 0
    gpu_memory_bytes_cap: int | None = None
    quota: QuotaSnapshot | None = None  # None while the tenant's block is being unlinked (evict)
    regions: tuple[RegionRecord, ...] = field(default=())
    origin: str = "runtime"  # "file": managed by the config file (reload); "runtime": by register/evict
    #: its ``tenant`` label on /metrics: a pseudonym stable across restarts, or the name (metrics_tenant_names)
    metrics_label: str = ""
    #: GPU time (shared.gpu_time): weight, cap, gpu_time_s, share over the last window, throttled, ...
    gpu_time: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolRecord(Record):
    """The idle worker pool of a status."""

    idle: int
    starting: int
    size: int
    pids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SupervisorRecord(HelloInfo):
    """The ``supervisor`` part of a status: hello info, run dir, pool, counts."""

    run_dir: str
    pool: PoolRecord = field()
    workers: int
    internal_errors: int
    rss_bytes: int | None = None
    #: bytes held for tenants (supervisor.routing.budgets): total, refused, and per kind
    held_bytes: dict[str, int] = field(default_factory=dict)
    #: unauthenticated requests dropped unanswered, and waiting for their turn
    unauthenticated_dropped: int = 0
    unauthenticated_backlog: int = 0
    #: the soft RLIMIT_NOFILE in force; frontend connections, their budget, connections shed
    fd_limit: int | None = None
    connections: int = 0
    connection_budget: int | None = None
    connections_shed: int = 0
    #: the same by reason (fd_budget, per_source, max_tcp_peers); TCP connections and their source addresses
    connections_shed_by: dict[str, int] = field(default_factory=dict)
    tcp_connections: int = 0
    tcp_sources: int = 0
    #: frontend.ipc and small.ipc renamed away for fds (connections near the budget), and how often so far
    frontend_paused: bool = False
    frontend_pauses: int = 0
    #: unauthenticated_dropped by reason (unread_replies, backlog_bytes, peer_rate; supervisor.admission.rates)
    unauthenticated_dropped_by: dict[str, int] = field(default_factory=dict)
    unauthenticated_rate_dropped: int = 0
    #: requests refused Overloaded by admission (requests or bytes per second), in all and by what
    admission_refused: int = 0
    admission_refused_by: dict[str, int] = field(default_factory=dict)
    #: of those, dropped unanswered: past the tenant's answers to refusals (tenant_refusals_per_s)
    admission_unanswered: int = 0
    #: times the TCP frontend was not read for a while, and for how long in all: it read and dropped
    #: more than tcp_drops_per_s (supervisor.admission.pacing)
    tcp_pauses: int = 0
    tcp_paused_s: float = 0.0
    #: times a tenant over its rate was held (its socket unread, its queued requests kept) while another
    #: tenant's request was in flight; of those, the holds that ran their longest (max 2 ms); holds for
    #: its contended budget (past half its rate while another tenant is active; supervisor.admission.yielding)
    yield_holds: int = 0
    yield_full_holds: int = 0
    yield_budget_holds: int = 0
    #: times frontend.ipc was not read while a tenant refused for its rate there waited for its bucket
    rate_pauses: int = 0
    #: the backend's driver: the NVIDIA kernel driver's version and the CUDA version it supports
    #: ("" on the stub; the same as twt_backend_info's labels)
    driver_version: str = ""
    cuda_version: str = ""


@dataclass(frozen=True, slots=True)
class DeviceRecord(Record):
    """One GPU of a status (supervisor.routing.placement): its memory, its budget block, its tenants."""

    index: int
    name: str
    total_bytes: int
    free_bytes_at_start: int | None  # None when the backend could not say
    budget_capacity_bytes: int
    reserve_bytes: int
    budget_limit_bytes: int
    budget_used_bytes: int
    budget_free_bytes: int
    budget_high_water: int
    budget_refusals: int
    tenants: tuple[str, ...] = ()
    segment: str = ""
    #: the device's GPU-time lease board (shared.gpu_time on main): scheduler, holder, grants, ...
    #: (free-form, as TenantRecord.gpu_time there); empty without a board
    gpu_time: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProbedDevice(Record):
    """One device as the backend probe reports it (the CUDA probe's child process prints JSON;
    the stub's are made up from the config): what ``Placement.create`` sizes its budget from."""

    index: int
    total_bytes: int = 0
    free_bytes: int | None = None  # None when the probe could not measure it
    name: str = ""
    compute_capability: str = ""  # "9.0"; "" for the stub
    #: what one CUDA context costs there (each worker's fixed overhead starts from it): measured once
    #: by the probe, else the device class's conservative default (never 0 for want of a measure)
    context_bytes: int | None = None
    context_bytes_source: str = ""  # "measured" | "default"
    context_note: str = ""  # why it is the default (the failed call)


@dataclass(frozen=True, slots=True)
class StatusSummary(Record):
    """Every registered tenant counted, whichever page of them a ``status`` reply holds: a
    supervisor of 10,000 tenants is read at a glance without sending 10,000 records."""

    tenants: int = 0
    states: dict[str, int] = field(default_factory=dict)  # tenants per state ("running": 12, ...)
    instances: int = 0  # instances wanted, all tenants together (draining ones not counted)
    ready: int = 0  # of which ready


#: the tenants a ``status`` reply holds when the request names no ``limit`` (every tenant of a
#: supervisor that held up to 1,024, the former max_tenants), and the most it ever holds
STATUS_PAGE_DEFAULT: Final = 1024
STATUS_PAGE_MAX: Final = 1024


@dataclass(frozen=True, slots=True)
class TenantRow(Record):
    """One tenant as a ``twt status`` / ``twt top`` table row: what the table shows and nothing
    else (``status`` with ``view = "rows"``). A full :class:`TenantRecord` carries the spec, the
    quota snapshot and the instances; at 10,000 tenants reading every one of those takes seconds,
    the rows a fraction of one."""

    tenant_id: str
    state: str
    ready: int
    wanted: int
    pids: tuple[int, ...]
    bytes_in_use: int
    memory_quota_bytes: int
    gpu_bytes_in_use: int
    gpu_memory_bytes_cap: int | None
    cpu_high_water: int
    gpu_high_water: int
    cpu_refusals: int
    gpu_refusals: int
    restarts: int
    uptime_s: float
    gpu_time_weight: float
    gpu_time_cap: float | None
    gpu_time_s: float
    #: its share of the device over the last window (None: not measured yet)
    gpu_share: float | None
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class StatusRecord(Record):
    """The ``status`` reply: one page of tenant records (by tenant id), the summary of all.

    ``next``: the ``after`` to ask for the next page; None when this page is the last (or the
    supervisor is too old to page, and sent every tenant)."""

    supervisor: SupervisorRecord
    tenants: tuple[TenantRecord, ...] = ()
    devices: tuple[DeviceRecord, ...] = ()
    summary: StatusSummary | None = None  # None only from a supervisor too old to send it
    next: str | None = None
    #: with ``view = "rows"``: the page as table rows instead of ``tenants`` (``twt top``)
    rows: tuple[TenantRow, ...] = ()

    def tenant(self, tenant_id: str) -> TenantRecord | None:
        return next((t for t in self.tenants if t.tenant_id == tenant_id), None)


# ------------------------------------------------------------------ other replies


@dataclass(frozen=True, slots=True)
class EvictResult(Record):
    """The ``evict`` reply: the tenant and the pids of the workers that were stopped."""

    evicted: str
    pids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RunResult(Record):
    """The ``run_wasm`` reply (worker.wasm.host)."""

    results: tuple[int | float, ...]
    fuel_used: int | None
    elapsed_s: float
    cached: bool = False
    gpu_peak_bytes: int = 0
    memory_bytes: int = 0
    logs: tuple[str, ...] = ()
    logs_dropped: int = 0  # log lines over the run's log limits
    exit_code: int | None = None  # the guest called exit() (WASI proc_exit): the run's outcome
    gpu_time_s: float = 0.0  # device time the run's kernels used (shared GPU-time accounting)
    gpu_wait_s: float = 0.0  # time the run waited for its GPU-time turn
    fuel_limit: int | None = None  # the run's fuel budget (the request's, capped by the tenant's wasm_fuel)
    timeout_s: float | None = None  # the run's deadline (the request's, capped by the tenant's wasm_timeout_s)


@dataclass(frozen=True, slots=True)
class EventsPage(Record):
    """An ``events`` reply: the events after the asked position (maps, free-form per kind: see
    docs/OPERATIONS.md), the position to ask next, how many fell out of the log unread, whether
    more are held, and the id of the log (another id: the supervisor was restarted)."""

    events: tuple[dict[str, object], ...]
    next: int
    missed: int
    more: bool
    log: str


@dataclass(frozen=True, slots=True)
class PingInfo(Record):
    """The ``ping`` reply: the worker that answered (tenant and instance are None while unbound)."""

    pid: int
    tenant: str | None
    instance: int | None
    requests: int
    uptime_s: float


@dataclass(frozen=True, slots=True)
class RegionGrant(Record):
    """The ``region_create`` reply: map ``name`` with ``shared.region.Region.attach``."""

    region: int
    name: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReloadChange(Record):
    """One changed tenant of a reload: which spec fields, and whether it restarts or scales."""

    tenant: str
    fields: tuple[str, ...]
    restart: bool
    scale: bool


@dataclass(frozen=True, slots=True)
class ReloadResult(Record):
    """The ``reload`` reply (supervisor.lifecycle.reload)."""

    registered: tuple[str, ...] = ()
    changed: tuple[ReloadChange, ...] = ()
    evicted: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    settings_not_applied: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FaultResult(Record):
    """The ``inject_fault`` reply: where the fault went, and what came of it (armed, or the exit)."""

    tenant: str
    instance: int
    pid: int
    kind: str
    ok: bool = True
    armed: dict[str, object] | None = None  # free-form, as FaultAck.armed
    exit_code: int | None = None
    signal: int | None = None
    exited: bool | None = None  # set when the fault ended the worker
