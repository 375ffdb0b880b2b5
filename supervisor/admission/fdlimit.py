"""File descriptors: the supervisor's soft limit raised to the hard one at start.

Every client connection costs the supervisor a file descriptor, and so does
each registered tenant (its segment's fd and mapping), each worker (two
sockets, a sentinel pipe). At the soft limit libzmq's ipc accept asserts
(``Too many open files (src/ipc_listener.cpp:297)``) and the process aborts,
taking every tenant's workers with it. So the supervisor starts by raising
its soft limit as far as it may (the hard limit, and the kernel's
``fs.nr_open``), and the frontend sheds connections well before the limit
(``fd_budget``): the limit is a resource like any other, never a crash.
"""

from __future__ import annotations

import logging
import os
import resource

from shared.log import get_logger, log_event

__all__ = ["fd_budget", "open_fds", "raise_fd_limit"]

_log = get_logger("supervisor.admission.fdlimit")

#: fds kept free for what the supervisor itself opens (workers, segments, logs, sqlite, ...)
RESERVE_FDS = 256


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def raise_fd_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; return (soft, hard) in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log_event(_log, logging.WARNING, "supervisor.fd_limit_not_raised", soft=soft, hard=hard, error=str(exc))
        else:
            log_event(_log, logging.INFO, "supervisor.fd_limit_raised", soft=soft, to=target, hard=hard)
            soft = target
    return soft, hard


def open_fds() -> int:
    """How many fds this process has open now (Linux: /proc/self/fd)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def fd_budget(soft: int) -> int:
    """How many client connections the frontend may hold with a soft limit of ``soft``:
    half of what is left after the reserve (the other half covers tenants and workers)."""
    return max(16, (soft - RESERVE_FDS) // 2)
