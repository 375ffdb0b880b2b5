"""TenantRegistry: tenants, their quota blocks, and the capabilities that guard them.

The in-process heart of the supervisor, with the Rust crate's API names.
``TenantRegistry.new()`` draws a random public registry id and a secret key
and mints the admin capability; ``register_with_capability`` creates the
tenant's :class:`~shared.quota.QuotaBlock` and mints a tenant capability.

Every capability-taking method checks, cheapest first:

1. the token's kind (a tenant token is no admin token and vice versa),
2. its registry id: another registry's token is *foreign* - refused with
   :class:`TenantIsolationViolation`, or :class:`CapabilityFromForeignRegistry`
   in the ``*_strict`` variant,
3. its HMAC (``hmac.compare_digest``): a bad MAC is *forged*,
4. its tenant generation: tokens of an evicted tenant are *revoked*
   (:class:`CapabilityRevoked`), also after the name is registered again.

The quota path takes no lock (the block's atomics do the work);
register/unregister/set_quota take one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar

from shared import capability as _cap
from shared.capability import MonitorCapability, RegistryAdminCapability, TenantCapability
from shared.checks import is_int
from shared.errors import (
    AlreadyRegistered,
    CapabilityFromForeignRegistry,
    CapabilityRevoked,
    SegmentError,
    TenantIsolationViolation,
    UnknownTenant,
)
from supervisor.host.mps import MPS_PROBE_MAX_AGE_S, MpsDecision, mps_or_fallback
from shared.protocol import QUOTA_KEYS
from shared.quota import UNCHANGED, QuotaCounters, QuotaSnapshot, Unchanged, new_segment_name
from shared.spec import TenantSpec
from supervisor.store.audit import Denial
from supervisor.store.state import RegistryKey, StateStore
from supervisor.store.tenant_quota import TenantQuota

__all__ = ["RegistryEntry", "TenantInfo", "TenantRegistry"]

_VERIFIED_MAX = 1 << 16
#: distinct (generation, limits) whose fresh quota record tenants share (past it: a record each)
_SHARED_RECORDS_MAX = 256


@dataclass(frozen=True)
class TenantInfo:
    """One tenant as the registry sees it (``tenants()`` / ``get()``)."""

    tenant_id: str
    generation: int
    spec: TenantSpec
    segment: str
    registered_at: float
    quota: QuotaSnapshot

    def to_dict(self) -> dict[str, object]:
        return {
            "tenant_id": self.tenant_id,
            "generation": self.generation,
            "spec": self.spec.to_dict(),
            "segment": self.segment,
            "registered_at": self.registered_at,
            "quota": self.quota.to_dict(),
        }


class RegistryEntry(Protocol):
    """What the registry keeps of a registered tenant. Its own record by default; the supervisor
    has it keep the tenant's runtime record instead (:meth:`TenantRegistry.register_entry`), so a
    tenant is one object, not two (at 10,000 tenants a second one was ~90 B a tenant)."""

    spec: TenantSpec
    block: TenantQuota
    generation: int
    registered_at: float


E = TypeVar("E", bound=RegistryEntry)


class _Tenant:
    __slots__ = ("spec", "block", "generation", "registered_at")

    def __init__(self, spec: TenantSpec, block: TenantQuota, generation: int) -> None:
        self.spec = spec
        self.block = block
        self.generation = generation
        self.registered_at = time.time()


class TenantRegistry:
    """Maps tenants to quota blocks; every operation is guarded by a capability.

    Create with :meth:`new`, which returns the registry and its admin
    capability. Safe to use from several threads.
    """

    def __init__(self, *, _secret: bytes, _registry_id: bytes, segment_prefix: str | None = None,
                 lazy_segments: bool = False) -> None:
        """Internal: use :meth:`new`."""
        self._secret = _secret
        self._rid = _registry_id
        self._prefix = segment_prefix or _registry_id.hex()[:8]
        self._tenants: dict[str, RegistryEntry] = {}
        #: the last generation issued to each tenant id not registered now (a registered one's is
        #: its entry's): an evicted tenant's capabilities stay revoked, also after a restart
        self._generations: dict[str, int] = {}
        self._slot = 0
        self._lock = threading.Lock()
        self._closed = False
        self._verified: set[bytes] = set()
        self._retired: set[bytes] = set()
        self._lazy = lazy_segments
        #: the quota records new tenants share until they change (by generation and limits; bounded)
        self._records: dict[tuple[int, int, int | None, int | None], QuotaCounters] = {}
        #: one bound method shared by every tenant's quota (a pointer each, not an object each)
        self._namer = self._next_segment_name

    def _next_segment_name(self) -> str:
        """A fresh segment name: ``twt-<prefix>-<slot>``, a slot never used before by this registry."""
        self._slot += 1
        return new_segment_name(self._prefix, self._slot)

    @classmethod
    def new(
        cls,
        *,
        segment_prefix: str | None = None,
        key: RegistryKey | None = None,
        generations: Mapping[str, int] | None = None,
        retired: Iterable[bytes] = (),
        lazy_segments: bool = False,
    ) -> tuple[TenantRegistry, RegistryAdminCapability]:
        """A registry and its admin capability.

        Without ``key`` the identity is fresh (random id and secret). With the
        ``key`` a previous run stored (:meth:`export_key`), capabilities minted
        before verify again and the admin capability is the same bytes;
        ``generations`` (the last one issued per tenant id) keeps evicted
        tenants' capabilities revoked, ``retired`` lists registry ids replaced by
        :meth:`rotate_key` (their capabilities are refused as revoked).

        Segments are named ``twt-<segment_prefix>-<slot>``; the prefix defaults
        to the first 8 hex digits of the registry id. With ``lazy_segments`` (the
        supervisor's) a tenant is registered without a segment: its quota is a record
        until :meth:`TenantQuota.open <supervisor.store.tenant_quota.TenantQuota.open>`
        (a worker is about to be bound); without, each tenant's block is made at once.
        """
        if segment_prefix is not None and (
            not segment_prefix or not all(c.isalnum() or c in "-_" for c in segment_prefix)
        ):
            raise ValueError(f"segment_prefix must be alphanumeric (plus - _), got {segment_prefix!r}")
        if key is None:
            key = RegistryKey.fresh()
        elif len(key.registry_id) != _cap.REGISTRY_ID_BYTES or len(key.secret) < 16:
            raise ValueError(
                f"registry key must have a {_cap.REGISTRY_ID_BYTES}-byte id and a secret of at least 16 bytes"
            )
        registry = cls(_secret=key.secret, _registry_id=key.registry_id, segment_prefix=segment_prefix,
                       lazy_segments=lazy_segments)
        registry._generations.update(generations or {})
        registry._retired.update(retired)
        return registry, registry._admin_capability()

    @classmethod
    def from_state(
        cls, store: StateStore, *, segment_prefix: str | None = None, lazy_segments: bool = False
    ) -> tuple[TenantRegistry, RegistryAdminCapability]:
        """The registry of a supervisor with durable state: the stored identity, or on a
        first start a fresh one that is stored at once (so the admin capability written
        for the CLI is the one the next start has too)."""
        key = store.registry_key()
        if key is None:
            key = RegistryKey.fresh()
            store.put_registry_key(key)
        return cls.new(
            segment_prefix=segment_prefix,
            key=key,
            generations=store.generations(),
            retired=store.retired_registry_ids(),
            lazy_segments=lazy_segments,
        )

    def _admin_capability(self) -> RegistryAdminCapability:
        return _cap.mint(RegistryAdminCapability, self._secret, self._rid, 0)

    def monitor_capability(self, admin_cap: RegistryAdminCapability) -> MonitorCapability:
        """The read-only monitoring capability (status, events, quota views). Minted from the key,
        like the admin one: the same bytes for as long as the key lives, revoked by :meth:`rotate_key`."""
        self._check_admin(admin_cap, False)
        return _cap.mint(MonitorCapability, self._secret, self._rid, 0)

    def export_key(self, admin_cap: RegistryAdminCapability) -> RegistryKey:
        """The registry's identity, for the state store only (the secret never leaves the supervisor)."""
        self._check_admin(admin_cap, False)
        return RegistryKey(self._rid, self._secret)

    def rotate_key(
        self, admin_cap: RegistryAdminCapability, key: RegistryKey | None = None
    ) -> tuple[RegistryKey, RegistryAdminCapability]:
        """Replace the identity: every capability minted so far is refused (as revoked) from now on.

        Tenants stay registered (with their quota blocks); their new
        capabilities come from :meth:`tenant_capability`. ``key``: the new
        identity (a caller with durable state stores it *before* rotating, so a
        crash can never bring the old key back); drawn here when omitted.
        Returns the new key and the new admin capability.
        """
        self._check_admin(admin_cap, True)
        key = key or RegistryKey.fresh()
        if len(key.registry_id) != _cap.REGISTRY_ID_BYTES or key.registry_id == self._rid:
            raise ValueError("rotate_key needs a new 16-byte registry id")
        with self._lock:
            self._retired.add(self._rid)
            self._rid = key.registry_id
            self._secret = key.secret
            self._verified.clear()
        return key, self._admin_capability()

    def generations(self) -> dict[str, int]:
        """The last generation issued per tenant id, evicted tenants included."""
        with self._lock:
            return {**self._generations, **{tid: entry.generation for tid, entry in self._tenants.items()}}

    @property
    def registry_id(self) -> str:
        """Public hex id; appears in every capability this registry mints."""
        return self._rid.hex()

    @property
    def segment_prefix(self) -> str:
        return self._prefix

    # --------------------------------------------------------------- checks

    def _check_admin(self, cap: object, strict: bool) -> None:
        if not isinstance(cap, RegistryAdminCapability):
            raise TenantIsolationViolation(None, "admin operations (not an admin capability)", "wrong_kind")
        if cap._registry_id != self._rid:
            self._foreign(cap, "", strict)
        if not self._mac_ok(cap):
            raise TenantIsolationViolation(None, "admin operations (forged capability)", "forged")

    def _check_tenant(self, cap: object, strict: bool) -> RegistryEntry:
        if not isinstance(cap, TenantCapability):
            raise TenantIsolationViolation(None, "tenant operations (not a tenant capability)", "wrong_kind")
        tid = cap._tenant_id
        if cap._registry_id != self._rid:
            self._foreign(cap, tid, strict)
        if not self._mac_ok(cap):
            raise TenantIsolationViolation(tid, "tenant operations (forged capability)", "forged")
        entry = self._tenants.get(tid)
        if entry is None or entry.generation != cap._generation:
            raise CapabilityRevoked(tid, f"generation {cap._generation}")
        return entry

    def _mac_ok(self, cap: _cap.Capability) -> bool:
        # An HMAC costs ~1.5 us here; a token whose exact bytes were verified
        # before needs no second MAC. Only successes are remembered, so this
        # cannot make a forged token pass; revocation is checked separately.
        raw = cap._raw
        if raw in self._verified:
            return True
        if not _cap.mac_ok(cap, self._secret):
            return False
        if len(self._verified) >= _VERIFIED_MAX:
            self._verified.clear()
        self._verified.add(raw)
        return True

    def _foreign(self, cap: _cap.Capability, tid: str, strict: bool) -> None:
        if cap._registry_id in self._retired:
            raise CapabilityRevoked(tid or "(admin)", "the registry key was rotated")
        if strict:
            raise CapabilityFromForeignRegistry(tid, self.registry_id, cap.registry_id)
        raise TenantIsolationViolation(tid or None, "this registry (capability from a foreign registry)",
                                       "foreign")

    def explain_refusal(self, raw: bytes | None, *, admin: bool) -> Denial:
        """Why these capability bytes are refused for an admin (or tenant) op: the audit's reason.

        Only for the refusal path (it repeats the checks). The tenant a token
        names is reported as verified only when its MAC is ours.
        """
        if raw is None:
            return Denial("missing", None, None)
        try:
            cap = _cap.capability_from_bytes(raw)
        except TenantIsolationViolation as exc:
            return Denial(exc.reason, None, None)  # truncated or malformed: said by the parser, not its text
        claimed = cap.tenant_id if isinstance(cap, TenantCapability) else None
        if isinstance(cap, RegistryAdminCapability) != admin:
            reason = "wrong_kind"
        elif cap._registry_id in self._retired:
            reason = "revoked"
        elif cap._registry_id != self._rid:
            reason = "foreign"
        elif not _cap.mac_ok(cap, self._secret):
            reason = "forged"
        elif claimed is not None:
            entry = self._tenants.get(claimed)
            reason = "revoked" if entry is None or entry.generation != cap._generation else "unknown_tenant"
        else:
            reason = "other"
        authentic = cap._registry_id == self._rid and _cap.mac_ok(cap, self._secret)
        return Denial(reason, claimed if authentic else None, None if authentic else claimed)

    def verify(self, cap: object) -> str:
        """Check a tenant capability; return its tenant id (the frontend's check)."""
        return self._check_tenant(cap, False).spec.tenant_id

    def verify_admin(self, cap: object) -> None:
        """Check an admin capability (raises when it is not this registry's)."""
        self._check_admin(cap, False)

    def verify_monitor(self, cap: object) -> None:
        """Check a monitor capability (raises when it is no monitor capability of this registry's key)."""
        if not isinstance(cap, MonitorCapability):
            raise TenantIsolationViolation(None, "read-only operations (not a monitor capability)", "wrong_kind")
        if cap._registry_id != self._rid:
            self._foreign(cap, "", False)
        if not self._mac_ok(cap):
            raise TenantIsolationViolation(None, "read-only operations (forged capability)", "forged")

    # ---------------------------------------------------------- registration

    def register_with_capability(self, admin_cap: RegistryAdminCapability, spec: TenantSpec) -> TenantCapability:
        return self._register(admin_cap, spec, False, _Tenant)[0]

    def register_with_capability_strict(
        self, admin_cap: RegistryAdminCapability, spec: TenantSpec
    ) -> TenantCapability:
        return self._register(admin_cap, spec, True, _Tenant)[0]

    def restore_with_capability(
        self, admin_cap: RegistryAdminCapability, spec: TenantSpec, generation: int,
        counters: QuotaCounters | None = None,
    ) -> TenantCapability:
        """Register a tenant again at the generation it had (a supervisor restart):
        capabilities minted for it before verify again. ``generation`` may not go
        back behind one already issued (that would un-revoke old capabilities).
        ``counters``: the quota counters a parked tenant kept in the state (its marks,
        refusals, GPU time), its own record from now on; its limits and generation are
        ``spec``'s and ``generation`` whatever the record says."""
        self._check_restore(generation, counters)
        return self._register(admin_cap, spec, False, _Tenant, generation, counters)[0]

    def register_entry(
        self, admin_cap: RegistryAdminCapability, spec: TenantSpec, make: Callable[[TenantSpec, TenantQuota, int], E],
        *, generation: int | None = None, counters: QuotaCounters | None = None,
    ) -> tuple[TenantCapability, E]:
        """:meth:`register_with_capability` (``generation`` None) or :meth:`restore_with_capability`
        (checked as there) keeping ``make(spec, block, generation)`` as the tenant's entry: the
        caller's own record of the tenant (the supervisor's runtime record), returned with the
        capability."""
        if generation is not None:
            self._check_restore(generation, counters)
        return self._register(admin_cap, spec, False, make, generation, counters)

    @staticmethod
    def _check_restore(generation: int, counters: QuotaCounters | None) -> None:
        if not is_int(generation) or generation < 1:
            raise ValueError(f"generation must be an int >= 1; got {generation!r}")
        if counters is not None and not isinstance(counters, QuotaCounters):
            raise TypeError(f"counters must be QuotaCounters, not {type(counters).__name__}")

    def _register(
        self, admin_cap: RegistryAdminCapability, spec: TenantSpec, strict: bool,
        make: Callable[[TenantSpec, TenantQuota, int], E], restore: int | None = None,
        counters: QuotaCounters | None = None,
    ) -> tuple[TenantCapability, E]:
        self._check_admin(admin_cap, strict)
        if not isinstance(spec, TenantSpec):
            raise TypeError(f"spec must be a TenantSpec, not {type(spec).__name__}")
        tid = spec.tenant_id
        with self._lock:
            self._ensure_open()
            if tid in self._tenants:
                raise AlreadyRegistered(tid)
            last = self._generations.get(tid, 0)
            if restore is not None and restore < last:
                raise ValueError(f"tenant {tid!r}: generation {restore} is behind {last}, already issued")
            generation = last + 1 if restore is None else restore
            key = (generation, spec.memory_quota_bytes, spec.gpu_memory_bytes_cap, spec.recorded_cuda_mem_pool_quota)
            if counters is not None:  # a parked tenant's kept counters: its own record
                block = TenantQuota(tid, _own_counters(counters, spec, generation), self._namer)
            else:
                record = self._records.get(key)
                if record is None:
                    record = QuotaCounters(generation=generation, memory_quota_bytes=spec.memory_quota_bytes,
                                           gpu_memory_bytes_cap=spec.gpu_memory_bytes_cap,
                                           cuda_mem_pool_quota_bytes=spec.recorded_cuda_mem_pool_quota)
                    if len(self._records) < _SHARED_RECORDS_MAX:
                        self._records[key] = record
                block = TenantQuota(tid, record, self._namer, shared=key in self._records)
            if not self._lazy:
                block.open()
            entry = make(spec, block, generation)
            self._tenants[tid] = entry
            self._generations.pop(tid, None)  # its entry holds it while it is registered
        return _cap.mint(TenantCapability, self._secret, self._rid, generation, tid), entry

    def tenant_capability(self, admin_cap: RegistryAdminCapability, tenant_id: str) -> TenantCapability:
        """The capability of a registered tenant (what register returned), for its current generation.

        How an operator hands out capabilities of tenants registered from a config file.
        """
        self._check_admin(admin_cap, False)
        entry = self._tenants.get(tenant_id)
        if entry is None:
            raise UnknownTenant(tenant_id)
        return _cap.mint(TenantCapability, self._secret, self._rid, entry.generation, entry.spec.tenant_id)

    def unregister(self, admin_cap: RegistryAdminCapability, tenant_id: str) -> None:
        """Evict: every capability minted for the tenant so far is refused from now on;
        its block is unlinked. The name may be registered again (with new capabilities)."""
        self._unregister(admin_cap, tenant_id, False)

    def unregister_strict(self, admin_cap: RegistryAdminCapability, tenant_id: str) -> None:
        self._unregister(admin_cap, tenant_id, True)

    def _unregister(self, admin_cap: RegistryAdminCapability, tenant_id: str, strict: bool) -> None:
        self._check_admin(admin_cap, strict)
        with self._lock:
            entry = self._tenants.pop(tenant_id, None)
            if entry is not None:
                self._generations[tenant_id] = entry.generation
        if entry is None:
            raise UnknownTenant(tenant_id)
        entry.block.unlink()
        entry.block.close()

    # ------------------------------------------------------------ quota ops

    def consume_bytes_with_capability(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, False).consume_bytes(n)

    def release_bytes_with_capability(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, False).release_bytes(n)

    def consume_gpu_bytes_with_capability(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, False).consume_gpu_bytes(n)

    def release_gpu_bytes_with_capability(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, False).release_gpu_bytes(n)

    def consume_bytes_with_capability_strict(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, True).consume_bytes(n)

    def release_bytes_with_capability_strict(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, True).release_bytes(n)

    def consume_gpu_bytes_with_capability_strict(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, True).consume_gpu_bytes(n)

    def release_gpu_bytes_with_capability_strict(self, cap: TenantCapability, n: int) -> None:
        self._quota(cap, True).release_gpu_bytes(n)

    def _quota(self, cap: TenantCapability, strict: bool) -> TenantQuota:
        block = self._check_tenant(cap, strict).block
        if block.closed:  # evicted between the check and now
            raise CapabilityRevoked(cap._tenant_id, f"generation {cap._generation}")
        return block

    def snapshot_with_capability(self, cap: TenantCapability) -> QuotaSnapshot:
        """A tenant's own quota snapshot."""
        try:
            return self._quota(cap, False).snapshot()
        except SegmentError:
            raise CapabilityRevoked(cap._tenant_id, f"generation {cap._generation}") from None

    # ----------------------------------------------------------------- admin

    def tenants(self, admin_cap: RegistryAdminCapability) -> list[TenantInfo]:
        """Every tenant with its quota snapshot, sorted by id."""
        self._check_admin(admin_cap, False)
        return [self._info(tid, entry) for tid, entry in sorted(self._tenants.items())]

    def tenants_strict(self, admin_cap: RegistryAdminCapability) -> list[TenantInfo]:
        self._check_admin(admin_cap, True)
        return self.tenants(admin_cap)

    def tenant_ids(self, admin_cap: RegistryAdminCapability) -> list[str]:
        self._check_admin(admin_cap, False)
        return sorted(self._tenants)

    def tenant_ids_strict(self, admin_cap: RegistryAdminCapability) -> list[str]:
        self._check_admin(admin_cap, True)
        return sorted(self._tenants)

    def get(self, admin_cap: RegistryAdminCapability, tenant_id: str) -> TenantInfo:
        self._check_admin(admin_cap, False)
        return self._get(tenant_id)

    def get_strict(self, admin_cap: RegistryAdminCapability, tenant_id: str) -> TenantInfo:
        self._check_admin(admin_cap, True)
        return self._get(tenant_id)

    def _get(self, tenant_id: str) -> TenantInfo:
        entry = self._tenants.get(tenant_id)
        if entry is None:
            raise UnknownTenant(tenant_id)
        return self._info(tenant_id, entry)

    def block(self, admin_cap: RegistryAdminCapability, tenant_id: str) -> TenantQuota:
        """The tenant's quota (its block, or its record while it has none): the supervisor reads
        and reclaims on it."""
        self._check_admin(admin_cap, False)
        entry = self._tenants.get(tenant_id)
        if entry is None:
            raise UnknownTenant(tenant_id)
        return entry.block

    def _info(self, tid: str, entry: RegistryEntry) -> TenantInfo:
        return TenantInfo(
            tenant_id=tid,
            generation=entry.generation,
            spec=entry.spec,
            segment=entry.block.name,
            registered_at=entry.registered_at,
            quota=entry.block.snapshot(),
        )

    def set_quota(
        self,
        admin_cap: RegistryAdminCapability,
        tenant_id: str,
        *,
        memory_quota_bytes: int | str | Unchanged = UNCHANGED,
        gpu_memory_bytes_cap: int | str | None | Unchanged = UNCHANGED,
        recorded_cuda_mem_pool_quota: int | str | None | Unchanged = UNCHANGED,
        gpu_time_weight: float | Unchanged = UNCHANGED,
        gpu_time_cap: float | None | Unchanged = UNCHANGED,
    ) -> TenantInfo:
        """Change a tenant's limits live (omitted ones stay; ``None`` removes the GPU cap).

        The GPU-time policy (weight, cap) is validated and kept in the spec here;
        the supervisor applies it to the device's lease board (``Placement``).
        """
        return self._set_quota(
            admin_cap, tenant_id, False, memory_quota_bytes, gpu_memory_bytes_cap, recorded_cuda_mem_pool_quota,
            gpu_time_weight, gpu_time_cap,
        )

    def set_quota_from(self, admin_cap: RegistryAdminCapability, tenant_id: str, changes: Mapping[str, object]
                       ) -> TenantInfo:
        """:meth:`set_quota` with the changes as the ``set_quota`` op's wire arguments (keys of
        ``QUOTA_KEYS``, values not yet narrowed: validated here as there)."""
        return self._set_quota(admin_cap, tenant_id, False, *(changes.get(k, UNCHANGED) for k in QUOTA_KEYS))

    def set_quota_strict(self, admin_cap: RegistryAdminCapability, tenant_id: str, **limits: int | str | None
                         ) -> TenantInfo:
        """:meth:`set_quota`, strict about foreign capabilities (keyword arguments as there)."""
        return self._set_quota(admin_cap, tenant_id, True, *(limits.get(k, UNCHANGED) for k in QUOTA_KEYS))

    def _set_quota(
        self,
        admin_cap: RegistryAdminCapability,
        tenant_id: str,
        strict: bool,
        memory_quota_bytes: object,
        gpu_memory_bytes_cap: object,
        recorded_cuda_mem_pool_quota: object,
        gpu_time_weight: object = UNCHANGED,
        gpu_time_cap: object = UNCHANGED,
        idle_timeout_s: object = UNCHANGED,
    ) -> TenantInfo:
        self._check_admin(admin_cap, strict)
        changes = {
            k: v
            for k, v in (
                ("memory_quota_bytes", memory_quota_bytes),
                ("gpu_memory_bytes_cap", gpu_memory_bytes_cap),
                ("recorded_cuda_mem_pool_quota", recorded_cuda_mem_pool_quota),
                ("gpu_time_weight", gpu_time_weight),
                ("gpu_time_cap", gpu_time_cap),
                ("idle_timeout_s", idle_timeout_s),
            )
            if v is not UNCHANGED
        }
        block_keys = ("memory_quota_bytes", "gpu_memory_bytes_cap", "recorded_cuda_mem_pool_quota")
        with self._lock:
            entry = self._tenants.get(tenant_id)
            if entry is None:
                raise UnknownTenant(tenant_id)
            new_spec = entry.spec._with(**changes)  # validates and parses sizes
            entry.block.set_limits(**{k: getattr(new_spec, k) for k in changes if k in block_keys})
            entry.spec = new_spec
            return self._info(tenant_id, entry)

    def update_spec(self, admin_cap: RegistryAdminCapability, spec: TenantSpec) -> None:
        """Replace a registered tenant's spec (quota fields are applied to its block)."""
        self._check_admin(admin_cap, False)
        with self._lock:
            entry = self._tenants.get(spec.tenant_id)
            if entry is None:
                raise UnknownTenant(spec.tenant_id)
            entry.block.set_limits(
                memory_quota_bytes=spec.memory_quota_bytes,
                gpu_memory_bytes_cap=spec.gpu_memory_bytes_cap,
                recorded_cuda_mem_pool_quota=spec.recorded_cuda_mem_pool_quota,
            )
            entry.spec = spec

    # ------------------------------------------------------------ lifecycle

    def len(self) -> int:
        """Number of registered tenants (the crate's ``len()``)."""
        return len(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    def __contains__(self, tenant_id: object) -> bool:
        return tenant_id in self._tenants

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError("registry is closed")

    def close(self) -> None:
        """Unlink every block (idempotent). Blocks are also unlinked on GC / exit."""
        with self._lock:
            self._closed = True
            entries = list(self._tenants.values())
            self._generations.update((tid, entry.generation) for tid, entry in self._tenants.items())
            self._tenants.clear()
        for entry in entries:
            entry.block.unlink()
            entry.block.close()

    def __enter__(self) -> TenantRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TenantRegistry {self.registry_id[:8]} tenants={len(self._tenants)}>"

    @staticmethod
    def mps_or_fallback(*, max_age_s: float = MPS_PROBE_MAX_AGE_S) -> MpsDecision:
        """Whether NVIDIA MPS is usable here: probed again once the last answer is ``max_age_s`` old."""
        return mps_or_fallback(max_age_s=max_age_s)


def _own_counters(counters: QuotaCounters, spec: TenantSpec, generation: int) -> QuotaCounters:
    """A copy of kept ``counters`` under ``spec``'s limits and ``generation`` (a config file may
    have changed the limits while the supervisor was down; the spec is what is enforced)."""
    record = counters.copy()
    record.generation = generation
    record.set_limits(memory_quota_bytes=spec.memory_quota_bytes, gpu_memory_bytes_cap=spec.gpu_memory_bytes_cap,
                      recorded_cuda_mem_pool_quota=spec.recorded_cuda_mem_pool_quota)
    return record
