"""CPU per test, for finding where the suite's time goes (``PYTEST_TWT_CPU_LOG=PATH``).

With ``PYTEST_TWT_CPU_LOG`` set, every test process (each xdist worker) appends one JSON line per
test to ``PATH.<worker>``: its node id, its wall start and end, and the CPU it cost - the test
process's own, its reaped children's (``RUSAGE_CHILDREN``: fresh ``python -m supervisor``
processes, ``twt`` commands, Ray's processes once shut down) and the suite's zygotes' whole trees,
read from ``/proc``: each zygote's and every live descendant's own CPU and reaped children's (every
forked supervisor, its fork server and workers). So a module fixture's supervisor's work lands on
the tests that made it, not on the test at whose end the fixture stops it (its tree is reaped only
then: a module's GEMM load once showed as 9-10 s of a 0.1 s test). A module-scoped fixture's
set-up lands on the module's first test, its tear-down on its last. Not counted: children
orphaned away from the test process, and the CPU of a live child of the test process itself
started outside a zygote (counted where it is reaped).

``python -m tests.helpers.cpu_profile PATH [N]`` sums the lines per module and per worker: the
top N modules by CPU, and each worker's busy wall time (the critical path of a parallel run).
"""

from __future__ import annotations

import glob
import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

from tests.helpers import hygiene

__all__ = ["ENV", "Recorder", "summarize"]

#: where the lines go (unset: nothing is recorded)
ENV = "PYTEST_TWT_CPU_LOG"
_TICK = float(os.sysconf("SC_CLK_TCK"))


def _live_tree_cpu(pid: int) -> float:
    """The CPU of ``pid`` and every live descendant, each with its reaped children's: a child's
    CPU moves into its parent's reaped figure when the parent reaps it, so the sum only grows
    (a descendant reaped by a process outside the tree would take its CPU away: a zygote is its
    tree's subreaper, so none is)."""
    return _tree_cpu(pid) + sum(_tree_cpu(kid) for kid in hygiene.descendants(pid))


def _tree_cpu(pid: int) -> float:
    """A process's CPU plus its reaped children's, in seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    # after the command: state is fields[0]; utime, stime, cutime, cstime are stat's 14-17
    return sum(int(v) for v in fields[11:15]) / _TICK


class Recorder:
    """Measures each test's CPU (see the module docstring) and appends it to ``path``."""

    def __init__(self, path: str, servers: Callable[[], Iterable[int]]) -> None:
        self._path = path
        self._servers = servers
        self._start_wall = 0.0
        self._start_cpu = 0.0

    def _cpu(self) -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        own = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        return own + sum(_live_tree_cpu(pid) for pid in self._servers())

    def start(self) -> None:
        self._start_wall = time.time()
        self._start_cpu = self._cpu()

    def stop(self, nodeid: str) -> None:
        line = {"id": nodeid, "t0": round(self._start_wall, 3), "t1": round(time.time(), 3),
                "cpu": round(self._cpu() - self._start_cpu, 3)}
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def summarize(prefix: str, top: int = 20) -> str:
    """The report of ``python -m tests.helpers.cpu_profile``: CPU per module, wall per worker."""
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # cpu, wall, tests
    workers: dict[str, list[float]] = {}
    tests: list[tuple[float, float, str]] = []
    for path in sorted(glob.glob(prefix + ".*")):
        worker = path.rsplit(".", 1)[1]
        first, last, busy = float("inf"), 0.0, 0.0
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(raw) for raw in f]
        for line in lines:
            entry = modules[line["id"].split("::", 1)[0]]
            entry[0] += line["cpu"]
            entry[1] += line["t1"] - line["t0"]
            entry[2] += 1
            tests.append((line["cpu"], line["t1"] - line["t0"], line["id"]))
            first, last = min(first, line["t0"]), max(last, line["t1"])
            busy += line["t1"] - line["t0"]
        workers[worker] = [first, last, busy]
    total = sum(e[0] for e in modules.values())
    out = [f"{len(modules)} modules, {sum(int(e[2]) for e in modules.values())} tests, {total:.1f} s of CPU in tests",
           f"{'cpu s':>8} {'wall s':>8} {'tests':>6}  module"]
    for name, (cpu, wall, count) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{cpu:8.1f} {wall:8.1f} {int(count):6d}  {name}")
    out.append(f"{'cpu s':>8} {'wall s':>8}  test")
    for cpu, wall, nodeid in sorted(tests, reverse=True)[:top]:
        out.append(f"{cpu:8.1f} {wall:8.1f}  {nodeid}")
    if workers:
        start = min(w[0] for w in workers.values())
        out.append("worker: first test at, last test ended at, busy (s from the first test of the run)")
        for name, (first, last, busy) in sorted(workers.items()):
            out.append(f"  {name}: {first - start:6.1f} {last - start:6.1f} {busy:6.1f}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20))
