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

import hashlib
import json
import math
import os
import random
import signal
import struct
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import psutil
import zmq

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import (
    RequestTimeout,
    TensorWasmError,
    WorkerLost,
)
from shared.spec import TenantSpec
from supervisor.client import SupervisorClient
from supervisor.core import DEADLINE_GRACE_S
from supervisor.demo import guest_path
from supervisor.events import TOPIC_PREFIX, decode_event
from supervisor.launch import launch

__all__ = [
    "ALL_FAULTS",
    "DEFAULT_FAULTS",
    "SIGNAL_FAULTS",
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

#: faults the worker applies to itself (``inject_fault``)
DEFAULT_FAULTS = ("crash", "segfault", "exit", "hang", "slow", "oom", "corrupt", "drop", "leak")
#: faults the nemesis delivers as signals to the worker's pid
SIGNAL_FAULTS = ("sigkill", "sigstop")
ALL_FAULTS = DEFAULT_FAULTS + SIGNAL_FAULTS
#: kinds that end the worker or get it killed (a leak only when big); a death is put down to the latest one
_DISRUPTIVE = frozenset({"crash", "segfault", "exit", "hang", "corrupt", "drop", "leak", "sigkill", "sigstop"})
#: error codes that say the instance that held a buffer died (or is being killed)
_DEATH_CODES = frozenset({"worker_lost", "kernel_timeout", "memory_exhausted"})
#: outcomes that break "every request answered with a result or a typed error"
_UNANSWERED = frozenset({"lost", "untyped"})

MiB = 1 << 20
#: settings of a supervisor the campaign starts itself (fast failure detection, warm restarts)
SUPERVISOR_SETTINGS: dict[str, Any] = {
    "pool_size": 2,
    "heartbeat_interval_s": 0.25,
    "heartbeat_liveness": 3,
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
        return TenantSpec(name, memory_quota_bytes=256 * MiB, gpu_memory_bytes_cap=256 * MiB, instances=instances,
                          request_timeout_s=10.0, wasm_timeout_s=2.0)
    # restarts must stay cheap and never exhaust the restart intensity: a short window, a high limit
    return TenantSpec(name, memory_quota_bytes=FAULTY_MEMORY, gpu_memory_bytes_cap=256 * MiB, instances=instances,
                      request_timeout_s=cfg.request_timeout_s, wasm_timeout_s=1.0, max_restarts=1_000_000,
                      restart_window_s=1.0)


def _deadline_s(spec: TenantSpec, op: str, wasm_timeout_s: float | None = None) -> float:
    """The deadline the supervisor gives ``op`` (supervisor.routing._deadline_s), from submission."""
    if op == "run_wasm":
        run_s = min(wasm_timeout_s, spec.wasm_timeout_s) if wasm_timeout_s else spec.wasm_timeout_s
        return max(run_s + DEADLINE_GRACE_S, spec.request_timeout_s)
    return spec.request_timeout_s


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``at_s`` seconds into the fault phase."""

    at_s: float
    tenant: str  # role name ("faulty-0")
    kind: str
    instance: int
    params: tuple[tuple[str, int], ...] = ()
    heal: bool = False  # the end of a ``slow`` fault (``slow`` with ms=0)

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "tenant": self.tenant, "kind": self.kind, "instance": self.instance,
                "params": dict(self.params), "heal": self.heal}


def _params(kind: str, rng: random.Random) -> tuple[tuple[str, int], ...]:
    if kind == "exit":
        return (("code", rng.choice((0, 1, 2, 3, 42, 255))),)
    if kind == "slow":
        return (("ms", rng.choice((20, 50, 100, 200))),)
    if kind == "oom":
        return (("count", rng.randint(1, 3)),)
    if kind == "leak":
        return (("bytes", LEAK_BIG if rng.random() < 0.5 else LEAK_SMALL),)
    return ()


def build_schedule(seed: int, kinds: Sequence[str], rate: float, span_s: float,
                   targets: Sequence[tuple[str, int]]) -> tuple[Fault, ...]:
    """Poisson arrivals at ``rate`` over ``span_s``; each picks a target, an instance, a kind, parameters.

    ``targets`` are (role name, instances). A ``slow`` fault is healed (``ms=0``)
    0.5-3 s later. Deterministic: the same arguments give the same schedule.
    """
    if not targets or not kinds or rate <= 0 or span_s <= 0:
        return ()
    rng = random.Random(f"twt-chaos-schedule:{seed}")
    out: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= span_s:
            break
        name, instances = targets[rng.randrange(len(targets))]
        kind = kinds[rng.randrange(len(kinds))]
        instance = rng.randrange(instances)
        params = _params(kind, rng)
        out.append(Fault(round(t, 3), name, kind, instance, params))
        if kind == "slow":
            heal_at = round(t + rng.uniform(0.5, 3.0), 3)
            if heal_at < span_s:
                out.append(Fault(heal_at, name, "slow", instance, (("ms", 0),), heal=True))
    out.sort(key=lambda f: f.at_s)
    return tuple(out)


def schedule_hash(schedule: Sequence[Fault]) -> str:
    """sha256 of the schedule's canonical JSON (first 16 hex digits)."""
    doc = json.dumps([f.to_dict() for f in schedule], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the recorder


@dataclass(slots=True)
class Record:
    """One request as its caller saw it."""

    tenant: str
    healthy: bool
    op: str
    phase: str  # warmup | baseline | faults | cleanup
    start: float  # time.monotonic() at send
    latency_s: float
    outcome: str  # "ok", an error code, "lost" (no answer), "untyped", "wrong_data"
    deadline_s: float
    detail: str = ""


class Recorder:
    """Every request's outcome, from every thread."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.phase = "warmup"
        self._lock = threading.Lock()

    def add(self, record: Record) -> None:
        with self._lock:
            self.records.append(record)

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by the nearest-rank method; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# --------------------------------------------------------------------------- the workload


@dataclass
class _Buf:
    nbytes: int
    shadow: bytearray | None = None  # what the buffer holds, when known
    doomed: bool = False  # an op on it met its instance's death


@dataclass
class _Modules:
    long_job: bytes
    probe: bytes

    @classmethod
    def load(cls) -> _Modules:
        return cls(guest_path("long_job").read_bytes(), guest_path("probe").read_bytes())


class _Client(threading.Thread):
    """One client thread: a paced, seeded mix of operations on one tenant, all recorded."""

    def __init__(self, index: int, tenant: str, healthy: bool, spec: TenantSpec, cap: TenantCapability,
                 run_dir: str, seed: int, recorder: Recorder, stop: threading.Event, modules: _Modules,
                 warmed: threading.Barrier | None) -> None:
        super().__init__(name=f"chaos-client-{index}", daemon=True)
        self.tenant = tenant
        self.healthy = healthy
        self.spec = spec
        self.cap = cap
        self.run_dir = run_dir
        self.rng = random.Random(f"twt-chaos-client:{seed}:{index}")
        self.recorder = recorder
        self.stop_event = stop
        self.modules = modules
        self.warmed = warmed
        self.live: dict[int, _Buf] = {}
        self.stale: list[tuple[int, int]] = []  # (handle, nbytes) dropped: their instance died
        self.client: SupervisorClient | None = None
        self.crashed: BaseException | None = None
        # the client gives up well after the supervisor must have answered: that is "lost"
        self.timeout_s = 2 * _deadline_s(spec, "run_wasm") + 10.0

    # ------------------------------------------------------------ plumbing

    def _call(self, op: str, fn: Callable[[SupervisorClient], Any], wasm_timeout_s: float | None = None
              ) -> tuple[str, Any]:
        assert self.client is not None
        phase = self.recorder.phase
        t0 = time.monotonic()
        detail = ""
        result: Any = None
        try:
            result = fn(self.client)
            outcome = "ok"
        except RequestTimeout as exc:
            outcome, detail = "lost", str(exc)
        except TensorWasmError as exc:
            outcome, result, detail = exc.code, exc, str(exc)[:200]
        except Exception as exc:  # noqa: BLE001 - recorded as a violation, never hidden
            outcome, detail = "untyped", repr(exc)[:200]
        latency = time.monotonic() - t0
        self.recorder.add(Record(self.tenant, self.healthy, op, phase, t0, latency, outcome,
                                 _deadline_s(self.spec, op, wasm_timeout_s), detail))
        return outcome, result

    def _wrong(self, op: str, detail: str) -> None:
        self.recorder.add(Record(self.tenant, self.healthy, op, self.recorder.phase, time.monotonic(), 0.0,
                                 "wrong_data", _deadline_s(self.spec, op), detail[:200]))

    def _after_error(self, handle: int, outcome: str, *, mutating: bool) -> None:
        buf = self.live.get(handle)
        if buf is None:
            return
        if outcome == "invalid_argument":
            # the handle names an instance incarnation that is gone: its buffer went with it
            del self.live[handle]
            self.stale.append((handle, buf.nbytes))
        elif outcome in _DEATH_CODES:
            buf.doomed = True
            buf.shadow = None
        elif mutating and outcome not in ("overloaded", "tenant_failed"):
            buf.shadow = None  # may or may not have been applied

    # ------------------------------------------------------------ operations

    def op_alloc(self) -> None:
        nbytes = self.rng.randrange(1, 33) * 4096
        outcome, result = self._call("alloc", lambda c: c.alloc(self.cap, nbytes))
        if outcome != "ok":
            return
        handle = int(result)
        self.live[handle] = _Buf(nbytes)
        data = self.rng.randbytes(nbytes)  # give it a known content
        outcome, _ = self._call("write", lambda c: c.write(self.cap, handle, data))
        if outcome == "ok":
            self.live[handle].shadow = bytearray(data)
        else:
            self._after_error(handle, outcome, mutating=True)

    def _pick(self) -> tuple[int, _Buf]:
        handle = self.rng.choice(sorted(self.live))
        return handle, self.live[handle]

    def op_free(self) -> None:
        handle, buf = self._pick()
        outcome, result = self._call("free", lambda c: c.free(self.cap, handle))
        if outcome == "ok":
            del self.live[handle]
            if int(result) != buf.nbytes:
                self._wrong("free", f"free of {handle:#x} released {result} B, it had {buf.nbytes} B")
        else:
            self._after_error(handle, outcome, mutating=False)

    def op_write(self) -> None:
        handle, buf = self._pick()
        off = self.rng.randrange(buf.nbytes)
        data = self.rng.randbytes(self.rng.randint(1, min(8192, buf.nbytes - off)))
        outcome, _ = self._call("write", lambda c: c.write(self.cap, handle, data, offset=off))
        if outcome == "ok":
            if buf.shadow is not None:
                buf.shadow[off:off + len(data)] = data
        else:
            self._after_error(handle, outcome, mutating=True)

    def op_read(self) -> None:
        handle, buf = self._pick()
        off = self.rng.randrange(buf.nbytes)
        n = self.rng.randint(1, min(16384, buf.nbytes - off))
        outcome, data = self._call("read", lambda c: c.read(self.cap, handle, n, offset=off))
        if outcome == "ok":
            if buf.shadow is not None and bytes(data) != bytes(buf.shadow[off:off + n]):
                self._wrong("read", f"read of {n} B at {off} of {handle:#x} differs from what was written")
        else:
            self._after_error(handle, outcome, mutating=False)

    def op_wasm_job(self) -> None:
        n = self.rng.choice((256, 1024, 4096))
        reps = self.rng.randint(1, 8)
        outcome, result = self._call("run_wasm", lambda c: c.run_wasm(self.cap, self.modules.long_job, "run",
                                                                       [n, reps]))
        if outcome != "ok":
            return
        got = result.get("results") or [None]
        want = 0.5 * reps * n
        if isinstance(got[0], float) and math.isnan(got[0]) and not self.healthy:
            return  # an injected OOM: the guest's alloc returned an error code, as documented
        if got[0] != want:
            self._wrong("run_wasm", f"long_job({n}, {reps}) returned {got!r}, expected [{want}]")

    def op_wasm_fill(self) -> None:
        handle, buf = self._pick()
        count = self.rng.randint(1, min(256, buf.nbytes // 4))
        value = self.rng.choice((1.5, -2.0, 0.25, 3.0))
        outcome, result = self._call("run_wasm", lambda c: c.run_wasm(self.cap, self.modules.probe, "fill_f32",
                                                                       [{"handle": handle}, value, count]))
        if outcome == "ok":
            if result.get("results") != [0]:
                self._wrong("run_wasm", f"fill_f32 on {handle:#x} returned {result.get('results')!r}")
                buf.shadow = None
            elif buf.shadow is not None:
                buf.shadow[: 4 * count] = struct.pack("<f", value) * count
        else:
            self._after_error(handle, outcome, mutating=True)

    def step(self) -> None:
        ops: list[tuple[Callable[[], None], int]] = [(self.op_wasm_job, 1)]
        if len(self.live) < MAX_LIVE_BUFFERS:
            ops.append((self.op_alloc, 3))
        if self.live:
            ops += [(self.op_free, 2), (self.op_write, 3), (self.op_read, 4), (self.op_wasm_fill, 1)]
        fns, weights = zip(*ops)
        self.rng.choices(fns, weights)[0]()

    def warm_up(self) -> None:
        """Every op once (compiles both guests in the worker) before anything is measured."""
        self.op_wasm_job()
        self.op_alloc()
        if self.live:
            self.op_wasm_fill()
            self.op_read()
            self.op_free()

    def run(self) -> None:
        try:
            self.client = SupervisorClient(self.run_dir, timeout_s=self.timeout_s)
            self.warm_up()
            if self.warmed is not None:
                try:
                    self.warmed.wait(60)
                except threading.BrokenBarrierError:
                    pass
            while not self.stop_event.is_set():
                self.step()
                self.stop_event.wait(self.rng.uniform(0.005, 0.02))
        except BaseException as exc:  # noqa: BLE001 - reported as a violation by the campaign
            self.crashed = exc
        finally:
            if self.client is not None:
                self.client.close()

    def free_all(self, client: SupervisorClient) -> None:
        """Cleanup: free every buffer still held (recorded in phase "cleanup")."""
        self.client = client
        for handle in sorted(self.live):
            buf = self.live[handle]
            outcome, _ = self._call("free", lambda c: c.free(self.cap, handle))  # noqa: B023 - called at once
            if outcome == "ok":
                del self.live[handle]
            elif outcome == "invalid_argument" or buf.doomed or outcome in _DEATH_CODES:
                del self.live[handle]
                self.stale.append((handle, buf.nbytes))


# --------------------------------------------------------------------------- events and the nemesis


class _EventLog(threading.Thread):
    """Collects the supervisor's lifecycle events (its own SUB socket, in its own thread)."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(name="chaos-events", daemon=True)
        self.endpoint = "ipc://" + os.path.join(run_dir, "events.ipc")
        self.events: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self.connected = threading.Event()

    def run(self) -> None:
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
        sock.connect(self.endpoint)
        self.connected.set()
        try:
            while not self.stop_event.is_set():
                if sock.poll(100):
                    try:
                        self.events.append(decode_event(sock.recv_multipart()))
                    except (ValueError, TensorWasmError):
                        continue
        finally:
            sock.close(0)


@dataclass
class Action:
    """What the nemesis did for one scheduled fault."""

    fault: Fault
    wall: float  # time.time() just before the fault was delivered
    outcome: str  # armed | exited | signalled | skipped | refused:<code> | lost
    pid: int | None = None
    latency_s: float = 0.0
    detail: str = ""


class _Nemesis(threading.Thread):
    def __init__(self, run_dir: str, schedule: Sequence[Fault], names: Mapping[str, str],
                 start: threading.Event, stop: threading.Event) -> None:
        super().__init__(name="chaos-nemesis", daemon=True)
        self.run_dir = run_dir
        self.schedule = schedule
        self.names = names
        self.start_event = start
        self.stop_event = stop
        self.actions: list[Action] = []
        self.crashed: BaseException | None = None

    def run(self) -> None:
        try:
            with SupervisorClient(self.run_dir, timeout_s=30.0) as client:
                while not self.start_event.wait(0.05):
                    if self.stop_event.is_set():
                        return
                t0 = time.monotonic()
                for fault in self.schedule:
                    if self.stop_event.wait(max(0.0, t0 + fault.at_s - time.monotonic())):
                        return
                    self.actions.append(self._deliver(client, fault))
        except BaseException as exc:  # noqa: BLE001 - reported by the campaign
            self.crashed = exc

    def _deliver(self, client: SupervisorClient, fault: Fault) -> Action:
        name = self.names[fault.tenant]
        wall, t0 = time.time(), time.monotonic()
        action = Action(fault, wall, "skipped")
        try:
            if fault.kind in SIGNAL_FAULTS:
                inst = client.tenant_status(None, name)["instances"][fault.instance]
                if inst["state"] != "ready" or inst["pid"] is None:
                    action.detail = f"instance {inst['state']}"
                else:
                    action.pid = int(inst["pid"])
                    action.wall = time.time()
                    os.kill(action.pid, signal.SIGKILL if fault.kind == "sigkill" else signal.SIGSTOP)
                    action.outcome = "signalled"
            else:
                result = client.inject_fault(None, name, fault.kind, instance=fault.instance, **dict(fault.params))
                action.pid = result.get("pid")
                action.outcome = "exited" if result.get("exited") else "armed"
        except ProcessLookupError:
            action.detail = "process already gone"
        except WorkerLost as exc:
            action.detail = exc.reason or str(exc)
        except RequestTimeout as exc:
            action.outcome, action.detail = "lost", str(exc)
        except TensorWasmError as exc:
            action.outcome, action.detail = f"refused:{exc.code}", str(exc)[:200]
        action.latency_s = time.monotonic() - t0
        return action


# --------------------------------------------------------------------------- checks


@dataclass
class Check:
    """One invariant's verdict."""

    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
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


def reconcile(record: Mapping[str, Any], live: Mapping[int, int]) -> Reconciliation:
    """Compare a tenant's status record (``status()["tenants"][i]``) with its live buffers (handle -> bytes).

    A buffer whose handle names an instance incarnation that is no longer the
    running one died with that instance (the supervisor reclaimed its share);
    every other buffer must be counted, instance by instance, and nothing else.
    Meaningful when nothing is in flight (the counters move with requests).
    """
    current: dict[int, int] = {}
    for inst in record.get("instances", []):
        if inst.get("state") == "ready" and inst.get("pid") is not None:
            current[int(inst["index"])] = int(inst["incarnation"]) & 0xFFFF
    expected: Counter[int] = Counter()
    lost = lost_bytes = 0
    for handle, nbytes in live.items():
        index = proto.handle_instance(handle)
        if current.get(index) == proto.handle_incarnation(handle):
            expected[index] += nbytes
        else:
            lost += 1
            lost_bytes += nbytes
    quota = record.get("quota") or {}
    shares = {int(i): int(gpu) for i, _cpu, gpu in quota.get("instance_shares", [])}
    cpu_shares = {int(i): int(cpu) for i, cpu, _gpu in quota.get("instance_shares", [])}
    counted = int(record.get("gpu_bytes_in_use", 0))
    cpu = int(record.get("bytes_in_use", 0))
    problems = []
    if counted != sum(expected.values()):
        problems.append(f"gpu_bytes_in_use {counted:,} B, the clients hold {sum(expected.values()):,} B")
    for index in sorted(set(shares) | set(expected)):
        if shares.get(index, 0) != expected.get(index, 0):
            problems.append(f"instance {index} share {shares.get(index, 0):,} B, expected {expected.get(index, 0):,} B")
    if cpu or any(cpu_shares.values()):
        problems.append(f"bytes_in_use {cpu:,} B with no WASM run in flight (expected 0)")
    return Reconciliation(str(record.get("tenant_id")), not problems, sum(expected.values()), counted, cpu,
                          lost, lost_bytes, problems)


def _check_answered(records: Sequence[Record], actions: Sequence[Action]) -> Check:
    bad = [r for r in records if r.outcome in _UNANSWERED]
    lost_admin = [a for a in actions if a.outcome == "lost"]
    if bad or lost_admin:
        sample = "; ".join(f"{r.tenant} {r.op}: {r.outcome} {r.detail}" for r in bad[:3])
        return Check("every request answered", False,
                     f"{len(bad)} of {len(records)} requests and {len(lost_admin)} fault injections got no typed "
                     f"answer ({sample})")
    codes = Counter(r.outcome for r in records if r.outcome != "ok")
    return Check("every request answered", True,
                 f"{len(records)} requests: {sum(r.outcome == 'ok' for r in records)} ok, "
                 f"{sum(codes.values())} typed errors; {len(actions)} fault injections answered")


def _check_deadlines(records: Sequence[Record], grace_s: float) -> Check:
    answered = [r for r in records if r.outcome not in _UNANSWERED]
    late = [r for r in answered if r.latency_s > r.deadline_s + grace_s]
    if not answered:
        return Check("answered within deadline + grace", True, "no requests")
    worst = max(late or answered, key=lambda r: r.latency_s - r.deadline_s)
    closest = (f"{worst.tenant} {worst.op} ({worst.outcome}) after {worst.latency_s:.3f} s against a "
               f"{worst.deadline_s:g} s deadline")
    if late:
        return Check("answered within deadline + grace", False,
                     f"{len(late)} answered later than deadline + {grace_s:g} s; worst: {closest}")
    return Check("answered within deadline + grace", True, f"closest to its deadline: {closest}")


def _check_data(records: Sequence[Record]) -> Check:
    wrong = [r for r in records if r.outcome == "wrong_data"]
    if wrong:
        return Check("data intact", False, f"{len(wrong)} wrong results: " + "; ".join(r.detail for r in wrong[:3]))
    reads = sum(r.op == "read" and r.outcome == "ok" for r in records)
    return Check("data intact", True, f"{reads} reads matched what was written; every WASM result as computed")


def _check_healthy(records: Sequence[Record], events: Sequence[dict[str, Any]], healthy: set[str],
                   until: float) -> Check:
    errors = [r for r in records if r.healthy and r.outcome != "ok"]
    touched = [e for e in events if e.get("tenant") in healthy and e.get("event") in ("kill", "exit", "failed")
               and float(e.get("ts", 0)) < until]
    if errors or touched:
        parts = [f"{r.tenant} {r.op} {r.phase}: {r.outcome} {r.detail}" for r in errors[:3]]
        parts += [f"{e.get('tenant')}: {e.get('event')} {e.get('reason', '')}" for e in touched[:3]]
        return Check("healthy tenants undisturbed", False,
                     f"{len(errors)} errors, {len(touched)} worker deaths in healthy tenants: " + "; ".join(parts))
    n = sum(r.healthy for r in records)
    return Check("healthy tenants undisturbed", True, f"{n} requests, no error, no worker death")


def latency_table(records: Sequence[Record], tenants: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per tenant: count, p50 and p99 (ms) of successful requests in the baseline and the fault phase."""
    out: dict[str, dict[str, Any]] = {}
    for name in tenants:
        row: dict[str, Any] = {}
        for phase in ("baseline", "faults"):
            lat = [r.latency_s for r in records if r.tenant == name and r.phase == phase and r.outcome == "ok"]
            p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
            row[phase] = {"n": len(lat), "p50_ms": None if p50 is None else round(p50 * 1000, 3),
                          "p99_ms": None if p99 is None else round(p99 * 1000, 3)}
        out[name] = row
    return out


def _check_latency(table: Mapping[str, Mapping[str, Any]], healthy: Sequence[str], factor: float | None) -> Check:
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
        if factor is not None and ratio > factor:
            ok = False
    return Check(name, ok, "; ".join(parts) or "no healthy tenant")


# --------------------------------------------------------------------------- fault statistics


def _disruptive(fault: Fault) -> bool:
    if fault.kind == "leak":
        return dict(fault.params).get("bytes", 0) >= LEAK_BIG
    return fault.kind in _DISRUPTIVE


def fault_stats(actions: Sequence[Action], events: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: delivered, armed, skipped, deaths, detection and recovery times (ms).

    A worker's death (its first ``kill`` or ``exit`` event) is put down to the
    latest disruptive fault delivered to its pid before it; detection is the
    time from delivery to that event, recovery from the ``exit`` event to the
    ``ready`` event of the instance's next incarnation.
    """
    first_down: dict[int, float] = {}
    exits: dict[int, dict[str, Any]] = {}
    readies: list[dict[str, Any]] = []
    for e in events:
        pid = e.get("pid")
        if e.get("event") in ("kill", "exit") and isinstance(pid, int):
            first_down.setdefault(pid, float(e["ts"]))
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
    stats: dict[str, dict[str, Any]] = {}
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
            nxt = [float(r["ts"]) for r in readies if r.get("tenant") == ex.get("tenant")
                   and r.get("instance") == ex.get("instance") and float(r["ts"]) >= float(ex["ts"])]
            if nxt:
                recover[kind].append(min(nxt) - float(ex["ts"]))
    out: dict[str, dict[str, Any]] = {}
    for kind, s in sorted(stats.items()):
        row: dict[str, Any] = dict(s)
        for label, values in (("detect", detect.get(kind, [])), ("recover", recover.get(kind, []))):
            p50, mx = percentile(values, 0.5), max(values, default=None)
            row[f"{label}_ms_p50"] = None if p50 is None else round(p50 * 1000, 1)
            row[f"{label}_ms_max"] = None if mx is None else round(mx * 1000, 1)
        out[kind] = row
    return out


# --------------------------------------------------------------------------- the campaign


def _alive(pid: int, created: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        if created is not None and abs(proc.create_time() - created) > 0.01:
            return False  # the pid was reused
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _describe(pids: Sequence[int]) -> str:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} ({p.name()}, parent {p.ppid()}, {p.status()})")
        except psutil.Error:
            out.append(f"{pid} (gone)")
    return ", ".join(out)


def _shm_names() -> list[str]:
    try:
        return [n for n in os.listdir("/dev/shm") if n.startswith("twt-")]
    except FileNotFoundError:
        return []


@contextmanager
def _supervisor(cfg: ChaosConfig, stack: ExitStack) -> Iterator[tuple[str, int | None]]:
    """(run dir, pid of a supervisor we started - None when using a running one)."""
    if cfg.run_dir is not None:
        yield cfg.run_dir, None
        return
    log: Any = subprocess.DEVNULL
    if cfg.supervisor_log:
        log = stack.enter_context(open(cfg.supervisor_log, "ab"))  # noqa: SIM115 - closed by the stack
    settings = {**SUPERVISOR_SETTINGS, "backend": cfg.backend}
    with launch({"supervisor": settings, "tenant": []}, start_method=cfg.start_method, stderr=log) as handle:
        yield handle.run_dir, handle.pid


class _Campaign:
    """One run of :func:`run_chaos`, step by step (each step appends its checks)."""

    def __init__(self, cfg: ChaosConfig, progress: IO[str] | None) -> None:
        self.cfg, self.progress = cfg, progress
        self.t_start = time.monotonic()
        self.roles = cfg.roles()
        suffix = "" if cfg.run_dir is None else f"-{os.getpid()}"  # beside a running supervisor's tenants
        self.names = {role: f"{role}{suffix}" for role, _, _ in self.roles}
        self.order = [self.names[role] for role, _, _ in self.roles]
        self.healthy = {self.names[role] for role, healthy, _ in self.roles if healthy}
        self.specs = {self.names[r]: _spec(self.names[r], h, n, cfg) for r, h, n in self.roles}
        targets = [(role, n) for role, healthy, n in self.roles if not healthy]
        self.schedule = build_schedule(cfg.seed, cfg.faults, cfg.rate, cfg.fault_phase, targets)
        self.recorder = Recorder()
        self.checks: list[Check] = []
        self.clients: list[_Client] = []
        self.actions: list[Action] = []
        self.events: list[dict[str, Any]] = []
        self.caps: dict[str, TenantCapability] = {}
        self.pids: dict[int, float | None] = {}  # every worker process of ours we saw (pid -> start time)
        self.segments: set[str] = set()
        self.prefix = ""
        self.fault_end = 0.0
        self.report: dict[str, Any] = {
            "config": {"duration_s": cfg.duration_s, "seed": cfg.seed, "tenants": cfg.tenants,
                       "faulty": cfg.n_faulty, "faults": list(cfg.faults), "rate": cfg.rate,
                       "clients": cfg.n_clients, "baseline_s": cfg.baseline, "fault_phase_s": cfg.fault_phase,
                       "backend": cfg.backend, "start_method": cfg.start_method,
                       "latency_factor": cfg.latency_factor, "grace_s": cfg.grace_s},
            "schedule": {"hash": schedule_hash(self.schedule), "faults": len(self.schedule),
                         "by_kind": dict(sorted(Counter("slow(heal)" if f.heal else f.kind
                                                        for f in self.schedule).items()))},
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }

    def say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress.write(f"chaos: {msg}\n")
            self.progress.flush()

    def note_pid(self, pid: Any, into: dict[int, float | None] | None = None) -> None:
        into = self.pids if into is None else into
        if isinstance(pid, int) and pid not in into:
            try:
                into[pid] = psutil.Process(pid).create_time()
            except psutil.Error:
                into[pid] = None

    # ------------------------------------------------------------ steps

    def run(self) -> dict[str, Any]:
        with ExitStack() as stack:
            with _supervisor(self.cfg, stack) as (run_dir, sup_pid):
                events = _EventLog(run_dir)
                events.start()
                stack.callback(events.join, 5)
                stack.callback(events.stop_event.set)
                events.connected.wait(5)
                time.sleep(0.2)  # let the subscription reach the publisher before anything happens
                main = SupervisorClient(run_dir, timeout_s=60.0)
                stack.callback(main.close)
                self.start(main, sup_pid)
                self.workload(run_dir)
                self.settle_and_reconcile(main)
                self.cleanup(main)
                descendants: dict[int, float | None] = {}
                if sup_pid is not None:
                    try:
                        for p in psutil.Process(sup_pid).children(recursive=True):
                            self.note_pid(p.pid, descendants)
                    except psutil.Error:
                        pass
                events.stop_event.set()
                events.join(5)
                self.events = events.events
            # here the supervisor we started has stopped
            self.leak_check(sup_pid, descendants)
        return self.finish()

    def start(self, main: SupervisorClient, sup_pid: int | None) -> None:
        hello = main.hello()
        self.prefix = f"twt-{str(hello['registry_id'])[:8]}-"
        self.report["supervisor"] = {"pid": hello["pid"], "backend": hello["backend"],
                                     "start_method": hello["start_method"], "started_here": sup_pid is not None}
        self.say(f"supervisor pid {hello['pid']} ({hello['backend']}, {hello['start_method']}); "
                 f"schedule {self.report['schedule']['hash']}: {len(self.schedule)} faults")
        self.caps = {name: main.register(None, spec) for name, spec in self.specs.items()}

    def workload(self, run_dir: str) -> None:
        """Warm-up, baseline, faults; every client and the nemesis stopped and joined at the end."""
        cfg = self.cfg
        stop_clients, stop_nemesis, faults_on = threading.Event(), threading.Event(), threading.Event()
        modules = _Modules.load()
        warmed = threading.Barrier(cfg.n_clients + 1)
        for i in range(cfg.n_clients):
            name = self.order[i % len(self.order)]
            self.clients.append(_Client(i, name, name in self.healthy, self.specs[name], self.caps[name], run_dir,
                                        cfg.seed, self.recorder, stop_clients, modules, warmed))
        nemesis = _Nemesis(run_dir, self.schedule, self.names, faults_on, stop_nemesis)
        try:
            for c in self.clients:
                c.start()
            nemesis.start()
            try:
                warmed.wait(120)
            except threading.BrokenBarrierError:
                pass
            self.recorder.phase = "baseline"
            self.say(f"baseline {cfg.baseline:g} s, {len(self.clients)} clients on {len(self.order)} tenants")
            time.sleep(cfg.baseline)
            self.recorder.phase = "faults"
            faults_on.set()
            self.say(f"faults {cfg.fault_phase:g} s at {cfg.rate:g}/s into {cfg.n_faulty} tenants")
            time.sleep(cfg.fault_phase)
        finally:
            stop_nemesis.set()
            nemesis.join(60)
            stop_clients.set()
            for c in self.clients:
                c.join(120)
        self.fault_end = time.time()
        self.recorder.phase = "cleanup"
        self.actions = nemesis.actions
        crashed = [f"{c.name}: {c.crashed!r}" for c in self.clients if c.crashed is not None]
        if nemesis.crashed is not None:
            crashed.append(f"nemesis: {nemesis.crashed!r}")
        if any(t.is_alive() for t in [*self.clients, nemesis]):
            crashed.append("a client or the nemesis did not stop within its timeout")
        self.checks.append(Check("harness ran to the end", not crashed, "; ".join(crashed) or "all threads finished"))

    def _settle(self, main: SupervisorClient, timeout_s: float = 30.0) -> tuple[bool, list[dict[str, Any]]]:
        """Wait until every tenant runs every instance with nothing in flight or parked."""
        deadline = time.monotonic() + timeout_s
        while True:
            recs = [r for r in main.status()["tenants"] if r["tenant_id"] in self.specs]
            if len(recs) == len(self.specs) and all(
                    r["state"] == "running" and r["in_flight"] == 0 and r["parked"] == 0 for r in recs):
                return True, recs
            if time.monotonic() >= deadline:
                return False, recs
            time.sleep(0.05)

    def settle_and_reconcile(self, main: SupervisorClient) -> None:
        """Counters against the buffers the clients hold, once nothing moves."""
        self.say("settling: heal slow faults, wait for every instance")
        for role, healthy, instances in self.roles:
            for i in range(0 if healthy else instances):
                try:
                    main.inject_fault(None, self.names[role], "slow", instance=i, ms=0)
                except TensorWasmError:
                    pass  # not running: nothing to heal
        # an armed hang shows only once heartbeats are missed: settle, wait that long, settle again
        settled, recs = self._settle(main)
        time.sleep(1.5)
        settled2, recs = self._settle(main)
        for rec in recs:
            for inst in rec["instances"]:
                self.note_pid(inst["pid"])
        live: dict[str, dict[int, int]] = defaultdict(dict)
        for c in self.clients:
            live[c.tenant].update({h: b.nbytes for h, b in c.live.items()})
        recons = [reconcile(r, live[r["tenant_id"]]) for r in recs]
        problems = [f"{r.tenant}: {'; '.join(r.problems)}" for r in recons if not r.ok]
        for name in sorted(self.healthy):  # and the worker's own list, where no fault can be armed
            try:
                held = main.buffers(self.caps[name])
            except TensorWasmError as exc:
                problems.append(f"{name}: buffers op failed: {exc}")
                continue
            if held != live[name]:
                problems.append(f"{name}: the worker holds {len(held)} buffers, the clients {len(live[name])}")
        if not (settled and settled2):
            problems.insert(0, "tenants did not settle within 30 s: " + ", ".join(
                f"{r['tenant_id']} {r['state']}, {r['in_flight']} in flight, {r['parked']} parked" for r in recs))
        lost_n = sum(r.lost_buffers for r in recons) + sum(len(c.stale) for c in self.clients)
        lost_b = sum(r.lost_bytes for r in recons) + sum(n for c in self.clients for _, n in c.stale)
        self.report["lost_allocations"] = {"buffers": lost_n, "bytes": lost_b}
        self.checks.append(Check(
            "quota counters equal live allocations", not problems, "; ".join(problems) or
            f"{sum(r.expected_gpu for r in recons):,} B in {sum(len(v) for v in live.values())} buffers counted "
            f"exactly; {lost_n} buffers ({lost_b:,} B) went with dead instances and were reclaimed"))

    def cleanup(self, main: SupervisorClient) -> None:
        """Free everything (counters must reach zero), then evict every tenant."""
        self.say("cleanup: free every buffer, evict every tenant")
        for c in self.clients:
            c.free_all(main)
        self._settle(main)
        deadline = time.monotonic() + 5.0
        while True:
            recs = [r for r in main.status()["tenants"] if r["tenant_id"] in self.specs]
            nonzero = [f"{r['tenant_id']}: gpu {r['gpu_bytes_in_use']:,} B, host {r['bytes_in_use']:,} B, "
                       f"shares {r['quota'].get('instance_shares')}" for r in recs
                       if r["gpu_bytes_in_use"] or r["bytes_in_use"] or r["quota"].get("instance_shares")]
            if not nonzero or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.segments = {str(r["quota"].get("name")) for r in recs}
        problems = list(nonzero)
        for name in self.specs:
            try:
                for pid in main.evict(None, name).get("pids", []):
                    self.note_pid(pid)
            except TensorWasmError as exc:
                problems.append(f"evict {name}: {exc}")
        self.checks.append(Check("counters zero after cleanup", not problems, "; ".join(problems) or
                                 f"{len(self.specs)} tenants at 0 B (GPU and host), then evicted"))

    def leak_check(self, sup_pid: int | None, descendants: dict[int, float | None]) -> None:
        """After the stop (or the evictions): no process we saw alive, no segment of ours left."""
        for e in self.events:
            # a running supervisor's pool workers are its own business; ours are those bound to our tenants
            if e.get("event") in ("spawn", "ready", "exit", "kill") and (sup_pid is not None
                                                                         or e.get("tenant") in self.specs):
                self.note_pid(e.get("pid"))
        for a in self.actions:
            self.note_pid(a.pid)
        watch = {**self.pids, **descendants}
        deadline = time.monotonic() + 5.0
        while True:
            alive = sorted(p for p, created in watch.items() if _alive(p, created))
            shm = sorted(n for n in _shm_names()
                         if n in self.segments or (sup_pid is not None and n.startswith(self.prefix)))
            if (not alive and not shm) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        scope = "supervisor stopped" if sup_pid is not None else "our tenants evicted (the supervisor runs on)"
        self.checks.append(Check("no process or segment leaked", not alive and not shm,
                                 f"alive: {_describe(alive)}; segments: {shm}" if alive or shm else
                                 f"{scope}: {len(watch)} processes gone, {len(self.segments)} tenant segments "
                                 f"unlinked"))

    def finish(self) -> dict[str, Any]:
        records = self.recorder.snapshot()
        table = latency_table(records, self.order)
        faulted = {a.pid for a in self.actions if a.pid is not None}
        unexplained = [e for e in self.events if e.get("event") == "exit" and not e.get("expected")
                       and e.get("tenant") in self.specs and float(e.get("ts", 0)) < self.fault_end
                       and e.get("pid") not in faulted]
        self.checks[1:1] = [
            _check_answered(records, self.actions),
            _check_deadlines(records, self.cfg.grace_s),
            _check_data(records),
            _check_healthy(records, self.events, self.healthy, self.fault_end),
            Check("no worker died without a fault", not unexplained,
                  "; ".join(f"{e.get('tenant')}/{e.get('instance')} pid {e.get('pid')}: {e.get('reason')}"
                            for e in unexplained[:5]) or "every unplanned exit followed a fault to that worker"),
        ]
        self.checks.append(_check_latency(table, sorted(self.healthy), self.cfg.latency_factor))
        tenants = []
        for name in self.order:
            rs = [r for r in records if r.tenant == name]
            tenants.append({"tenant": name, "healthy": name in self.healthy, "instances": self.specs[name].instances,
                            "requests": len(rs), "ok": sum(r.outcome == "ok" for r in rs),
                            "errors": dict(sorted(Counter(r.outcome for r in rs if r.outcome != "ok").items())),
                            "latency": table[name]})
        self.report.update({
            "tenants": tenants,
            "faults": fault_stats(self.actions, self.events),
            "actions": [{"at_s": a.fault.at_s, "tenant": a.fault.tenant, "kind": a.fault.kind,
                         "instance": a.fault.instance, "params": dict(a.fault.params), "heal": a.fault.heal,
                         "outcome": a.outcome, "pid": a.pid, "detail": a.detail} for a in self.actions],
            "requests": {"total": len(records),
                         "by_outcome": dict(sorted(Counter(r.outcome for r in records).items()))},
            "worker_deaths": {"total": sum(e.get("event") == "exit" and not e.get("expected")
                                           and e.get("tenant") in self.specs for e in self.events),
                              "not_from_a_fault": len(unexplained)},
            "events": len(self.events),
            "checks": [c.to_dict() for c in self.checks],
            "ok": all(c.ok for c in self.checks),
            "elapsed_s": round(time.monotonic() - self.t_start, 1),
        })
        return self.report


def run_chaos(cfg: ChaosConfig, progress: IO[str] | None = None) -> dict[str, Any]:
    """Run one campaign; returns the report (``report["ok"]`` is the verdict, ``format_report`` prints it)."""
    return _Campaign(cfg, progress).run()


# --------------------------------------------------------------------------- the report


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text: schedule, fault table, tenant table, invariant verdicts."""
    cfg, sched = report["config"], report["schedule"]
    lines = [
        (f"twt chaos: seed {cfg['seed']}, {cfg['duration_s']:g} s ({cfg['baseline_s']:g} s baseline + "
         f"{cfg['fault_phase_s']:g} s faults), {cfg['tenants']} tenants ({cfg['faulty']} faulty), "
         f"{cfg['clients']} clients, rate {cfg['rate']:g}/s"),
        f"schedule {sched['hash']}: {sched['faults']} faults "
        + ", ".join(f"{k} {n}" for k, n in sched["by_kind"].items()),
    ]
    sup = report.get("supervisor")
    if sup:
        lines.append(f"supervisor pid {sup['pid']}, backend {sup['backend']}, {sup['start_method']}"
                     + ("" if sup["started_here"] else " (already running)"))
    lines.append("")
    rows = [["fault", "delivered", "armed", "exited", "signalled", "skipped", "deaths",
             "detect p50/max ms", "recover p50/max ms"]]
    for kind, s in report.get("faults", {}).items():
        rows.append([kind, s.get("delivered", 0), s.get("armed", 0), s.get("exited", 0), s.get("signalled", 0),
                     s.get("skipped", 0), s.get("deaths", 0),
                     f"{_ms(s['detect_ms_p50'])}/{_ms(s['detect_ms_max'])}",
                     f"{_ms(s['recover_ms_p50'])}/{_ms(s['recover_ms_max'])}"])
    lines += _table(rows)
    lines.append("")
    rows = [["tenant", "requests", "ok", "errors", "p99 base ms", "p99 faults ms"]]
    for t in report.get("tenants", []):
        errs = ", ".join(f"{k} {n}" for k, n in t["errors"].items()) or "-"
        rows.append([t["tenant"], t["requests"], t["ok"], errs, _ms(t["latency"]["baseline"]["p99_ms"]),
                     _ms(t["latency"]["faults"]["p99_ms"])])
    lines += _table(rows)
    lost = report.get("lost_allocations")
    if lost:
        lines.append(f"\nallocations lost with dead instances (reclaimed): {lost['buffers']} buffers, "
                     f"{lost['bytes']:,} B; worker deaths: {report['worker_deaths']['total']} "
                     f"({report['worker_deaths']['not_from_a_fault']} not from a fault)")
    lines.append("")
    for c in report.get("checks", []):
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}")
    verdict = "all invariants hold" if report.get("ok") else "INVARIANT VIOLATED"
    lines.append(f"\nchaos: {verdict} ({report.get('elapsed_s')} s)")
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out
