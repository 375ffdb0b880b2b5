"""What a config reload (and a restart with durable state) changes: the plan, before any change.

The config file says which tenants *the file* manages; the state says which
tenants exist, with the spec each was registered with and the spec it has
now (after ``set-quota``, ``scale`` ...). :func:`plan_reload` compares them:

* a file tenant not registered            -> ``register`` (origin ``file``)
* a file tenant whose entry is unchanged  -> untouched (live changes made with
  ``set-quota``/``scale`` since are kept)
* a file tenant whose entry changed       -> ``change`` from the spec it has
  now to the file's, classified by what the change needs (:class:`SpecChange`)
* a file tenant no longer in the file     -> ``evict``
* a tenant registered at runtime          -> untouched, even if the file now
  names it (reported in ``conflicts``: evict it to hand it to the file)

Changed ``[supervisor]`` settings are reported, never applied: they need a
restart. Planning has no side effects; the loop applies the plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from shared.protocol import QUOTA_KEYS
from shared.spec import TenantSpec

__all__ = [
    "LIVE_FIELDS",
    "QUOTA_FIELDS",
    "RESTART_FIELDS",
    "ReloadPlan",
    "SpecChange",
    "TenantNow",
    "plan_reload",
]

#: applied to the tenant's shared-memory block at once (workers see it at their next allocation): set_quota's keys
QUOTA_FIELDS: tuple[str, ...] = QUOTA_KEYS
#: read by the supervisor only: take effect with the next request or restart decision
LIVE_FIELDS = frozenset(
    {*QUOTA_FIELDS, "restart", "max_restarts", "restart_window_s", "max_in_flight", "request_timeout_s",
     "requests_per_s", "bytes_per_s",
     "gpu_time_weight", "gpu_time_cap"}  # GPU-time policy: on the device's lease board at once
)
#: a worker gets these when it is bound: changing them needs new workers (a rolling restart)
RESTART_FIELDS = frozenset(
    {"cuda_device_index", "isolation", "sm_percentage", "wasm_fuel", "wasm_timeout_s", "wasm_max_memory_bytes"}
)


@dataclass(frozen=True)
class TenantNow:
    """A registered tenant as the planner needs it."""

    spec: TenantSpec
    registered_spec: TenantSpec
    origin: Literal["file", "runtime"]


@dataclass(frozen=True)
class SpecChange:
    """One tenant's move from the spec it has to the one the file asks for."""

    old: TenantSpec
    new: TenantSpec

    @property
    def tenant_id(self) -> str:
        return self.new.tenant_id

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for f in TenantSpec.field_names() if getattr(self.old, f) != getattr(self.new, f))

    @property
    def quota(self) -> dict[str, object]:
        """Changed quota fields and their new values (applied at once)."""
        return {f: getattr(self.new, f) for f in QUOTA_FIELDS if f in self.fields}

    @property
    def scale(self) -> bool:
        return "instances" in self.fields

    @property
    def needs_restart(self) -> bool:
        """True when running workers hold a value that changed (rolling restart)."""
        return any(f in RESTART_FIELDS for f in self.fields)

    @property
    def needs_placement(self) -> bool:
        return any(f in ("cuda_device_index", "isolation", "sm_percentage") for f in self.fields)

    def describe(self) -> dict[str, object]:
        return {
            "tenant": self.tenant_id,
            "fields": list(self.fields),
            "restart": self.needs_restart,
            "scale": self.scale,
        }


@dataclass(frozen=True)
class ReloadPlan:
    register: tuple[TenantSpec, ...] = ()
    change: tuple[SpecChange, ...] = ()
    #: file tenants whose entry changed in ways that do not touch the running spec
    #: (e.g. the file now says what set-quota already set): only the record is updated
    adopt: tuple[TenantSpec, ...] = ()
    evict: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.register or self.change or self.adopt or self.evict)

    def summary(self) -> dict[str, object]:
        """The reply of ``reload`` and the fields of its event."""
        return {
            "registered": [s.tenant_id for s in self.register],
            "changed": [c.describe() for c in self.change],
            "evicted": list(self.evict),
            "unchanged": list(self.unchanged),
            "conflicts": list(self.conflicts),
            "settings_not_applied": list(self.settings),
        }


def plan_reload(
    file_tenants: Iterable[TenantSpec],
    current: Mapping[str, TenantNow],
    *,
    old_settings: Mapping[str, object] | None = None,
    new_settings: Mapping[str, object] | None = None,
) -> ReloadPlan:
    """The difference between the file and what runs (see the module docstring).

    ``old_settings``/``new_settings``: the file's ``[supervisor]`` table before
    and now; keys whose value differs are listed in ``settings``.
    """
    wanted = {spec.tenant_id: spec for spec in file_tenants}
    register: list[TenantSpec] = []
    change: list[SpecChange] = []
    adopt: list[TenantSpec] = []
    unchanged: list[str] = []
    conflicts: list[str] = []
    for tid, spec in sorted(wanted.items()):
        now = current.get(tid)
        if now is None:
            register.append(spec)
        elif now.origin == "runtime":
            conflicts.append(tid)
        elif spec == now.registered_spec:
            unchanged.append(tid)
        elif spec == now.spec:
            adopt.append(spec)
        else:
            change.append(SpecChange(now.spec, spec))
    evict = tuple(sorted(tid for tid, now in current.items() if now.origin == "file" and tid not in wanted))
    old_s, new_s = dict(old_settings or {}), dict(new_settings or {})
    settings = tuple(sorted(k for k in set(old_s) | set(new_s) if old_s.get(k) != new_s.get(k)))
    return ReloadPlan(
        register=tuple(register),
        change=tuple(change),
        adopt=tuple(adopt),
        evict=evict,
        unchanged=tuple(unchanged),
        conflicts=tuple(conflicts),
        settings=settings,
    )
