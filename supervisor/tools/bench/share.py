"""``twt bench share``: GPU-time shares between tenants, measured against the same machine in one run.

Two supervisors on the stub backend (the device is one serial executor: see
docs/GPU-QUOTAS.md), one with the GPU-time scheduler on and one with it off,
each tenant running ``gemm_loop`` runs of the ``share`` guest from client
threads (two instances and two threads per tenant where it must saturate
the device). Work is what the guests count (GEMMs done, spread evenly over
each run's span); accounted time is the tenants' ``gpu_time_ns`` in shared
memory, sampled by this process every few milliseconds.

    solo on/off   one tenant (weight 7) alone on each supervisor, in ``--pairs`` pairs of short
                  blocks A B B A (:func:`paired_blocks`; each side's loops paused, not restarted,
                  while the other runs): its work rate with the scheduler on vs off (the
                  scheduler's overhead), the median of the pairs' ratios with its 95 % interval
    7:3           weights 7 and 3, both saturating: work and accounted shares over the blocks and
                  per 1 s window; together vs one tenant alone, paired the same way, with as many
                  worker processes and client threads (4 instances of weight 7: what the scheduler
                  costs, not what the stub's host-CPU device loses to more processes beside it)
    idle          then the weight-3 tenant stops: the other's accounted rate from one quantum
                  after the last chunk of the stopped one, vs its solo rate
    light         one GEMM of 64x64 every 10 ms beside a saturating hog: each op's wait for the
                  device (the run reply's ``gpu_wait_s``), p99
    8 tenants     equal weights: Jain's fairness index of work and of accounted time
    cap           ``gpu_time_cap = 0.25`` alone: accounted device time per wall second
    decision      what one lease decision costs here (shared memory, this process) against a
                  supervisor round trip (a ZeroMQ ipc request to another process)

``--mix`` runs tenants that differ instead (one supervisor, scheduler on, weights 1:1):

    heavy+chatty  a heavy GEMM tenant beside a chatty one (``chatty``: a 64-float fill, then
                  0.1 / 0.3 / 1 ms of guest arithmetic, in a loop), in blocks of ``--block-seconds``
                  alternating (A B B A, the heavy loops running throughout) with a control whose
                  chatty loop makes the same host call with a count of 0 (the host's work without
                  the device's: the same CPU competition): the heavy tenant's work rate vs the
                  control's (the median of neighbouring pairs' ratios, with a 95 % confidence
                  interval: :func:`pair_ratios`, :func:`median_ci`), the chatty op's wait for the device (p99 from the
                  tenant's wait histogram), the device busy while any tenant has work (every
                  worker's work and busy intervals from the work trace, ``shared.gpu_time.WorkTrace``,
                  unioned across workers: :func:`busy_while_work`), the device busy time vs the
                  control's (a figure), and how often the lease changed hands (handoffs + steals
                  per second, from the board)
    k instances   a tenant of k instances against one of one instance, all saturating: the
                  accounted shares by tenant (50/50) and by instance

The stub's device runs on a CPU of its own (``--device-cpus last``, the default: every supervisor's
``stub_device_cpus``, and this program's clients on the CPUs left), in every arm of the run alike; a
GPU runs launched work whatever the host's load, and a device thread sharing two cores with the guests,
the supervisor and the clients waited for one of them (docs/GPU-QUOTAS.md, "The stub device").
``--device-cpus none`` measures without it.

``--plot FILE.png`` (the ``plot`` extra: matplotlib) draws each tenant's
share per 1 s window of the 7:3 and 8-tenant phases. Exit status 0 when
every target is met, 4 when one is missed, 2 for bad usage.

Typing: each scenario's figures are a TypedDict (:class:`SplitResult`, ...), read back by key
for the report, its targets and the plot.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from typing import TYPE_CHECKING, TypedDict, cast

from shared.capability import TenantCapability
from shared.device_cpus import resolve, set_threads_affinity
from shared.gpu_time import HANDOVER_TRACE_ENV, WORK_TRACE_ENV, GpuTimeBoard, WorkTrace
from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from supervisor.tools.bench._report import (Report, Target, count, device_cpus, format_table, percentile,
                                             seconds)
from supervisor.tools.demo import guest_path
from supervisor.client.launch import SupervisorHandle, launch

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from numpy.typing import NDArray

    #: intervals: (start, end) pairs, or an (n, 2) int64 array of them
    Spans: TypeAlias = Sequence[tuple[int, int]] | NDArray[np.int64]

__all__ = ["main"]

_SPAWN = mp.get_context("spawn")
#: errors of every load thread of this run (printed; any makes the run a MISS)
ERRORS: list[str] = []


@dataclass
class Tenant:
    """One tenant of a phase: its capability, guest digest, runs done and its block (read-only)."""

    name: str
    cap: TenantCapability
    digest: str
    block: QuotaBlock
    #: (start, end, iterations) of every run, monotonic seconds
    runs: list[tuple[float, float, int]] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)

    def work_between(self, t0: float, t1: float) -> float:
        """GEMMs done in [t0, t1): each run's count spread evenly over its span."""
        total = 0.0
        for start, end, n in self.runs:
            span = max(end - start, 1e-9)
            overlap = min(end, t1) - max(start, t0)
            if overlap > 0:
                total += n * overlap / span
        return total


class Valve:
    """Lets a set of load loops run (open) or pause (closed) between measured blocks: a loop calls
    :meth:`enter` before each guest run and :meth:`leave` after it; :meth:`close` returns once the
    runs in flight have ended, so the next block's load starts on an otherwise quiet device."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self._stopped = False
        self._running = 0

    def enter(self) -> bool:
        """Wait until the valve is open (True: run once, then :meth:`leave`) or stopped (False)."""
        with self._cond:
            while not self._open and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return False
            self._running += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close(self) -> None:
        """Let no new run start and wait for those in flight."""
        with self._cond:
            self._open = False
            while self._running:
                self._cond.wait()

    def stop(self) -> None:
        """End the loops (each at its next :meth:`enter`)."""
        with self._cond:
            self._stopped = True
            self._open = False
            self._cond.notify_all()


class Phase:
    """Tenants on one supervisor, client threads, and a sampler of their accounted time."""

    def __init__(self, sup: SupervisorHandle, n: int, reps: int) -> None:
        self.sup = sup
        self.n = n
        self.reps = reps
        self.tenants: dict[str, Tenant] = {}
        #: what went wrong in a load thread (reported; a phase with errors misses its targets)
        self.errors: list[str] = []
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop_sampler = threading.Event()
        self._sampler: threading.Thread | None = None
        self._guest = guest_path("share").read_bytes()

    def add(self, name: str, *, instances: int = 2, **spec: object) -> Tenant:
        c = self.sup.client
        cap = c.register(self.sup.admin_capability, TenantSpec.from_dict(
            {"tenant_id": name, "instances": instances, "wasm_timeout_s": 600.0, "request_timeout_s": 600.0,
             "memory_quota_bytes": 4 << 30, **spec}))
        digest = c.put_module(cap, self._guest)
        for _ in range(instances):  # compile the guest and warm BLAS in each instance before any measuring
            c.run_wasm(cap, digest, "gemm_loop", [self.n, 1])
        rec = c.status().tenant(name)
        assert rec is not None and rec.quota is not None, f"{name} has no quota block"
        t = Tenant(name, cap, digest, QuotaBlock.attach(rec.quota.name))
        self.tenants[name] = t
        return t

    # -- load

    def gemm_loop(self, t: Tenant, stop: threading.Event) -> Callable[[], None]:
        def loop() -> None:
            client = self.sup.connect(timeout_s=600.0)
            try:
                client.run_wasm(t.cap, t.digest, "gemm_loop", [self.n, 1])  # compiled, BLAS warm
                while not stop.is_set():
                    t0 = time.monotonic()
                    done = client.run_wasm(t.cap, t.digest, "gemm_loop", [self.n, self.reps]).results[0]
                    t.runs.append((t0, time.monotonic(), int(done)))
            finally:
                client.close()

        return loop

    def valved_gemm_loop(self, t: Tenant, valve: Valve) -> Callable[[], None]:
        """A GEMM loop that runs a guest run only while ``valve`` is open (it ends when the valve is
        stopped): blocks of one kind and another alternate without restarting clients or guests."""
        def loop() -> None:
            client = self.sup.connect(timeout_s=600.0)
            try:
                warm = True
                while valve.enter():
                    try:
                        if warm:  # compiled, BLAS warm: not counted
                            client.run_wasm(t.cap, t.digest, "gemm_loop", [self.n, 1])
                            warm = False
                            continue
                        t0 = time.monotonic()
                        done = client.run_wasm(t.cap, t.digest, "gemm_loop", [self.n, self.reps]).results[0]
                        t.runs.append((t0, time.monotonic(), int(done)))
                    finally:
                        valve.leave()
            finally:
                client.close()

        return loop

    def light_loop(self, t: Tenant, stop: threading.Event, every_s: float, n: int) -> Callable[[], None]:
        def loop() -> None:
            client = self.sup.connect(timeout_s=600.0)
            try:
                hs = [client.alloc(t.cap, 4 * n * n) for _ in range(3)]
                args = [{"handle": h} for h in hs] + [n]
                client.run_wasm(t.cap, t.digest, "one_gemm", args)
                next_at = time.monotonic()
                while not stop.is_set():
                    reply = client.run_wasm(t.cap, t.digest, "one_gemm", args)
                    t.waits.append(reply.gpu_wait_s)
                    next_at += every_s
                    time.sleep(max(0.0, next_at - time.monotonic()))
                for h in hs:
                    client.free(t.cap, h)
            finally:
                client.close()

        return loop

    def start(self, loops: Sequence[Callable[[], None]]) -> list[threading.Thread]:
        def guarded(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - reported with the results
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    ERRORS.append(f"{type(exc).__name__}: {exc}")

            return run

        threads = [threading.Thread(target=guarded(fn), daemon=True) for fn in loops]
        for th in threads:
            th.start()
        return threads

    # -- accounted time

    def sample_every(self, every_s: float = 0.002) -> None:
        def run() -> None:
            while not self._stop_sampler.is_set():
                tenants = list(self.tenants.items())  # "light" joins later, from another thread
                self.samples.append((time.monotonic(), {n: t.block.gpu_time_ns for n, t in tenants}))
                time.sleep(every_s)

        self._sampler = threading.Thread(target=run, daemon=True)
        self._sampler.start()

    def accounted(self, name: str, at: float) -> float:
        """Accounted device seconds of ``name`` at time ``at`` (the last sample not after it)."""
        best = 0
        for ts, values in self.samples:
            if ts > at:
                break
            best = values.get(name, 0)
        return best / 1e9

    def close(self) -> None:
        self._stop_sampler.set()
        if self._sampler is not None:
            self._sampler.join(5)
        for t in self.tenants.values():
            t.block.close()
            try:
                self.sup.client.evict(None, t.name)
            except Exception:  # noqa: BLE001 - the supervisor stops right after anyway
                pass


def run_for(phase: Phase, loops: Sequence[Callable[[], None]], stop: threading.Event, seconds: float,
             warm_s: float = 1.0, at_start: Callable[[], None] | None = None) -> tuple[float, float]:
    """Start the loops, measure ``seconds`` after ``warm_s``; (t0, t1) of the measured span
    (``at_start`` runs right before t0: a counter's first reading)."""
    threads = phase.start(loops)
    time.sleep(warm_s)
    if at_start is not None:
        at_start()
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    stop.set()
    for th in threads:
        th.join(600)
    return t0, t1


def one_s_windows(t0: float, t1: float, width: float = 1.0) -> list[tuple[float, float]]:
    out = []
    t = t0
    while t + width <= t1 + 1e-9:
        out.append((t, t + width))
        t += width
    return out


def _jain(values: Sequence[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 0.0


# ----------------------------------------------------------------- phases


# what each scenario returns: read back by main() for the report and its targets, and by _plot


class SoloRounds(TypedDict):
    rates: dict[str, list[float]]  # "on"/"off": GEMMs/s of each block
    accounted_s: dict[str, list[float]]
    pair_ratios: list[float]  # on / off of each pair of neighbouring blocks (:func:`pair_ratios`)


class SplitWindow(TypedDict):
    t: float
    work_share: float  # the weight-7 tenant's
    time_share: float
    device_busy: float


class IdleResult(TypedDict):
    rate_after_one_quantum: float


class SplitResult(TypedDict):
    solo_work_rate: float
    solo_device_rate: float
    solo_work_rates: list[float]
    together_rates: list[float]
    together_ratio: float  # the median of the pairs' ratios
    together_pair_ratios: list[float]  # together / alone of each pair of neighbouring blocks
    work: tuple[float, float]  # (weight 7, weight 3)
    accounted_s: tuple[float, float]
    together_rate: float
    windows: list[SplitWindow]
    idle: IdleResult
    light_waits_s: list[float]
    #: where "together" loses against "alone", per round (medians): the lease changing hands per wall
    #: s (handoffs + steals), the device busy (accounted s per wall s), and GEMMs per accounted device
    #: s (the stub's device is this host's CPU: more processes beside it slow each GEMM)
    solo_handovers: float
    together_handovers: float
    solo_busy: float
    together_busy: float
    solo_per_device_s: float
    together_per_device_s: float
    #: the device idle at handovers (from a grant another process made to the grantee's first chunk)
    #: per wall s, and per handover timed (us)
    solo_gap: float
    together_gap: float
    solo_gap_us: float
    together_gap_us: float
    #: the device held idle by a holder before a steal, per wall s
    solo_held_idle: float
    together_held_idle: float


class EightWindow(TypedDict):
    t: float
    time_shares: list[float]


class EightResult(TypedDict):
    work: list[float]
    accounted_s: list[float]
    windows: list[EightWindow]


class CapResult(TypedDict):
    device_share: float
    work_rate: float
    throttled: int


def abba(pairs: int) -> list[int]:
    """The kinds of ``pairs`` pairs of blocks in the order 0 1 1 0 0 1 1 0 ...: each pair one block of
    each kind, the order alternating pair by pair, so that a drift of the host's load across a pair
    favours neither kind over the run."""
    return [k for p in range(pairs) for k in ((0, 1) if p % 2 == 0 else (1, 0))]


class PairBlock(TypedDict):
    """One measured block of a paired row: its kind (1: the side measured, 0: its baseline - the key
    :func:`pair_ratios` pairs by), its span (monotonic s) and GEMMs/s, and what ``probe`` read."""

    device: int
    t0: float
    t1: float
    rate: float
    probe: dict[str, float]


def paired_blocks(valves: Mapping[int, Valve], rate: Mapping[int, Callable[[float, float], float]], pairs: int,
                  block_s: float, settle_s: float = 0.25, warm_s: float = 0.5,
                  probe: Callable[[], Callable[[float], dict[str, float]]] | None = None) -> list[PairBlock]:
    """Blocks of ``block_s`` of two kinds of load in :func:`abba` order, each kind's loops paused
    (its valve closed) while the other runs - never restarted. A block's first ``settle_s`` is not
    measured (the queues and the lease settle into the new load). ``probe()`` runs at a block's
    start and returns what to call at its end with the block's wall seconds (counters read across
    the block). Each kind runs ``warm_s`` first, unmeasured (its loops' first runs warm BLAS). The
    rates are taken once every loop has paused (runs that straddle a block's end are counted in
    proportion, :meth:`Tenant.work_between`)."""
    for kind in (0, 1):
        valves[kind].open()
        time.sleep(warm_s)
        valves[kind].close()
    blocks: list[PairBlock] = []
    for kind in abba(pairs):
        valves[kind].open()
        time.sleep(settle_s)
        end = probe() if probe is not None else None
        t0 = time.monotonic()
        time.sleep(block_s)
        t1 = time.monotonic()
        got = end(t1 - t0) if end is not None else {}
        valves[kind].close()
        blocks.append({"device": kind, "t0": t0, "t1": t1, "rate": 0.0, "probe": got})
    for b in blocks:
        b["rate"] = rate[b["device"]](b["t0"], b["t1"])
    return blocks


def _valved(phase: Phase, loops: Sequence[Tenant]) -> tuple[Valve, list[threading.Thread]]:
    """One valve for a GEMM loop per entry of ``loops`` (a tenant twice: two client threads)."""
    valve = Valve()
    return valve, phase.start([phase.valved_gemm_loop(t, valve) for t in loops])


def _stop(valves: Sequence[Valve], threads: Sequence[threading.Thread]) -> None:
    for v in valves:
        v.stop()
    for th in threads:
        th.join(600)


def _solo_rounds(on: SupervisorHandle, off: SupervisorHandle, args: argparse.Namespace) -> SoloRounds:
    """The same tenant alone (two instances, two client threads) on the supervisor with the
    scheduler on and on the one with it off, in short paired blocks (:func:`paired_blocks`)."""
    phases = {"on": Phase(on, args.n, args.reps), "off": Phase(off, args.n, args.reps)}
    valves: list[Valve] = []
    threads: list[threading.Thread] = []
    try:
        ts = {key: phase.add("solo", gpu_time_weight=7.0) for key, phase in phases.items()}
        for key in ("off", "on"):  # kind 0: off (the baseline), 1: on
            v, th = _valved(phases[key], [ts[key], ts[key]])
            valves.append(v)
            threads += th

        def rate(key: str) -> Callable[[float, float], float]:
            return lambda t0, t1: ts[key].work_between(t0, t1) / (t1 - t0)

        def probe() -> Callable[[float], dict[str, float]]:
            g0 = {key: t.block.gpu_time_ns for key, t in ts.items()}
            return lambda wall: {key: (t.block.gpu_time_ns - g0[key]) / 1e9 for key, t in ts.items()}

        blocks = paired_blocks({0: valves[0], 1: valves[1]}, {0: rate("off"), 1: rate("on")}, args.pairs,
                               args.pair_seconds, probe=probe)
        _stop(valves, threads)
        valves = []
    finally:
        _stop(valves, threads)
        for phase in phases.values():
            phase.close()
    kinds = {0: "off", 1: "on"}
    return {"rates": {key: [b["rate"] for b in blocks if kinds[b["device"]] == key] for key in ("on", "off")},
            "accounted_s": {key: [b["probe"][key] for b in blocks if kinds[b["device"]] == key]
                            for key in ("on", "off")},
            "pair_ratios": pair_ratios(blocks)}


def _split(sup: SupervisorHandle, args: argparse.Namespace) -> SplitResult:
    """7:3 in short blocks paired with one tenant alone (:func:`paired_blocks`: the "together"
    baseline under the same load), then the weight-3 tenant stops (idle), then a light tenant beside
    a hog, all on one supervisor.

    "Alone" is a tenant of weight 7 with four instances driven by four client threads: as many
    worker processes, guest threads and client threads as 7:3 runs (two instances of each tenant).
    The stub's device is this host's CPU, so every process beside it slows each GEMM: a baseline
    of two processes measured 2.5 % more GEMMs per accounted device second than 7:3's four, at the
    same device busy time - a loss of the stub's device, not of the scheduler (the split's
    diagnosis line reports both figures)."""
    phase = Phase(sup, args.n, args.reps)
    valves: list[Valve] = []
    threads: list[threading.Thread] = []
    try:
        a = phase.add("w7", gpu_time_weight=7.0)
        b = phase.add("w3", gpu_time_weight=3.0)
        solo = phase.add("alone", instances=4, gpu_time_weight=7.0)
        phase.sample_every()
        board = _board(sup)
        try:
            for loops in ([solo] * 4, [a, a, b, b]):  # kind 0: alone (the baseline), 1: together
                v, started = _valved(phase, loops)
                valves.append(v)
                threads += started

            def probe() -> Callable[[float], dict[str, float]]:
                h0, g0 = _handovers(board), _gap(board)

                def end(wall: float) -> dict[str, float]:
                    idle, each, held = _gap_rates(g0, _gap(board), wall)
                    return {"handovers": (_handovers(board) - h0) / wall, "gap": idle, "gap_us": each,
                            "held_idle": held}

                return end

            blocks = paired_blocks({0: valves[0], 1: valves[1]},
                                   {0: lambda t0, t1: solo.work_between(t0, t1) / (t1 - t0),
                                    1: lambda t0, t1: (a.work_between(t0, t1) + b.work_between(t0, t1)) / (t1 - t0)},
                                   args.pairs, args.pair_seconds, probe=probe)
            _stop(valves, threads)
            valves = []
        finally:
            if board is not None:
                board.close()
        time.sleep(0.03)  # the sampler's next reading is past the last block's end

        def dev(names: Sequence[str], t0: float, t1: float) -> float:
            return sum(phase.accounted(n, t1) - phase.accounted(n, t0) for n in names) / (t1 - t0)

        alone_blocks = [x for x in blocks if x["device"] == 0]
        together_blocks = [x for x in blocks if x["device"] == 1]
        solo_work = [x["rate"] for x in alone_blocks]
        solo_dev = [dev(["alone"], x["t0"], x["t1"]) for x in alone_blocks]
        together = [x["rate"] for x in together_blocks]
        together_dev = [dev(["w7", "w3"], x["t0"], x["t1"]) for x in together_blocks]
        segments = [(x["t0"], x["t1"]) for x in together_blocks]
        ratios = pair_ratios(blocks)
        windows: list[SplitWindow] = []
        for s0, s1 in segments:
            for w0, w1 in one_s_windows(s0, s1):
                wa, wb = a.work_between(w0, w1), b.work_between(w0, w1)
                aa = phase.accounted("w7", w1) - phase.accounted("w7", w0)
                ab = phase.accounted("w3", w1) - phase.accounted("w3", w0)
                windows.append({"t": round(w0 - segments[0][0], 3), "work_share": wa / (wa + wb) if wa + wb else 0.0,
                                "time_share": aa / (aa + ab) if aa + ab else 0.0, "device_busy": (aa + ab) / (w1 - w0)})
        work = (sum(a.work_between(*seg) for seg in segments), sum(b.work_between(*seg) for seg in segments))
        acc = (sum(phase.accounted("w7", s1) - phase.accounted("w7", s0) for s0, s1 in segments),
               sum(phase.accounted("w3", s1) - phase.accounted("w3", s0) for s0, s1 in segments))
        # idle: both run, then w3 stops; w7's accounted rate one quantum after w3's last chunk
        stop_a, stop_b = threading.Event(), threading.Event()
        idle_threads = phase.start([phase.gemm_loop(a, stop_a) for _ in range(2)]
                                   + [phase.gemm_loop(b, stop_b) for _ in range(2)])
        time.sleep(1.5)
        stop_b.set()
        for th in idle_threads[2:]:
            th.join(600)
        time.sleep(1.0 + 21 * args.quantum)
        stop_a.set()
        for th in idle_threads[:2]:
            th.join(600)
        final_b = phase.samples[-1][1]["w3"]
        last_b = min(ts for ts, v in phase.samples if v["w3"] >= final_b)  # its last chunk ended by then
        q = args.quantum
        span = 20 * q
        after = (phase.accounted("w7", last_b + q + span) - phase.accounted("w7", last_b + q)) / span
        # light tenant beside a hog
        light = phase.add("light", instances=1)
        stop = threading.Event()
        run_for(phase, [phase.gemm_loop(a, stop) for _ in range(2)] + [phase.light_loop(light, stop, 0.010, 64)],
                 stop, args.seconds)

        def probed(key: str, kind: int) -> float:
            return _median_or_0([x["probe"][key] for x in blocks if x["device"] == kind])

        return {
            "solo_work_rate": statistics.median(solo_work), "solo_device_rate": statistics.median(solo_dev),
            "solo_work_rates": solo_work, "together_rates": together,
            "together_ratio": _median_or_0(ratios), "together_pair_ratios": ratios,
            "work": work, "accounted_s": acc, "together_rate": statistics.median(together), "windows": windows,
            "idle": {"rate_after_one_quantum": after},
            "light_waits_s": light.waits,
            "solo_handovers": probed("handovers", 0), "together_handovers": probed("handovers", 1),
            "solo_busy": statistics.median(solo_dev), "together_busy": statistics.median(together_dev),
            "solo_per_device_s": _median_or_0([w / d for w, d in zip(solo_work, solo_dev) if d > 0]),
            "together_per_device_s": _median_or_0([w / d for w, d in zip(together, together_dev) if d > 0]),
            "solo_gap": probed("gap", 0), "together_gap": probed("gap", 1),
            "solo_gap_us": probed("gap_us", 0), "together_gap_us": probed("gap_us", 1),
            "solo_held_idle": probed("held_idle", 0), "together_held_idle": probed("held_idle", 1),
        }
    finally:
        _stop(valves, threads)
        phase.close()


def _eight(sup: SupervisorHandle, args: argparse.Namespace) -> EightResult:
    phase = Phase(sup, args.n, args.reps)
    try:
        ts = [phase.add(f"e{i}", instances=1) for i in range(8)]
        phase.sample_every(0.01)
        stop = threading.Event()
        # eight workers compile and warm up one after the other on a small host: measure once all run
        t0, t1 = run_for(phase, [phase.gemm_loop(t, stop) for t in ts], stop, args.seconds, warm_s=3.0)
        work = [t.work_between(t0, t1) for t in ts]
        acc = [phase.accounted(t.name, t1) - phase.accounted(t.name, t0) for t in ts]
        windows: list[EightWindow] = []
        for w0, w1 in one_s_windows(t0, t1):
            got = [phase.accounted(t.name, w1) - phase.accounted(t.name, w0) for t in ts]
            total = sum(got) or 1.0
            windows.append({"t": round(w0 - t0, 3), "time_shares": [g / total for g in got]})
        return {"work": work, "accounted_s": acc, "windows": windows}
    finally:
        phase.close()


def _cap(sup: SupervisorHandle, args: argparse.Namespace) -> CapResult:
    phase = Phase(sup, args.n, args.reps)
    try:
        t = phase.add("capped", gpu_time_cap=0.25)
        phase.sample_every(0.01)
        stop = threading.Event()
        t0, t1 = run_for(phase, [phase.gemm_loop(t, stop) for _ in range(2)], stop, args.seconds)
        acc = phase.accounted("capped", t1) - phase.accounted("capped", t0)
        return {"device_share": acc / (t1 - t0), "work_rate": t.work_between(t0, t1) / (t1 - t0),
                "throttled": t.block.snapshot().gpu_throttled}
    finally:
        phase.close()


# ----------------------------------------------------------------- mixes


class MixGap(TypedDict):
    gap_ms: float
    spin: int
    control_rates: list[float]  # heavy GEMMs/s beside the chatty loop without device ops
    mix_rates: list[float]  # ... with them
    ratio: float  # the median of the pairs' ratios (:func:`pair_ratios`)
    pair_ratios: list[float]  # mix / control rate of each pair of neighbouring blocks
    ratio_ci: tuple[float, float]  # a 95 % confidence interval of that median (:func:`median_ci`)
    chatty_ops: int
    chatty_wait_bins: list[int]  # per-op waits (GPU_WAIT_BUCKETS_S and +Inf) over the mix rounds
    chatty_p99_ms: float  # the upper edge of the bin holding the 99th percentile
    busy_control: float  # accounted device s per wall s
    busy_mix: float
    handovers_control: float  # the lease changing hands (handoffs + steals) per wall s, median of rounds
    handovers_mix: float
    idle_at_handovers_mix: float  # the device idle from each grant to its grantee's first chunk, per wall s
    #: the measured spans of the rounds (monotonic ns), control and mix: the work trace's windows
    windows_control: list[tuple[int, int]]
    windows_mix: list[tuple[int, int]]
    #: from the work trace (:func:`busy_while_work`, the rounds of each kind pooled; None: nothing
    #: traced): the device busy while any tenant had work, the device in a launch while any had work
    #: (busy plus, on the stub, the device thread waiting for a core), and the share of the wall
    #: time any tenant had work
    busy_while_work_control: float | None
    busy_while_work_mix: float | None
    #: the same with the stub executors' rows as placed (``WorkTrace.CORE`` as ``BUSY``: not laid end
    #: to end, two executors sharing the device's core overlapping - what the bench reported before)
    busy_as_placed_control: float | None
    busy_as_placed_mix: float | None
    launched_while_work_control: float | None
    launched_while_work_mix: float | None
    any_work_control: float | None
    any_work_mix: float | None
    #: where the device was not busy while any tenant had work, by cause (:func:`idle_causes`)
    idle_causes_control: dict[str, dict[str, float]] | None
    idle_causes_mix: dict[str, dict[str, float]] | None


class KResult(TypedDict):
    k: int
    accounted_s: list[float]  # the k instances' tenant, then the single one
    tenant_share: float  # the k-instance tenant's share of the accounted time
    busy: float  # accounted device s per wall s (below ~0.9 the host's CPUs, not the lease, decide)


def _p99_ms(bins: Sequence[int]) -> float:
    """The upper edge (ms) of the histogram bin that holds the 99th percentile (inf past the last)."""
    from shared.quota import GPU_WAIT_BUCKETS_S

    total = sum(bins)
    if not total:
        return float("inf")
    seen = 0
    for i, c in enumerate(bins):
        seen += c
        if seen >= 0.99 * total:
            return GPU_WAIT_BUCKETS_S[i] * 1e3 if i < len(GPU_WAIT_BUCKETS_S) else float("inf")
    return float("inf")


def _chatty_loop(phase: Phase, t: Tenant, stop: threading.Event, ops: int, spin: int, device: int,
                 counts: list[int]) -> Callable[[], None]:
    def loop() -> None:
        client = phase.sup.connect(timeout_s=600.0)
        try:
            while not stop.is_set():
                done = client.run_wasm(t.cap, t.digest, "chatty", [ops, spin, device], fuel=1 << 62).results[0]
                counts.append(int(done))
        finally:
            client.close()

    return loop


def _calibrate_spin(phase: Phase, t: Tenant) -> float:
    """Guest arithmetic iterations per ms on this host (no device op; the median of 5 runs)."""
    client = phase.sup.client
    spin, ops = 200_000, 20
    client.run_wasm(t.cap, t.digest, "chatty", [1, 1, 0], fuel=1 << 62)
    per_ms = []
    for _ in range(5):
        t0 = time.monotonic()
        client.run_wasm(t.cap, t.digest, "chatty", [ops, spin, 0], fuel=1 << 62)
        t1 = time.monotonic()
        client.run_wasm(t.cap, t.digest, "chatty", [ops, 0, 0], fuel=1 << 62)  # the run's own cost
        t2 = time.monotonic()
        per_ms.append(ops * spin / max(1e-6, ((t1 - t0) - (t2 - t1)) * 1e3))
    return statistics.median(per_ms)


def _board(sup: SupervisorHandle) -> GpuTimeBoard | None:
    """Device 0's lease board, attached read-only (its handoff and steal counters), or None."""
    for dev in sup.client.status().devices:
        segment = dev.gpu_time.get("segment") if dev.index == 0 and dev.gpu_time else None
        if isinstance(segment, str):
            return GpuTimeBoard.attach(segment, tenant_slot=None)
    return None


def _median_or_0(values: list[float]) -> float:
    """The median, 0.0 for no values (a round in which nothing was accounted: reported, not a crash)."""
    return statistics.median(values) if values else 0.0


def _gap(board: GpuTimeBoard | None) -> tuple[int, int, int]:
    """The board's summed handover gap (ns, handovers timed, held idle before steals); zeros without a board."""
    return (0, 0, 0) if board is None else board.handover_gap()


def _gap_rates(before: tuple[int, int, int], after: tuple[int, int, int],
               wall_s: float) -> tuple[float, float, float]:
    """(device idle at handovers per wall s, us per handover, device held idle before steals per
    wall s) between two readings of :func:`_gap`."""
    ns, n, held = (x - y for x, y in zip(after, before))
    wall = max(wall_s, 1e-9)
    return ns / 1e9 / wall, ns / 1e3 / n if n else 0.0, held / 1e9 / wall


def _handovers(board: GpuTimeBoard | None) -> int:
    if board is None:
        return 0
    snap = board.snapshot()
    return snap.handoffs + snap.steals


class MixBlock(TypedDict):
    """One measured block of a gap: the chatty loop with (1) or without (0) its device ops."""

    device: int
    window: tuple[int, int]  # monotonic ns
    rate: float  # the heavy tenant's GEMMs/s
    busy: float  # accounted device s per wall s, both tenants
    handovers: float  # per wall s
    idle: float  # the device idle at handovers per wall s (the board's handover gap)
    bins: list[int]  # the chatty op's wait histogram over the block
    chatty_waits: int


def _mix_blocks(phase: Phase, heavy: Tenant, chatty: Tenant, board: GpuTimeBoard | None, order: Sequence[int],
                block_s: float, ops: int, spin: int) -> list[MixBlock]:
    """The heavy tenant's two loops run throughout; the chatty loop runs blocks of ``block_s`` in
    ``order``, each with its device ops (1) or the same host call with a count of 0 (0, the control).
    A block's first chatty run (~0.25 s) is not measured: the mode changes at a run's start, and the
    queues and the lease settle into it. Blocks of each kind are paired with their neighbours
    (:func:`pair_ratios`): the host's load drifts over seconds to minutes, so a control measured a
    few seconds from its mix block shares most of its load, where one round of each, tens of
    seconds apart, did not."""
    heavy.runs.clear()
    stop = threading.Event()
    blocks: list[MixBlock] = []

    def chatty_loop() -> None:
        client = phase.sup.connect(timeout_s=600.0)
        try:
            for device in order:
                client.run_wasm(chatty.cap, chatty.digest, "chatty", [ops, spin, device], fuel=1 << 62)  # settle
                before = chatty.block.snapshot()
                h0, g0 = _handovers(board), _gap(board)
                t0 = time.monotonic()
                while time.monotonic() - t0 < block_s:
                    client.run_wasm(chatty.cap, chatty.digest, "chatty", [ops, spin, device], fuel=1 << 62)
                t1 = time.monotonic()
                h1, g1 = _handovers(board), _gap(board)
                after = chatty.block.snapshot()
                time.sleep(0.03)  # the sampler's next reading (every 10 ms) is past t1
                acc = sum(phase.accounted(n, t1) - phase.accounted(n, t0) for n in ("heavy", "chatty"))
                blocks.append({"device": device, "window": (round(t0 * 1e9), round(t1 * 1e9)),
                               "rate": 0.0, "busy": acc / (t1 - t0), "handovers": (h1 - h0) / (t1 - t0),
                               "idle": _gap_rates(g0, g1, t1 - t0)[0],
                               "bins": [a - b for a, b in zip(after.gpu_wait_bins, before.gpu_wait_bins)],
                               "chatty_waits": after.gpu_waits - before.gpu_waits})
        finally:
            client.close()
            stop.set()

    loops = [phase.gemm_loop(heavy, stop) for _ in range(2)]
    threads = phase.start(loops)
    time.sleep(0.5)
    chatty_thread = phase.start([chatty_loop])
    for th in chatty_thread + threads:
        th.join(3600)
    for b in blocks:
        t0, t1 = b["window"][0] / 1e9, b["window"][1] / 1e9
        b["rate"] = heavy.work_between(t0, t1) / (t1 - t0)
    return blocks


def pair_ratios(blocks: Sequence[Mapping[str, object]]) -> list[float]:
    """Mix rate over control rate for each pair of neighbouring blocks (blocks 0-1, 2-3, ...: one of
    each kind, in either order); a pair without both kinds, or with a zero control, is left out."""
    out = []
    for i in range(0, len(blocks) - 1, 2):
        pair = {int(cast(int, b["device"])): float(cast(float, b["rate"])) for b in blocks[i:i + 2]}
        if set(pair) == {0, 1} and pair[0] > 0:
            out.append(pair[1] / pair[0])
    return out


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median (order statistics, the sign test's
    binomial): the widest [x_(j), x_(n+1-j)] with P(Binomial(n, 1/2) < j) <= (1 - level) / 2 - for
    fewer than six values no such j exists and the range (min, max) is returned (its coverage is
    then 1 - 2^(1-n)). (0, 0) for no values."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return 0.0, 0.0
    tail = (1 - level) / 2
    j, cum = 0, 0.0
    while True:
        p = math.comb(n, j) / 2 ** n
        if cum + p > tail:
            break
        cum += p
        j += 1
    # cum = P(X < j) <= tail: the interval [x_(j), x_(n+1-j)] (1-indexed); j = 0: no such interval
    j = max(j, 1)
    return xs[j - 1], xs[n - j]


def _mix(sup: SupervisorHandle, args: argparse.Namespace) -> tuple[list[MixGap], KResult]:
    from shared.quota import GPU_WAIT_BUCKETS_S

    phase = Phase(sup, args.n, args.reps)
    board: GpuTimeBoard | None = None
    try:
        heavy = phase.add("heavy", gpu_time_weight=1.0)
        chatty = phase.add("chatty", instances=1, gpu_time_weight=1.0, wasm_fuel=1 << 50)
        board = _board(sup)
        phase.sample_every(0.01)
        per_ms = _calibrate_spin(phase, chatty)
        gaps: list[MixGap] = []
        block_s = args.block_seconds
        # as much measured time of each kind as rounds x seconds, in blocks alternating A B B A ...
        pairs = max(1, round(args.rounds * args.seconds / block_s))
        order = abba(pairs)
        for gap_ms in args.gaps:
            spin = max(1, round(per_ms * gap_ms))
            ops = max(10, round(250 / (gap_ms + 0.05)))  # runs of ~0.25 s: the lease's run-end release is rare
            blocks = _mix_blocks(phase, heavy, chatty, board, order, block_s, ops, spin)
            rates = {d: [b["rate"] for b in blocks if b["device"] == d] for d in (0, 1)}
            busy = {d: [b["busy"] for b in blocks if b["device"] == d] for d in (0, 1)}
            hands = {d: [b["handovers"] for b in blocks if b["device"] == d] for d in (0, 1)}
            idle = [b["idle"] for b in blocks if b["device"] == 1]
            windows = {d: [b["window"] for b in blocks if b["device"] == d] for d in (0, 1)}
            bins = [sum(col) for col in zip(*(b["bins"] for b in blocks if b["device"] == 1))] or (
                [0] * (len(GPU_WAIT_BUCKETS_S) + 1))
            chatty_ops = sum(b["chatty_waits"] for b in blocks if b["device"] == 1)
            ratios = pair_ratios(blocks)
            lo, hi = median_ci(ratios)
            gaps.append({"gap_ms": gap_ms, "spin": spin, "control_rates": rates[0], "mix_rates": rates[1],
                         "ratio": statistics.median(ratios) if ratios else 0.0, "pair_ratios": ratios,
                         "ratio_ci": (lo, hi),
                         "chatty_ops": chatty_ops, "chatty_wait_bins": bins, "chatty_p99_ms": _p99_ms(bins),
                         "busy_control": _median_or_0(busy[0]), "busy_mix": _median_or_0(busy[1]),
                         "handovers_control": _median_or_0(hands[0]),
                         "handovers_mix": _median_or_0(hands[1]), "idle_at_handovers_mix": _median_or_0(idle),
                         "windows_control": windows[0], "windows_mix": windows[1],
                         "busy_while_work_control": None, "busy_while_work_mix": None,
                         "busy_as_placed_control": None, "busy_as_placed_mix": None,
                         "launched_while_work_control": None, "launched_while_work_mix": None,
                         "any_work_control": None, "any_work_mix": None,
                         "idle_causes_control": None, "idle_causes_mix": None})
    finally:
        if board is not None:
            board.close()
        phase.close()
    k = args.k
    phase = Phase(sup, args.n, args.reps)
    try:
        many = phase.add("k-inst", instances=k, gpu_time_weight=1.0)
        one = phase.add("one-inst", instances=1, gpu_time_weight=1.0)
        phase.sample_every(0.01)
        stop = threading.Event()
        # two client threads per instance: each instance always has its next run queued
        loops = [phase.gemm_loop(many, stop) for _ in range(2 * k)] + [phase.gemm_loop(one, stop) for _ in range(2)]
        t0, t1 = run_for(phase, loops, stop, args.seconds, warm_s=2.0)
        split = [phase.accounted(t.name, t1) - phase.accounted(t.name, t0) for t in (many, one)]
        kres: KResult = {"k": k, "accounted_s": split, "tenant_share": split[0] / (sum(split) or 1.0),
                         "busy": sum(split) / (t1 - t0)}
    finally:
        phase.close()
    return gaps, kres


def _spans(intervals: Spans) -> NDArray[np.int64]:
    """Intervals as an (n, 2) int64 array (a list of pairs, or one already)."""
    import numpy

    arr = numpy.asarray(intervals, dtype=numpy.int64)
    return arr.reshape(-1, 2)


def _union(intervals: Spans) -> NDArray[np.int64]:
    """:func:`union` as an array, vectorised: a full ``--mix`` run traces millions of intervals."""
    import numpy

    arr = _spans(intervals)
    arr = arr[arr[:, 1] > arr[:, 0]]
    if not len(arr):
        return arr
    arr = arr[numpy.argsort(arr[:, 0], kind="stable")]
    reach = numpy.maximum.accumulate(arr[:, 1])  # the furthest end so far
    new = numpy.empty(len(arr), dtype=bool)
    new[0] = True
    new[1:] = arr[1:, 0] > reach[:-1]  # a gap before it: a new span starts (touching ones merge)
    firsts = numpy.flatnonzero(new)
    lasts = numpy.append(firsts[1:] - 1, len(arr) - 1)
    return numpy.stack([arr[firsts, 0], reach[lasts]], axis=1)


def _pairs(arr: NDArray[np.int64]) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in arr.tolist()]


def union(intervals: Spans) -> list[tuple[int, int]]:
    """The union of ``intervals`` ((start, end), any order; empty ones dropped) as sorted, disjoint
    intervals (touching ones merged)."""
    return _pairs(_union(intervals))


def covered(spans: Spans, t0: int, t1: int) -> int:
    """How much of [t0, t1) the sorted, disjoint ``spans`` (a :func:`union`) cover."""
    import numpy

    arr = _spans(spans)
    if not len(arr) or t1 <= t0:
        return 0
    return int(numpy.maximum(0, numpy.minimum(arr[:, 1], t1) - numpy.maximum(arr[:, 0], t0)).sum())


def _intersect(a: NDArray[np.int64], b: NDArray[np.int64]) -> NDArray[np.int64]:
    """:func:`intersect` as an array, vectorised: every piece of an intersection of two disjoint
    sorted unions starts at a start of one and ends at the first end after it of either."""
    import numpy

    if not len(a) or not len(b):
        return numpy.empty((0, 2), dtype=numpy.int64)
    out = []
    for x, y in ((a, b), (b, a)):
        # each span of x against the span of y holding its start (the last y starting at or before it)
        i = numpy.searchsorted(y[:, 0], x[:, 0], side="right") - 1
        ok = i >= 0
        xs, ys = x[ok], y[i[ok]]
        hit = ys[:, 1] > xs[:, 0]
        out.append(numpy.stack([xs[hit, 0], numpy.minimum(xs[hit, 1], ys[hit, 1])], axis=1))
        # ... and the spans of y that start inside a span of x (strictly after its start)
    both = numpy.concatenate(out)
    return _union(both)


def intersect(a: Spans, b: Spans) -> list[tuple[int, int]]:
    """The intersection of two unions (sorted, disjoint), sorted and disjoint."""
    return _pairs(_intersect(_union(a), _union(b)))


class WhileWork(TypedDict):
    any_work: float | None  # the share of the wall time any tenant had work
    busy: float | None  # |busy ∩ work| / |work|: the device busy while any tenant had work
    launched: float | None  # |launch ∩ work| / |work|: the device in a launch (None: no launch rows)


@dataclass
class WorkSpans:
    """The unions :func:`busy_while_work` measures, made once for every window of a run."""

    work: NDArray[np.int64]
    busy: NDArray[np.int64]  # busy ∩ work
    launched: NDArray[np.int64] | None  # launch ∩ work (None: no launch rows: cuda)


def end_to_end(intervals: Spans) -> NDArray[np.int64]:
    """Busy rows that ran on one CPU (``WorkTrace.CORE``: the stub's executors on their device's
    core), laid end to end: no two ran at once, but each is its CPU time placed at its launch's end,
    so two executors that shared the core overlap as placed and their union counts less than the
    core ran. From the latest end back, each row ends at its own end or where the next one was laid
    to begin, whichever is earlier; its length stays its CPU time (vectorised: with rows by
    descending end and P the CPU time laid before a row, a row ends at min over the rows laid before
    it and itself of (end + P) less its own P)."""
    import numpy

    arr = _spans(intervals)
    arr = arr[arr[:, 1] > arr[:, 0]]
    if not len(arr):
        return arr
    arr = arr[numpy.argsort(-arr[:, 1], kind="stable")]
    length = arr[:, 1] - arr[:, 0]
    before = numpy.concatenate([[0], numpy.cumsum(length)[:-1]])  # laid after it in time, before it here
    end = numpy.minimum.accumulate(arr[:, 1] + before) - before
    return numpy.stack([end - length, end], axis=1)[::-1]


def _busy_rows(rows: Mapping[int, Spans]) -> NDArray[np.int64]:
    """The device's busy rows of every worker: BUSY as placed, CORE laid end to end (:func:`end_to_end`)."""
    import numpy

    return numpy.concatenate([_spans(rows.get(WorkTrace.BUSY, [])), end_to_end(rows.get(WorkTrace.CORE, []))])


def work_spans(rows: Mapping[int, Spans]) -> WorkSpans:
    """Each kind's union over all workers (:func:`shared.gpu_time.read_work_trace`), intersected with
    the work's (busy: :func:`_busy_rows`)."""
    work = _union(rows.get(WorkTrace.WORK, []))
    launches = _union(rows.get(WorkTrace.LAUNCH, []))
    return WorkSpans(work, _intersect(work, _union(_busy_rows(rows))),
                     _intersect(work, launches) if len(launches) else None)


def busy_while_work(rows: Mapping[int, Spans] | WorkSpans, windows: Sequence[tuple[int, int]]) -> WhileWork:
    """The issue's own measure over ``windows`` (monotonic ns spans, pooled), from every worker's
    intervals (or their :func:`work_spans`): the device busy while any tenant had work, |busy ∩
    work| / |work|; the same for launches; the share of the wall time with work. All None when no
    work fell in the windows (nothing traced)."""
    spans = rows if isinstance(rows, WorkSpans) else work_spans(rows)
    w = sum(covered(spans.work, t0, t1) for t0, t1 in windows)
    wall = sum(t1 - t0 for t0, t1 in windows)
    if not w or wall <= 0:
        return {"any_work": None, "busy": None, "launched": None}
    launched = spans.launched
    return {"any_work": w / wall, "busy": sum(covered(spans.busy, t0, t1) for t0, t1 in windows) / w,
            "launched": None if launched is None else sum(covered(launched, t0, t1) for t0, t1 in windows) / w}


#: the causes :func:`idle_causes` sorts the device's idle time while any tenant had work into
IDLE_CAUSES = ("in a launch, not busy", "between one worker's ops", "a worker's gap in its own work",
               "a handover inside the giver's work", "a handover at the giver's work end", "no launch within 50 ms")


def read_work_trace_by_worker(directory: str) -> dict[int, dict[int, NDArray[np.int64]]]:
    """Every worker's :class:`shared.gpu_time.WorkTrace` rows in ``directory`` (``<pid>.work``), by
    pid and kind, as :func:`shared.gpu_time.read_work_trace` reads them all together."""
    import glob

    import numpy

    out: dict[int, dict[int, NDArray[np.int64]]] = {}
    for path in glob.glob(os.path.join(directory, "*.work")):
        try:
            pid = int(os.path.basename(path).split(".")[0])
        except ValueError:
            continue
        with open(path, "rb") as f:
            data = f.read()
        rows = numpy.frombuffer(data[:len(data) // 24 * 24], dtype="<i8").reshape(-1, 3).astype(numpy.int64)
        out[pid] = {kind: rows[(rows[:, 0] == kind) & (rows[:, 2] >= rows[:, 1])][:, 1:]
                    for kind in (WorkTrace.WORK, WorkTrace.BUSY, WorkTrace.LAUNCH, WorkTrace.CORE)}
    return out


def idle_causes(by_worker: Mapping[int, Mapping[int, Spans]],
                windows: Sequence[tuple[int, int]]) -> dict[str, dict[str, float]]:
    """Where the device was not busy while any tenant had work, over ``windows`` (pooled), by cause:
    for each of :data:`IDLE_CAUSES` its share of the work time, its stretches per wall second and
    their mean (us). A launch without busy time is the device thread waiting for a core (the stub:
    its device is that CPU). Each stretch of work outside every launch is named by the launches on
    either side (the last to end before it, the first to start after it): one worker's both -
    *between its ops* (its own thread's time from one launch to the next), or *a gap in its own
    work* when its work ended or began in the stretch (another worker's work open meanwhile: the
    device held, or not yet passed on, across it); two workers' - *a handover*, at the giver's work
    end when the giver's work ended in it (a run's end, a stretch's), else inside it (a claim
    served, a quantum's end). Empty without work in the windows (nothing traced) or without launch
    rows (cuda's launches are asynchronous: not traced)."""
    import numpy

    def kind(k: int) -> NDArray[np.int64]:
        parts = [_spans(rows.get(k, [])) for rows in by_worker.values()]
        return numpy.concatenate(parts) if parts else numpy.empty((0, 2), numpy.int64)

    work = _intersect(_union(kind(WorkTrace.WORK)), _union(_spans(list(windows))))
    total = int((work[:, 1] - work[:, 0]).sum()) if len(work) else 0
    wall = sum(t1 - t0 for t0, t1 in windows)
    if not total or wall <= 0:
        return {}
    launches = _union(kind(WorkTrace.LAUNCH))
    if not len(launches):
        return {}  # (cuda: no host-synchronous launches traced, nothing to name a stretch by)
    busy = _intersect(_union(_busy_rows({k: kind(k) for k in (WorkTrace.BUSY, WorkTrace.CORE)})), work)
    launched = _intersect(launches, work)
    out: dict[str, dict[str, float]] = {c: {"share": 0.0, "per_s": 0.0, "mean_us": 0.0} for c in IDLE_CAUSES}

    def put(cause: str, n: int, ns: int) -> None:
        out[cause] = {"share": ns / total, "per_s": n / (wall / 1e9), "mean_us": ns / n / 1e3 if n else 0.0}

    def length(a: NDArray[np.int64]) -> int:
        return int((a[:, 1] - a[:, 0]).sum()) if len(a) else 0

    put(IDLE_CAUSES[0], len(launched), max(0, length(launched) - length(busy)))
    # the work outside every launch: the work minus the launches' union (its complement's pieces)
    lo, hi = numpy.iinfo(numpy.int64).min, numpy.iinfo(numpy.int64).max
    between = numpy.stack([numpy.concatenate([[lo], launches[:, 1]]), numpy.concatenate([launches[:, 0], [hi]])],
                          axis=1)
    outside = _intersect(work, _union(between))
    if not len(outside):
        return out
    labelled = [(_spans(rows.get(WorkTrace.LAUNCH, [])), pid) for pid, rows in by_worker.items()]
    spans = numpy.concatenate([a for a, _ in labelled])
    pids = numpy.concatenate([numpy.full(len(a), pid, numpy.int64) for a, pid in labelled])
    by_end, by_start = numpy.argsort(spans[:, 1], kind="stable"), numpy.argsort(spans[:, 0], kind="stable")
    s, e = outside[:, 0], outside[:, 1]
    i = numpy.searchsorted(spans[by_end, 1], s, side="right") - 1  # the last launch ended by s
    j = numpy.searchsorted(spans[by_start, 0], e, side="left")  # the first launch starting at e or later
    near = 50_000_000
    ok = (i >= 0) & (j < len(spans))
    before = numpy.where(ok, pids[by_end[numpy.clip(i, 0, None)]], -1)
    after = numpy.where(ok, pids[by_start[numpy.clip(j, 0, len(spans) - 1)]], -1)
    ok &= (s - spans[by_end[numpy.clip(i, 0, None)], 1] < near) & (
        spans[by_start[numpy.clip(j, 0, len(spans) - 1)], 0] - e < near)
    bounds_in = numpy.zeros(len(outside), dtype=bool)  # the earlier launch's worker's work began or ended in it
    for pid, rows in by_worker.items():
        mine = before == pid
        if not mine.any():
            continue
        w = _spans(rows.get(WorkTrace.WORK, []))
        b = numpy.sort(numpy.concatenate([w[:, 0], w[:, 1]]))
        bounds_in[mine] = numpy.searchsorted(b, e[mine], side="right") > numpy.searchsorted(b, s[mine], side="left")
    same = ok & (before == after)
    other = ok & (before != after)
    lengths = e - s
    for cause, mask in ((IDLE_CAUSES[1], same & ~bounds_in), (IDLE_CAUSES[2], same & bounds_in),
                        (IDLE_CAUSES[3], other & ~bounds_in), (IDLE_CAUSES[4], other & bounds_in),
                        (IDLE_CAUSES[5], ~ok)):
        put(cause, int(mask.sum()), int(lengths[mask].sum()))
    return out


#: the legs of a handover, in order, as :func:`handover_legs` names them
HANDOVER_LEGS = ("giver: chunk end -> grant", "giver: grant -> wake call returned",
                 "wake call -> grantee's futex return", "grantee: futex return -> holds",
                 "grantee: holds -> launch", "device idle: chunk end -> launch", "board's gap: grant -> look")


def handover_legs(directory: str) -> dict[str, object]:
    """The legs of every handover traced in ``directory`` (:class:`shared.gpu_time.HandoverTrace`
    files): each giver's row joined with its grantee's by the grant stamp and the grantee's slot.
    Per leg the count, p50 and p90 (us); also handovers joined, given (G rows), how many grantees
    were already awake at the grant (their last futex return before it: the wake leg then
    measures nothing), and futex returns that did not acquire per handover (waiters woken for
    another's grant: runnable threads at the moment the grantee needs a core)."""
    import glob

    gives: dict[tuple[int, int], list[int]] = {}
    takes: dict[tuple[int, int], list[int]] = {}
    launches: dict[tuple[int, int], int] = {}
    idle_wakes = 0
    for path in glob.glob(f"{directory}/*.handover"):
        with open(path, encoding="ascii") as f:
            for line in f:
                p = line.split()
                try:
                    if p and p[0] == "G" and len(p) == 9:
                        grant, cas, woken, last_end, chunk_end, _giver, nxt = (int(x) for x in p[1:8])
                        gives[(grant, nxt)] = [cas, woken, last_end, chunk_end]
                    elif p and p[0] == "A" and len(p) == 7:
                        grant, _wait0, wake, acq, slot = (int(x) for x in p[1:6])
                        takes[(grant, slot)] = [wake, acq]
                    elif p and p[0] == "L" and len(p) == 4:
                        launches[(int(p[1]), int(p[3]))] = int(p[2])
                    elif p and p[0] == "S":
                        idle_wakes += 1
                except ValueError:
                    continue  # a row cut short (a worker killed while it wrote): left out
    legs: dict[str, list[float]] = {name: [] for name in HANDOVER_LEGS}
    awake = joined = 0
    for key, (_cas, woken, last_end, chunk_end) in gives.items():
        take = takes.get(key)
        launch_ns = launches.get(key)
        if take is None or launch_ns is None:
            continue
        grant = key[0]
        wake, acq = take
        joined += 1
        end = chunk_end or last_end
        if chunk_end:
            legs[HANDOVER_LEGS[0]].append((grant - chunk_end) / 1e3)
        legs[HANDOVER_LEGS[1]].append((woken - grant) / 1e3)
        if wake > grant:
            legs[HANDOVER_LEGS[2]].append((wake - woken) / 1e3)
            legs[HANDOVER_LEGS[3]].append((acq - wake) / 1e3)
        else:
            awake += 1
        legs[HANDOVER_LEGS[4]].append((launch_ns - acq) / 1e3)
        legs[HANDOVER_LEGS[5]].append((launch_ns - end) / 1e3)
        legs[HANDOVER_LEGS[6]].append((acq - grant) / 1e3)
    table = {name: {"n": len(v), "p50_us": percentile(v, 0.5) if v else 0.0, "p90_us": percentile(v, 0.9) if v else 0.0}
             for name, v in legs.items()}
    return {"given": len(gives), "joined": joined, "grantee_awake": awake,
            "idle_wakes_per_handover": idle_wakes / max(1, len(gives)), "legs": table}


def _spread(values: Sequence[float]) -> str:
    """The median and the range of a list of rates: "1,650 (1,420-1,900)"."""
    if not values:
        return "-"
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def _cause(causes: Mapping[str, Mapping[str, float]] | None, cause: str) -> str:
    """One cell of the idle causes' table: "6.8 % (1,526/s, 44 us)", "-" without a trace."""
    got = (causes or {}).get(cause)
    if not got:
        return "-"
    return f"{got['share']:.1%} ({got['per_s']:,.0f}/s, {got['mean_us']:.0f} us)"


def _concat(parts: Sequence[NDArray[np.int64]]) -> NDArray[np.int64]:
    import numpy

    return numpy.concatenate(parts) if parts else numpy.empty((0, 2), numpy.int64)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


#: the benchmark's stub configuration: its device on a core of its own (docs/GPU-QUOTAS.md, "The stub device")
DEVICE_CPUS = "last"


def _device_core(args: argparse.Namespace, report: Report) -> dict[str, object]:
    """The supervisors' ``stub_device_cpus`` for ``--device-cpus``, this process (the clients) onto the
    CPUs left, and a line saying which: every arm of the run (on and off, control and mix) the same."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set()
    cpus, why = resolve(args.device_cpus, [0], allowed)
    if not cpus:
        note = "the stub's device shares the host's CPUs with everything else" + (f" ({why})" if why else "")
        report.sections.append(("the stub's device", note))
        report.data["device_cpus"] = None
        return {}
    rest = allowed - set(cpus.values())
    report.sections.append((
        "the stub's device",
        f"a core of its own: every stub worker's device thread on CPU {cpus[0]}, the host's other work - the "
        f"guests, the supervisor, this program's clients - on CPU {','.join(map(str, sorted(rest)))} "
        "(stub_device_cpus; --device-cpus none: the device thread shares every CPU)"))
    report.data["device_cpus"] = {"device": cpus[0], "rest": sorted(rest)}
    return {"stub_device_cpus": list(cpus.values())}


def _clients_off_device(report: Report) -> None:
    """This process's threads (the clients' load loops start from them) onto the CPUs the device left,
    once the supervisors have started (they inherit this process's affinity, and need the device's CPU
    in it to hand it on); best effort."""
    plan = report.data.get("device_cpus")
    if isinstance(plan, dict):
        set_threads_affinity(plan["rest"])


def _mix_main(args: argparse.Namespace) -> int:
    report = Report("share --mix")
    base = {"log_level": "warning", "pool_size": 0, "backend": "stub", "gpu_time_quantum_s": args.quantum,
            **_device_core(args, report)}
    q_ms = args.quantum * 1e3
    if args.handover_trace:
        os.makedirs(args.handover_trace, exist_ok=True)
        os.environ[HANDOVER_TRACE_ENV] = os.path.abspath(args.handover_trace)  # the workers inherit it
    import shutil
    import tempfile

    work_dir = args.work_trace or tempfile.mkdtemp(prefix="twt-work-trace-")
    if args.work_trace:
        os.makedirs(work_dir, exist_ok=True)
    os.environ[WORK_TRACE_ENV] = work_dir  # every worker records its work and busy intervals
    try:
        with launch({"supervisor": {**base, "gpu_time_scheduler": True}}) as on:
            _clients_off_device(report)
            gaps, kres = _mix(on, args)
        by_worker = read_work_trace_by_worker(work_dir)  # the workers have exited: every row is on disk
        kinds = {k: _concat([rows[k] for rows in by_worker.values()])
                 for k in (WorkTrace.WORK, WorkTrace.BUSY, WorkTrace.LAUNCH, WorkTrace.CORE)}
        traced = work_spans(kinds)
        as_placed = work_spans({WorkTrace.WORK: kinds[WorkTrace.WORK], WorkTrace.LAUNCH: kinds[WorkTrace.LAUNCH],
                                WorkTrace.BUSY: _concat([kinds[WorkTrace.BUSY], kinds[WorkTrace.CORE]])})
    finally:
        os.environ.pop(WORK_TRACE_ENV, None)
        if not args.work_trace:
            shutil.rmtree(work_dir, ignore_errors=True)
    for g in gaps:
        control, mix = busy_while_work(traced, g["windows_control"]), busy_while_work(traced, g["windows_mix"])
        g["any_work_control"], g["busy_while_work_control"] = control["any_work"], control["busy"]
        g["launched_while_work_control"] = control["launched"]
        g["any_work_mix"], g["busy_while_work_mix"], g["launched_while_work_mix"] = (
            mix["any_work"], mix["busy"], mix["launched"])
        g["busy_as_placed_control"] = busy_while_work(as_placed, g["windows_control"])["busy"]
        g["busy_as_placed_mix"] = busy_while_work(as_placed, g["windows_mix"])["busy"]
        g["idle_causes_control"] = idle_causes(by_worker, g["windows_control"])
        g["idle_causes_mix"] = idle_causes(by_worker, g["windows_mix"])
    rows = []
    for g in gaps:
        lo, hi = g["ratio_ci"]
        rows.append([f"{g['gap_ms']:g}", _spread(g["control_rates"]), _spread(g["mix_rates"]),
                     f"{g['ratio']:.2f}x [{lo:.2f}-{hi:.2f}], {len(g['pair_ratios'])} pairs", g["chatty_ops"],
                     f"<= {g['chatty_p99_ms']:g}", f"{g['busy_control']:.0%}", f"{g['busy_mix']:.0%}",
                     f"{g['handovers_control']:.0f}", f"{g['handovers_mix']:.0f}",
                     f"{g['idle_at_handovers_mix']:.1%}"])
    report.sections.append((
        f"a heavy GEMM tenant ({args.n}^3, 2 instances) beside a chatty one (fill of 64 floats, then host work), "
        f"weights 1:1, control and mix in alternating blocks of {args.block_seconds:g} s (A B B A), the ratio the "
        "median of neighbouring pairs' mix / control with its 95 % confidence interval (GEMMs/s: median, min-max "
        "of the blocks)",
        format_table(["host gap ms", "heavy GEMMs/s control", "beside chatty", "ratio [95 % CI]", "chatty ops",
                      "chatty wait p99 ms", "busy control", "busy mix", "handovers/s control", "handovers/s mix",
                      "idle at handovers mix"],
                     rows),
    ))
    report.sections.append((
        "device busy while any tenant has work (every worker's intervals, CLOCK_MONOTONIC, unions across "
        "workers; work: an op submitted and not finished - queued, waiting for the lease or on the device; "
        "busy: the device's charged time, the stub executors' chunks on the device's core laid end to end - "
        "'as placed': each at its launch's end, overlapping where two executors shared the core; in a launch: "
        "a launch's wall span, on the stub busy plus the device thread waiting for a core); beside it the old "
        "ratio, busy mix / control",
        format_table(["host gap ms", "round", "any work (of wall)", "device busy while work", "as placed",
                      "in a launch while work", "busy mix / control"],
                     [row for g in gaps for row in (
                         [f"{g['gap_ms']:g}", "control", _pct(g["any_work_control"]),
                          _pct(g["busy_while_work_control"]), _pct(g["busy_as_placed_control"]),
                          _pct(g["launched_while_work_control"]), ""],
                         [f"{g['gap_ms']:g}", "mix", _pct(g["any_work_mix"]), _pct(g["busy_while_work_mix"]),
                          _pct(g["busy_as_placed_mix"]), _pct(g["launched_while_work_mix"]),
                          f"{g['busy_mix'] / (g['busy_control'] or 1.0):.2f}x"])]),
    ))
    report.sections.append((
        "where the device was not busy while any tenant had work, by cause (% of the work time; stretches per "
        "wall s, mean us): a launch without busy time is the device thread waiting for a core (the stub: its "
        "device is that CPU); work outside every launch is named by the launches on either side - one "
        "worker's (between its ops; a gap in its own work, its work ending or beginning inside) or two "
        "workers' (a handover inside the giver's work, or at its end)",
        format_table(["host gap ms", "round", *IDLE_CAUSES],
                     [[f"{g['gap_ms']:g}", key, *[_cause(causes, c) for c in IDLE_CAUSES]]
                      for g in gaps for key, causes in (("control", g["idle_causes_control"]),
                                                        ("mix", g["idle_causes_mix"]))]),
    ))
    report.sections.append((
        f"{kres['k']} instances of one tenant against one instance of another, weights 1:1",
        f"accounted device s: {kres['accounted_s'][0]:.2f} vs {kres['accounted_s'][1]:.2f} "
        f"({kres['tenant_share']:.1%} to the {kres['k']}-instance tenant); device busy {kres['busy']:.0%} of the "
        "wall time (the share is the lease's only while the device is the bottleneck, not the host's CPUs)",
    ))
    report.data.update({"mix": gaps, "k_instances": kres,
                        "config": {"n": args.n, "reps": args.reps, "seconds": args.seconds, "rounds": args.rounds,
                                   "block_seconds": args.block_seconds, "quantum_s": args.quantum,
                                   "gaps_ms": args.gaps, "k": args.k}})
    pts = " pts"
    for g in gaps:
        report.targets += [
            Target(f"heavy beside chatty at {g['gap_ms']:g} ms gaps vs the control (work rate)", g["ratio"], 0.9),
            Target(f"chatty wait per op at {g['gap_ms']:g} ms gaps, p99 (ms, bin edge) <= 1 quantum",
                   g["chatty_p99_ms"], q_ms, higher_is_better=False, unit=" ms"),
            Target(f"device busy while any tenant has work, beside chatty at {g['gap_ms']:g} ms gaps",
                   100 * (g["busy_while_work_mix"] or 0.0), 95.0, unit=" %"),
        ]
    report.targets.append(Target(f"{kres['k']} instances vs 1: distance of the tenant share from 50 %",
                                 abs(kres["tenant_share"] - 0.5) * 100, 5.0, higher_is_better=False, unit=pts))
    report.targets.append(Target("load threads that failed", float(len(ERRORS)), 0.0, higher_is_better=False,
                                 unit=""))
    if args.handover_trace:
        legs = handover_legs(args.handover_trace)
        report.data["handover_legs"] = legs
        table = legs["legs"]
        assert isinstance(table, dict)
        report.sections.append((
            f"handover legs, traced ({legs['joined']} of {legs['given']} handovers joined, all rounds; "
            f"{legs['grantee_awake']} grantees awake at the grant; "
            f"{legs['idle_wakes_per_handover']:.2f} futex returns without the lease per handover)",
            format_table(["leg", "n", "p50 us", "p90 us"],
                         [[name, row["n"], f"{row['p50_us']:.0f}", f"{row['p90_us']:.0f}"]
                          for name, row in table.items()]),
        ))
    if ERRORS:
        report.sections.append(("errors", "\n".join(ERRORS[:20])))
    return report.emit(as_json=args.json)


# -------------------------------------------------------------- decision cost


def _echo(endpoint: str, ready: Event) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.bind(endpoint)
    ready.set()
    while True:
        msg = sock.recv()
        sock.send(msg)
        if msg == b"stop":
            break
    sock.close(0)
    ctx.term()


def _decision_costs(rounds: int = 2000) -> dict[str, float]:
    """us per lease decision: in shared memory (this process) vs a ZeroMQ ipc round trip to another."""
    import os
    import tempfile

    import zmq

    from shared.gpu_time import GpuTimeBoard

    board = GpuTimeBoard.create(0)
    try:
        slot = board.add_tenant(1.0)
        worker = GpuTimeBoard.attach(board.name, tenant_slot=slot)
        try:
            worker.acquire()
            worker.finish(0)
            batches = []
            for _ in range(20):  # the median of 20 batches: a host stall spoils one batch, not the figure
                t0 = time.perf_counter_ns()
                for _ in range(rounds // 20):
                    worker.acquire()  # the fast path: a CAS on the owner word
                    worker.finish(1000)  # charge, and the quantum check
                batches.append((time.perf_counter_ns() - t0) / (rounds // 20) / 1000)
            fast_us = statistics.median(batches)
            picks = []
            for _ in range(rounds // 10):
                t0 = time.perf_counter_ns()
                worker.pick(time.monotonic_ns())  # a full decision: scan the waiters and passes
                picks.append((time.perf_counter_ns() - t0) / 1000)
            pick_us = statistics.median(picks)
        finally:
            worker.close()
    finally:
        board.unlink()
        board.close()
    tmp = tempfile.mkdtemp(prefix="twt-bench-")
    endpoint = "ipc://" + os.path.join(tmp, "echo.ipc")
    ready = _SPAWN.Event()
    child = _SPAWN.Process(target=_echo, args=(endpoint, ready), daemon=True)
    child.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    try:
        ready.wait(30)
        sock.connect(endpoint)
        for _ in range(50):
            sock.send(b"lease?")
            sock.recv()
        samples = []
        for _ in range(rounds // 4):
            t0 = time.perf_counter_ns()
            sock.send(b"lease?")
            sock.recv()
            samples.append((time.perf_counter_ns() - t0) / 1000)
        sock.send(b"stop")
        sock.recv()
    finally:
        sock.close(0)
        ctx.term()
        child.join(10)
        try:
            os.unlink(endpoint[len("ipc://"):])
            os.rmdir(tmp)
        except OSError:
            pass
    return {"shm_fast_path_us": fast_us, "shm_pick_us": pick_us, "zmq_round_trip_us": statistics.median(samples)}


# ------------------------------------------------------------------ report


def _plot(path: str, split: SplitResult, eight: EightResult) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("twt bench share --plot needs matplotlib: pip install 'tensor-wasm-tenant[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=False)
    xs = [w["t"] for w in split["windows"]]
    top.plot(xs, [w["time_share"] for w in split["windows"]], "o-", label="weight 7: accounted time")
    top.plot(xs, [1 - w["time_share"] for w in split["windows"]], "o-", label="weight 3: accounted time")
    top.plot(xs, [w["work_share"] for w in split["windows"]], "x--", label="weight 7: work (GEMMs)")
    top.plot(xs, [1 - w["work_share"] for w in split["windows"]], "x--", label="weight 3: work (GEMMs)")
    for y in (0.7, 0.3):
        top.axhspan(y - 0.05, y + 0.05, color="grey", alpha=0.15)
    top.set_ylim(0, 1)
    top.set_ylabel("share of the device")
    top.set_title("weights 7:3, per 1 s window (band: target +-5 points)")
    top.legend(fontsize=8, loc="center right")
    xs = [w["t"] for w in eight["windows"]]
    for i in range(8):
        bottom.plot(xs, [w["time_shares"][i] for w in eight["windows"]], ".-", label=f"e{i}")
    bottom.axhline(1 / 8, color="grey", linestyle=":")
    bottom.set_ylim(0, 0.3)
    bottom.set_xlabel("seconds into the phase")
    bottom.set_ylabel("share of the device")
    bottom.set_title("8 equal tenants, per 1 s window")
    bottom.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _gap_list(text: str) -> list[float]:
    try:
        gaps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"host gaps are ms, comma-separated: {text!r}") from None
    if not gaps or any(not 0 < g <= 100 for g in gaps):
        raise argparse.ArgumentTypeError(f"host gaps must be in (0, 100] ms: {text!r}")
    return gaps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    parser.add_argument("--seconds", type=seconds, default=10.0, help="measured seconds of each phase (default 10)")
    parser.add_argument("--pairs", type=count, default=20,
                        help="pairs of blocks of the paired rows: one tenant alone with the scheduler on / off, "
                             "7:3 together / one tenant alone; blocks alternate A B B A (default 20)")
    parser.add_argument("--pair-seconds", type=seconds, default=1.0,
                        help="measured seconds of each block of the paired rows (default 1)")
    parser.add_argument("--rounds", type=count, default=5,
                        help="--mix: rounds x --seconds is each gap's measured time of each kind (default 5)")
    parser.add_argument("--n", type=count, default=256, help="GEMM size (n x n @ n x n; default 256)")
    parser.add_argument("--reps", type=count, default=64, help="GEMMs per guest run (default 64)")
    parser.add_argument("--quantum", type=seconds, default=0.01, help="gpu_time_quantum_s (default 0.01)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the shares per 1 s window (needs matplotlib)")
    parser.add_argument("--mix", action="store_true",
                        help="tenants that differ: a heavy one beside a chatty one, k instances against one")
    parser.add_argument("--gaps", type=_gap_list, default=[0.1, 0.3, 1.0],
                        help="--mix: the chatty tenant's host gaps, ms, comma-separated (default 0.1,0.3,1)")
    parser.add_argument("--block-seconds", type=seconds, default=2.0,
                        help="--mix: seconds of each measured block; control and mix blocks alternate A B B A, "
                             "as many of each as --rounds x --seconds fill, each pair of neighbours one ratio "
                             "(default 2)")
    parser.add_argument("--k", type=count, default=3, help="--mix: instances of the many-instance tenant (default 3)")
    parser.add_argument("--handover-trace", metavar="DIR",
                        help="--mix: trace every handover's timestamps into DIR and print where its device idle "
                             "goes, leg by leg (slows each handover by a few us)")
    parser.add_argument("--work-trace", metavar="DIR",
                        help="--mix: keep the work trace (every worker's DIR/<pid>.work) in DIR, and the rounds' "
                             "windows in the JSON, for an analysis of its own")
    parser.add_argument("--device-cpus", type=device_cpus, default=DEVICE_CPUS,
                        help="stub_device_cpus of every supervisor this run starts, and this process's clients on "
                             "the CPUs left: the stub's device as a core of its own ('last': the last CPU of the "
                             "affinity set; CPU numbers; 'none': the device thread shares every CPU; default "
                             f"{DEVICE_CPUS})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and 2
    if args.mix:
        return _mix_main(args)
    report = Report("share")
    base = {"log_level": "warning", "pool_size": 0, "backend": "stub", "gpu_time_quantum_s": args.quantum,
            **_device_core(args, report)}
    q_ms = args.quantum * 1e3
    with launch({"supervisor": {**base, "gpu_time_scheduler": True}}) as on, \
            launch({"supervisor": {**base, "gpu_time_scheduler": False}}) as off:
        _clients_off_device(report)
        solo = _solo_rounds(on, off, args)
        split = _split(on, args)
        eight = _eight(on, args)
        capped = _cap(on, args)
    costs = _decision_costs()

    on_rate, off_rate = statistics.median(solo["rates"]["on"]), statistics.median(solo["rates"]["off"])
    on_off_pairs = solo["pair_ratios"]
    on_off = statistics.median(on_off_pairs) if on_off_pairs else 0.0
    on_off_ci = median_ci(on_off_pairs)
    together_ci = median_ci(split["together_pair_ratios"])
    work, acc = split["work"], split["accounted_s"]
    work_share = work[0] / sum(work)
    time_share = acc[0] / sum(acc)
    win_work_dev = max((abs(w["work_share"] - 0.7) for w in split["windows"]), default=1.0)
    win_time_dev = max((abs(w["time_share"] - 0.7) for w in split["windows"]), default=1.0)
    together = split["together_ratio"]
    idle_ratio = split["idle"]["rate_after_one_quantum"] / split["solo_device_rate"]
    waits_ms = [w * 1e3 for w in split["light_waits_s"]]
    p99 = percentile(waits_ms, 0.99) if waits_ms else float("inf")
    jain_work, jain_time = _jain(eight["work"]), _jain(eight["accounted_s"])

    report.sections.append((
        f"one tenant alone (weight 7), scheduler on / off in {args.pairs} pairs of {args.pair_seconds:g} s blocks "
        f"(A B B A), GEMM {args.n}^3",
        format_table(["scheduler", "GEMMs/s (median)", "range of the blocks"],
                     [["on", on_rate, _spread(solo["rates"]["on"])],
                      ["off", off_rate, _spread(solo["rates"]["off"])]])
        + "\non / off per pair of blocks: " + " ".join(f"{r:.2f}" for r in on_off_pairs)
        + f"\nmedian {on_off:.2f}x, 95 % interval of the median [{on_off_ci[0]:.2f}-{on_off_ci[1]:.2f}]"
        + (" (fewer than 6 pairs: their range)" if len(on_off_pairs) < 6 else ""),
    ))
    report.sections.append((
        f"weights 7:3 in {args.pairs} blocks of {args.pair_seconds:g} s, both saturating (2 instances, 2 client "
        "threads each), each block paired with one of one tenant alone (A B B A)",
        format_table(["", "weight 7", "weight 3", "share of weight 7"],
                     [["work (GEMMs)", work[0], work[1], f"{work_share:.1%}"],
                      ["accounted device s", acc[0], acc[1], f"{time_share:.1%}"]])
        + "\nper 1 s window, share of weight 7 (work / accounted): "
        + ", ".join(f"{w['work_share']:.0%}/{w['time_share']:.0%}" for w in split["windows"])
        + f"\ntogether {_spread(split['together_rates'])} GEMMs/s vs {_spread(split['solo_work_rates'])} alone "
        "(one tenant, 4 instances and 4 client threads; medians and ranges of the blocks)"
        + "\ntogether / alone per pair of blocks: " + " ".join(f"{r:.2f}" for r in split["together_pair_ratios"])
        + f"\nmedian {together:.2f}x, 95 % interval of the median [{together_ci[0]:.2f}-{together_ci[1]:.2f}]"
        + (" (fewer than 6 pairs: their range)" if len(split["together_pair_ratios"]) < 6 else "")
        + f"\nwhere the rate goes (medians, together / alone): device busy {split['together_busy']:.0%} / "
        f"{split['solo_busy']:.0%} of the wall time, {split['together_per_device_s']:.0f} / "
        f"{split['solo_per_device_s']:.0f} GEMMs per accounted device s, the lease changing hands "
        f"{split['together_handovers']:.0f} / {split['solo_handovers']:.0f} times a s, the device idle at "
        f"handovers {split['together_gap']:.1%} / {split['solo_gap']:.1%} of the wall time "
        f"({split['together_gap_us']:.0f} / {split['solo_gap_us']:.0f} us each), held idle before a steal "
        f"{split['together_held_idle']:.1%} / {split['solo_held_idle']:.1%}",
    ))
    report.sections.append((
        "when the weight-3 tenant goes idle",
        f"weight 7's accounted rate from one quantum ({q_ms:g} ms) after the other's last chunk, over "
        f"{20 * q_ms:g} ms: {split['idle']['rate_after_one_quantum']:.2f} device s/s "
        f"(alone: {split['solo_device_rate']:.2f})",
    ))
    report.sections.append((
        "a light tenant (one 64x64 GEMM every 10 ms) beside a saturating hog",
        format_table(["ops", "p50 ms", "p99 ms", "max ms"],
                     [[len(waits_ms), percentile(waits_ms, 0.5) if waits_ms else 0.0, p99,
                       max(waits_ms) if waits_ms else 0.0]]),
    ))
    report.sections.append((
        "8 equal tenants",
        format_table(["", *[f"e{i}" for i in range(8)], "Jain"],
                     [["work", *[f"{w:.0f}" for w in eight["work"]], f"{jain_work:.3f}"],
                      ["accounted s", *[f"{a:.2f}" for a in eight["accounted_s"]], f"{jain_time:.3f}"]]),
    ))
    report.sections.append((
        "gpu_time_cap = 0.25, alone",
        f"accounted device time per wall second: {capped['device_share']:.3f} "
        f"({capped['throttled']} throttles; {capped['work_rate']:.0f} GEMMs/s)",
    ))
    report.sections.append((
        "where the lease decision lives: cost per decision, us",
        format_table(["path", "us"],
                     [["shared memory, fast path (CAS + charge, this process)", costs["shm_fast_path_us"]],
                      ["shared memory, full pick (scan waiters and passes)", costs["shm_pick_us"]],
                      ["supervisor round trip (ZeroMQ REQ/REP over ipc, another process)",
                       costs["zmq_round_trip_us"]]]),
    ))
    report.data.update({"solo": solo, "split": {k: v for k, v in split.items() if k != "light_waits_s"},
                        "light_wait_ms": {"p50": percentile(waits_ms, 0.5) if waits_ms else None, "p99": p99,
                                          "n": len(waits_ms)},
                        "eight": eight, "cap": capped, "decision_us": costs,
                        "config": {"n": args.n, "reps": args.reps, "seconds": args.seconds, "pairs": args.pairs,
                                   "pair_seconds": args.pair_seconds, "quantum_s": args.quantum}})
    pts = " pts"
    report.targets += [
        Target("7:3 work share of weight 7, distance from 70 % over the run", abs(work_share - 0.7) * 100, 3.0,
               higher_is_better=False, unit=pts),
        Target("7:3 accounted share of weight 7, distance from 70 % over the run", abs(time_share - 0.7) * 100, 3.0,
               higher_is_better=False, unit=pts),
        Target("7:3 work share, worst 1 s window's distance from 70 %", win_work_dev * 100, 5.0,
               higher_is_better=False, unit=pts),
        Target("7:3 accounted share, worst 1 s window's distance from 70 %", win_time_dev * 100, 5.0,
               higher_is_better=False, unit=pts),
        Target("7:3 together vs one tenant alone, as many processes (work rate, median of paired blocks)",
               together, 0.97),
        Target("alone with weights, scheduler on vs off (work rate, median of paired blocks)", on_off, 0.98),
        Target("8 equal tenants, Jain's index of accounted time", jain_time, 0.98, unit=""),
        Target("8 equal tenants, Jain's index of work", jain_work, 0.98, unit=""),
        Target("other tenant idle: rate one quantum later vs alone", idle_ratio, 0.95),
        Target(f"light tenant p99 wait per op, ms (2 quanta + 2 ms = {2 * q_ms + 2:g})", p99, 2 * q_ms + 2,
               higher_is_better=False, unit=" ms"),
        Target("gpu_time_cap 0.25 alone: distance of its device share from 25 %",
               abs(capped["device_share"] - 0.25) * 100, 3.0, higher_is_better=False, unit=pts),
    ]
    report.targets.append(Target("load threads that failed", float(len(ERRORS)), 0.0, higher_is_better=False,
                                 unit=""))
    if ERRORS:
        report.sections.append(("errors", "\n".join(ERRORS[:20])))
    if args.plot:
        _plot(args.plot, split, eight)
        report.sections.append(("plot", f"written to {args.plot}"))
    return report.emit(as_json=args.json)
