"""``twt bench route --flood --sched``: where a victim's round trip waits, per thread, from the kernel.

A victim's ping crosses a dozen threads (its client and the client's libzmq
I/O thread, the supervisor's I/O thread and loop, its worker's I/O thread and
executor) and on a small host it can lose time at each hop in two ways:

* **run-queue wait** - woken and runnable, but the CPUs are busy (a busy
  core: the flood's own threads hold them);
* **neither running nor runnable** - the wake-up itself: an inter-processor
  interrupt, a halted vCPU coming back.

Linux keeps, per thread, the CPU time it ran and the time it waited runnable
on a run queue (``/proc/PID/task/TID/schedstat``: run ns, run-queue wait ns,
time slices; CONFIG_SCHED_INFO, present without ``perf`` or schedstats). The
flood bench reads it for every thread of the processes on the victim's path
before and after the victim's pings of each flood, and reports per role and
per ping: CPU run, run-queue wait and the share of a CPU each role used (a
role's wait includes the flood's own requests where the role serves both: the
supervisor). The victim's own threads (its client and its worker) do the same
work per ping in every flood, so their figures split its round trip: the rise
of their run-queue wait is time waiting for a CPU, the rise of their run time
the same work made slower (cold caches after a neighbour's copies).

``/proc/stat`` gives how busy the whole host was over the same window (all
sessions, not only this bench's), so "waiting for a CPU while a CPU was idle"
shows up as run-queue wait beside idle time.

Pure parsing and arithmetic on ``/proc`` text; the bench calls
:func:`snapshot` / :func:`host_snapshot` and :func:`split`. Linux only (elsewhere
every snapshot is empty and the table says so).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HostTimes", "RoleSplit", "ThreadTimes", "host_busy_cpus", "host_snapshot", "parse_proc_stat", "parse_schedstat",
           "snapshot", "split"]


@dataclass(frozen=True)
class ThreadTimes:
    """One thread's cumulative scheduler figures (``/proc/PID/task/TID/schedstat``)."""

    comm: str
    run_ns: int
    wait_ns: int


@dataclass(frozen=True)
class HostTimes:
    """``/proc/stat``'s first line (all CPUs, clock ticks) and when it was read."""

    busy_ticks: int
    total_ticks: int
    at: float


@dataclass(frozen=True)
class RoleSplit:
    """A role's threads over one window, per victim ping: CPU run, run-queue wait; its CPU share."""

    role: str
    threads: int
    run_us: float
    wait_us: float
    cpu_share: float


def parse_schedstat(text: str) -> tuple[int, int]:
    """``"run_ns wait_ns slices"`` -> (run ns, run-queue wait ns)."""
    fields = text.split()
    if len(fields) < 2:
        raise ValueError(f"not a schedstat line: {text!r}")
    return int(fields[0]), int(fields[1])


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread or process ended between the listing and the read
        return None


def snapshot(pids: Sequence[int]) -> dict[tuple[int, int], ThreadTimes]:
    """Every thread of ``pids`` now: (pid, tid) -> its figures (threads gone mid-read are left out)."""
    out: dict[tuple[int, int], ThreadTimes] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stat = _read(f"/proc/{pid}/task/{tid}/schedstat")
            comm = _read(f"/proc/{pid}/task/{tid}/comm")
            if stat is None or comm is None:
                continue
            try:
                run, wait = parse_schedstat(stat)
            except ValueError:
                continue
            out[(pid, int(tid))] = ThreadTimes(comm.strip(), run, wait)
    return out


def parse_proc_stat(text: str) -> tuple[int, int]:
    """``/proc/stat``'s ``cpu`` line -> (busy ticks, total ticks); idle and iowait are not busy."""
    fields = text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError("no cpu line first in /proc/stat")
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def host_snapshot() -> HostTimes | None:
    text = _read("/proc/stat")
    if text is None:
        return None
    try:
        busy, total = parse_proc_stat(text)
    except ValueError:
        return None
    return HostTimes(busy, total, time.perf_counter())


def host_busy_cpus(before: HostTimes | None, after: HostTimes | None) -> float | None:
    """CPUs busy on average between two host snapshots (every session's work, not only ours)."""
    if before is None or after is None or after.at <= before.at:
        return None
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    return (after.busy_ticks - before.busy_ticks) / ticks_per_s / (after.at - before.at)


def split(before: Mapping[tuple[int, int], ThreadTimes], after: Mapping[tuple[int, int], ThreadTimes],
          roles: Mapping[str, Sequence[int]], pings: int, seconds: float) -> list[RoleSplit]:
    """Per role (name -> its pids), over the window between the snapshots: run and run-queue wait
    per ping (us) and the CPUs it used. Threads present in only one snapshot are left out."""
    out = []
    for role, pids in roles.items():
        run = wait = 0
        threads = 0
        for key, now in after.items():
            then = before.get(key)
            if key[0] not in pids or then is None:
                continue
            threads += 1
            run += now.run_ns - then.run_ns
            wait += now.wait_ns - then.wait_ns
        per = max(1, pings) * 1000
        out.append(RoleSplit(role, threads, run / per, wait / per,
                             run / 1e9 / seconds if seconds > 0 else 0.0))
    return out
