"""Tenant signals: what happens below (a worker ready, a tenant failed) told to the parts above.

The parts are built bottom-up, each handed the parts it calls
(:func:`supervisor.wiring.build_parts`): the worker set before parking, the
dispatcher, the admin and service ops and the frontend. News travels the
other way - an instance became ready, a tenant failed, a tenant is gone, the
registry key was rotated - so it goes through one object built *first*,
which every part is handed: the one that has the news calls it, and a part
that must hear it subscribes in its own constructor. No part is assigned a
callback after it is built, and no part imports the parts above it::

    WorkerSet ──bind_sent / instance_ready / registration_failed / not_restarted / tenant_failed──┐
    AdminOps  ──tenant_down / evicted────────────────────────────────────────────┐    │
    ServiceOps ─key_rotated────────────────────────────────────────────────┐     │    │
                                                                           ▼     ▼    ▼
                                                                       TenantSignals
      subscribers, by stage:  Parking (BUFFERS, AFTER) · AdminOps (TENANT) · ServiceOps (SERVICE)
                              · Frontend (evicted, key_rotated) · the Supervisor (key_rotated)

Where the order of the subscribers matters it is the :class:`Stage`, not the
order the parts were built in: a ready instance of a tenant being activated gets
its buffers back (parking, ``BUFFERS``) before a registration is answered or a
waiting request is sent (``TENANT``) and before a rolling restart moves on
(``SERVICE``); a stopped activation is settled (``AFTER``) once the tenant's
waiting requests were answered.

Owns: the subscriber lists (filled while the parts are built). Loop thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

from shared.capability import RegistryAdminCapability
from shared.errors import TensorWasmError
from supervisor.runtime.tenants import InstanceSlot, TenantRuntime
from supervisor.runtime.workers import WorkerHandle

__all__ = ["Stage", "TenantSignals"]

S = TypeVar("S")

#: a subscriber told of a tenant
TenantSlot = Callable[[TenantRuntime], None]
#: a subscriber told of an instance not restarted: (tenant, index, exit code, signal, reason)
NotRestartedSlot = Callable[[TenantRuntime, int, "int | None", "int | None", str], None]
#: a subscriber told of a bind sent: (tenant, instance slot, its worker)
BindSentSlot = Callable[[TenantRuntime, InstanceSlot, WorkerHandle], None]
#: a subscriber told of a failed tenant: (tenant, why)
FailedSlot = Callable[[TenantRuntime, str], None]
#: a subscriber told of a tenant gone (failed or evicted), with what its waiters are told
DownSlot = Callable[[TenantRuntime, TensorWasmError], None]


class Stage(enum.IntEnum):
    """Who hears a tenant's news first (see the module docstring)."""

    #: parking: a ready instance of a tenant being activated restores its buffers first
    BUFFERS = 0
    #: the admin ops: registrations answered, requests waiting for an instance sent or refused
    TENANT = 1
    #: the service ops: rolling restarts and reset/restart waiters
    SERVICE = 2
    #: parking: an activation that stopped (failure, instance gone) is settled last
    AFTER = 3


class TenantSignals:
    """The news of the tenants, from the parts below to the parts above (see the module docstring).

    Implements the worker set's :class:`~supervisor.lifecycle.workerset.TenantHooks`.
    """

    def __init__(self, *, stopping: Callable[[], bool],
                 key_rotated: tuple[Callable[[RegistryAdminCapability], None], ...] = ()) -> None:
        """``stopping()``: the supervisor is stopping (the worker set restarts nothing then).
        ``key_rotated``: told first of a rotated registry key (the supervisor, which is built
        before the signals and rewrites its run dir's files)."""
        self._stopping = stopping
        self._ready: list[tuple[Stage, TenantSlot]] = []
        self._bind_sent: list[BindSentSlot] = []
        self._registration_failed: list[Callable[[TenantRuntime, TensorWasmError], None]] = []
        self._not_restarted: list[tuple[Stage, NotRestartedSlot]] = []
        self._failed: list[tuple[Stage, FailedSlot]] = []
        self._down: list[DownSlot] = []
        self._evicted: list[TenantSlot] = []
        self._key_rotated: list[Callable[[RegistryAdminCapability], None]] = list(key_rotated)

    # ------------------------------------------------------------ subscribe (in a part's constructor)

    def on_instance_ready(self, stage: Stage, slot: TenantSlot) -> None:
        _insert(self._ready, stage, slot)

    def on_bind_sent(self, slot: BindSentSlot) -> None:
        self._bind_sent.append(slot)

    def on_registration_failed(self, slot: Callable[[TenantRuntime, TensorWasmError], None]) -> None:
        self._registration_failed.append(slot)

    def on_instance_not_restarted(self, stage: Stage, slot: NotRestartedSlot) -> None:
        _insert(self._not_restarted, stage, slot)

    def on_tenant_failed(self, stage: Stage, slot: FailedSlot) -> None:
        _insert(self._failed, stage, slot)

    def on_tenant_down(self, slot: DownSlot) -> None:
        self._down.append(slot)

    def on_evicted(self, slot: TenantSlot) -> None:
        self._evicted.append(slot)

    def on_key_rotated(self, slot: Callable[[RegistryAdminCapability], None]) -> None:
        self._key_rotated.append(slot)

    # ------------------------------------------------------------ tell (the part that has the news)

    def instance_ready(self, rt: TenantRuntime) -> None:
        """An instance of ``rt`` is ready (the worker set): every stage, parking's first."""
        for _, slot in self._ready:
            slot(rt)

    def bind_sent(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle) -> None:
        """A ``bind`` of ``worker`` to ``slot`` of ``rt`` was just sent (the worker set), its answer
        not yet in: what must reach the worker right after its bind may be sent now - the worker
        serves its messages in order, so it comes after the bind without waiting for its answer
        (parking: an activation's import, one round trip fewer)."""
        for slot_ in self._bind_sent:
            slot_(rt, slot, worker)

    def serving(self, rt: TenantRuntime) -> None:
        """``rt`` serves again (parking: an activation done, a park cancelled): what a ready
        instance means, past parking's own stage."""
        for stage, slot in self._ready:
            if stage > Stage.BUFFERS:
                slot(rt)

    def registration_failed(self, rt: TenantRuntime, exc: TensorWasmError) -> None:
        for slot in self._registration_failed:
            slot(rt, exc)

    def instance_not_restarted(self, rt: TenantRuntime, index: int, code: int | None, sig: int | None,
                               reason: str) -> None:
        for _, slot in self._not_restarted:
            slot(rt, index, code, sig, reason)

    def tenant_failed(self, rt: TenantRuntime, why: str) -> None:
        for _, slot in self._failed:
            slot(rt, why)

    def tenant_down(self, rt: TenantRuntime, exc: TensorWasmError) -> None:
        """``rt`` failed or was evicted (the admin ops): its waiters are told ``exc``."""
        for slot in self._down:
            slot(rt, exc)

    def evicted(self, rt: TenantRuntime) -> None:
        """``rt`` was evicted (the admin ops): nothing of it may stay."""
        for slot in self._evicted:
            slot(rt)

    def key_rotated(self, new_admin: RegistryAdminCapability) -> None:
        """The registry key was rotated (the service ops): the new admin capability."""
        for slot in self._key_rotated:
            slot(new_admin)

    def is_stopping(self) -> bool:
        return self._stopping()


def _insert(slots: list[tuple[Stage, S]], stage: Stage, slot: S) -> None:
    """Add ``slot`` after every subscriber of its stage or an earlier one (stable within a stage)."""
    at = len(slots)
    while at > 0 and slots[at - 1][0] > stage:
        at -= 1
    slots.insert(at, (stage, slot))
