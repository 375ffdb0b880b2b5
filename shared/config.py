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
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from shared.sizes import parse_size
from shared.spec import TenantSpec

__all__ = ["ENV_PREFIX", "SupervisorConfig", "default_run_dir", "load_config", "parse_host_port"]

ENV_PREFIX = "TWT_"
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
    device_reserve_bytes: int = 512 << 20
    devices: tuple[int, ...] | str = "all"
    placement: str = "most-free"
    cuda_driver_module: str | None = None
    cuda_nvrtc_module: str | None = None
    metrics_addr: str | None = None
    #: tenant names as metric labels (default: per-supervisor pseudonyms; docs/SECURITY.md)
    metrics_tenant_names: bool = False
    #: group (name or gid) of tenant-only clients running as other users (docs/SECURITY.md)
    client_group: str | None = None
    #: bytes the supervisor holds for one tenant / for all (queued replies, parked bodies, modules)
    max_tenant_held_bytes: int = 256 << 20
    max_held_bytes: int = 2 << 30
    register_timeout_s: float = 60.0
    tenants: tuple[TenantSpec, ...] = ()

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "run_dir", os.path.abspath(os.path.expanduser(str(self.run_dir))))
        if len(os.path.join(self.run_dir, "frontend.ipc")) > 100:
            raise ValueError(f"run_dir {self.run_dir!r} is too long for unix socket paths (keep it under ~80 chars)")
        _choice(self.backend, _BACKENDS, "backend")
        _choice(self.start_method, _START_METHODS, "start_method")
        _choice(self.log_format, _LOG_FORMATS, "log_format")
        s(self, "log_level", str(self.log_level).lower())
        _choice(self.log_level, _LOG_LEVELS, "log_level")
        _int(self.pool_size, "pool_size", 0, 1024)
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
        if not isinstance(self.metrics_tenant_names, bool):
            raise ValueError(f"metrics_tenant_names must be true or false; got {self.metrics_tenant_names!r}")
        if self.client_group is not None:
            s(self, "client_group", str(self.client_group))
            if not self.client_group or "/" in self.client_group:
                raise ValueError(f"client_group must be a group name or gid; got {self.client_group!r}")
        tenants = tuple(t if isinstance(t, TenantSpec) else TenantSpec.from_dict(t) for t in self.tenants)
        names = [t.tenant_id for t in tenants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tenant(s) listed twice in the config: {', '.join(dupes)}")
        s(self, "tenants", tenants)

    # paths inside the run dir
    def path(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    def endpoint(self, name: str) -> str:
        return "ipc://" + self.path(f"{name}.ipc")

    def replace(self, **changes: Any) -> SupervisorConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.field_names() if f != "tenants"}
        out["devices"] = list(self.devices) if isinstance(self.devices, tuple) else self.devices
        out["tenants"] = [t.to_dict() for t in self.tenants]
        return out


def _choice(value: Any, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _int(value: Any, name: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}; got {value!r}")


def _pos(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}")
    return float(value)


def _devices(value: Any) -> tuple[int, ...] | str:
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
    "client_group",
    "register_timeout_s",
)
_INT_FIELDS = {"pool_size", "heartbeat_liveness"}
_BOOL_FIELDS = {"metrics_tenant_names"}
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_FLOAT_FIELDS = {"heartbeat_interval_s", "stop_timeout_s", "kill_grace_s", "register_timeout_s"}


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _ENV_FIELDS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        try:
            if name in _BOOL_FIELDS:
                if raw.lower() not in _BOOLS:
                    raise ValueError(raw)
                out[name] = _BOOLS[raw.lower()]
            elif name in _INT_FIELDS:
                out[name] = int(raw)
            elif name in _FLOAT_FIELDS:
                out[name] = float(raw)
            else:
                out[name] = raw
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {name}") from None
    return out


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a TOML (or JSON, for ``launch()``) config file into flat supervisor fields + tenants."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read config {p}: {exc.strerror}") from None
    try:
        doc = json.loads(text) if p.suffix == ".json" else tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config {p} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
    return config_dict_to_fields(doc, str(p))


def config_dict_to_fields(doc: Mapping[str, Any], where: str = "config") -> dict[str, Any]:
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: the top level must be a table")
    unknown = sorted(set(doc) - {"supervisor", "tenant"})
    if unknown:
        raise ValueError(f"{where}: unknown top-level key(s) {', '.join(map(repr, unknown))}; expected [supervisor] and [[tenant]]")
    sup = doc.get("supervisor", {})
    if not isinstance(sup, Mapping):
        raise ValueError(f"{where}: [supervisor] must be a table")
    known = set(SupervisorConfig.field_names()) - {"tenants"}
    bad = sorted(set(sup) - known)
    if bad:
        raise ValueError(f"{where}: unknown [supervisor] key(s) {', '.join(map(repr, bad))}; known: {', '.join(sorted(known))}")
    fields = dict(sup)
    tenants = doc.get("tenant", [])
    if not isinstance(tenants, list):
        raise ValueError(f"{where}: tenants must be [[tenant]] tables")
    fields["tenants"] = tuple(TenantSpec.from_dict(t) for t in tenants)
    return fields


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SupervisorConfig:
    """Defaults < file < ``TWT_*`` environment < ``overrides`` (flags). Raises ValueError."""
    fields: dict[str, Any] = {}
    if path is not None:
        fields.update(read_config_file(path))
    fields.update(_from_env(os.environ if environ is None else environ))
    fields.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return SupervisorConfig(**fields)
