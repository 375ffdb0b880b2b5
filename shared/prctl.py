"""Linux process controls (``prctl``): this process's name, and the signal it gets when its parent dies.

* :func:`set_process_name` - ``ps -o comm``, ``top`` and ``psutil.Process.name()``
  show ``twt-worker`` / ``twt-supervisor`` instead of ``python3``;
* :func:`set_parent_death_signal` - a worker (or a cluster node's supervisor)
  never outlives the process that started it.

Both are Linux only and return False elsewhere: a name is a convenience, and
the parent-death signal has a backstop (heartbeats, the parent-pid check).

Why ``CDLL(None)`` and not ``ctypes.util.find_library("c")``: on Linux
``find_library`` runs ``ldconfig -p`` in a subprocess on each call, and every
worker and supervisor calls this at start - that cost a fork and exec of
``ldconfig`` (~12 ms of CPU) per process. The interpreter is linked against
libc, so its symbols are already in the process's global namespace.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from functools import cache

__all__ = ["may_raise_priority", "set_parent_death_signal", "set_process_name", "set_threads_nice"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


@cache
def _libc() -> ctypes.CDLL | None:
    """The C library's symbols (loaded once per process), or None off Linux or where it fails."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def set_process_name(name: str) -> bool:
    """Set the kernel's short name of this process (<= 15 bytes); True when it worked."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0)


#: CAP_SYS_NICE's bit in a capability set (linux/capability.h)
_CAP_SYS_NICE = 23


def may_raise_priority(to_nice: int) -> bool:
    """Whether a thread of this process, its nice value raised, may lower it again to ``to_nice``
    (Linux: with CAP_SYS_NICE, or where RLIMIT_NICE allows ``to_nice``); False off Linux or when
    it cannot be told. An unprivileged process may lower its priority but never raise it back."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import resource

        if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - to_nice:
            return True
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError, AttributeError):
        pass
    return False


def set_threads_nice(pid: int, nice: int) -> list[tuple[int, OSError]]:
    """Set every thread of process ``pid`` to nice value ``nice`` (Linux keeps one per thread, and
    ``setpriority`` on a process id sets only its main thread); returns the threads refused, with
    why. A thread that ended meanwhile is skipped; a process that is gone has no threads."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []
    refused = []
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            pass
        except OSError as exc:
            refused.append((tid, exc))
    return refused


def set_parent_death_signal(sig: signal.Signals) -> bool:
    """Have the kernel send ``sig`` to this process when its parent thread exits; True when set.

    The caller must still check ``os.getppid()`` afterwards: the parent may have died
    before the call, and then no signal comes.
    """
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
