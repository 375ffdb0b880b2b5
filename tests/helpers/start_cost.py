"""``python -m tests.helpers.start_cost [N] [WORKERS]``: the CPU one test supervisor start costs.

Starts ``tests.helpers.cluster.supervisor()`` N times (default 20) with WORKERS tenants (default 0:
none; 1: one worker spawned and ready) and prints the CPU of the whole process tree per start (user +
system). This process is a child subreaper, so what outlives its parent (a supervisor's resource
tracker, a worker after its supervisor) is reaped and counted here too. With
``PYTEST_TWT_ZYGOTE=0`` every start is a fresh ``python -m supervisor``; otherwise the suite's zygote
forks it (tests/helpers/zygote.py; its own start is left out: the first, unmeasured start).
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time

import supervisor.client.launch as launcher
from tests.helpers import zygote
from tests.helpers.cluster import instance_pid, supervisor, wait_for

_PR_SET_CHILD_SUBREAPER = 36
_TICKS = os.sysconf("SC_CLK_TCK")


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _tree_cpu() -> float:
    """CPU of every reaped descendant, and of the zygotes' reaped children (theirs until the end)."""
    time.sleep(0.5)  # orphans of the last start end and are reaped
    _reap()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    for pid in zygote.server_pids():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(v) for v in fields[11:15]) / _TICKS  # utime stime cutime cstime
    return total


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    zygote.install(launcher)
    tenants = [{"name": f"t{i}"} for i in range(workers)]
    with supervisor(tenants):
        pass  # the zygote's start (once per test process) is not a supervisor's
    t0, cpu0 = time.monotonic(), _tree_cpu()
    for _ in range(n):
        with supervisor(tenants) as handle:
            for i in range(workers):
                wait_for(lambda: instance_pid(handle, f"t{i}"), what=f"t{i}'s worker")
        _reap()
    wall = time.monotonic() - t0
    cpu = _tree_cpu() - cpu0
    how = "forked from the zygote" if zygote.enabled() else "fresh interpreters"
    print(f"{n} starts with {workers} worker(s), {how}: {cpu / n:.3f} s of CPU per start "
          f"(wall {wall / n:.3f} s)")
    zygote.stop()


if __name__ == "__main__":
    main()
