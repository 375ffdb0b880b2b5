"""File descriptors: the supervisor's soft limit raised to the hard one at start.

Every client connection costs the supervisor a file descriptor, and so does
each registered tenant (its segment's fd and mapping), each worker (two
sockets, a sentinel pipe). At the soft limit libzmq's ipc accept asserts
(``Too many open files (src/ipc_listener.cpp:297)``) and the process aborts,
taking every tenant's workers with it. So the supervisor starts by raising
its soft limit as far as it may (the hard limit, and the kernel's
``fs.nr_open``), and the frontend keeps its connections well below the limit
(``fd_budget``: a guard thread renames the ipc paths away near it, and what
still gets in past it is shed; see ``supervisor.admission.connections`` and
``supervisor.admission.fd_guard``): the limit is a resource like any other,
never a crash.

Other parts of the supervisor that open descriptors on behalf of peers (the
metrics HTTP server: its listener, its event loop and at most
``metrics_max_connections`` connections) hold a **reservation**
(:func:`reserve_fds`) for their worst case. ``fd_budget`` leaves it out of what
the frontend may take, so those descriptors can never be the ones libzmq
needed. A reservation is sized against the soft limit in force: at most
:func:`max_reservation` descriptors each.

Threads: reservations are made and released by whoever owns the server (any
thread); ``fd_budget`` is read by the loop every second. One lock guards the table.
"""

from __future__ import annotations

import itertools
import logging
import os
import resource
import threading

from shared.log import get_logger, log_event

__all__ = ["FdReservation", "fd_budget", "max_reservation", "open_fds", "raise_fd_limit", "reserve_fds",
           "reserved_fds", "soft_fd_limit"]

_log = get_logger("supervisor.host.fdlimit")

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


def soft_fd_limit() -> int:
    """RLIMIT_NOFILE's soft limit in force (unlimited read as 2**20)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def fd_budget(soft: int) -> int:
    """How many client connections the frontend may hold with a soft limit of ``soft``:
    half of what is left after the reserve and the reservations (:func:`reserve_fds`; the other
    half covers tenants and workers)."""
    return max(16, (soft - RESERVE_FDS - reserved_fds()) // 2)


def max_reservation(soft: int) -> int:
    """The most descriptors one reservation may hold with a soft limit of ``soft``: an eighth
    of it (at least 8), so no side server can take what tenants and clients need."""
    return max(8, soft // 8)


_lock = threading.Lock()
_reservations: dict[int, int] = {}
_ids = itertools.count(1)


class FdReservation:
    """Descriptors set aside for one owner (see the module docstring); :meth:`resize` as its
    bound changes, :meth:`release` when it closes (idempotent)."""

    def __init__(self, what: str, count: int) -> None:
        self.what = what
        self._id = next(_ids)
        self.count = 0
        self.resize(count)

    def resize(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"a reservation of {count} fds for {self.what}")
        with _lock:
            _reservations[self._id] = count
        self.count = count

    def release(self) -> None:
        with _lock:
            _reservations.pop(self._id, None)
        self.count = 0


def reserve_fds(what: str, count: int) -> FdReservation:
    """Set ``count`` descriptors aside for ``what`` (e.g. the metrics HTTP server): the frontend's
    budget shrinks by as many from its next refresh (every second) and at its construction."""
    return FdReservation(what, count)


def reserved_fds() -> int:
    """Descriptors all live reservations hold together."""
    with _lock:
        return sum(_reservations.values())
