"""Chaos campaigns (``twt chaos``): a seeded workload, a nemesis, a recorder and invariant checks.

    launch() a supervisor (or use a running one: ``run_dir``)
    register K tenants: ``faulty-*`` (2 instances each) and ``healthy-*`` (1 instance, at least one)
      ├─ events    SUB on events.ipc: fault, kill, exit, ready ... (detection and recovery times)
      ├─ clients   one thread and one SupervisorClient per client, a paced, seeded mix of
      │            alloc / free / write / read / run_wasm on its tenant; every call is recorded
      │            (phase, latency, ok or the typed error's code) and reads are checked byte
      │            for byte against what the client wrote
      └─ nemesis   phase "baseline": nothing (the healthy tenants' reference latency);
                   phase "faults": the seeded schedule, faults into the faulty tenants only
    settle ──► reconcile quota counters with the allocations the clients hold
           ──► free everything, evict ──► counters zero, segments gone
           ──► stop the supervisor ──► no worker process, no twt-* segment left
    report: per-fault counts with detection and recovery times, per-tenant outcomes,
            invariant verdicts; ``ok`` is False when any invariant was violated

The fault schedule is a pure function of the seed, the fault kinds, the rate,
the length of the fault phase and the faulty tenants (:func:`build_schedule`);
its hash is printed, so two runs with the same seed inject the same faults at
the same offsets. What the workload does around them depends on timing.

Faults are injected the way a user would: ``inject_fault`` (the worker breaks
itself; the supervisor has no special path for it) or, for ``sigkill`` and
``sigstop``, a real signal sent by the nemesis to the worker's pid.
"""

from __future__ import annotations

from supervisor.tools.chaos.campaign import run_chaos
from supervisor.tools.chaos.checks import (
    Check,
    Reconciliation,
    fault_stats,
    latency_table,
    reconcile,
)
from supervisor.tools.chaos.config import (
    ALL_FAULTS,
    DEFAULT_FAULTS,
    SIGNAL_FAULTS,
    SUPERVISOR_FAULTS,
    ChaosConfig,
)
from supervisor.tools.chaos.nemesis import Action
from supervisor.tools.chaos.recorder import Record, Recorder, percentile
from supervisor.tools.chaos.report import format_report
from supervisor.tools.chaos.schedule import Fault, build_schedule, schedule_hash

__all__ = [
    "ALL_FAULTS",
    "DEFAULT_FAULTS",
    "SIGNAL_FAULTS",
    "SUPERVISOR_FAULTS",
    "Action",
    "ChaosConfig",
    "Check",
    "Fault",
    "Reconciliation",
    "Record",
    "Recorder",
    "build_schedule",
    "fault_stats",
    "format_report",
    "latency_table",
    "percentile",
    "reconcile",
    "run_chaos",
    "schedule_hash",
]
