"""Campaign settings (:class:`ChaosConfig`) and the tenants and deadlines derived from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.kinds import SIGNAL_FAULT_KINDS, SUPERVISOR_FAULT_KINDS
from shared.protocol import FAULT_KINDS
from shared.spec import TenantSpec

__all__ = [
    "ALL_FAULTS",
    "ChaosConfig",
    "DEFAULT_FAULTS",
    "FAULTY_MEMORY",
    "LEAK_BIG",
    "LEAK_SMALL",
    "MAX_LIVE_BUFFERS",
    "PARK_IDLE_S",
    "PARK_WAIT_S",
    "SIGNAL_FAULTS",
    "SUPERVISOR_FAULTS",
]

#: faults the worker applies to itself (``inject_fault``; the kinds are the protocol's)
DEFAULT_FAULTS: tuple[str, ...] = FAULT_KINDS
#: faults the nemesis delivers as signals to the worker's pid
SIGNAL_FAULTS: tuple[str, ...] = SIGNAL_FAULT_KINDS
#: faults the nemesis delivers through the supervisor: ``park`` (not in the default campaign: each
#: park and activation costs a worker start, which slows the default run; ``--faults`` adds it)
SUPERVISOR_FAULTS: tuple[str, ...] = SUPERVISOR_FAULT_KINDS
ALL_FAULTS = DEFAULT_FAULTS + SIGNAL_FAULTS + SUPERVISOR_FAULTS
#: the idle time a ``park`` fault gives its tenant while its clients pause, and how long the nemesis
#: waits for the park (a tenant with a request that never ends does not park: the fault is then "armed")
PARK_IDLE_S = 0.05
PARK_WAIT_S = 3.0
#: error codes that say the instance that held a buffer died (or is being killed)
_DEATH_CODES = frozenset({"worker_lost", "kernel_timeout", "memory_exhausted"})
#: error codes that say a buffer is gone already: its instance restarted since it was allocated
_GONE_CODES = frozenset({"buffer_lost"})
#: an ``invalid_argument`` says a buffer is gone only when the worker says so about the handle
#: (a request parked across a restart reaches the new incarnation); any other one (a bad offset,
#: a refused fault) leaves the buffer where it is - taking it for gone loses track of bytes still
#: charged, which is how seed 1 once "found" quota drift
_GONE_DETAILS = ("belongs to another worker instance or to one that restarted", "unknown buffer handle")
#: outcomes that break "every request answered with a result or a typed error"
_UNANSWERED = frozenset({"lost", "untyped"})

MiB = 1 << 20
#: heartbeats of a supervisor the campaign starts: a hung worker is found within 2 s, and a healthy
#: one stalled for a second by a loaded host is not taken for hung (at 0.75 s it once was: the
#: campaign then reported a healthy tenant disturbed)
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_LIVENESS = 8
#: how long an armed hang takes at most to show as missed heartbeats, and a margin for the restart
HANG_SHOWS_WITHIN_S = HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS * 1.5
#: settings of a supervisor the campaign starts itself (fast failure detection, warm restarts)
SUPERVISOR_SETTINGS: dict[str, object] = {
    "pool_size": 2,
    "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
    "heartbeat_liveness": HEARTBEAT_LIVENESS,
    "kill_grace_s": 0.5,
    "stop_timeout_s": 3.0,
    "rss_allowance_bytes": 128 * MiB,
    "log_level": "warning",
}
FAULTY_MEMORY = 64 * MiB
#: a leak this big takes a faulty worker over its RSS limit (quota + allowance) in a supervisor started here
LEAK_BIG = 320 * MiB
LEAK_SMALL = 8 * MiB
MAX_LIVE_BUFFERS = 6


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ChaosConfig:
    """One campaign. ``duration_s`` covers both phases (baseline, then faults)."""

    duration_s: float = 60.0
    seed: int = 1
    tenants: int = 4
    faulty: int | None = None  # default: half of them, rounded down, and at least one healthy
    faults: tuple[str, ...] = DEFAULT_FAULTS
    rate: float = 1.0  # faults per second, all faulty tenants together
    clients: int | None = None  # client threads (default: two per tenant, at most 12, at least one per tenant)
    baseline_s: float | None = None  # default: a quarter of the duration, 2..15 s
    run_dir: str | None = None  # a running supervisor to use instead of starting one
    backend: str = "stub"
    start_method: str = "forkserver"
    latency_factor: float | None = 3.0  # None: report the latencies, do not check them
    grace_s: float = 1.0  # beyond a request's deadline before it counts as late
    request_timeout_s: float = 2.0  # the faulty tenants' request deadline
    supervisor_log: str | None = None  # where the started supervisor's stderr goes

    def __post_init__(self) -> None:
        if not (isinstance(self.duration_s, (int, float)) and math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration_s!r}")
        if not 1 <= self.tenants <= 64:
            raise ValueError(f"tenants must be in 1..64, got {self.tenants}")
        if self.faulty is not None and not 0 <= self.faulty < self.tenants:
            raise ValueError(f"faulty must be in 0..{self.tenants - 1} (at least one tenant stays healthy)")
        unknown = [k for k in self.faults if k not in ALL_FAULTS]
        if unknown:
            raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(ALL_FAULTS)}")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"rate must be >= 0 faults per second, got {self.rate!r}")
        if self.clients is not None and not self.tenants <= self.clients <= 256:
            raise ValueError(f"clients must be in {self.tenants}..256 (one per tenant at least), got {self.clients}")
        if self.baseline_s is not None and not 0 < self.baseline_s < self.duration_s:
            raise ValueError("baseline must be positive and shorter than the duration")
        if self.latency_factor is not None and not self.latency_factor >= 1:
            raise ValueError("latency factor must be >= 1")

    @property
    def n_faulty(self) -> int:
        return self.tenants // 2 if self.faulty is None else self.faulty

    @property
    def baseline(self) -> float:
        if self.baseline_s is not None:
            return float(self.baseline_s)
        return min(15.0, max(2.0, self.duration_s / 4), self.duration_s / 2)

    @property
    def fault_phase(self) -> float:
        return float(self.duration_s) - self.baseline

    @property
    def n_clients(self) -> int:
        return self.clients if self.clients is not None else max(self.tenants, min(12, 2 * self.tenants))

    def roles(self) -> list[tuple[str, bool, int]]:
        """(role name, healthy, instances) of every tenant, faulty ones first."""
        out = [(f"faulty-{i}", False, 2) for i in range(self.n_faulty)]
        out += [(f"healthy-{i}", True, 1) for i in range(self.tenants - self.n_faulty)]
        return out


def _spec(name: str, healthy: bool, instances: int, cfg: ChaosConfig) -> TenantSpec:
    if healthy:
        return TenantSpec(
            name,
            memory_quota_bytes=256 * MiB,
            gpu_memory_bytes_cap=256 * MiB,
            instances=instances,
            request_timeout_s=10.0,
            # a healthy tenant's jobs take milliseconds; the deadline only bounds a hang. Their
            # runs share the device's lease with every faulty instance, and on a starved host
            # (a loaded test run) a wait for it reached 2 s: the run then timed out (it once
            # returned the op's error as NaN, counted as wrong data), a disturbance of the host,
            # not of the faults. Faulty tenants keep 1 s: their hangs must end quickly.
            wasm_timeout_s=10.0,
        )
    # restarts must stay cheap and never exhaust the restart intensity: a short window, a high limit
    return TenantSpec(
        name,
        memory_quota_bytes=FAULTY_MEMORY,
        gpu_memory_bytes_cap=256 * MiB,
        instances=instances,
        request_timeout_s=cfg.request_timeout_s,
        wasm_timeout_s=1.0,
        max_restarts=1_000_000,
        restart_window_s=1.0,
    )
