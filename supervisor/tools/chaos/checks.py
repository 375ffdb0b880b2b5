"""The invariants a campaign must keep, and the fault statistics of its report.

Typing: the reports (and the event maps they are built from) are JSON-shaped dicts,
written here and read back by key to print and check them; their values stay dynamically typed.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypedDict

from shared import protocol as proto
from shared.exitcodes import WORKER_COMPILE_OVERRUN, WORKER_GPU_QUEUE_OVERRUN
from shared.kinds import DISRUPTIVE_FAULTS
from shared.records import TenantRecord
from supervisor.tools.chaos.config import _UNANSWERED, LEAK_BIG
from supervisor.tools.chaos.nemesis import Action
from supervisor.tools.chaos.recorder import Record, percentile
from supervisor.tools.chaos.schedule import Fault

__all__ = ["Check", "Reconciliation", "fault_stats", "host_request_ms", "latency_by_op", "latency_table",
           "reconcile"]

# --------------------------------------------------------------------------- checks


@dataclass
class Check:
    """One invariant's verdict."""

    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Reconciliation:
    """A tenant's quota counters against the buffers its clients know they hold."""

    tenant: str
    ok: bool
    expected_gpu: int  # bytes of known buffers on live instance incarnations
    counted_gpu: int  # the quota block's gpu_bytes_in_use
    counted_cpu: int
    lost_buffers: int  # known buffers whose instance died (gone with it)
    lost_bytes: int
    problems: list[str] = field(default_factory=list)


def reconcile(record: TenantRecord, live: Mapping[int, int]) -> Reconciliation:
    """Compare a tenant's status record with its live buffers (handle -> bytes).

    A buffer whose handle names an instance incarnation that is no longer the
    running one died with that instance (the supervisor reclaimed its share);
    every other buffer must be counted, instance by instance, and nothing else.
    Meaningful when nothing is in flight (the counters move with requests).
    """
    current: dict[int, int] = {}
    for inst in record.instances:
        if inst.state == "ready" and inst.pid is not None:
            current[inst.index] = inst.incarnation & 0xFFFF
    expected: Counter[int] = Counter()
    lost = lost_bytes = 0
    for handle, nbytes in live.items():
        index = proto.handle_instance(handle)
        if current.get(index) == proto.handle_incarnation(handle):
            expected[index] += nbytes
        else:
            lost += 1
            lost_bytes += nbytes
    held = record.quota.instance_shares if record.quota else ()
    shares = {i: gpu for i, _cpu, gpu in held}
    cpu_shares = {i: cpu for i, cpu, _gpu in held}
    counted = record.gpu_bytes_in_use
    # host bytes at rest are the tenant's shared-memory regions (charged to its host quota) only
    cpu = record.bytes_in_use - sum(r.nbytes for r in record.regions)
    problems = []
    if counted != sum(expected.values()):
        problems.append(f"gpu_bytes_in_use {counted:,} B, the clients hold {sum(expected.values()):,} B")
    for index in sorted(set(shares) | set(expected)):
        if shares.get(index, 0) != expected.get(index, 0):
            problems.append(f"instance {index} share {shares.get(index, 0):,} B, expected {expected.get(index, 0):,} B")
    if cpu or any(cpu_shares.values()):
        problems.append(f"bytes_in_use {cpu:,} B beyond its regions with no WASM run in flight (expected 0)")
    return Reconciliation(
        record.tenant_id, not problems, sum(expected.values()), counted, cpu, lost, lost_bytes, problems
    )


def _check_answered(records: Sequence[Record], actions: Sequence[Action]) -> Check:
    bad = [r for r in records if r.outcome in _UNANSWERED]
    lost_admin = [a for a in actions if a.outcome == "lost"]
    if bad or lost_admin:
        sample = "; ".join(f"{r.tenant} {r.op}: {r.outcome} {r.detail}" for r in bad[:3])
        return Check(
            "every request answered",
            False,
            f"{len(bad)} of {len(records)} requests and {len(lost_admin)} fault injections got no typed "
            f"answer ({sample})",
        )
    codes = Counter(r.outcome for r in records if r.outcome != "ok")
    return Check(
        "every request answered",
        True,
        f"{len(records)} requests: {sum(r.outcome == 'ok' for r in records)} ok, "
        f"{sum(codes.values())} typed errors; {len(actions)} fault injections answered",
    )


def _check_deadlines(records: Sequence[Record], grace_s: float, host_ms: float | None = None) -> Check:
    """Every answer within its deadline + ``grace_s`` + ``host_ms``.

    Past a request's deadline the supervisor still has to see it, stop the worker (``kill_grace_s``,
    then SIGKILL), reap it and answer: hops and process work that a loaded host stretches as it
    stretches every request. So the bound grows by the host's own request latency (``host_ms``: the
    healthy tenants' baseline p99, :func:`host_request_ms`), a few ms on a quiet host; an answer that
    never comes, or one held far beyond what any request takes on this host, still fails it.
    """
    allowance = grace_s + (host_ms or 0.0) / 1000
    answered = [r for r in records if r.outcome not in _UNANSWERED]
    late = [r for r in answered if r.latency_s > r.deadline_s + allowance]
    if not answered:
        return Check("answered within deadline + grace", True, "no requests")
    worst = max(late or answered, key=lambda r: r.latency_s - r.deadline_s)
    closest = (
        f"{worst.tenant} {worst.op} ({worst.outcome}) after {worst.latency_s:.3f} s against a "
        f"{worst.deadline_s:g} s deadline"
    )
    bound = f"deadline + {grace_s:g} s" + (
        "" if host_ms is None else f" + {host_ms:.0f} ms (the host's request p99, healthy baseline)")
    if late:
        return Check(
            "answered within deadline + grace",
            False,
            f"{len(late)} answered later than {bound}; worst: {closest}",
        )
    return Check("answered within deadline + grace", True, f"within {bound}; closest to its deadline: {closest}")


def _check_data(records: Sequence[Record]) -> Check:
    wrong = [r for r in records if r.outcome == "wrong_data"]
    if wrong:
        return Check("data intact", False, f"{len(wrong)} wrong results: " + "; ".join(r.detail for r in wrong[:3]))
    reads = sum(r.op == "read" and r.outcome == "ok" for r in records)
    return Check("data intact", True, f"{reads} reads matched what was written; every WASM result as computed")


def _check_healthy(
    records: Sequence[Record], events: Sequence[Mapping[str, object]], healthy: set[str], until: float
) -> Check:
    errors = [r for r in records if r.healthy and r.outcome != "ok"]
    touched = [
        e
        for e in events
        if e.get("tenant") in healthy and e.get("event") in ("kill", "exit", "failed") and _ts(e) < until
    ]
    if errors or touched:
        parts = [f"{r.tenant} {r.op} {r.phase}: {r.outcome} {r.detail}" for r in errors[:3]]
        parts += [f"{e.get('tenant')}: {e.get('event')} {e.get('reason', '')}" for e in touched[:3]]
        return Check(
            "healthy tenants undisturbed",
            False,
            f"{len(errors)} errors, {len(touched)} worker deaths in healthy tenants: " + "; ".join(parts),
        )
    n = sum(r.healthy for r in records)
    return Check("healthy tenants undisturbed", True, f"{n} requests, no error, no worker death")


#: a worker's own exit that enforces its run's deadline (the run got ``KernelTimeout``): queued GPU work
#: or a compile past it, which only the process's end stops
DEADLINE_EXITS = frozenset({WORKER_GPU_QUEUE_OVERRUN, WORKER_COMPILE_OVERRUN})


def _check_deaths(events: Sequence[Mapping[str, object]], tenants: Collection[str], healthy: Collection[str],
                  faulted: Collection[object], until: float) -> tuple[Check, int, int]:
    """Every unplanned exit of a campaign tenant's worker (before ``until``) is of a pid the nemesis
    faulted; (the check, deaths not from a fault, deadline exits of faulty tenants).

    A faulty tenant's runs have a 1 s deadline (its hangs must end quickly). A run whose queued device
    work or compile is still going past it ends its worker (:data:`DEADLINE_EXITS`), and a request
    still unanswered at its own deadline has its worker killed by the supervisor (the exit's
    ``cause`` is ``deadline``): the deadline enforced as designed - on a loaded host that happens
    with no fault (a first run's compile, the stub's device being the host's CPU). Those exits are
    counted, not violations; a healthy tenant's (a 10 s hang guard) is one.
    """
    unexplained: list[Mapping[str, object]] = []
    deadline_exits = 0
    for e in events:
        if (e.get("event") != "exit" or e.get("expected") or e.get("tenant") not in tenants or _ts(e) >= until
                or e.get("pid") in faulted):
            continue
        if (e.get("exit_code") in DEADLINE_EXITS or e.get("cause") == "deadline") and e.get("tenant") not in healthy:
            deadline_exits += 1
        else:
            unexplained.append(e)
    detail = "; ".join(
        f"{e.get('tenant')}/{e.get('instance')} pid {e.get('pid')}: {e.get('reason')}" for e in unexplained[:5]
    ) or "every unplanned exit followed a fault to that worker"
    if deadline_exits:
        detail += (f" ({deadline_exits} more: a faulty tenant's deadline enforced - its queued GPU work or "
                   "compile past it ended the worker, or the supervisor killed it at its request's deadline)")
    return Check("no worker died without a fault", not unexplained, detail), len(unexplained), deadline_exits


class Latency(TypedDict):
    """One tenant's successful requests in one phase: how many, p50 and p99 in ms (None: none)."""

    n: int
    p50_ms: float | None
    p99_ms: float | None


def _ts(event: Mapping[str, object]) -> float:
    """An event's wall time (``ts``; 0 when it has none)."""
    ts = event.get("ts", 0)
    return float(ts) if isinstance(ts, (int, float)) else 0.0


def latency_table(records: Sequence[Record], tenants: Sequence[str]) -> dict[str, dict[str, Latency]]:
    """Per tenant: count, p50 and p99 (ms) of successful requests in the baseline and the fault phase."""
    out: dict[str, dict[str, Latency]] = {}
    for name in tenants:
        row: dict[str, Latency] = {}
        for phase in ("baseline", "faults"):
            lat = [r.latency_s for r in records if r.tenant == name and r.phase == phase and r.outcome == "ok"]
            p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
            row[phase] = {
                "n": len(lat),
                "p50_ms": None if p50 is None else round(p50 * 1000, 3),
                "p99_ms": None if p99 is None else round(p99 * 1000, 3),
            }
        out[name] = row
    return out


def latency_by_op(records: Sequence[Record]) -> dict[str, dict[str, Latency]]:
    """The healthy tenants' successful requests per op, baseline and fault phase: which op a grown p99
    comes from (a ``run_wasm`` waiting for the device, or every op: the host)."""
    out: dict[str, dict[str, Latency]] = {}
    for op in sorted({r.op for r in records if r.healthy}):
        row: dict[str, Latency] = {}
        for phase in ("baseline", "faults"):
            lat = [r.latency_s for r in records if r.healthy and r.op == op and r.phase == phase and r.outcome == "ok"]
            p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
            row[phase] = {"n": len(lat), "p50_ms": None if p50 is None else round(p50 * 1000, 3),
                          "p99_ms": None if p99 is None else round(p99 * 1000, 3)}
        out[op] = row
    return out


def host_request_ms(table: Mapping[str, Mapping[str, Latency]], healthy: Sequence[str]) -> float | None:
    """This host's own request latency: the largest baseline p99 (ms) of the healthy tenants (no fault
    yet, no fault ever in them); None without samples."""
    values = [p for t in healthy if (p := table[t]["baseline"]["p99_ms"]) is not None]
    return max(values, default=None)


def _check_latency(table: Mapping[str, Mapping[str, Latency]], healthy: Sequence[str], factor: float | None,
                   host: tuple[float | None, float | None] = (None, None)) -> Check:
    """Healthy p99 in the fault phase within ``factor`` x the baseline's, allowing for what the host added.

    ``host`` is the host's own request latency (the p99 ms of a raw relay's round trips,
    :class:`~.relayprobe.RelayProbe`, pinged from the campaign's process) in the baseline and
    the fault phase. Restarting workers take CPU from every process on the host, and the
    campaign's threads share one interpreter; on a busy machine that alone delays a request's
    hops - every hop of it, and a healthy request has more hops and more work than the relay's
    round trip. So the bound is the larger of ``factor * baseline + (the relay's p99 growth)``
    and ``factor * baseline * (the relay's p99 ratio)``: a host whose own round trip became 1.6x
    slower makes a healthy request ~1.6x slower too, beside two CPU burners as on a quiet host.
    A supervisor that holds healthy tenants up still fails it (the relay does not go through the
    supervisor); a busy host does not.
    """
    host_base, host_faults = host
    extra_ms, slowdown = 0.0, 1.0
    if host_base is not None and host_faults is not None:
        extra_ms = max(0.0, host_faults - host_base)
        if host_base > 0:
            slowdown = max(1.0, host_faults / host_base)
    name = f"healthy p99 within {factor:g}x of baseline" if factor else "healthy latency (not checked)"
    parts, ok = [], True
    for tenant in healthy:
        base, during = table[tenant]["baseline"]["p99_ms"], table[tenant]["faults"]["p99_ms"]
        if base is None or during is None:
            parts.append(f"{tenant}: no samples")
            ok = ok and factor is None
            continue
        ratio = during / base if base else math.inf
        parts.append(f"{tenant} {base:.2f} -> {during:.2f} ms ({ratio:.2f}x)")
        if factor is not None and during > max(factor * base + extra_ms, factor * base * slowdown):
            ok = False
    if host_base is not None and host_faults is not None:
        parts.append(f"raw relay p99 {host_base:.2f} -> {host_faults:.2f} ms "
                     f"(allowance +{extra_ms:.2f} ms or x{slowdown:.2f}, the larger)")
    return Check(name, ok, "; ".join(parts) or "no healthy tenant")


# --------------------------------------------------------------------------- fault statistics


def _disruptive(fault: Fault) -> bool:
    if fault.kind == "leak":
        return dict(fault.params).get("bytes", 0) >= LEAK_BIG
    return fault.kind in DISRUPTIVE_FAULTS


def fault_stats(actions: Sequence[Action], events: Sequence[Mapping[str, object]]) -> dict[str, dict[str, float | None]]:
    """Per kind: delivered, armed, skipped, deaths, detection and recovery times (ms).

    A worker's death (its first ``kill`` or ``exit`` event) is put down to the
    latest disruptive fault delivered to its pid before it; detection is the
    time from delivery to that event, recovery from the ``exit`` event to the
    ``ready`` event of the instance's next incarnation.
    """
    first_down: dict[int, float] = {}
    exits: dict[int, Mapping[str, object]] = {}
    readies: list[Mapping[str, object]] = []
    for e in events:
        pid = e.get("pid")
        if e.get("event") in ("kill", "exit") and isinstance(pid, int):
            first_down.setdefault(pid, _ts(e))
            if e.get("event") == "exit":
                exits.setdefault(pid, e)
        elif e.get("event") == "ready" and e.get("tenant") is not None:
            readies.append(e)
    blamed: dict[int, Action] = {}
    for a in actions:
        if a.pid is not None and _disruptive(a.fault) and a.outcome in ("armed", "exited", "signalled"):
            down = first_down.get(a.pid)
            if down is not None and down >= a.wall - 0.05:
                blamed[a.pid] = a  # actions are in order: the latest one before the death wins
    stats: dict[str, Counter[str]] = {}
    detect: dict[str, list[float]] = defaultdict(list)
    recover: dict[str, list[float]] = defaultdict(list)
    for a in actions:
        kind = "slow(heal)" if a.fault.heal else a.fault.kind
        s = stats.setdefault(kind, Counter())
        s["delivered"] += 1
        s[a.outcome.split(":")[0]] += 1
    for pid, a in blamed.items():
        if first_down[pid] > a.wall + 60:
            continue
        kind = a.fault.kind
        stats[kind]["deaths"] += 1
        detect[kind].append(max(0.0, first_down[pid] - a.wall))
        ex = exits.get(pid)
        if ex is not None:
            nxt = [
                _ts(r)
                for r in readies
                if r.get("tenant") == ex.get("tenant")
                and r.get("instance") == ex.get("instance")
                and _ts(r) >= _ts(ex)
            ]
            if nxt:
                recover[kind].append(min(nxt) - _ts(ex))
    out: dict[str, dict[str, float | None]] = {}
    for kind, s in sorted(stats.items()):
        row: dict[str, float | None] = dict(s)
        for label, values in (("detect", detect.get(kind, [])), ("recover", recover.get(kind, []))):
            p50, mx = percentile(values, 0.5), max(values, default=None)
            row[f"{label}_ms_p50"] = None if p50 is None else round(p50 * 1000, 1)
            row[f"{label}_ms_max"] = None if mx is None else round(mx * 1000, 1)
        out[kind] = row
    return out
