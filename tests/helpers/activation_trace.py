"""``python -m tests.helpers.activation_trace [TENANTS] [REQUESTS] [--perf] [--out PREFIX]``: what the
slowest activating requests of the density stream waited for.

Runs ``twt bench density``'s parking stream (``supervisor.tools.bench.density_parking``: TENANTS
stored parked, default 10,000; a ``max_active`` 64 forkserver supervisor; a Zipf(1.1) stream of
REQUESTS, default 3,000, half ``ping`` and half ``run_wasm``) and stamps each request with
CLOCK_MONOTONIC (``time.monotonic``) at its send and its answer. It keeps the supervisor's events of
the stream (``activate``, ``park``, ``spawn``, ``exit``, ``ready``, ``kill``; their wall ``ts`` put on
the same clock) and prints, per op, the activating requests (a tenant's first ``run_wasm`` left
out, as in the bench) in latency bands - the fastest half, p50-p90, p90-p99, the slowest 1 % - with
the pool workers forked (``spawn``) and the workers ended (``exit``) from 30 ms before each request
to its answer, also as a multiple of what the stream's own rates put in windows that long (a slow
request's longer window holds more by chance); the overhead's p50 / p90 by the pool workers forked
from 5 ms before a request to its answer and by the parks ahead that ended inside it; the spawns'
bursts (spawns less than 10 ms apart); how the activations' workers came; and the warm requests' (no
activation during them) p50 / p90 by the pool workers forked and the workers ended from 5 ms before
each to its answer - the held work that ran beside them.

With ``--perf`` (root, or ``perf_event_paranoid`` <= 0; ``perf`` installed) a ``perf sched record
-a -k CLOCK_MONOTONIC`` runs for the stream's span, and each band also gets the CPU that ran while
its requests were out, by role: the supervisor, the activated tenant's own worker (``bound``, from
its ``ready`` event), this supervisor's other workers (pool workers starting, workers exiting), the
fork server, this process, and everything else on the host by command name (other people's work),
in ms and as cores (that CPU over the band's mean time out); beside it the scheduling delay (runnable, not running) of the slices that began inside it. The
slowest requests are listed one by one with their activation's phases and the events around them.

``--out PREFIX`` keeps the raw record (``PREFIX.json``, and ``PREFIX.perf.data``); ``--report PREFIX``
prints a kept one again. A measurement tool: say the host's load with what it prints.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

import psutil

from shared.rundir import temp_parent
from supervisor.tools.bench import density_parking as dp
from supervisor.tools.bench.density import _register, _start
from supervisor.tools.demo import guest_path

KINDS = ["activate", "park", "spawn", "exit", "ready", "kill"]
#: how far before a request a spawn or exit still counts as around it (a start's CPU lasts ~15 ms)
BEFORE_S = 0.03
#: how far before a request a pool worker's fork still counts as beside it, by the start's count
SPAWN_BEFORE_S = 0.005
_SLICE = re.compile(r"\s*([\d.]+)\s+\[(\d+)\]\s+(.+?)\[(\d+)(?:/(\d+))?\]\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def record(tenants: int, requests: int, prefix: str, use_perf: bool) -> dict[str, Any]:
    """Run the stream; the raw record (also written to ``PREFIX.json``)."""
    state = tempfile.mkdtemp(prefix="twt-activation-trace-", dir=temp_parent())
    names = [f"d{i:05d}" for i in range(tenants)]
    try:
        with _start(state, metrics=False) as sup:
            _register(sup, names, 8, 0)
        dp.park_all(state, names)
        with dp.start_dense(state, max_active=dp.MAX_ACTIVE) as sup, sup.connect(timeout_s=120.0) as c:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:
                summary = c.status(limit=1).summary
                if (summary.tenants if summary is not None else 0) >= tenants:
                    break
                time.sleep(0.01)
            fork_servers = [ch.pid for ch in psutil.Process(sup.pid).children()
                            if any("forkserver" in part for part in ch.cmdline())]
            perf = None
            if use_perf:
                perf = subprocess.Popen(["perf", "sched", "record", "-a", "-k", "CLOCK_MONOTONIC", "-o",
                                         prefix + ".perf.data"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                time.sleep(1.0)  # perf's start-up, outside the stream
            module = guest_path("probe").read_bytes()
            rng = random.Random(2)
            caps: dict[int, Any] = {}
            stored: set[int] = set()
            ran: set[int] = set()
            rows: list[dict[str, Any]] = []
            events: list[dict[str, Any]] = []
            wall_off = time.time() - time.monotonic()
            digest = ""
            try:
                for index in dp.zipf_stream(tenants, requests, dp.ZIPF_S, 1):
                    tid = names[index]
                    cap = caps.get(index)
                    if cap is None:
                        cap = caps[index] = c.tenant_capability(None, tid)
                    op = "run_wasm" if rng.random() < dp.RUN_WASM_SHARE else "ping"
                    if op == "run_wasm" and index not in stored:
                        digest = c.put_module(cap, module)
                        stored.add(index)
                    mark = c.events_page(None)["next"]
                    sent = time.monotonic()
                    if op == "ping":
                        c.ping(cap)
                    else:
                        c.run_wasm(cap, digest, "add", [2, 40])
                    answered = time.monotonic()
                    page = c.events_page(None, mark if isinstance(mark, int) else None, kinds=KINDS)["events"]
                    page = page if isinstance(page, list) else []
                    events.extend(page)
                    woke = [e for e in page if e.get("event") == "activate" and e.get("tenant") == tid]
                    rows.append({"tid": tid, "op": op, "t0": sent, "t1": answered,
                                 "first": op == "run_wasm" and index not in ran,
                                 "act": [{k: e.get(k) for k in ("activate_ms", "bind_ms", "restore_ms", "waited_ms",
                                                                "workers")} for e in woke]})
                    if op == "run_wasm":
                        ran.add(index)
            finally:
                if perf is not None:
                    time.sleep(0.3)
                    perf.send_signal(signal.SIGINT)
                    perf.wait(60)
            out: dict[str, Any] = {"supervisor": sup.pid, "fork_servers": fork_servers, "bench": os.getpid(),
                                   "wall_off": wall_off, "rows": rows, "events": events,
                                   "load": os.getloadavg()[0]}
        with open(prefix + ".json", "w") as f:
            json.dump(out, f)
        return out
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Slices:
    """``perf sched timehist``'s run slices (start, end, pid, command, schedule delay), by start."""

    def __init__(self, path: str) -> None:
        text = subprocess.run(["perf", "sched", "timehist", "-i", path], capture_output=True, text=True,
                              check=False).stdout
        rows: list[tuple[float, float, int, str, float]] = []
        for line in text.splitlines():
            m = _SLICE.match(line)
            if m is None:
                continue
            end, _cpu, comm, tid, pid, _wait, delay, run = m.groups()
            t = float(end)
            rows.append((t - float(run) / 1000, t, int(pid) if pid else int(tid), comm.strip(), float(delay)))
        rows.sort()
        self.rows = rows
        self.starts = [r[0] for r in rows]

    def within(self, a: float, b: float, role: Any) -> tuple[dict[str, float], dict[str, float]]:
        """CPU ms by role over [a, b], and the schedule delay (ms) of the slices beginning inside it."""
        cpu: dict[str, float] = defaultdict(float)
        delay: dict[str, float] = defaultdict(float)
        i = max(0, bisect.bisect_left(self.starts, a - 0.5))
        while i < len(self.rows) and self.rows[i][0] < b:
            start, end, pid, comm, wait = self.rows[i]
            i += 1
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                cpu[role(pid, comm)] += overlap * 1000
            if a <= start <= b and wait > 0:
                delay[role(pid, comm)] += wait
        return cpu, delay


def _top(values: dict[str, float], n: int, digits: int = 1) -> str:
    return ", ".join(f"{k} {v:.{digits}f}" for k, v in sorted(values.items(), key=lambda kv: -kv[1])[:n])


def report(data: dict[str, Any], perf_path: str | None) -> None:
    """Print the bands, the bursts and (with a perf record) the CPU by role around the slow requests."""
    off = data["wall_off"]
    rows: list[dict[str, Any]] = data["rows"]
    events = sorted({e["seq"]: e for e in data["events"]}.values(), key=lambda e: e["seq"])
    ours: set[int] = set()
    for e in events:
        e["t"] = e["ts"] - off
        if e.get("pid"):
            ours.add(int(e["pid"]))
    spawns = [e["t"] for e in events if e["event"] == "spawn"]
    exits = [e["t"] for e in events if e["event"] == "exit"]
    ahead_ends = [e["t"] for e in events if e["event"] == "park" and e.get("ahead")]
    served_by: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        if e["event"] == "ready" and e.get("tenant"):
            served_by[e["tenant"]].append((e["t"], int(e["pid"])))
    warm = {op: statistics.median([r["t1"] - r["t0"] for r in rows if r["op"] == op and not r["act"]] or [0.0])
            for op in ("ping", "run_wasm")}
    print(f"load {data.get('load', 0.0):.1f}; stream {rows[-1]['t1'] - rows[0]['t0']:.1f} s; warm p50 ms: "
          + ", ".join(f"{op} {v * 1000:.2f}" for op, v in warm.items()))
    span_s = max(1e-9, rows[-1]["t1"] - rows[0]["t0"])
    spawn_rate, exit_rate = len(spawns) / span_s, len(exits) / span_s
    slices = Slices(perf_path) if perf_path is not None and os.path.exists(perf_path) else None
    sup, bench, fork_servers = data["supervisor"], data["bench"], set(data["fork_servers"])

    def role_for(bound: set[int]) -> Any:
        def role(pid: int, comm: str) -> str:
            if pid == 0:
                return "idle"
            if pid == sup:
                return "supervisor"
            if pid in bound:
                return "bound worker"
            if pid in ours:
                return "our other workers"
            if pid in fork_servers:
                return "fork server"
            if pid == bench:
                return "this client"
            return "host: " + comm.split("/")[0][:12]
        return role

    def count(ts: list[float], a: float, b: float) -> int:
        return bisect.bisect_right(ts, b) - bisect.bisect_left(ts, a)

    def bound_of(r: dict[str, Any]) -> set[int]:
        return {pid for t, pid in served_by.get(r["tid"], []) if r["t0"] - 1 <= t <= r["t1"] + 0.01}

    for op in ("ping", "run_wasm"):
        sel = sorted((r for r in rows if r["op"] == op and r["act"] and not r["first"]), key=lambda r: r["t1"] - r["t0"])
        if not sel:
            continue
        over = [(r["t1"] - r["t0"] - warm[op]) * 1000 for r in sel]
        n = len(sel)
        print(f"\n{op}: {n} activating; overhead over the warm p50: p50 {_pct(over, 0.5):.1f} / p99 "
              f"{_pct(over, 0.99):.1f} ms")
        bands = [("fastest half", sel[:n // 2]), ("p50-p90", sel[n // 2:int(n * 0.9)]),
                 ("p90-p99", sel[int(n * 0.9):int(n * 0.99)]), ("slowest 1 %", sel[int(n * 0.99):])]
        for label, band in bands:
            if not band:
                continue
            mean_ms = statistics.mean((r["t1"] - r["t0"]) * 1000 for r in band)
            # a longer request's window holds more of anything by chance: each count also against
            # what the stream's own rate puts in windows that long
            window_s = sum(r["t1"] - r["t0"] + BEFORE_S for r in band)
            seen_spawns = sum(count(spawns, r["t0"] - BEFORE_S, r["t1"]) for r in band)
            seen_exits = sum(count(exits, r["t0"] - BEFORE_S, r["t1"]) for r in band)
            line = (f"  {label:12s} [{len(band):4d}] mean {mean_ms:6.1f} ms; around each: spawns "
                    f"{seen_spawns / len(band):.2f} ({seen_spawns / max(1e-9, window_s * spawn_rate):.2f}x the "
                    f"stream's rate), exits {seen_exits / len(band):.2f} "
                    f"({seen_exits / max(1e-9, window_s * exit_rate):.2f}x)")
            if slices is not None:
                cpu: dict[str, float] = defaultdict(float)
                delay: dict[str, float] = defaultdict(float)
                for r in band:
                    c, d = slices.within(r["t0"], r["t1"], role_for(bound_of(r)))
                    for k, v in c.items():
                        cpu[k] += v / len(band)
                    for k, v in d.items():
                        delay[k] += v / len(band)
                cores = {k: v / mean_ms for k, v in cpu.items()}
                line += (f"\n      CPU ms while out: {_top(cpu, 7)}\n      as cores (CPU / the time out): "
                         f"{_top(cores, 5, 2)}\n      schedule delay ms: {_top(delay, 4)}")
            print(line)
        # the work beside each request: pool workers forked from SPAWN_BEFORE_S before it to its
        # answer, and parks ahead that ended inside it (overhead p50 / p90 [n] by their count)
        for label, ts, before, cap in (("pool starts", spawns, SPAWN_BEFORE_S, 2), ("parks ahead ending", ahead_ends, 0.0, 3)):
            groups: dict[int, list[float]] = defaultdict(list)
            for r, o in zip(sel, over):
                groups[min(cap, count(ts, r["t0"] - before, r["t1"]))].append(o)
            print(f"  by the {label} in its window: " + "; ".join(
                f"{k}{'+' if k == cap else ''}: {_pct(v, 0.5):.1f} / {_pct(v, 0.9):.1f} [{len(v)}]"
                for k, v in sorted(groups.items())))
        for r in sel[-max(3, n // 100):][::-1]:
            a, b = r["t0"], r["t1"]
            act = r["act"][0]
            around = " ".join(f"{e['event']}@{(e['t'] - a) * 1000:.0f}" for e in events
                              if a - BEFORE_S <= e["t"] <= b and e["event"] != "activate")
            print(f"  {(b - a) * 1000:6.1f} ms: activation {act['activate_ms']:.1f} (bind {act['bind_ms']:.1f}, "
                  f"restore {act['restore_ms']:.1f}, waited {act['waited_ms']}) {act['workers']}; around (ms): {around}")
            if slices is not None:
                c, d = slices.within(a, b, role_for(bound_of(r)))
                print(f"      CPU ms: {_top(c, 6)} | delay: {_top(d, 3)}")
    # the warm requests (no activation during them): their time by the pool workers forked and the
    # workers ended from SPAWN_BEFORE_S before each to its answer - the held work beside them
    for op in ("ping", "run_wasm"):
        sel = [r for r in rows if r["op"] == op and not r["act"] and not r["first"]]
        if not sel:
            continue
        took = [(r["t1"] - r["t0"]) * 1000 for r in sel]
        print(f"\n{op}: {len(sel)} warm; p50 {_pct(took, 0.5):.2f} / p90 {_pct(took, 0.9):.2f} ms")
        for label, ts, cap in (("pool starts", spawns, 2), ("exits", exits, 2)):
            groups = defaultdict(list)
            for r, t in zip(sel, took):
                groups[min(cap, count(ts, r["t0"] - SPAWN_BEFORE_S, r["t1"]))].append(t)
            print(f"  by the {label} in its window: " + "; ".join(
                f"{k}{'+' if k == cap else ''}: {_pct(v, 0.5):.2f} / {_pct(v, 0.9):.2f} [{len(v)}]"
                for k, v in sorted(groups.items())))
        if slices is not None:
            cpu = defaultdict(float)
            for r in sel:
                c, _d = slices.within(r["t0"], r["t1"], role_for(bound_of(r)))
                for k, v in c.items():
                    cpu[k] += v / len(sel)
            print(f"  CPU ms while out (mean): {_top(cpu, 7, 2)}")
    bursts: list[int] = []
    run = 1
    for x, y in zip(spawns, spawns[1:]):
        if y - x < 0.010:
            run += 1
        else:
            bursts.append(run)
            run = 1
    if spawns:
        bursts.append(run)
    print(f"\nspawns {len(spawns)}, in bursts (< 10 ms apart) of: {dict(sorted(Counter(bursts).items()))}")
    how: Counter[str] = Counter()
    for e in events:
        if e["event"] == "activate":
            for k, v in (e.get("workers") or {}).items():
                how[k] += int(v)
    total = sum(how.values())
    print(f"activations' workers: {dict(how)}; warm {100 * how['warm'] / max(1, total):.1f} %")


def main() -> None:
    if "--report" in sys.argv:  # a kept record again: --report PREFIX
        prefix = sys.argv[sys.argv.index("--report") + 1]
        with open(prefix + ".json") as f:
            report(json.load(f), prefix + ".perf.data")
        return
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    use_perf = "--perf" in sys.argv
    kept: str | None = None
    if "--out" in sys.argv:
        kept = sys.argv[sys.argv.index("--out") + 1]
        args.remove(kept)
    tenants = int(args[0]) if args else 10_000
    requests = int(args[1]) if len(args) > 1 else 3_000
    keep = kept is not None
    work = tempfile.mkdtemp(prefix="twt-activation-trace-out-", dir=temp_parent())
    prefix = kept or os.path.join(work, "trace")
    try:
        data = record(tenants, requests, prefix, use_perf)
        report(data, prefix + ".perf.data" if use_perf else None)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
