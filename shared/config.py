"""Supervisor configuration: TOML file, ``TWT_*`` environment, command-line flags.

Precedence, lowest first: defaults < ``[supervisor]`` table of the config file
< ``TWT_*`` environment variables < command-line flags. The environment is
read once, at start-up, by :func:`load_config` - never at import.

    [supervisor]
    run_dir = "/run/twt"
    backend = "auto"            # auto | stub | cuda
    start_method = "spawn"      # spawn | forkserver
    pool_size = 2

    [[tenant]]
    name = "acme"
    gpu_memory_bytes_cap = "2GiB"
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from collections.abc import Callable, Iterable, Mapping

from shared.checks import is_int, is_number
from shared.device_cpus import parse_device_cpus
from shared.errors import ConfigError
from shared.sizes import parse_size
from shared.spec import TenantSpec

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "SupervisorConfig",
    "default_run_dir",
    "load_config",
    "parse_host_port",
    "usable_cpus",
    "read_config_file",
    "unknown_env_vars",
]

ENV_PREFIX = "TWT_"
#: the admission defaults' share of the host, per CPU the supervisor may run on: a tenant's
#: requests and request bytes a second (``tenant_requests_per_s`` / ``tenant_bytes_per_s``).
#: Why per CPU: a tenant's requests cost the supervisor's loop and I/O threads, its worker and
#: the kernel - CPUs of this host. On 2 CPUs, 20,000 requests/s and 4 GiB/s (the fixed defaults
#: before) never bound a flood: one tenant's pings or 1 MiB writes kept both CPUs busy and another
#: tenant's ping p99 went to 7-16x its quiet p50; at 8,000/s and 256 MiB/s it stayed
#: under 10x. On 16 CPUs the defaults are 64,000 requests/s (more than the loop serves) and 2 GiB/s.
REQUESTS_PER_S_PER_CPU = 4000.0
BYTES_PER_S_PER_CPU = 128 << 20
Backend = Literal["auto", "stub", "cuda"]
StartMethod = Literal["spawn", "forkserver"]

_BACKENDS = ("auto", "stub", "cuda")
_PLACEMENTS = ("most-free", "first")
_START_METHODS = ("spawn", "forkserver")
_LOG_FORMATS = ("text", "json")
_LOG_LEVELS = ("debug", "info", "warning", "error")
#: fields given in bytes: an int or a size string ("512MiB")
_SIZE_FIELDS = (
    "max_message_bytes",
    "max_header_bytes",
    "max_client_reply_bytes",
    "max_tenant_held_bytes",
    "max_held_bytes",
    "rss_allowance_bytes",
    "stub_device_capacity_bytes",
    "device_reserve_bytes",
    "tenant_bytes_per_s",
)


def default_run_dir() -> str:
    """``$XDG_RUNTIME_DIR/twt`` when that exists, else ``/tmp/twt-<uid>`` (short: ipc paths are limited)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "twt")
    return f"/tmp/twt-{os.getuid()}"


@dataclass(frozen=True)
class SupervisorConfig:
    """Everything ``twt supervise`` needs; see docs/OPERATIONS.md for each field."""

    run_dir: str = field(default_factory=default_run_dir)
    #: where the durable state lives (``None``: ``<run_dir>/state``; see :attr:`state_path`)
    state_dir: str | None = None
    backend: str = "auto"
    start_method: str = "spawn"
    log_format: str = "text"
    log_level: str = "info"
    pool_size: int = 2
    heartbeat_interval_s: float = 1.0
    heartbeat_liveness: int = 3
    stop_timeout_s: float = 5.0
    kill_grace_s: float = 1.0
    max_message_bytes: int = 256 << 20
    max_header_bytes: int = 64 << 10
    max_client_reply_bytes: int = 32 << 20
    rss_allowance_bytes: int = 512 << 20
    stub_device_capacity_bytes: int = 16 << 30
    #: device memory kept out of each device budget: driver headroom and other processes; each worker's
    #: own fixed overhead (context, scratch, modules, cuBLAS) is measured and charged on top of it
    device_reserve_bytes: int = 512 << 20
    devices: tuple[int, ...] | str = "all"
    placement: str = "most-free"
    cuda_driver_module: str | None = None
    cuda_nvrtc_module: str | None = None
    metrics_addr: str | None = None
    #: tenant names as metric labels (default: per-supervisor pseudonyms; docs/SECURITY.md)
    metrics_tenant_names: bool = False
    #: the metrics port's bounds (supervisor.observe.http_server): connections at once (past it closed at
    #: accept), seconds for a request to arrive and again for its answer to be taken, page renders a
    #: second (scrapes in between get the latest render)
    metrics_max_connections: int = 32
    metrics_request_timeout_s: float = 5.0
    metrics_renders_per_s: float = 1.0
    #: a file holding the bearer token /metrics asks for (None: no token; the probes never need one)
    metrics_token_file: str | None = None
    #: group (name or gid) of tenant-only clients running as other users (docs/SECURITY.md)
    client_group: str | None = None
    #: bytes the supervisor holds for one tenant / for all (queued replies, parked bodies, modules)
    max_tenant_held_bytes: int = 256 << 20
    max_held_bytes: int = 2 << 30
    register_timeout_s: float = 60.0
    #: TCP frontends with CURVE, e.g. ("tcp://10.0.0.5:7700",); port 0 picks a free port
    listen: tuple[str, ...] = ()
    #: the CURVE key pair as a certificate file (e.g. a mounted Secret); None: made and kept in state_dir
    server_key_file: str | None = None
    #: allow-list of client public keys (*.key certificates) for the TCP frontend; None: any key
    client_keys_dir: str | None = None
    #: admin ops over TCP; refused (TenantIsolationViolation) unless true
    allow_remote_admin: bool = False
    #: the inject_fault op; false (the production setting, deploy/) refuses it (FaultInjectionDisabled)
    fault_injection: bool = True
    #: SIGTERM drains: new requests are refused (Draining), in-flight ones finish within this long, then
    #: the workers stop. At least the longest request deadline (request_timeout_s, 30 s by default)
    drain_timeout_s: float = 35.0
    #: TCP connections at once, greeted or not: past it handshakes are refused (ZAP), a few more shed at accept
    max_tcp_peers: int = 1024
    #: TCP connections from one source address (an IPv6 /64) at once; past it shed at accept
    max_tcp_peers_per_source: int = 64
    #: a TCP connection that has not finished its CURVE handshake by then is closed (ZMQ_HANDSHAKE_IVL)
    tcp_handshake_timeout_s: float = 3.0
    #: a TCP connection that carried no request (and has none in flight) for this long is closed; the
    #: client reconnects before its next request (supervisor.admission.peers: the idle rule and eviction)
    tcp_idle_timeout_s: float = 60.0
    #: the supervisor's memory over its RSS at start past which the frontend's connections that complete
    #: no message are shed (a message that never ends: supervisor.admission.fd_guard); 0: no bound.
    #: None: max_held_bytes + 1 GiB (what the frontend may hold for its clients, and room for libzmq's queues)
    frontend_memory_bytes: int | None = None
    #: admission defaults per tenant (a spec's requests_per_s / bytes_per_s override them): token buckets
    #: (bursts: supervisor.admission.rates); past them Overloaded with retry_after_s. By default a share of
    #: the host: so many per CPU the supervisor may run on (see REQUESTS_PER_S_PER_CPU)
    tenant_requests_per_s: float = field(default_factory=lambda: REQUESTS_PER_S_PER_CPU * usable_cpus())
    tenant_bytes_per_s: int = field(default_factory=lambda: BYTES_PER_S_PER_CPU * usable_cpus())
    #: answers per second to a tenant's requests refused for its rate (a burst of one second's worth or its
    #: max_in_flight, whichever is more); past them such requests are dropped unanswered and counted
    tenant_refusals_per_s: float = 100.0
    #: requests per second one peer may send without a verified capability; the rest are dropped
    unauthenticated_requests_per_s: float = 200.0
    #: messages per second the TCP frontend may read and drop unanswered (refusals past their answers,
    #: garbage, forged capabilities) before the loop stops reading it, up to 1 ms at a time (0: never)
    tcp_drops_per_s: float = 1000.0
    #: lifecycle events kept (numbered) for clients that poll them with the ``events`` op
    event_log_size: int = 4096
    #: GPU time (shared.gpu_time): the device lease's quantum, and whether weights and caps are
    #: scheduled at all (false: the device is only serialised and time still accounted)
    gpu_time_quantum_s: float = 0.01
    gpu_time_scheduler: bool = True
    #: nice steps a bound worker's guest thread (WASM and its host calls) runs below the worker's
    #: threads that drive the device, and so below the supervisor (worker.priority; 0: same priority -
    #: the default: on the stub it gained no measurable device time and slowed guests' host loops)
    worker_guest_nice: int = 0
    #: nice steps a starting pool worker runs below the supervisor and the bound workers until it is
    #: warmed or bound (worker.priority); 0: the same priority - the default: on the 2-core stub host
    #: 5 steps cost warm share (twt bench density: 97.6-98.6 % warm in 7 runs, 97.3-99.6 % without).
    #: Only where the worker may raise its priority back (CAP_SYS_NICE, or RLIMIT_NICE)
    pool_start_nice: int = 0
    #: tenants registered at once, and tenant instances (worker processes) of all tenants at once:
    #: a registration or scale past either is refused (CapacityExhausted); each device's GPU-time
    #: board is sized from them at start
    max_tenants: int = 16_384
    max_workers: int = 4096
    #: tenant workers alive at once (bound to a tenant: active, activating, parking); an activation
    #: past it parks the least recently used idle tenant early, or is refused (CapacityExhausted).
    #: None: no bound but each device's memory budget over its context cost (GPU-QUOTAS.md)
    max_active: int | None = None
    #: with ``max_active``, this many of its places are kept free: the least recently used idle tenants
    #: past ``max_active - park_ahead`` are parked ahead, so that an activation finds room without
    #: waiting for a park. None: ``max_active // 16`` (0 below 16)
    park_ahead: int | None = None
    #: the warm pool grows with the activation rate up to this many (None: ``pool_size``, a fixed pool)
    pool_max: int | None = None
    #: the stub's device as a core of its own (shared.device_cpus): the CPUs on which every stub
    #: worker's device thread of each device runs, the worker's other threads and the supervisor on the
    #: rest; "last" (the last CPUs of the affinity set, one a device) or CPU numbers; () off - the
    #: default, for a user who runs the stub beside other work (docs/GPU-QUOTAS.md, "The stub device")
    stub_device_cpus: tuple[int, ...] | str = ()
    tenants: tuple[TenantSpec, ...] = ()
    #: the file the settings came from (``twt reload`` and SIGHUP read it again); set by :func:`load_config`
    config_file: str | None = None

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "run_dir", os.path.abspath(os.path.expanduser(str(self.run_dir))))
        if len(os.path.join(self.run_dir, "frontend.ipc")) > 100:
            raise ValueError(f"run_dir {self.run_dir!r} is too long for unix socket paths (keep it under ~80 chars)")
        if self.state_dir is not None:
            if not isinstance(self.state_dir, str) or not self.state_dir:
                raise ValueError(f"state_dir must be a directory path; got {self.state_dir!r}")
            s(self, "state_dir", os.path.abspath(os.path.expanduser(self.state_dir)))
        if self.config_file is not None:
            s(self, "config_file", os.path.abspath(os.fspath(self.config_file)))
        _choice(self.backend, _BACKENDS, "backend")
        _choice(self.start_method, _START_METHODS, "start_method")
        _choice(self.log_format, _LOG_FORMATS, "log_format")
        s(self, "log_level", str(self.log_level).lower())
        _choice(self.log_level, _LOG_LEVELS, "log_level")
        _int(self.pool_size, "pool_size", 0, 1024)
        _int(self.pool_start_nice, "pool_start_nice", 0, 19)
        s(self, "heartbeat_interval_s", _pos(self.heartbeat_interval_s, "heartbeat_interval_s"))
        _int(self.heartbeat_liveness, "heartbeat_liveness", 1, 1000)
        s(self, "stop_timeout_s", _pos(self.stop_timeout_s, "stop_timeout_s"))
        s(self, "kill_grace_s", _pos(self.kill_grace_s, "kill_grace_s"))
        s(self, "register_timeout_s", _pos(self.register_timeout_s, "register_timeout_s"))
        for name in _SIZE_FIELDS:
            s(self, name, parse_size(getattr(self, name), what=name))
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1KiB")
        s(self, "devices", _devices(self.devices))
        _choice(self.placement, _PLACEMENTS, "placement")
        for name in ("cuda_driver_module", "cuda_nvrtc_module"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, str) and all(p.isidentifier() for p in value.split("."))
            ):
                raise ValueError(f"{name} must be a dotted module name; got {value!r}")
        if self.metrics_addr is not None:
            parse_host_port(self.metrics_addr, "metrics_addr")
        s(self, "metrics_tenant_names", _bool(self.metrics_tenant_names, "metrics_tenant_names"))
        _int(self.metrics_max_connections, "metrics_max_connections", 1, 4096)
        s(self, "metrics_request_timeout_s", _pos(self.metrics_request_timeout_s, "metrics_request_timeout_s"))
        if self.metrics_request_timeout_s > 300:
            raise ValueError(f"metrics_request_timeout_s must be at most 300 s; got {self.metrics_request_timeout_s!r}")
        s(self, "metrics_renders_per_s", _pos(self.metrics_renders_per_s, "metrics_renders_per_s"))
        if self.metrics_renders_per_s > 1000:
            raise ValueError(f"metrics_renders_per_s must be at most 1000; got {self.metrics_renders_per_s!r}")
        if self.metrics_token_file is not None:
            if not isinstance(self.metrics_token_file, str) or not self.metrics_token_file:
                raise ValueError(f"metrics_token_file must be a file path; got {self.metrics_token_file!r}")
            s(self, "metrics_token_file", os.path.abspath(os.path.expanduser(self.metrics_token_file)))
        if self.client_group is not None:
            s(self, "client_group", str(self.client_group))
            if not self.client_group or "/" in self.client_group:
                raise ValueError(f"client_group must be a group name or gid; got {self.client_group!r}")
        s(self, "listen", _listen(self.listen))
        if self.server_key_file is not None:
            s(self, "server_key_file", os.path.abspath(os.path.expanduser(str(self.server_key_file))))
        if self.client_keys_dir is not None:
            s(self, "client_keys_dir", os.path.abspath(os.path.expanduser(str(self.client_keys_dir))))
        s(self, "allow_remote_admin", _bool(self.allow_remote_admin, "allow_remote_admin"))
        s(self, "fault_injection", _bool(self.fault_injection, "fault_injection"))
        if not is_number(self.drain_timeout_s) or not 0 <= self.drain_timeout_s <= 86_400:
            raise ValueError(f"drain_timeout_s must be a number of seconds in 0..86400 (0: no drain); "
                             f"got {self.drain_timeout_s!r}")
        s(self, "drain_timeout_s", float(self.drain_timeout_s))
        _int(self.max_tcp_peers, "max_tcp_peers", 1, 1_000_000)
        _int(self.max_tcp_peers_per_source, "max_tcp_peers_per_source", 1, 1_000_000)
        if self.frontend_memory_bytes is None:
            s(self, "frontend_memory_bytes", self.max_held_bytes + (1 << 30))
        else:
            s(self, "frontend_memory_bytes", parse_size(self.frontend_memory_bytes, what="frontend_memory_bytes"))
        _int(self.frontend_memory_bytes, "frontend_memory_bytes", 0, 1 << 50)
        for name in ("tcp_handshake_timeout_s", "tcp_idle_timeout_s", "tenant_requests_per_s", "tenant_refusals_per_s",
                     "unauthenticated_requests_per_s"):
            s(self, name, _pos(getattr(self, name), name))
        if self.tenant_bytes_per_s < 1:
            raise ValueError("tenant_bytes_per_s must be at least 1")
        if not is_number(self.tcp_drops_per_s) or not 0 <= self.tcp_drops_per_s < math.inf:
            raise ValueError(f"tcp_drops_per_s must be a number >= 0 (0: never pause); got {self.tcp_drops_per_s!r}")
        s(self, "tcp_drops_per_s", float(self.tcp_drops_per_s))
        _int(self.event_log_size, "event_log_size", 16, 100_000)
        s(self, "gpu_time_quantum_s", _pos(self.gpu_time_quantum_s, "gpu_time_quantum_s"))
        if not 0.0001 <= self.gpu_time_quantum_s <= 1.0:
            raise ValueError(f"gpu_time_quantum_s must be in 0.0001..1 s; got {self.gpu_time_quantum_s!r}")
        _int(self.max_tenants, "max_tenants", 1, 65_536)
        _int(self.max_workers, "max_workers", 1, 131_072)
        if self.max_active is not None:
            _int(self.max_active, "max_active", 1, 131_072)
        if self.park_ahead is not None:
            _int(self.park_ahead, "park_ahead", 0, 131_071)
            if self.max_active is not None and self.park_ahead >= self.max_active:
                raise ValueError(f"park_ahead must be below max_active ({self.max_active}); got {self.park_ahead!r}")
        if self.pool_max is not None:
            _int(self.pool_max, "pool_max", 0, 1024)
            if self.pool_max < self.pool_size:
                raise ValueError(f"pool_max must be at least pool_size ({self.pool_size}); got {self.pool_max!r}")
        s(self, "gpu_time_scheduler", _bool(self.gpu_time_scheduler, "gpu_time_scheduler"))
        _int(self.worker_guest_nice, "worker_guest_nice", 0, 19)
        s(self, "stub_device_cpus", parse_device_cpus(self.stub_device_cpus))
        tenants = tuple(t if isinstance(t, TenantSpec) else TenantSpec.from_dict(t) for t in self.tenants)
        names = [t.tenant_id for t in tenants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tenant(s) listed twice in the config: {', '.join(dupes)}")
        s(self, "tenants", tenants)

    @property
    def state_path(self) -> str:
        """The state directory: ``state_dir``, else ``<run_dir>/state``."""
        return self.state_dir if self.state_dir is not None else os.path.join(self.run_dir, "state")

    # paths inside the run dir
    def path(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    def endpoint(self, name: str) -> str:
        return "ipc://" + self.path(f"{name}.ipc")

    def replace(self, **changes: object) -> SupervisorConfig:
        values: dict[str, object] = {name: getattr(self, name) for name in self.field_names()}
        values.update(changes)
        return SupervisorConfig.checked(values)

    @classmethod
    def checked(cls, fields: Mapping[str, object]) -> SupervisorConfig:
        """``SupervisorConfig(**fields)`` for values of types not known yet (a parsed file, the
        environment, flags): ``__post_init__`` checks every field's type and range
        (``TypeError``/``ValueError``), so the constructor is the checker, called as a plain callable."""
        make: Callable[..., SupervisorConfig] = cls
        return make(**fields)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, object]:
        out = {f: getattr(self, f) for f in self.field_names() if f not in ("tenants", "config_file")}
        out["devices"] = list(self.devices) if isinstance(self.devices, tuple) else self.devices
        out["listen"] = list(self.listen)
        if isinstance(self.stub_device_cpus, tuple):
            out["stub_device_cpus"] = list(self.stub_device_cpus)
        out["tenants"] = [t.to_dict() for t in self.tenants]
        return out


def _choice(value: object, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _int(value: object, name: str, lo: int, hi: int) -> None:
    if not is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}; got {value!r}")


def _pos(value: object, name: str) -> float:
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}")
    return float(value)


def _devices(value: object) -> tuple[int, ...] | str:
    if value == "all":
        return "all"
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            try:
                idx = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"devices must be 'all' or a list of device indexes; got {value!r}") from None
            if idx < 0:
                raise ValueError(f"device index must be >= 0; got {idx}")
            out.append(idx)
        if not out:
            raise ValueError("devices must name at least one device")
        return tuple(sorted(set(out)))
    raise ValueError(f"devices must be 'all' or a list of device indexes; got {value!r}")


def _listen(value: object) -> tuple[str, ...]:
    """``listen``: TCP endpoints ``tcp://HOST:PORT`` (a list, or one comma-separated string)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"listen must be a list of tcp://HOST:PORT endpoints; got {value!r}")
    out = []
    for ep in value:
        if not isinstance(ep, str) or not ep.startswith("tcp://") or ep == "tcp://" or ep.startswith("tcp://:"):
            raise ValueError(f"listen endpoint must be tcp://HOST:PORT (port 0: any free port); got {ep!r}")
        parse_host_port(ep.removeprefix("tcp://"), f"listen endpoint {ep!r}")
        out.append(ep)
    return tuple(dict.fromkeys(out))


def _bool(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"{name} must be true or false; got {value!r}")


def parse_host_port(addr: str, what: str = "address") -> tuple[str, int]:
    """``"127.0.0.1:9464"`` / ``"[::1]:9464"`` / ``":9464"`` -> (host, port); port 0 means any free
    port, an empty host 127.0.0.1. The one HOST:PORT parser (config, exporter, CLI)."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:9464; port 0: any free port); got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


#: fields settable from the environment as TWT_<FIELD upper-case>
_ENV_FIELDS = (
    "run_dir",
    "state_dir",
    "backend",
    "start_method",
    "log_format",
    "log_level",
    "pool_size",
    "heartbeat_interval_s",
    "heartbeat_liveness",
    "stop_timeout_s",
    "kill_grace_s",
    *_SIZE_FIELDS,
    "devices",
    "placement",
    "cuda_driver_module",
    "cuda_nvrtc_module",
    "metrics_addr",
    "metrics_tenant_names",
    "metrics_max_connections",
    "metrics_request_timeout_s",
    "metrics_renders_per_s",
    "metrics_token_file",
    "client_group",
    "register_timeout_s",
    "listen",
    "server_key_file",
    "client_keys_dir",
    "allow_remote_admin",
    "fault_injection",
    "drain_timeout_s",
    "max_tcp_peers",
    "event_log_size",
    "max_tcp_peers_per_source",
    "tcp_handshake_timeout_s",
    "tcp_idle_timeout_s",
    "frontend_memory_bytes",
    "tenant_requests_per_s",
    "tenant_refusals_per_s",
    "unauthenticated_requests_per_s",
    "tcp_drops_per_s",
    "gpu_time_quantum_s",
    "gpu_time_scheduler",
    "worker_guest_nice",
    "pool_start_nice",
    "max_tenants",
    "max_workers",
    "max_active",
    "park_ahead",
    "pool_max",
    "stub_device_cpus",
)
_INT_FIELDS = {"pool_size", "heartbeat_liveness", "max_tcp_peers", "event_log_size", "max_tcp_peers_per_source",
               "max_tenants", "max_workers", "metrics_max_connections", "max_active", "park_ahead",
               "pool_max", "worker_guest_nice", "pool_start_nice"}
_FLOAT_FIELDS = {"heartbeat_interval_s", "stop_timeout_s", "drain_timeout_s", "kill_grace_s", "register_timeout_s",
                 "tcp_handshake_timeout_s", "tcp_idle_timeout_s", "tenant_requests_per_s", "tenant_refusals_per_s",
                 "unauthenticated_requests_per_s", "tcp_drops_per_s",
                 "gpu_time_quantum_s", "metrics_request_timeout_s", "metrics_renders_per_s"}


#: TWT_* names that are not supervisor fields but are read elsewhere
_OTHER_ENV = ("RUN_DIR", "HANDOVER_TRACE", "WORK_TRACE")


def unknown_env_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """``TWT_*`` variables that nothing reads (typos), each with a suggestion when one is close.

    ``twt supervise`` logs them as a warning: a misspelt ``TWT_POOL_SZIE``
    would otherwise be ignored without a word.
    """
    env = os.environ if environ is None else environ
    known = {ENV_PREFIX + n.upper() for n in _ENV_FIELDS} | {ENV_PREFIX + n for n in _OTHER_ENV}
    out = []
    for name in sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        out.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    problems: list[str] = []
    for name in _ENV_FIELDS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        try:
            if name in _INT_FIELDS:
                out[name] = int(raw)
            elif name in _FLOAT_FIELDS:
                out[name] = float(raw)
            else:
                out[name] = raw
        except ValueError:
            problems.append(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {name}")
    if problems:
        raise ConfigError.listing("environment", problems)
    return out


def read_config_file(path: str | os.PathLike[str]) -> dict[str, object]:
    """Parse a TOML (or JSON, for ``launch()``) config file into flat supervisor fields + tenants."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError.listing(f"config {p}", ["the file does not exist"]) from None
    except IsADirectoryError:
        raise ConfigError.listing(f"config {p}", ["is a directory, not a file"]) from None
    except PermissionError:
        raise ConfigError.listing(f"config {p}", ["permission denied: this user cannot read it"]) from None
    except OSError as exc:
        raise ConfigError.listing(f"config {p}", [f"cannot be read ({(exc.strerror or str(exc)).lower()})"]) from None
    kind = "JSON" if p.suffix == ".json" else "TOML"
    try:
        doc = json.loads(text) if p.suffix == ".json" else tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError.listing(f"config {p}", [f"not valid {kind}: {exc}"]) from None
    except RecursionError:  # the parsers recurse per nesting level (a 10,000-deep hostile file)
        raise ConfigError.listing(f"config {p}", [f"{kind} nested too deeply (a config file is at most "
                                          f"{MAX_CONFIG_DEPTH} levels deep)"]) from None
    depth = _nesting_depth(doc)
    if depth > MAX_CONFIG_DEPTH:  # parsed, but later checks (messages, specs) must not recurse that deep
        raise ConfigError.listing(f"config {p}", [f"{kind} nested {depth} levels deep; a config file is at most "
                                          f"{MAX_CONFIG_DEPTH} levels deep"])
    return config_dict_to_fields(doc, f"config {p}")


#: deeper than any real config file (tables in arrays of tables: 4 or 5), shallow enough for every
#: recursive check after parsing
MAX_CONFIG_DEPTH = 32


def _nesting_depth(doc: object) -> int:
    """How deeply lists and tables nest in ``doc`` (iterative: no recursion to exhaust)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Iterable[object] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_CONFIG_DEPTH:
            return depth  # enough to refuse: no need to walk the rest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def config_dict_to_fields(doc: Mapping[str, object], where: str = "config") -> dict[str, object]:
    """Flat supervisor fields + tenants from a parsed document; every mistake is reported at once."""
    if not isinstance(doc, Mapping):
        raise ConfigError.listing(where, ["the top level must be a table"])
    problems: list[str] = []
    unknown = sorted(set(doc) - {"supervisor", "tenant"})
    if unknown:
        problems.append(f"unknown top-level key(s) {', '.join(map(repr, unknown))}; expected [supervisor] and [[tenant]]")
    sup = doc.get("supervisor", {})
    if not isinstance(sup, Mapping):
        problems.append("[supervisor] must be a table")
        sup = {}
    known = set(SupervisorConfig.field_names()) - {"tenants", "config_file"}
    for key in sorted(set(sup) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(known))}"
        problems.append(f"unknown [supervisor] key {key!r}; {hint}")
    fields = {k: v for k, v in sup.items() if k in known}
    problems += _field_problems(fields)
    tenants = doc.get("tenant", [])
    specs: list[TenantSpec] = []
    if not isinstance(tenants, list):
        problems.append("tenants must be [[tenant]] tables")
        tenants = []
    for n, table in enumerate(tenants, 1):
        spec, tenant_problems = _tenant_problems(table)
        who = f"[[tenant]] #{n}" + (f" ({table.get('name') or table.get('tenant_id')!r})"
                                    if isinstance(table, Mapping) and (table.get("name") or table.get("tenant_id"))
                                    else "")
        problems += [f"{who}: {p}" for p in tenant_problems]
        if spec is not None:
            specs.append(spec)
    problems += _duplicate_names(tenants)
    if problems:
        raise ConfigError.listing(where, problems)
    fields["tenants"] = tuple(specs)
    return fields


def tenants_of(fields: Mapping[str, object]) -> tuple[TenantSpec, ...]:
    """The tenant specs in fields from :func:`config_dict_to_fields` (a tuple of specs under ``tenants``)."""
    specs = fields.get("tenants", ())
    if not isinstance(specs, tuple) or not all(isinstance(spec, TenantSpec) for spec in specs):
        raise TypeError(f"tenants must be a tuple of TenantSpec, not {type(specs).__name__}")
    return specs


def _duplicate_names(tables: list[object]) -> list[str]:
    """Names given to more than one [[tenant]] table, in the same pass as every other mistake
    (a table whose other fields are wrong still has its name)."""
    seen: dict[str, list[int]] = {}
    for n, table in enumerate(tables, 1):
        if isinstance(table, Mapping):
            name = table.get("name", table.get("tenant_id"))
            if isinstance(name, str) and name:
                seen.setdefault(name, []).append(n)
    return [f"tenant {name!r} listed twice in the config ([[tenant]] #{', #'.join(map(str, at))})"
            for name, at in seen.items() if len(at) > 1]


def _field_problems(fields: Mapping[str, object]) -> list[str]:
    """Each supervisor field checked on its own (the defaults are valid), so one bad value hides no other."""
    problems = []
    for key, value in fields.items():
        try:
            SupervisorConfig.checked({key: value})
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    return problems


def _tenant_problems(table: object) -> tuple[TenantSpec | None, list[str]]:
    """One tenant table: the spec, or every field's mistake."""
    if not isinstance(table, Mapping):
        return None, [f"tenant spec must be a table/dict, not {type(table).__name__}"]
    try:
        return TenantSpec.from_dict(table), []
    except (TypeError, ValueError) as first:
        values = dict(table)
        tid = values.pop("name", None) or values.pop("tenant_id", None)
        values.pop("tenant_id", None)
        problems = []
        try:
            TenantSpec.from_dict({"tenant_id": "x", **{k: v for k, v in values.items()
                                                               if k not in TenantSpec.field_names()}})
        except (TypeError, ValueError) as exc:
            problems.append(str(exc).replace("tenant spec 'x'", "the table"))  # unknown keys
        if tid is None:
            problems.append("needs a 'name' (or 'tenant_id')")
        else:
            try:
                TenantSpec.from_dict({"tenant_id": tid})
            except (TypeError, ValueError) as exc:
                problems.append(str(exc))
        for key, value in values.items():
            if key not in TenantSpec.field_names():
                continue
            try:
                TenantSpec.from_dict({"tenant_id": "x", key: value})
            except (TypeError, ValueError) as exc:
                problems.append(str(exc))
        return None, problems or [str(first)]


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> SupervisorConfig:
    """Defaults < file < ``TWT_*`` environment < ``overrides`` (flags). Raises ValueError."""
    fields: dict[str, object] = {}
    if path is not None:
        fields.update(read_config_file(path))
        fields["config_file"] = os.fspath(path)
    fields.update(_from_env(os.environ if environ is None else environ))
    fields.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return SupervisorConfig.checked(fields)
