"""``twt bench density``'s parking half: parked tenants woken by a Zipf(1.1) stream, at most 64 active.

Measured in one run (stub backend, each figure beside its baseline):

* **the stream**: the bench's registered tenants (``d00000`` ...) are stored as a supervisor that
  parked them all would have stored them (one instance, ``idle_timeout_s``, the parked flag: the
  registrations themselves are measured before, with ``instances = 0``), and a supervisor with
  ``max_active = 64`` restarts on that state (restart to ready: every tenant back, none started).
  One client then sends a Zipf(1.1) stream over them, half ``ping`` and half a small ``run_wasm``
  (a stored module, run by digest), one request at a time. A request whose tenant was activated for
  it (an ``activate`` event of that tenant while it was served) is *cold*, the others *warm*; the
  activation overhead is a cold request's time minus the warm p50 of the same op. Past 64 active
  tenants, each activation parks the least recently used idle one first (``max_active``). The
  ``activate`` events split each activation: its workers bound (``bind_ms``: a warm pool worker's
  bind, or a pool worker still starting, or a new process), its buffers restored (``restore_ms``),
  and count how its workers came (warm / starting / spawned): where a tail comes from.
* **CPU** of the stream, per activation: the supervisor's, the fork server's own (its forks) and
  its workers' (the pool workers' starts, binds, restores, requests, parks and exits).
* **fds and /dev/shm segments** of the supervisor after the stream, beside the workers alive.
* **64 MiB restore**: a tenant holding one 64 MiB buffer is parked and woken by a ping; its
  restore time is its activation time (the ``activate`` event's ``activate_ms``) minus that of a
  tenant without buffers woken the same way, round by round. Against a memcpy of the same 64 MiB
  into fresh memory in the bench's process (what a restore must do at least: new pages, one copy).
* **first run after activation**: a tenant runs a stored module (compiled), is parked, is woken by
  a ping, then its first ``run_wasm`` is timed against its warm runs; the same for a module stored
  but never run before the park (no artifact: compiled at that run), for comparison.

Typing: the report rows are JSON-shaped dicts, read back by key.
"""

from __future__ import annotations

import bisect
import itertools
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shared.capability import TenantCapability
from shared.errors import CapacityExhausted
from shared.rundir import temp_parent
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.client.launch import SupervisorHandle, launch
from supervisor.store.state import StateStore
from supervisor.tools.bench import route_sched
from supervisor.tools.demo import guest_path

__all__ = ["MAX_ACTIVE", "RUN_WASM_SHARE", "STREAM_REQUESTS", "ZIPF_S", "measure_buffers_and_first_run",
           "measure_first_run", "measure_stream", "park_all", "zipf_stream"]

MiB = 1 << 20
MAX_ACTIVE = 64
ZIPF_S = 1.1
#: the share of the stream's requests that are a ``run_wasm`` (the rest: ``ping``)
RUN_WASM_SHARE = 0.5
#: the full stream's length: long enough that each op's activation overhead p99 rests on >= 5
#: activating requests. A tenant's first ``run_wasm`` ever compiles and is not counted, and over
#: 10,000 tenants most run_wasm activations are such a first run: 2,000 requests left ~139
#: activating runs (their p99 the second-worst), 5,000 leave ~550 (and ~1,300 pings).
STREAM_REQUESTS = 5000
#: the parked tenants' idle time: long enough that the stream's parks are max_active's (LRU)
IDLE_S = 30.0
#: a tiny idle time that parks a tenant at the next housekeeping
PARK_NOW_S = 0.2
BIG = 64 * MiB


def zipf_stream(n: int, count: int, s: float, seed: int) -> list[int]:
    """``count`` draws of tenant indexes 0..n-1 with P(rank k) ~ 1/k**s, ranks shuffled over the
    indexes (the popular tenants are not the first registered)."""
    rng = random.Random(seed)
    cum = list(itertools.accumulate(k ** -s for k in range(1, n + 1)))
    order = list(range(n))
    rng.shuffle(order)
    return [order[min(bisect.bisect_left(cum, rng.random() * cum[-1]), n - 1)] for _ in range(count)]


def park_all(state_dir: str, names: list[str]) -> None:
    """Store ``names`` (registered, stopped supervisor) as parked tenants with one instance and
    ``idle_timeout_s``: two transactions."""
    store = StateStore.open(state_dir)
    try:
        wanted = set(names)
        stored = [t for t in store.tenants() if t.spec.tenant_id in wanted]
        store.register_many([(replace(t.spec, instances=1, idle_timeout_s=IDLE_S), t.generation, "runtime")
                             for t in stored])
        store.set_parked_many([t.spec.tenant_id for t in stored], True)
    finally:
        store.close()


def start_dense(state_dir: str, *, max_active: int | None) -> Any:
    """A supervisor for the parking workload (forkserver workers, an adaptive warm pool)."""
    settings: dict[str, object] = {"pool_size": 2, "pool_max": 8, "log_level": "warning", "max_tenants": 16_384,
                                   "start_method": "forkserver"}
    if max_active is not None:
        settings["max_active"] = max_active
    return launch({"supervisor": settings, "tenant": []}, backend="stub", extra_args=["--state-dir", state_dir],
                  ready_timeout_s=600.0)


def _cursor(c: SupervisorClient) -> int:
    nxt = c.events_page(None)["next"]
    assert isinstance(nxt, int)
    return nxt


def _events(c: SupervisorClient, kind: str, tid: str, after: int) -> list[dict[str, Any]]:
    events = c.events_page(None, after, kinds=[kind])["events"]
    assert isinstance(events, list)
    return [e for e in events if isinstance(e, dict) and e.get("tenant") == tid]


def _wait_event(c: SupervisorClient, kind: str, tid: str, after: int, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _events(c, kind, tid, after)
        if found:
            return found[0]
        time.sleep(0.005)
    raise TimeoutError(f"no {kind} event of {tid} within {timeout_s:g} s")


def _pool_full(c: SupervisorClient, timeout_s: float = 60.0) -> None:
    """Wait until the warm pool is refilled (an activation then binds a warm worker)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = c.status(limit=1).supervisor.pool
        if pool.idle >= pool.size and pool.starting == 0:
            return
        time.sleep(0.01)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_ns(pid: int) -> int:
    """Every thread's CPU time of a live process so far (ns; ``/proc/PID/task/*/schedstat`` through
    :func:`route_sched.snapshot`, ns resolution, not the clock ticks of ``/proc/PID/stat``); 0 when
    it is gone or there is no /proc."""
    return sum(t.run_ns for t in route_sched.snapshot([pid]).values())


def _thread_cpu_s(pid: int) -> float:
    """:func:`thread_cpu_ns` in seconds."""
    return thread_cpu_ns(pid) / 1e9


def _reaped_cpu_s(pid: int) -> float:
    """The CPU of ``pid``'s reaped children (``cutime + cstime``, clock ticks), s."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) / _TICKS
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_sample(supervisor_pid: int) -> dict[str, float]:
    """The CPU so far (s) of the supervisor process, of its fork server's own process, and of every
    worker it forked (those alive, read per thread, plus those it reaped). Two samples' difference is
    what a stretch of work cost each part; a worker that lived through only part of it is counted
    only for that part (alive at the first sample: its CPU then is subtracted; born later: from 0).
    Without a fork server (``spawn`` workers are the supervisor's children) the workers read 0."""
    import psutil

    out = {"supervisor": _thread_cpu_s(supervisor_pid), "fork_server": 0.0, "workers": 0.0}
    try:
        children = psutil.Process(supervisor_pid).children()
    except psutil.Error:
        return out
    for child in children:
        try:
            if not any("forkserver" in part for part in child.cmdline()):
                continue
            workers = child.children()
        except psutil.Error:
            continue
        out["fork_server"] += _thread_cpu_s(child.pid)
        out["workers"] += _reaped_cpu_s(child.pid) + sum(_thread_cpu_s(w.pid) for w in workers)
    return out


def measure_stream(sup: SupervisorHandle, names: list[str], requests: int, seed: int) -> dict[str, Any]:
    """The Zipf stream over ``names`` on a restarted ``max_active`` supervisor (see the module docstring)."""
    module = guest_path("probe").read_bytes()
    stream = zipf_stream(len(names), requests, ZIPF_S, seed)
    rng = random.Random(seed + 1)
    caps: dict[int, TenantCapability] = {}
    stored: set[int] = set()
    ran: set[int] = set()
    first_compiles: list[float] = []
    artifact_misses = 0
    times: dict[tuple[str, bool], list[float]] = {("ping", False): [], ("ping", True): [],
                                                  ("run_wasm", False): [], ("run_wasm", True): []}
    refused = 0
    out: dict[str, Any] = {}
    phases: dict[str, list[float]] = {"bind": [], "restore": [], "total": []}
    #: the whole activation, by how its worker came: a warm pool worker's, or not (the tail's source)
    by_how: dict[str, list[float]] = {"warm": [], "other": []}
    #: when (s into the stream) each activation that did not get a warm worker happened
    cold_at: list[float] = []
    #: each activating request's client time beyond its activation's whole time (the supervisor's
    #: account, ``activate_ms``) and its op's warm time: the tail outside the activation itself
    outside: list[float] = []
    got: dict[str, int] = {}
    outside_ops: list[str] = []
    outside_room: list[bool] = []
    outside_how: list[str] = []
    with sup.connect(timeout_s=120.0) as c:
        digest = ""
        cpu_before = cpu_sample(sup.pid)
        t_stream = time.perf_counter()
        for index in stream:
            tid = names[index]
            cap = caps.get(index)
            if cap is None:
                cap = caps[index] = c.tenant_capability(None, tid)
            op = "run_wasm" if rng.random() < RUN_WASM_SHARE else "ping"
            if op == "run_wasm" and index not in stored:
                digest = c.put_module(cap, module)  # served by the supervisor: no activation
                stored.add(index)
            call: Callable[[], object] = ((lambda: c.ping(cap)) if op == "ping"
                                          else (lambda: c.run_wasm(cap, digest, "add", [2, 40]).cached))
            mark = _cursor(c)
            while True:
                t0 = time.perf_counter()
                try:
                    cached = call()
                except CapacityExhausted as exc:  # no room and none could be made: counted, retried
                    refused += 1
                    time.sleep(exc.retry_after_s or 0.05)
                    continue
                dt = time.perf_counter() - t0
                break
            woke = _events(c, "activate", tid, mark)
            activated = bool(woke)
            for event in woke:  # where the activation's time went, and how its worker came
                phases["bind"].append(float(event.get("bind_ms", 0.0)))
                phases["restore"].append(float(event.get("restore_ms", 0.0)))
                phases["total"].append(float(event.get("activate_ms", 0.0)))
                workers = event.get("workers") or {}
                for how, n in workers.items():
                    got[how] = got.get(how, 0) + int(n)
                pooled = set(workers) <= {"warm"}
                by_how["warm" if pooled else "other"].append(float(event.get("activate_ms", 0.0)))
                if not pooled:
                    cold_at.append(time.perf_counter() - t_stream)
            if woke and not (op == "run_wasm" and index not in ran):
                outside.append(dt * 1000 - sum(float(e.get("activate_ms", 0.0)) for e in woke))
                outside_ops.append(op)
                # the activation could not begin at once: it waited for room (a park under way) first
                outside_room.append(any(float(e.get("waited_ms", 0.0)) > 0.0 for e in woke))
                outside_how.append("+".join(sorted({str(k) for e in woke for k in (e.get("workers") or {})})))
            if op == "run_wasm" and index not in ran:
                # the tenant's first run ever compiles its module: not an activation's cost
                ran.add(index)
                first_compiles.append(dt)
                continue
            if op == "run_wasm" and cached is False:
                artifact_misses += 1  # compiled before, parked since: the artifact should have served it
            times[(op, activated)].append(dt)
        out["stream_s"] = time.perf_counter() - t_stream
        cpu_after = cpu_sample(sup.pid)
        out["cpu_s"] = {part: cpu_after[part] - cpu_before[part] for part in cpu_before}
        status = c.status(limit=1)
        out["workers_alive"] = status.supervisor.workers
        out["pool_idle"] = status.supervisor.pool.idle
        out["tenant_states"] = status.summary.to_wire().get("states") if status.summary is not None else None
    out["requests"] = requests
    out["distinct_tenants"] = len(set(stream))
    out["capacity_refusals"] = refused
    out["first_compiles_n"] = len(first_compiles)
    out["first_compile_p50_s"] = statistics.median(first_compiles) if first_compiles else None
    out["artifact_misses"] = artifact_misses
    for phase, values in phases.items():  # the supervisor's own account (activate events), ms
        out[f"activate_{phase}_p50_ms"] = statistics.median(values) if values else None
        out[f"activate_{phase}_p99_ms"] = _pct(values, 0.99) if values else None
    out["activation_workers"] = got
    # the stream's CPU per activation (ms): each activation's cycle (a pool worker's fork and start,
    # its bind and restore, past max_active a park and a worker's exit) plus its share of the
    # requests' routing - what contends with the requests on a small host
    wakes = len(phases["total"])
    out["activations"] = wakes
    out["cpu_per_activation_ms"] = ({part: 1000 * v / wakes for part, v in out["cpu_s"].items()} if wakes else None)
    for how, values in by_how.items():
        out[f"activate_{how}_n"] = len(values)
        out[f"activate_{how}_p50_ms"] = statistics.median(values) if values else None
        out[f"activate_{how}_p99_ms"] = _pct(values, 0.99) if values else None
    out["activate_other_at_s"] = [round(t, 2) for t in cold_at]
    # less the op's warm p50: what an activating request waited for beyond its activation
    warm_ms = {op: statistics.median(times[(op, False)]) * 1000 if times[(op, False)] else 0.0
               for op in ("ping", "run_wasm")}
    beyond = [v - warm_ms[op] for v, op in zip(outside, outside_ops)]
    out["activate_outside_p50_ms"] = statistics.median(beyond) if beyond else None
    out["activate_outside_p99_ms"] = _pct(beyond, 0.99) if beyond else None
    roomed = [v for v, room in zip(beyond, outside_room) if room]
    out["activate_room_n"] = len(roomed)
    out["activate_room_p50_ms"] = statistics.median(roomed) if roomed else None
    out["activate_room_p99_ms"] = _pct(roomed, 0.99) if roomed else None
    worst = sorted(zip(beyond, outside_room, outside_how, outside_ops), reverse=True)[:8]
    out["activate_outside_worst"] = [f"{v:.0f} {op} {how}{' room' if room else ''}" for v, room, how, op in worst]
    for how in ("warm", "other"):  # by how the activation's workers came
        those = [v for v, h in zip(beyond, outside_how) if (h == "warm") == (how == "warm")]
        out[f"activate_outside_{how}_p99_ms"] = _pct(those, 0.99) if those else None
        out[f"activate_outside_{how}_n"] = len(those)
    for op in ("ping", "run_wasm"):
        warm, cold = times[(op, False)], times[(op, True)]
        out[f"{op}_warm_n"], out[f"{op}_cold_n"] = len(warm), len(cold)
        base = statistics.median(warm) if warm else 0.0
        out[f"{op}_warm_p50_s"] = base
        out[f"{op}_warm_p99_s"] = _pct(warm, 0.99) if warm else None
        out[f"{op}_cold_p50_s"] = statistics.median(cold) if cold else None
        out[f"{op}_cold_p99_s"] = _pct(cold, 0.99) if cold else None
        out[f"{op}_overhead_p50_s"] = statistics.median(cold) - base if cold else None
        out[f"{op}_overhead_p99_s"] = _pct(cold, 0.99) - base if cold else None
    return out


def _memcpy(src: bytes, rounds: int) -> tuple[float, float]:
    """Bytes per second of a copy of ``src`` into fresh memory (allocation and first touch
    counted: what a restore into a new worker must do at least), and into memory touched before."""
    fresh: list[float] = []
    hot: list[float] = []
    dst = bytearray(len(src))
    dst[:] = src
    for _ in range(rounds):
        t0 = time.perf_counter()
        new = bytearray(src)
        fresh.append(time.perf_counter() - t0)
        del new
        t0 = time.perf_counter()
        dst[:] = src
        hot.append(time.perf_counter() - t0)
    return len(src) / statistics.median(fresh), len(src) / statistics.median(hot)


def _park_and_wake(c: SupervisorClient, cap: TenantCapability, tid: str) -> dict[str, Any]:
    """Park ``tid`` now, wait for it, then wake it with a ping: its ``activate`` event."""
    mark = _cursor(c)
    c.set_quota(None, tid, idle_timeout_s=PARK_NOW_S)
    _wait_event(c, "park", tid, mark)
    c.set_quota(None, tid, idle_timeout_s=3600.0)
    _pool_full(c)
    mark = _cursor(c)
    c.ping(cap)
    return _wait_event(c, "activate", tid, mark)


def measure_buffers_and_first_run(rounds: int) -> dict[str, Any]:
    """The 64 MiB restore and the first run after activation, on a supervisor of their own
    (no ``max_active``: an activation waits for no other tenant's park)."""
    state = tempfile.mkdtemp(prefix="twt-bench-density-park-", dir=temp_parent())
    out: dict[str, Any] = {}
    src = random.Random(7).randbytes(BIG)
    try:
        with start_dense(state, max_active=None) as sup, sup.connect(timeout_s=120.0) as c:
            quota = {"memory_quota_bytes": 4 * BIG, "gpu_memory_bytes_cap": 2 * BIG}
            big = c.register(None, TenantSpec.from_dict({"tenant_id": "big", **quota}))
            empty = c.register(None, TenantSpec.from_dict({"tenant_id": "empty", **quota}))
            handle = c.alloc(big, BIG)
            c.write(big, handle, src)
            restore: list[float] = []
            memcpy: list[float] = []
            memcpy_hot: list[float] = []
            for _ in range(rounds):
                full = _park_and_wake(c, big, "big")
                bare = _park_and_wake(c, empty, "empty")
                restore.append(max(1e-6, (float(full["activate_ms"]) - float(bare["activate_ms"])) / 1000))
                out.setdefault("activate_ms_big", []).append(full["activate_ms"])
                out.setdefault("activate_ms_empty", []).append(bare["activate_ms"])
                fresh, hot = _memcpy(src, 3)
                memcpy.append(fresh)
                memcpy_hot.append(hot)
            if c.read(big, handle, 4096) != src[:4096]:
                raise AssertionError("the restored buffer's bytes differ")
            out["restore_s"] = statistics.median(restore)
            out["restore_bytes_per_s"] = BIG / out["restore_s"]
            out["memcpy_bytes_per_s"] = statistics.median(memcpy)
            out["memcpy_hot_bytes_per_s"] = statistics.median(memcpy_hot)

            out.update(_first_runs(c, rounds, quota))
        return out
    finally:
        shutil.rmtree(state, ignore_errors=True)


def measure_first_run(rounds: int) -> dict[str, Any]:
    """Only the first run after activation against a warm one (``--first-run-only``), ``rounds``
    activations on a supervisor of its own: a short run, labelled with the host's load."""
    state = tempfile.mkdtemp(prefix="twt-bench-density-first-", dir=temp_parent())
    try:
        with start_dense(state, max_active=None) as sup, sup.connect(timeout_s=120.0) as c:
            return _first_runs(c, rounds, {"memory_quota_bytes": 4 * BIG, "gpu_memory_bytes_cap": 2 * BIG})
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _first_runs(c: SupervisorClient, rounds: int, quota: dict[str, int]) -> dict[str, Any]:
    """``rounds`` times: park tenant ``wasm``, wake it with a ping (a warm pool worker is bound),
    time its first ``run_wasm`` of a module compiled before the park (its artifact), then five warm
    ones; and once a module never run before the park (compiled at that run). Medians, the
    per-activation ratios' median, and the 1-minute load average before and after."""
    out: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    wasm = c.register(None, TenantSpec.from_dict({"tenant_id": "wasm", **quota}))
    probe = guest_path("probe").read_bytes()
    other = probe + b"\n;; the same code under another digest: stored, never run before the park\n"
    digest = c.put_module(wasm, probe)
    cold_digest = c.put_module(wasm, other)
    c.run_wasm(wasm, digest, "add", [1, 2])  # compiled before the park: kept as an artifact
    first: list[float] = []
    warm: list[float] = []
    compiled: list[float] = []
    cached_first: list[bool] = []
    woke: list[dict[str, Any]] = []
    for _ in range(rounds):
        woke.append(_park_and_wake(c, wasm, "wasm"))
        t0 = time.perf_counter()
        cached_first.append(c.run_wasm(wasm, digest, "add", [1, 2]).cached)
        first.append(time.perf_counter() - t0)
        for _ in range(5):
            t0 = time.perf_counter()
            c.run_wasm(wasm, digest, "add", [1, 2])
            warm.append(time.perf_counter() - t0)
    # a module stored but never run before the park: no artifact, compiled at its first run
    _park_and_wake(c, wasm, "wasm")
    t0 = time.perf_counter()
    c.run_wasm(wasm, cold_digest, "add", [1, 2])
    compiled.append(time.perf_counter() - t0)
    out["first_run_s"] = statistics.median(first)
    out["warm_run_s"] = statistics.median(warm)
    out["first_run_compiling_s"] = statistics.median(compiled)
    out["first_run_cached"] = all(cached_first)
    ratios = [f / statistics.median(warm[i * 5:i * 5 + 5]) for i, f in enumerate(first)]
    out["first_run_ratio_p50"] = statistics.median(ratios)
    out["first_run_rounds"] = len(first)
    for phase in ("activate_ms", "bind_ms", "restore_ms"):  # the ping's activation, by phase
        out[f"first_run_{phase}_p50"] = statistics.median(float(e.get(phase, 0.0)) for e in woke)
    out["load_after"] = os.getloadavg()[0]
    return out
