"""``python -m tests.helpers.tree_cpu [--linger S] -- CMD ...``: the CPU of a command's whole process tree.

``time`` reports the CPU of the children a command reaps; a test run's processes that outlive their
parents (a supervisor's resource tracker and fork server, a worker of a killed supervisor, Ray's
daemons) are reaped by init and never counted, and ``/proc/stat`` counts everything else the
machine runs too. Here this process becomes the tree's subreaper (Linux's
``PR_SET_CHILD_SUBREAPER``), so every descendant that is orphaned is reparented to it and reaped
here. Once CMD exits it waits up to ``--linger`` seconds (default 30) for what is left, then prints
one line: wall time, user + system CPU of everything reaped, and how many descendants still ran
(their CPU is missing from the figure). It exits with CMD's status.

What a process that ignores SIGCHLD starts is reaped by the kernel and its usage reaches no one:
Ray's raylet does (its dashboard and runtime-env agents and its Python workers, ~12 s of a run's
CPU in the cluster module), so for Ray's share ``perf stat -e task-clock -- CMD`` (its counters
are inherited at fork, whoever reaps) is the figure.

    python -m tests.helpers.tree_cpu -- make test
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def _reap_all(until: float) -> int:
    """Reap descendants until none is left or ``until`` (monotonic) passes; how many are left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid:
            continue
        if time.monotonic() >= until:
            return len(_children())
        time.sleep(0.1)


def _children() -> list[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def main(argv: list[str]) -> int:
    linger = 30.0
    if argv[:1] == ["--linger"]:
        linger, argv = float(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("tree_cpu: cannot become a subreaper (not Linux?): orphans are not counted", file=sys.stderr)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv)
    while True:  # reaping orphans as they come, so that none waits as a zombie until the end
        pid, status = os.wait()
        if pid == proc.pid:
            code = proc.returncode = os.waitstatus_to_exitcode(status)
            break
    wall = time.monotonic() - t0
    left = _reap_all(time.monotonic() + linger)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"tree_cpu: wall {wall:.1f} s, CPU {usage.ru_utime + usage.ru_stime:.1f} s "
          f"(user {usage.ru_utime:.1f} s, system {usage.ru_stime:.1f} s), "
          f"{left} descendant(s) still running after {linger:.0f} s (not counted)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
