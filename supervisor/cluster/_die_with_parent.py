"""``python -m supervisor.cluster._die_with_parent PPID [--nice N] CMD...``: exec CMD, to die when PPID does.

Sets ``PR_SET_PDEATHSIG(SIGTERM)`` (kept across ``execve``), checks that the
parent is still ``PPID`` (it may have died before the prctl), with ``--nice N``
lowers its niceness to N (see below), then becomes CMD.

``--nice``: Ray starts its workers, the node actor among them, at niceness 15
(``worker_niceness``), and a child inherits it: a supervisor and its tenants'
workers started by the actor would get ~1/30 of a nice-0 process's share of a
busy node's CPUs (the cluster tests' supervisors took over 60 s to start beside
eight busy processes, against 1.7 s at niceness 0). The actor passes the
niceness of the node's raylet. Lowering needs ``CAP_SYS_NICE`` (or
``RLIMIT_NICE``); without it the command runs at the niceness it has and says so
on stderr (the node's status shows it; docs/CLUSTER.md: ``RAY_worker_niceness=0``).

The node actor starts its supervisor through this instead of a
``preexec_fn``, which is unsafe in a process with threads (a Ray worker has
many). SIGTERM, not SIGKILL: the supervisor stops its workers and unlinks
its segments on the way out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

__all__: list[str] = []

_PR_SET_PDEATHSIG = 1


_USAGE = "usage: python -m supervisor.cluster._die_with_parent PPID [--nice N] CMD..."


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit(_USAGE)
    ppid, cmd = int(argv[0]), argv[1:]
    nice: int | None = None
    if cmd[0] == "--nice":
        if len(cmd) < 3 or not cmd[1].lstrip("-").isdigit():
            sys.exit(_USAGE)
        nice, cmd = int(cmd[1]), cmd[2:]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != ppid:
        sys.exit(71)  # the parent died before the prctl took effect
    if nice is not None:
        lower_niceness(nice)
    os.execv(cmd[0], cmd)


def lower_niceness(target: int) -> int:
    """Lower this process's niceness to ``target`` when it is higher (never raises it); the niceness it
    then has. Without the privilege to lower it, one line on stderr says what it stays at."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current <= target:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    except PermissionError:
        print(f"twt: running at niceness {current}, not {target}: lowering it needs CAP_SYS_NICE or RLIMIT_NICE "
              "(start Ray with RAY_worker_niceness=0, docs/CLUSTER.md)", file=sys.stderr, flush=True)
        return current
    return target


if __name__ == "__main__":
    main(sys.argv[1:])
