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

__all__ = ["may_raise_priority", "set_parent_death_signal", "set_process_name", "set_threads_nice", "short_slice"]

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


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (linux/sched/types.h, the first version with utilisation clamps)."""

    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64), ("util_min", ctypes.c_uint32),
                ("util_max", ctypes.c_uint32)]


#: x86-64's and arm64's numbers of sched_setattr / sched_getattr
_SYS_SCHED_ATTR = {"x86_64": (314, 315), "aarch64": (274, 275)}
#: SCHED_OTHER, the normal policy: a custom slice is asked for with it only
_SCHED_OTHER = 0


def short_slice(slice_ns: int, tid: int = 0) -> bool:
    """Ask the kernel for a short time slice for the calling thread (Linux 6.12+, the EEVDF
    scheduler: ``sched_setattr`` with ``sched_runtime`` on a normal thread; 0.1-100 ms, no privilege
    needed), its policy and nice value unchanged. A woken thread with a shorter slice than the one
    running preempts it at once (the kernel's ``PREEMPT_SHORT``) instead of waiting for that thread's
    slice to end (~1.4 ms by default here); its CPU share is its weight's, as before. For the threads
    whose wake-up the device waits for and whose work is short (the device thread: a launch, a lease
    decision). ``tid``: another thread of this process (a native id; 0: the calling thread). False
    where the kernel or the architecture has no such call, or it was refused (an older kernel takes
    the call and ignores the slice: the thread runs as before)."""
    libc = _libc()
    nums = _SYS_SCHED_ATTR.get(os.uname().machine)
    if libc is None or nums is None:
        return False
    attr = _SchedAttr()
    size = ctypes.sizeof(_SchedAttr)
    if libc.syscall(nums[1], tid, ctypes.byref(attr), size, 0) != 0 or attr.policy != _SCHED_OTHER:
        return False  # (a real-time or idle policy: left alone)
    attr.size, attr.flags, attr.runtime = size, 0, slice_ns
    return bool(libc.syscall(nums[0], tid, ctypes.byref(attr), 0) == 0)
