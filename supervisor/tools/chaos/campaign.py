"""One campaign end to end: start, register, baseline, faults, settle, reconcile, clean up.

Typing: the reports (and the event maps they are built from) are JSON-shaped dicts,
written here and read back by key to print and check them; their values stay dynamically typed.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import IO, Any, TextIO

import psutil

from shared.capability import TenantCapability
from shared.errors import (
    TensorWasmError,
)
from shared.quota import SEGMENT_PREFIX, segment_namespace
from shared.records import TenantRecord
from supervisor.tools.chaos.checks import (
    Check,
    _check_answered,
    _check_data,
    _check_deadlines,
    _check_deaths,
    _check_healthy,
    _check_latency,
    fault_stats,
    host_request_ms,
    latency_by_op,
    latency_table,
    reconcile,
)
from supervisor.tools.chaos.config import HANG_SHOWS_WITHIN_S, SUPERVISOR_SETTINGS, ChaosConfig, _spec
from supervisor.tools.chaos.relayprobe import RelayProbe
from supervisor.tools.chaos.nemesis import Action, _EventLog, _Nemesis
from supervisor.tools.chaos.recorder import Recorder
from supervisor.tools.chaos.schedule import build_schedule, schedule_hash
from supervisor.tools.chaos.workload import _Client, _Modules
from supervisor.client.api import SupervisorClient
from supervisor.tools.progress import LiveLine
from supervisor.client.launch import launch

__all__ = ["run_chaos"]

#: how long the settle waits for every tenant to run with nothing in flight (a wait for that event;
#: a loaded host with restart backoffs after a burst of faults once needed more than 30 s)
SETTLE_TIMEOUT_S = 60.0

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
    log: IO[bytes] | int = subprocess.DEVNULL
    if cfg.supervisor_log:
        log = stack.enter_context(open(cfg.supervisor_log, "ab"))
    settings = {**SUPERVISOR_SETTINGS, "backend": cfg.backend}
    with launch({"supervisor": settings, "tenant": []}, start_method=cfg.start_method, stderr=log) as handle:
        yield handle.run_dir, handle.pid


def is_settled(rec: TenantRecord) -> bool:
    """A tenant running with nothing in flight or parked, and every instance's worker ready.

    The instances count on their own: a worker killed for a missed deadline leaves the tenant
    running and its request answered (nothing in flight) while it is still stopping - its quota
    share still holding what the answered request made (an ``alloc`` its client was told timed
    out) until it is dead and reclaimed, which on a loaded host can be seconds later. Reconciled
    then, that share reads as drift of the instance's current incarnation."""
    return (rec.state == "running" and rec.in_flight == 0 and rec.parked == 0
            and all(inst.state == "ready" for inst in rec.instances))


class _Campaign:
    """One run of :func:`run_chaos`, step by step (each step appends its checks)."""

    def __init__(self, cfg: ChaosConfig, progress: IO[str] | None, live: TextIO | None = None) -> None:
        self.cfg, self.progress, self.live = cfg, progress, live
        self.t_start = time.monotonic()
        #: seconds per step, in order (the report's ``phases_s``): a slow run says where it waited
        self.phases: dict[str, float] = {}
        self._phase_t0 = self.t_start
        self.roles = cfg.roles()
        suffix = "" if cfg.run_dir is None else f"-{os.getpid()}"  # beside a running supervisor's tenants
        self.names = {role: f"{role}{suffix}" for role, _, _ in self.roles}
        self.order = [self.names[role] for role, _, _ in self.roles]
        self.healthy = {self.names[role] for role, healthy, _ in self.roles if healthy}
        self.specs = {self.names[r]: _spec(self.names[r], h, n, cfg) for r, h, n in self.roles}
        targets = [(role, n) for role, healthy, n in self.roles if not healthy]
        self.schedule = build_schedule(cfg.seed, cfg.faults, cfg.rate, cfg.fault_phase, targets)
        self.recorder = Recorder()
        self.host = RelayProbe(lambda: self.recorder.phase)
        self.checks: list[Check] = []
        self.clients: list[_Client] = []
        self.actions: list[Action] = []
        self.events: list[dict[str, object]] = []
        self.caps: dict[str, TenantCapability] = {}
        self.pids: dict[int, float | None] = {}  # every worker process of ours we saw (pid -> start time)
        self.segments: set[str] = set()
        self.prefix = ""
        self.fault_end = 0.0
        self.report: dict[str, Any] = {
            "config": {
                "duration_s": cfg.duration_s,
                "seed": cfg.seed,
                "tenants": cfg.tenants,
                "faulty": cfg.n_faulty,
                "faults": list(cfg.faults),
                "rate": cfg.rate,
                "clients": cfg.n_clients,
                "baseline_s": cfg.baseline,
                "fault_phase_s": cfg.fault_phase,
                "backend": cfg.backend,
                "start_method": cfg.start_method,
                "latency_factor": cfg.latency_factor,
                "grace_s": cfg.grace_s,
            },
            "schedule": {
                "hash": schedule_hash(self.schedule),
                "faults": len(self.schedule),
                "by_kind": dict(sorted(Counter("slow(heal)" if f.heal else f.kind for f in self.schedule).items())),
            },
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }

    def lap(self, name: str) -> None:
        """Close the step ``name``: the time since the previous step ended goes to it."""
        now = time.monotonic()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self._phase_t0, 2)
        self._phase_t0 = now

    def say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress.write(f"chaos: {msg}\n")
            self.progress.flush()

    def note_pid(self, pid: object, into: dict[int, float | None] | None = None) -> None:
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
                # every segment a supervisor on this run dir names carries its namespace
                self.prefix = f"{SEGMENT_PREFIX}{segment_namespace(run_dir)}-"
                stack.callback(main.close)
                self.start(main, sup_pid)
                self.lap("start")
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
                self.lap("event log")
            # here the supervisor we started has stopped
            self.lap("supervisor stop")
            self.leak_check(sup_pid, descendants)
            self.lap("leak check")
        return self.finish()

    def start(self, main: SupervisorClient, sup_pid: int | None) -> None:
        hello = main.hello()
        self.report["supervisor"] = {
            "pid": hello.pid,
            "backend": hello.backend,
            "start_method": hello.start_method,
            "started_here": sup_pid is not None,
        }
        self.say(
            f"supervisor pid {hello.pid} ({hello.backend}, {hello.start_method}); "
            f"schedule {self.report['schedule']['hash']}: {len(self.schedule)} faults"
        )
        self.caps = {name: main.register(None, spec) for name, spec in self.specs.items()}

    def workload(self, run_dir: str) -> None:
        """Warm-up, baseline, faults; every client and the nemesis stopped and joined at the end."""
        cfg = self.cfg
        stop_clients, stop_nemesis, faults_on = threading.Event(), threading.Event(), threading.Event()
        modules = _Modules.load()
        warmed = threading.Barrier(cfg.n_clients + 1)
        go = {name: threading.Event() for name in self.order}
        for ev in go.values():
            ev.set()
        for i in range(cfg.n_clients):
            name = self.order[i % len(self.order)]
            self.clients.append(
                _Client(
                    i,
                    name,
                    name in self.healthy,
                    self.specs[name],
                    self.caps[name],
                    run_dir,
                    cfg.seed,
                    self.recorder,
                    stop_clients,
                    modules,
                    warmed,
                    go[name],
                )
            )
        nemesis = _Nemesis(run_dir, self.schedule, self.names, faults_on, stop_nemesis, go)
        try:
            if cfg.latency_factor is not None:  # the relay's p99 is only that check's allowance
                self.host.start()
            for c in self.clients:
                c.start()
            nemesis.start()
            try:
                warmed.wait(120)
            except threading.BrokenBarrierError:
                pass
            self.lap("warm-up")
            self.recorder.phase = "baseline"
            self.say(f"baseline {cfg.baseline:g} s, {len(self.clients)} clients on {len(self.order)} tenants")
            time.sleep(cfg.baseline)
            self.lap("baseline")
            self.recorder.phase = "faults"
            faults_on.set()
            self.say(f"faults {cfg.fault_phase:g} s at {cfg.rate:g}/s into {cfg.n_faulty} tenants")
            self._fault_phase(nemesis, cfg.fault_phase)
            self.lap("faults")
        finally:
            stop_nemesis.set()
            nemesis.join(60)
            self.lap("nemesis stop")
            stop_clients.set()
            for c in self.clients:
                c.join(120)
            self.host.stop()
            self.lap("clients stop")
        self.fault_end = time.time()
        self.recorder.phase = "cleanup"
        self.actions = nemesis.actions
        crashed = [f"{c.name}: {c.crashed!r}" for c in self.clients if c.crashed is not None]
        if nemesis.crashed is not None:
            crashed.append(f"nemesis: {nemesis.crashed!r}")
        if any(t.is_alive() for t in [*self.clients, nemesis]):
            crashed.append("a client or the nemesis did not stop within its timeout")
        self.checks.append(Check("harness ran to the end", not crashed, "; ".join(crashed) or "all threads finished"))

    def _fault_phase(self, nemesis: _Nemesis, seconds: float) -> None:
        """Wait out the fault phase; on a terminal, say once a second how it goes."""
        line = LiveLine(self.live)
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            requests, errors = self.recorder.tally("faults")
            line.update(f"chaos: faults {len(nemesis.actions)}/{len(self.schedule)} delivered, "
                        f"{requests} requests, {errors} errors, {max(0.0, end - time.monotonic()):.0f} s left")
        line.done()

    def _records(self, main: SupervisorClient) -> list[TenantRecord]:
        """The status records of the campaign's own tenants."""
        return [r for r in main.status().tenants if r.tenant_id in self.specs]

    def _settle(self, main: SupervisorClient, timeout_s: float = SETTLE_TIMEOUT_S) -> tuple[bool, list[TenantRecord]]:
        """Wait until every tenant runs every instance with nothing in flight or parked (:func:`is_settled`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            recs = self._records(main)
            if len(recs) == len(self.specs) and all(map(is_settled, recs)):
                return True, recs
            if time.monotonic() >= deadline:
                return False, recs
            time.sleep(0.05)

    def settle_and_reconcile(self, main: SupervisorClient) -> None:
        """Counters against the buffers the clients hold, once nothing moves."""
        self.say("settling: heal slow and park faults, wait for every instance")
        # what the heal's calls answered with instead of a result (not a verdict: an instance that is
        # restarting has nothing to heal), with how long each took - the main client waits up to
        # 60 s for an answer, so a slow "heal" step in phases_s is explained here
        unhealed: list[str] = self.report.setdefault("heal_errors", [])
        for role, healthy, _ in self.roles:  # parks healed first: a parked tenant activated again
            if healthy or "park" not in self.cfg.faults:
                continue
            t0 = time.monotonic()
            try:
                main.set_quota(None, self.names[role], idle_timeout_s=None)
                main.ping(self.caps[self.names[role]])
            except TensorWasmError as exc:  # an instance restarting: the settle waits for it
                unhealed.append(f"{self.names[role]} park: {exc.code} after {time.monotonic() - t0:.1f} s")
        for role, healthy, instances in self.roles:
            for i in range(0 if healthy else instances):
                t0 = time.monotonic()
                try:
                    main.inject_fault(None, self.names[role], "slow", instance=i, ms=0)
                except TensorWasmError as exc:  # not running: nothing to heal
                    unhealed.append(f"{self.names[role]}/{i} slow: {exc.code} after {time.monotonic() - t0:.1f} s")
        self.lap("heal")
        # an armed hang shows only once heartbeats are missed: settle, wait that long, settle again
        settled, first = self._settle(main)
        self.lap("settle")
        time.sleep(HANG_SHOWS_WITHIN_S)
        settled2, recs = self._settle(main)
        self.lap("hang window, settle again")
        for rec in recs:
            for inst in rec.instances:
                self.note_pid(inst.pid)
        live: dict[str, dict[int, int]] = defaultdict(dict)
        for c in self.clients:
            live[c.tenant].update({h: b.nbytes for h, b in c.live.items()})
        recons = [reconcile(r, live[r.tenant_id]) for r in recs]
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
            unsettled = [r for r in (recs if not settled2 else first)
                         if not is_settled(r)]
            problems.insert(
                0,
                f"tenants did not settle within {SETTLE_TIMEOUT_S:g} s "
                f"({'after the hang window' if not settled2 else 'before the hang window'}; "
                f"{len(first)} of {len(self.specs)} tenants listed): "
                + ", ".join(
                    f"{r.tenant_id} {r.state}, {r.in_flight} in flight, {r.parked} parked, instances "
                    + "/".join(i.state for i in r.instances) for r in unsettled or first
                ),
            )
        lost_n = sum(r.lost_buffers for r in recons) + sum(len(c.stale) for c in self.clients)
        lost_b = sum(r.lost_bytes for r in recons) + sum(n for c in self.clients for _, n in c.stale)
        self.report["lost_allocations"] = {"buffers": lost_n, "bytes": lost_b}
        self.checks.append(
            Check(
                "quota counters equal live allocations",
                not problems,
                "; ".join(problems)
                or f"{sum(r.expected_gpu for r in recons):,} B in {sum(len(v) for v in live.values())} buffers counted "
                f"exactly; {lost_n} buffers ({lost_b:,} B) went with dead instances and were reclaimed",
            )
        )

    def cleanup(self, main: SupervisorClient) -> None:
        """Free everything (counters must reach zero), then evict every tenant."""
        self.say("cleanup: free every buffer, evict every tenant")
        for c in self.clients:
            c.free_all(main)
        self.lap("free")
        # not a verdict of its own (the counters below are): whether the tenants settled after the
        # frees, or this waited out SETTLE_TIMEOUT_S, says the report
        self.report["settled_after_free"] = self._settle(main)[0]
        self.lap("settle after free")
        deadline = time.monotonic() + 5.0
        while True:
            recs = self._records(main)
            nonzero = [
                f"{r.tenant_id}: gpu {r.gpu_bytes_in_use:,} B, host {r.bytes_in_use:,} B, "
                f"shares {r.quota.instance_shares if r.quota else None}"
                for r in recs
                if r.gpu_bytes_in_use or r.bytes_in_use or (r.quota and r.quota.instance_shares)
            ]
            if not nonzero or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.segments = {r.quota.name for r in recs if r.quota}
        problems = list(nonzero)
        self.lap("counters to zero")
        for name in self.specs:
            try:
                for pid in main.evict(None, name).pids:
                    self.note_pid(pid)
            except TensorWasmError as exc:
                problems.append(f"evict {name}: {exc}")
        self.lap("evict")
        self.checks.append(
            Check(
                "counters zero after cleanup",
                not problems,
                "; ".join(problems) or f"{len(self.specs)} tenants at 0 B (GPU and host), then evicted",
            )
        )

    def leak_check(self, sup_pid: int | None, descendants: dict[int, float | None]) -> None:
        """After the stop (or the evictions): no process we saw alive, no segment of ours left."""
        for e in self.events:
            # a running supervisor's pool workers are its own business; ours are those bound to our tenants
            if e.get("event") in ("spawn", "ready", "exit", "kill") and (
                sup_pid is not None or e.get("tenant") in self.specs
            ):
                self.note_pid(e.get("pid"))
        for a in self.actions:
            self.note_pid(a.pid)
        watch = {**self.pids, **descendants}
        deadline = time.monotonic() + 5.0
        while True:
            alive = sorted(p for p, created in watch.items() if _alive(p, created))
            shm = sorted(
                n for n in _shm_names() if n in self.segments or (sup_pid is not None and n.startswith(self.prefix))
            )
            if (not alive and not shm) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        scope = "supervisor stopped" if sup_pid is not None else "our tenants evicted (the supervisor runs on)"
        self.checks.append(
            Check(
                "no process or segment leaked",
                not alive and not shm,
                f"alive: {_describe(alive)}; segments: {shm}"
                if alive or shm
                else f"{scope}: {len(watch)} processes gone, {len(self.segments)} tenant segments unlinked",
            )
        )

    def finish(self) -> dict[str, Any]:
        records = self.recorder.snapshot()
        table = latency_table(records, self.order)
        faulted = {a.pid for a in self.actions if a.pid is not None}
        deaths, unexplained, deadline_exits = _check_deaths(self.events, self.specs, self.healthy, faulted,
                                                            self.fault_end)
        self.checks[1:1] = [
            _check_answered(records, self.actions),
            _check_deadlines(records, self.cfg.grace_s, host_request_ms(table, sorted(self.healthy))),
            _check_data(records),
            _check_healthy(records, self.events, self.healthy, self.fault_end),
            deaths,
        ]
        host = (self.host.p99_ms("baseline"), self.host.p99_ms("faults"))
        self.report["relay_p99_ms"] = {"baseline": host[0], "faults": host[1]}
        self.checks.append(_check_latency(table, sorted(self.healthy), self.cfg.latency_factor, host))
        tenants = []
        for name in self.order:
            rs = [r for r in records if r.tenant == name]
            tenants.append(
                {
                    "tenant": name,
                    "healthy": name in self.healthy,
                    "instances": self.specs[name].instances,
                    "requests": len(rs),
                    "ok": sum(r.outcome == "ok" for r in rs),
                    "errors": dict(sorted(Counter(r.outcome for r in rs if r.outcome != "ok").items())),
                    "latency": table[name],
                }
            )
        self.report.update(
            {
                "tenants": tenants,
                "healthy_latency_by_op": latency_by_op(records),
                "faults": fault_stats(self.actions, self.events),
                "actions": [
                    {
                        "at_s": a.fault.at_s,
                        "tenant": a.fault.tenant,
                        "kind": a.fault.kind,
                        "instance": a.fault.instance,
                        "params": dict(a.fault.params),
                        "heal": a.fault.heal,
                        "outcome": a.outcome,
                        "pid": a.pid,
                        "detail": a.detail,
                    }
                    for a in self.actions
                ],
                "requests": {
                    "total": len(records),
                    "by_outcome": dict(sorted(Counter(r.outcome for r in records).items())),
                },
                "worker_deaths": {
                    "total": sum(
                        e.get("event") == "exit" and not e.get("expected") and e.get("tenant") in self.specs
                        for e in self.events
                    ),
                    "not_from_a_fault": unexplained,
                    "deadline_enforced": deadline_exits,
                },
                "events": len(self.events),
                "parking": {
                    kind: sum(e.get("event") == kind and e.get("tenant") in self.specs for e in self.events)
                    for kind in ("park", "activate", "park_refused")
                },
                "checks": [c.to_dict() for c in self.checks],
                "ok": all(c.ok for c in self.checks),
                "elapsed_s": round(time.monotonic() - self.t_start, 1),
                "phases_s": dict(self.phases),
            }
        )
        return self.report


def run_chaos(cfg: ChaosConfig, progress: IO[str] | None = None, live: TextIO | None = None) -> dict[str, Any]:
    """Run one campaign; returns the report (``report["ok"]`` is the verdict, ``format_report`` prints it).

    ``progress`` gets a line per phase; ``live`` (a terminal) a line rewritten once a second during
    the fault phase: faults delivered, requests and errors so far.
    """
    return _Campaign(cfg, progress, live).run()
