"""The vocabularies of the protocol as tables: one row per kind, its attributes in the row.

Event kinds (:data:`EVENT_KINDS`): what the supervisor publishes and keeps in its
event log; each row says at which level the event is logged and whether a tenant
following its own events sees it. ``supervisor.observe.events`` (log level),
``supervisor.observe.event_log`` (a tenant's view) and ``twt events`` (``--filter``
choices) all read this table, so a new kind is one row here.

Fault kinds (:data:`FAULT_TABLE`): what ``inject_fault`` makes a worker do to
itself, and the signals the chaos nemesis sends; each row says how it is
delivered and whether it ends the worker. ``shared.protocol.FAULT_KINDS``,
``worker.faults`` and ``supervisor.tools.chaos`` read it.

Both tables are plain data: ``shared`` imports neither ``supervisor`` nor ``worker``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "DISRUPTIVE_FAULTS",
    "EVENT_KINDS",
    "EventKind",
    "FAULT_TABLE",
    "FaultKind",
    "SIGNAL_FAULT_KINDS",
    "SUPERVISOR_FAULT_KINDS",
    "TENANT_EVENT_KINDS",
    "WORKER_FAULT_KINDS",
]


@dataclass(frozen=True, slots=True)
class EventKind:
    """One kind of lifecycle event."""

    name: str
    #: the level the supervisor logs it at (an ``expected`` exit or kill is logged at INFO whatever this says)
    level: int
    #: a tenant following its own events (its capability) sees this kind; the admin sees every kind
    tenant_visible: bool
    doc: str


_I, _W, _E = logging.INFO, logging.WARNING, logging.ERROR

#: every event kind, by name (docs/OPERATIONS.md "Events" describes their fields)
EVENT_KINDS: Final[dict[str, EventKind]] = {k.name: k for k in (
    EventKind("spawn", _I, False, "a worker process started (pool or instance)"),
    EventKind("ready", _I, True, "an instance's worker is bound and serves"),
    EventKind("exit", _W, True, "a worker ended: exit_code or signal, reason, expected"),
    EventKind("restart", _I, True, "an instance is restarted after its worker ended"),
    EventKind("failed", _E, True, "a tenant restarted too often and is failed until twt reset"),
    EventKind("register", _I, True, "a tenant was registered (or restored at start)"),
    EventKind("evict", _I, True, "a tenant was evicted"),
    EventKind("scale", _I, True, "a tenant's instance count changed"),
    EventKind("set_quota", _I, True, "a tenant's limits changed"),
    EventKind("quota_refusal", _I, True, "an allocation was refused by a quota"),
    EventKind("fault", _I, True, "a fault was injected into a worker"),
    EventKind("kill", _W, True, "a worker was killed (deadline, RSS limit, heartbeat)"),
    EventKind("denied", _W, False, "a request with a refused capability (supervisor.store.audit)"),
    EventKind("denied_dropped", _W, False, "denied events not published (rate limit)"),
    EventKind("reload", _I, False, "the config file was applied again"),
    EventKind("reload_failed", _E, False, "the config file could not be applied; nothing changed"),
    EventKind("reset", _I, True, "a tenant was reset (its restart history cleared)"),
    EventKind("rolling_restart", _I, True, "a tenant's instances are being replaced one at a time"),
    EventKind("rotate_key", _W, False, "the registry key was replaced: every capability revoked"),
    EventKind("stall", _W, False, "the supervisor loop stalled"),
    EventKind("state_error", _E, False, "an admin change could not be written to the state store"),
    EventKind("park", _I, True, "an idle tenant was parked: its workers exited, its buffers held by the supervisor"),
    EventKind("park_refused", _W, True, "an idle tenant could not be parked (its buffers do not fit its memory quota)"),
    EventKind("activation_refused", _W, True, "a parked tenant could not be activated: no room under max_active"),
    EventKind("activate", _I, True, "a parked tenant is active again: its buffers restored with the same handles"),
)}
#: the kinds a tenant capability sees (of its own tenant): its instances' lifecycle and its own changes
TENANT_EVENT_KINDS: Final = frozenset(k.name for k in EVENT_KINDS.values() if k.tenant_visible)


@dataclass(frozen=True, slots=True)
class FaultKind:
    """One kind of injected fault."""

    name: str
    #: "worker": ``inject_fault`` (the worker applies it to itself); "signal": the chaos nemesis signals the pid;
    #: "supervisor": the chaos nemesis changes the tenant through the supervisor's admin ops
    via: Literal["worker", "signal", "supervisor"]
    #: ends the worker or gets it killed (a leak only when big): a worker death is put down to the latest one
    disruptive: bool
    doc: str


#: every fault kind, by name, in the order the protocol lists them (docs/RELIABILITY.md)
FAULT_TABLE: Final[dict[str, FaultKind]] = {k.name: k for k in (
    FaultKind("crash", "worker", True, "the worker kills itself (SIGKILL)"),
    FaultKind("segfault", "worker", True, "the worker makes a real invalid memory access (SIGSEGV)"),
    FaultKind("exit", "worker", True, "the worker exits with params code (default 1)"),
    FaultKind("hang", "worker", True, "the executor stops answering (killed at the deadline)"),
    FaultKind("slow", "worker", False, "each request waits params ms first"),
    FaultKind("oom", "worker", False, "the next params count allocations fail as a device OOM"),
    FaultKind("corrupt", "worker", True, "the next params count replies are garbage (the supervisor stops the worker)"),
    FaultKind("drop", "worker", True, "the next params count replies are never sent"),
    FaultKind("leak", "worker", True, "the worker holds params bytes it never frees (RSS limit when big)"),
    FaultKind("cuda-fault", "worker", False, "the next request meets a sticky CUDA error (a faulting kernel first)"),
    FaultKind("sigkill", "signal", True, "SIGKILL to the worker's pid"),
    FaultKind("sigstop", "signal", True, "SIGSTOP to the worker's pid (heartbeats stop)"),
    FaultKind("park", "supervisor", False, "the tenant's idle_timeout_s is made tiny: it parks when idle and its "
              "next request activates it (healed later: idle_timeout_s none)"),
)}
#: the kinds ``inject_fault`` accepts
WORKER_FAULT_KINDS: Final = tuple(k.name for k in FAULT_TABLE.values() if k.via == "worker")
#: the kinds the chaos nemesis delivers as signals
SIGNAL_FAULT_KINDS: Final = tuple(k.name for k in FAULT_TABLE.values() if k.via == "signal")
#: the kinds the chaos nemesis delivers through the supervisor (admin ops)
SUPERVISOR_FAULT_KINDS: Final = tuple(k.name for k in FAULT_TABLE.values() if k.via == "supervisor")
DISRUPTIVE_FAULTS: Final = frozenset(k.name for k in FAULT_TABLE.values() if k.disruptive)
