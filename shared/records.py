"""Typed records at the process boundaries: status, tenants, instances, boot and bind messages.

Each record is a frozen dataclass with one encoder (:meth:`Record.to_wire`,
a msgpack-ready dict) and one decoder (:meth:`Record.from_wire`), so the
supervisor builds them with checked fields and the CLI, chaos campaign and
Prometheus exporter read attributes instead of ``.get("...")`` on a dict.

Decoding ignores keys a record does not know (an older reader of a newer
supervisor) and fills fields a message lacks from their defaults; a field
without a default that is missing raises :class:`ProtocolError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shared.errors import ProtocolError

__all__ = [
    "BindMessage",
    "BootMessage",
    "FaultAck",
    "FaultExit",
    "FaultOrder",
    "HelloInfo",
    "InstanceRecord",
    "PoolRecord",
    "Record",
    "RegionRecord",
    "StatusRecord",
    "SupervisorRecord",
    "TenantRecord",
    "WorkerHello",
]

R = TypeVar("R", bound="Record")


class Record:
    """Mixin: the one encoder/decoder of every record below."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Record):
                value = value.to_wire()
            elif isinstance(value, tuple):
                value = [v.to_wire() if isinstance(v, Record) else v for v in value]
            out[f.name] = value
        return out

    @classmethod
    def from_wire(cls: type[R], data: Mapping[str, Any]) -> R:
        if not isinstance(data, Mapping):
            raise ProtocolError(f"{cls.__name__} must be a map, not {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError(f"{cls.__name__} lacks {f.name!r}")
                continue
            value = data[f.name]
            nested = f.metadata.get("record")
            if nested is not None and value is not None:
                if isinstance(value, list):
                    value = tuple(nested.from_wire(v) for v in value)
                else:
                    value = nested.from_wire(value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
        return cls(**kwargs)


def _holds(record: type[Record]) -> dict[str, Any]:
    """Field metadata: the field holds a ``record`` (or a tuple of them), decoded as one."""
    return {"record": record}


# ------------------------------------------------------------------ supervisor -> worker


@dataclass(frozen=True, slots=True)
class BootMessage(Record):
    """What a worker process is started with (the argument of ``worker.main.run``)."""

    worker_id: str  # a public label (logs, events)
    token: str  # one-time token the worker's two hellos must carry
    #: the ZeroMQ identity to connect with: 128 random bits, never published (a process that
    #: reaches backend.ipc cannot claim it first and shut the real worker out)
    routing_id: str
    data_endpoint: str
    control_endpoint: str
    heartbeat_interval_s: float
    heartbeat_liveness: int
    log_format: str = "text"
    log_level: str = "info"
    max_message_bytes: int = 256 << 20
    #: spawn: the supervisor's pid; forkserver: None (the worker checks the fork server instead)
    parent_pid: int | None = None
    #: the supervisor's pid and start time (psutil's clock): a silent supervisor is given up on
    #: only when this process is gone (worker.control), never because it is slow
    supervisor_pid: int | None = None
    supervisor_started: float | None = None


@dataclass(frozen=True, slots=True)
class BindMessage(Record):
    """The ``bind`` request's arguments: which tenant instance a worker becomes."""

    spec: dict[str, Any]  # TenantSpec.to_dict()
    instance: int
    incarnation: int
    segment: str  # the tenant's quota block
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ control channel (both ways)


@dataclass(frozen=True, slots=True)
class WorkerHello(Record):
    """A worker's first message on each of its two sockets: the one-time token from its boot message."""

    token: str
    pid: int


@dataclass(frozen=True, slots=True)
class FaultOrder(Record):
    """``fault`` (supervisor -> worker): arm or execute one fault (kinds: ``shared.protocol.FAULT_KINDS``)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FaultAck(Record):
    """``fault_ack`` (worker -> supervisor): what was armed, or the typed error that refused it."""

    ok: bool
    armed: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # TensorWasmError.to_dict() when not ok


@dataclass(frozen=True, slots=True)
class FaultExit(Record):
    """The answer to a fault that ended the worker (crash, segfault, exit): how it ended."""

    exit_code: int | None
    signal: int | None
    exited: bool = True


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
    last_exit: dict[str, Any] | None  # {exit_code, signal, reason, at}


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
    instances: tuple[InstanceRecord, ...] = field(default=(), metadata=_holds(InstanceRecord))
    restarts: int = 0
    in_flight: int = 0
    parked: int = 0
    uptime_s: float = 0.0
    backend: str = ""
    device: int = 0
    isolation: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    bytes_in_use: int = 0
    memory_quota_bytes: int = 0
    gpu_bytes_in_use: int = 0
    gpu_memory_bytes_cap: int | None = None
    quota: dict[str, Any] = field(default_factory=dict)  # the full QuotaSnapshot
    regions: tuple[RegionRecord, ...] = field(default=(), metadata=_holds(RegionRecord))
    origin: str = "runtime"  # "file": managed by the config file (reload); "runtime": by register/evict
    #: its ``tenant`` label on /metrics: a pseudonym stable across restarts, or the name (metrics_tenant_names)
    metrics_label: str = ""
    #: GPU time (shared.gpu_time): weight, cap, gpu_time_s, share over the last window, throttled, ...
    gpu_time: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolRecord(Record):
    idle: int
    starting: int
    size: int
    pids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SupervisorRecord(HelloInfo):
    """The ``supervisor`` part of a status: hello info, run dir, pool, counts."""

    run_dir: str
    pool: PoolRecord = field(metadata=_holds(PoolRecord))
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
    #: unauthenticated_dropped by reason (unread_replies, backlog_bytes, peer_rate; supervisor.admission.rates)
    unauthenticated_dropped_by: dict[str, int] = field(default_factory=dict)
    unauthenticated_rate_dropped: int = 0
    #: requests refused Overloaded by admission (requests or bytes per second), in all and by what
    admission_refused: int = 0
    admission_refused_by: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StatusRecord(Record):
    """The ``status`` reply."""

    supervisor: SupervisorRecord = field(metadata=_holds(SupervisorRecord))
    tenants: tuple[TenantRecord, ...] = field(default=(), metadata=_holds(TenantRecord))
    devices: tuple[dict[str, Any], ...] = ()

    def tenant(self, tenant_id: str) -> TenantRecord | None:
        return next((t for t in self.tenants if t.tenant_id == tenant_id), None)
