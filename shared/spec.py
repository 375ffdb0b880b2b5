"""What a tenant is allowed: :class:`TenantSpec`, the crate's builder as a frozen dataclass.

    spec = (
        TenantSpec("acme")
        .with_memory_quota_bytes(2 << 30)
        .with_gpu_memory_bytes_cap(512 << 20)
        .with_isolation(IsolationKind.PROCESS)
    )

A spec validates itself on construction (a clear ``ValueError`` / ``TypeError``
naming the field), is immutable (``with_*`` returns a new spec), and loads from
a TOML ``[[tenant]]`` table or a dict, refusing unknown keys by name. Sizes
accept ints or strings like ``"512MiB"``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from types import EllipsisType
from typing import Final
from collections.abc import Callable, Mapping

from shared.gpu_time import check_gpu_time_cap, check_gpu_time_weight
from shared.checks import is_int, is_number
from shared.ids import TenantId, tenant_name
from shared.quota import DEFAULT_QUOTA_BYTES, MAX_INSTANCES
from shared.sizes import parse_size

__all__ = ["DEADLINE_GRACE_S", "IsolationKind", "RestartPolicy", "TenantSpec"]

#: how much longer than its run limit a ``run_wasm`` may take before the supervisor answers
#: ``KernelTimeout`` (compile, copy and reply time; see :meth:`TenantSpec.run_deadline_s`)
DEADLINE_GRACE_S = 2.0


class IsolationKind(str, enum.Enum):
    """How a tenant's workers share a GPU.

    PROCESS: one process and CUDA context per instance, no MPS (faults stay in
    the process). MPS: through the MPS daemon with per-client memory and SM
    limits (a fatal GPU fault reaches every MPS client on the device). AUTO:
    MPS when ``mps_or_fallback()`` finds a live daemon, else PROCESS.
    """

    PROCESS = "process"
    MPS = "mps"
    AUTO = "auto"


class RestartPolicy(str, enum.Enum):
    """When a worker that exited is started again (OTP's permanent/transient/temporary)."""

    ALWAYS = "always"
    ON_FAILURE = "on-failure"
    NEVER = "never"


def _size(value: object, name: str) -> int:
    return parse_size(value, what=name)


def _opt_size(value: object, name: str) -> int | None:
    return None if value is None else parse_size(value, what=name)


def _int(value: object, name: str, lo: int, hi: int) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")
    return value


def _float(value: object, name: str, lo: float, hi: float) -> float:
    if not is_number(value):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    number = float(value)
    if not (math.isfinite(number) and lo <= number <= hi):
        raise ValueError(f"{name} must be in {lo:g}..{hi:g}, got {number}")
    return number


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """Everything the supervisor needs to run one tenant.

    Quotas: ``memory_quota_bytes`` (host bytes, default 8 GiB; WASM linear
    memory counts against it), ``gpu_memory_bytes_cap`` (``None``: counted,
    never refused - operator trust), ``recorded_cuda_mem_pool_quota`` (reported
    only: not a cap, and not set as the pool's release threshold, which stays 0).
    Placement: ``cuda_device_index`` (``None``: the placement policy picks),
    ``isolation``, ``sm_percentage`` (MPS only). Processes: ``instances``,
    ``restart`` / ``max_restarts`` within ``restart_window_s``,
    ``max_in_flight``, ``request_timeout_s``. WASM: ``wasm_fuel`` and
    ``wasm_timeout_s`` are a run's default and its ceiling,
    ``wasm_max_memory_bytes`` bounds a guest's linear memory. Admission:
    ``requests_per_s`` / ``bytes_per_s`` (token buckets; ``None``: the
    supervisor's ``tenant_requests_per_s`` / ``tenant_bytes_per_s``). GPU time:
    ``gpu_time_weight`` (> 0, default 1: a work-conserving share) and
    ``gpu_time_cap`` (a fraction in (0, 1], default None: a hard ceiling);
    see docs/GPU-QUOTAS.md. Density: ``idle_timeout_s`` (``None``, the default: never parks) -
    a tenant that received no request for that long is parked: its workers exit, its buffers
    wait in the supervisor's memory and come back with the same handles on its next request
    (docs/ARCHITECTURE.md, "Parked tenants").
    """

    tenant_id: str  # validated as a TenantId, kept a plain str (shared.ids.tenant_name)
    memory_quota_bytes: int = DEFAULT_QUOTA_BYTES
    gpu_memory_bytes_cap: int | None = None
    recorded_cuda_mem_pool_quota: int | None = None
    cuda_device_index: int | None = None
    isolation: IsolationKind = IsolationKind.PROCESS
    sm_percentage: int | None = None
    instances: int = 1
    restart: RestartPolicy = RestartPolicy.ALWAYS
    max_restarts: int = 5
    restart_window_s: float = 60.0
    max_in_flight: int = 64
    request_timeout_s: float = 30.0
    wasm_fuel: int = 2_000_000_000
    wasm_timeout_s: float = 10.0
    wasm_max_memory_bytes: int = 256 << 20
    #: admission (supervisor.admission.rates): requests and request bytes per second; None: the supervisor's default
    requests_per_s: float | None = None
    bytes_per_s: int | None = None
    #: GPU time (shared.gpu_time): a work-conserving weight on each device the tenant uses, and an
    #: optional hard ceiling on its fraction of the device's time (None: no ceiling)
    gpu_time_weight: float = 1.0
    gpu_time_cap: float | None = None
    #: parking (supervisor.lifecycle.parking): seconds without a request before the tenant is
    #: parked; None: never
    idle_timeout_s: float | None = None

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "tenant_id", tenant_name(self.tenant_id))
        s(self, "memory_quota_bytes", _size(self.memory_quota_bytes, "memory_quota_bytes"))
        s(self, "gpu_memory_bytes_cap", _opt_size(self.gpu_memory_bytes_cap, "gpu_memory_bytes_cap"))
        s(
            self,
            "recorded_cuda_mem_pool_quota",
            _opt_size(self.recorded_cuda_mem_pool_quota, "recorded_cuda_mem_pool_quota"),
        )
        if self.cuda_device_index is not None:
            _int(self.cuda_device_index, "cuda_device_index", 0, 1023)
        try:
            s(self, "isolation", IsolationKind(self.isolation))
        except ValueError:
            raise ValueError(
                f"isolation must be one of {[k.value for k in IsolationKind]}, got {self.isolation!r}"
            ) from None
        if self.sm_percentage is not None:
            _int(self.sm_percentage, "sm_percentage", 1, 100)
        _int(self.instances, "instances", 0, MAX_INSTANCES)
        try:
            s(self, "restart", RestartPolicy(self.restart))
        except ValueError:
            raise ValueError(
                f"restart must be one of {[k.value for k in RestartPolicy]}, got {self.restart!r}"
            ) from None
        _int(self.max_restarts, "max_restarts", 0, 1_000_000)
        s(self, "restart_window_s", _float(self.restart_window_s, "restart_window_s", 0.001, 1e7))
        _int(self.max_in_flight, "max_in_flight", 1, 1_000_000)
        s(self, "request_timeout_s", _float(self.request_timeout_s, "request_timeout_s", 0.001, 1e6))
        _int(self.wasm_fuel, "wasm_fuel", 1, (1 << 63) - 1)
        s(self, "wasm_timeout_s", _float(self.wasm_timeout_s, "wasm_timeout_s", 0.001, 1e6))
        s(self, "wasm_max_memory_bytes", _size(self.wasm_max_memory_bytes, "wasm_max_memory_bytes"))
        if self.wasm_max_memory_bytes < 65536:
            raise ValueError("wasm_max_memory_bytes must be at least one 64 KiB page")
        if self.requests_per_s is not None:
            s(self, "requests_per_s", _float(self.requests_per_s, "requests_per_s", 0.001, 1e9))
        if self.bytes_per_s is not None:
            s(self, "bytes_per_s", _size(self.bytes_per_s, "bytes_per_s"))
            if self.bytes_per_s < 1:
                raise ValueError("bytes_per_s must be at least 1")
        s(self, "gpu_time_weight", check_gpu_time_weight(self.gpu_time_weight))  # InvalidArgument naming the key
        s(self, "gpu_time_cap", check_gpu_time_cap(self.gpu_time_cap))
        if self.idle_timeout_s is not None:
            s(self, "idle_timeout_s", _float(self.idle_timeout_s, "idle_timeout_s", 0.001, 1e7))
        # a value equal to its default shares the default's object: a spec decoded from the wire
        # would otherwise hold its own float and large-int objects (~190 B a tenant at 10,000 tenants)
        for name, default in _SHARED_DEFAULTS:
            value = getattr(self, name)
            if value is not default and type(value) is type(default) and value == default:
                s(self, name, default)

    # ------------------------------------------------------------ builder

    def _with(self, **changes: object) -> TenantSpec:
        values: dict[str, object] = {name: getattr(self, name) for name in self.field_names()}
        values.update(changes)
        return TenantSpec._checked(values)

    @classmethod
    def _checked(cls, values: Mapping[str, object]) -> TenantSpec:
        """``TenantSpec(**values)`` for values of types not known yet: ``__post_init__`` checks
        every field's type and range (``TypeError``/``ValueError``), so the constructor is the
        checker and is called as a plain callable here."""
        make: Callable[..., TenantSpec] = cls
        return make(**values)

    def with_memory_quota_bytes(self, n: int | str) -> TenantSpec:
        return self._with(memory_quota_bytes=n)

    def with_gpu_memory_bytes_cap(self, n: int | str | None) -> TenantSpec:
        return self._with(gpu_memory_bytes_cap=n)

    def with_recorded_cuda_mem_pool_quota(self, n: int | str | None) -> TenantSpec:
        return self._with(recorded_cuda_mem_pool_quota=n)

    def with_cuda_device_index(self, index: int | None) -> TenantSpec:
        return self._with(cuda_device_index=index)

    def with_isolation(self, kind: IsolationKind | str) -> TenantSpec:
        return self._with(isolation=kind)

    def with_sm_percentage(self, pct: int | None) -> TenantSpec:
        return self._with(sm_percentage=pct)

    def with_gpu_time(self, *, weight: float | None = None, cap: float | None | EllipsisType = ...) -> TenantSpec:
        """Weight and/or cap of the tenant's GPU time (``cap=None`` removes the cap; omitted: unchanged)."""
        changes: dict[str, object] = {}
        if weight is not None:
            changes["gpu_time_weight"] = weight
        if cap is not ...:
            changes["gpu_time_cap"] = cap
        return self._with(**changes)

    def with_idle_timeout_s(self, seconds: float | None) -> TenantSpec:
        """Park the tenant after ``seconds`` without a request (``None``: never)."""
        return self._with(idle_timeout_s=seconds)

    def with_instances(self, n: int) -> TenantSpec:
        return self._with(instances=n)

    def with_restart(
        self,
        policy: RestartPolicy | str,
        *,
        max_restarts: int | None = None,
        restart_window_s: float | None = None,
    ) -> TenantSpec:
        changes: dict[str, object] = {"restart": policy}
        if max_restarts is not None:
            changes["max_restarts"] = max_restarts
        if restart_window_s is not None:
            changes["restart_window_s"] = restart_window_s
        return self._with(**changes)

    def with_max_in_flight(self, n: int) -> TenantSpec:
        return self._with(max_in_flight=n)

    def with_wasm_limits(
        self,
        *,
        fuel: int | None = None,
        timeout_s: float | None = None,
        max_memory_bytes: int | str | None = None,
    ) -> TenantSpec:
        changes: dict[str, object] = {}
        if fuel is not None:
            changes["wasm_fuel"] = fuel
        if timeout_s is not None:
            changes["wasm_timeout_s"] = timeout_s
        if max_memory_bytes is not None:
            changes["wasm_max_memory_bytes"] = max_memory_bytes
        return self._with(**changes)

    # -------------------------------------------------------- the deadline rule

    def wasm_run_s(self, requested: object = None) -> float:
        """The run time a ``run_wasm`` gets: ``requested`` if it is a positive number, never
        more than ``wasm_timeout_s``."""
        if is_number(requested) and requested > 0:
            return min(float(requested), self.wasm_timeout_s)
        return self.wasm_timeout_s

    def run_deadline_s(self, timeout_s: object = None) -> float:
        """How long after it arrives a guest run is answered at the latest: its run time
        (:meth:`wasm_run_s` of its ``timeout_s``) plus :data:`DEADLINE_GRACE_S`, at least
        ``request_timeout_s`` (every other op gets ``request_timeout_s``: the rule is
        ``shared.protocol.OpSpec.deadline_s``)."""
        return max(self.wasm_run_s(timeout_s) + DEADLINE_GRACE_S, self.request_timeout_s)

    # -------------------------------------------------------- (de)serialise

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TenantSpec:
        """Build from a dict / TOML table; unknown keys are refused by name.

        ``name`` is accepted as an alias of ``tenant_id`` (``[[tenant]] name = "acme"``).
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"tenant spec must be a table/dict, not {type(data).__name__}")
        values = dict(data)
        if "name" in values:
            if "tenant_id" in values:
                raise ValueError("tenant spec has both 'name' and 'tenant_id'; use one")
            values["tenant_id"] = values.pop("name")
        known = set(cls.field_names())
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            who = values.get("tenant_id", "?")
            raise ValueError(
                f"unknown key(s) in tenant spec {who!r}: {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        if "tenant_id" not in values:
            raise ValueError("tenant spec needs a 'tenant_id' (or 'name')")
        return cls._checked(values)

    def to_dict(self) -> dict[str, object]:
        """Plain values only (enums as strings): msgpack/TOML/JSON-able."""
        out: dict[str, object] = {}
        for name in self.field_names():
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, enum.Enum) else (
                str(value) if isinstance(value, TenantId) else value
            )
        return out


#: (field, default) of the defaults worth sharing between specs (objects, not small ints or None)
_SHARED_DEFAULTS: Final = tuple(
    (f.name, f.default) for f in dataclasses.fields(TenantSpec)
    if isinstance(f.default, float) or (isinstance(f.default, int) and not isinstance(f.default, bool)
                                        and not -5 <= f.default <= 256)
)
