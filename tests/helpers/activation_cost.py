"""``python -m tests.helpers.activation_cost [CYCLES]``: the CPU of one park/activate cycle, by part.

On a forkserver supervisor of its own (stub backend, the density bench's settings, no
``max_active``), CYCLES times (default 30): park tenant ``a`` (``idle_timeout_s``), wait for the
pool to be full, activate it with a ping; then 200 pings to the active tenant. Prints, per cycle,
the CPU (user + system) of:

* a pool worker's start to warm: the forked worker's own CPU when it is idle and warmed in the
  pool (read before its bind), its minor (copy-on-write) faults so far (a count, not ms), and the
  fork server's own CPU per fork;
* the bind + restore + the waking ping, in the worker (its CPU after the ping less before it);
* the park in the worker (export, stop, exit: the fork server's reaped children's CPU less the
  worker's CPU read before the park began);
* the supervisor's: per activation (bind, restore, the ping), per park, per pool refill (start,
  hellos, warmed), and per warm ping - each less its idle housekeeping rate over the same time.

Live processes are read from ``/proc/PID/task/*/schedstat`` (ns, every thread); exited workers
from the fork server's ``cutime + cstime`` (clock ticks, 10 ms: read the park's *mean* over the
cycles, not its p50). The supervisor's parts with a poll in them (the park's, the refill's) count
the bench's own status and event reads; its clean whole cycle does not. On a shared host pair
each run with one of the tree to compare against, in the same minutes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil

from shared.rundir import temp_parent
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.tools.bench import density_parking as dp

_TICKS = os.sysconf("SC_CLK_TCK")


cpu_ns = dp.thread_cpu_ns  # every thread's CPU time so far (ns); 0 for a process that is gone


def reaped_ns(pid: int) -> int:
    """The CPU of ``pid``'s reaped children (cutime + cstime), ns."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) * 1_000_000_000 // _TICKS


def minor_faults(pid: int) -> int:
    """``pid``'s minor page faults so far (every thread's, ``/proc/PID/stat``); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return 0


def _forkserver(sup_pid: int) -> int:
    for child in psutil.Process(sup_pid).children():
        if any("forkserver" in part for part in child.cmdline()):
            return int(child.pid)
    raise RuntimeError("no fork server among the supervisor's children")


def _workers(fs: int) -> dict[int, int]:
    return {p.pid: cpu_ns(p.pid) for p in psutil.Process(fs).children()}


def _wait(c: SupervisorClient, what: str, pred: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise TimeoutError(what)


def _pool_settled(c: SupervisorClient) -> bool:
    pool = c.status(limit=1).supervisor.pool
    return bool(pool.idle >= pool.size and pool.starting == 0)


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    state = tempfile.mkdtemp(prefix="twt-activation-cost-", dir=temp_parent())
    parts: dict[str, list[float]] = {k: [] for k in (
        "pool_worker_start_to_warm", "pool_worker_start_faults", "forkserver_per_fork", "worker_bind_restore_ping", "worker_park_exit",
        "sup_activation", "sup_park", "sup_refill")}
    try:
        with dp.start_dense(state, max_active=None) as sup, sup.connect(timeout_s=120.0) as c:
            spid = sup.pid
            cap = c.register(None, TenantSpec.from_dict({"tenant_id": "a"}))
            c.ping(cap)
            fs = _forkserver(spid)
            # the supervisor's idle rate (housekeeping, heartbeats): subtracted from every part
            _wait(c, "pool", lambda: _pool_settled(c))
            t0, s0 = time.monotonic(), cpu_ns(spid)
            time.sleep(3.0)
            idle_rate = (cpu_ns(spid) - s0) / (time.monotonic() - t0)
            counted: set[int] = set()

            def sup_since(s: int, t: float) -> float:
                return (cpu_ns(spid) - s - idle_rate * (time.monotonic() - t)) / 1e6

            for _ in range(cycles):
                # park
                mark = dp._cursor(c)
                tenant_pid = next(i.pid for t in c.status().tenants if t.tenant_id == "a" for i in t.instances)
                assert tenant_pid
                before = cpu_ns(tenant_pid)
                r0, f0 = reaped_ns(fs), cpu_ns(fs)
                t, s = time.monotonic(), cpu_ns(spid)
                c.set_quota(None, "a", idle_timeout_s=dp.PARK_NOW_S)
                dp._wait_event(c, "park", "a", mark)
                c.set_quota(None, "a", idle_timeout_s=3600.0)
                _wait(c, "worker reaped", lambda: not os.path.exists(f"/proc/{tenant_pid}"))
                parts["sup_park"].append(sup_since(s, t))
                parts["worker_park_exit"].append((reaped_ns(fs) - r0 - before) / 1e6)
                # refill: whatever the park's room asked for
                t, s = time.monotonic(), cpu_ns(spid)
                _wait(c, "pool", lambda: _pool_settled(c))
                time.sleep(0.3)  # a warmed worker's last steps and its supervisor's bookkeeping
                parts["sup_refill"].append(sup_since(s, t))
                pool = _workers(fs)
                fresh = [pid for pid in pool if pid not in counted]
                for pid in fresh:
                    counted.add(pid)
                    parts["pool_worker_start_to_warm"].append(pool[pid] / 1e6)
                    parts["pool_worker_start_faults"].append(minor_faults(pid))
                if fresh:
                    parts["forkserver_per_fork"].append((cpu_ns(fs) - f0) / 1e6 / len(fresh))
                # activate
                mark = dp._cursor(c)
                t, s = time.monotonic(), cpu_ns(spid)
                c.ping(cap)
                dp._wait_event(c, "activate", "a", mark)
                parts["sup_activation"].append(sup_since(s, t))
                after = _workers(fs)
                bound = [pid for pid in pool if pid in after and after[pid] - pool[pid] > 0]
                bound_pid = max(bound, key=lambda pid: after[pid] - pool[pid])
                parts["worker_bind_restore_ping"].append((after[bound_pid] - pool[bound_pid]) / 1e6)
            # warm pings
            t, s = time.monotonic(), cpu_ns(spid)
            n = 200
            for _ in range(n):
                c.ping(cap)
            per_ping = sup_since(s, t) / n
            # a set_quota that changes nothing (the clean cycles below pay two of them)
            t, s = time.monotonic(), cpu_ns(spid)
            for _ in range(20):
                c.set_quota(None, "a", idle_timeout_s=3600.0)
            per_set_quota = sup_since(s, t) / 20
            # the supervisor's whole cycle without the polls above: fixed waits, one look at the end
            mark = dp._cursor(c)
            t, s = time.monotonic(), cpu_ns(spid)
            clean = max(5, cycles // 2)
            for _ in range(clean):
                c.set_quota(None, "a", idle_timeout_s=dp.PARK_NOW_S)
                time.sleep(1.2)  # parked at a housekeeping tick, the pool refilled
                c.set_quota(None, "a", idle_timeout_s=3600.0)
                time.sleep(0.3)
                c.ping(cap)
                time.sleep(0.5)
            sup_cycle = (sup_since(s, t) - clean * (2 * per_set_quota + per_ping)) / clean
            parks, wakes = len(dp._events(c, "park", "a", mark)), len(dp._events(c, "activate", "a", mark))
            if parks != clean or wakes != clean:
                raise AssertionError(f"{clean} clean cycles made {parks} parks and {wakes} activations")
    finally:
        shutil.rmtree(state, ignore_errors=True)
    print(f"{cycles} cycles; load {os.getloadavg()[0]:.1f}; supervisor idle {idle_rate / 1e6:.2f} ms CPU/s "
          "(subtracted)")
    print(f"{'part':32} {'mean ms':>8} {'p50 ms':>8} {'n':>4}")
    for name, values in parts.items():
        if values:
            print(f"{name:32} {statistics.fmean(values):8.2f} {statistics.median(values):8.2f} {len(values):4}")
    print(f"{'sup_per_warm_ping':32} {per_ping:8.3f}")
    print(f"{'sup_per_set_quota':32} {per_set_quota:8.3f}")
    print(f"{'sup_whole_cycle (clean)':32} {sup_cycle:8.2f}")


if __name__ == "__main__":
    main()
