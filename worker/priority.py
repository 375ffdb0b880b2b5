"""CPU priority inside a worker: the tenant's guest code below the threads that drive the device.

A bound worker runs the tenant's guest (wasmtime, and the host calls it makes)
on its executor thread, beside its device thread (``twt-device``: the ops
under the GPU-time lease), its control thread (heartbeats, faults) and the
epoch thread (deadlines). On a host whose CPUs are all busy - and on the stub,
whose "device" is this host's CPU - a device thread that was just handed the
lease waits for a core while guest code (of this tenant or another) runs: the
device sits idle for that wait, and every tenant pays for it. So with
``worker_guest_nice`` > 0 (off by default: docs/GPU-QUOTAS.md has the paired
runs) the executor thread lowers its own priority by that many steps at bind
(``setpriority`` on its thread id; Linux keeps a nice value per thread), and the
threads that drive the device keep the worker's normal one: a woken device
thread is given a core before guest code, and the supervisor (at its normal
priority) before every guest.

A pool worker starts below the normal priority too (``pool_start_nice``, where its threads
may raise their priority back: :func:`lower_start`): its start - the fork server's child, zmq,
the control thread, the WASM warm-up, ~12 ms of CPU - then yields the CPU to the supervisor and
the bound workers serving requests, most of all to the activation that took the pool worker it
replaces. Every thread of it is back at the normal priority once it is warmed or bound
(:func:`restore_start`), before any tenant's work.

An unprivileged thread may raise its nice value but never lower it again, and a
new thread starts with its creator's. So the threads that must keep the normal
priority are started through :func:`start_thread`: called on a lowered thread,
it has the spawner - a thread made at the normal priority before the executor
lowered itself - start them. Threads started plainly (the module compiler's)
run at the guest's priority, which is what they are.
"""

from __future__ import annotations

import logging
import os
import threading

from shared.log import get_logger, log_event
from shared.prctl import set_process_name, set_threads_nice

__all__ = ["lower_current_thread", "lower_start", "lowered", "name_thread", "restore_start", "start_thread"]

_log = get_logger("worker")

#: the most a nice value can be (Linux)
NICE_MAX = 19

_lock = threading.Lock()
#: native ids of the threads of this process that lowered themselves (:func:`lower_current_thread`)
_lowered: set[int] = set()
_spawner: _Spawner | None = None
#: the nice value this process's threads go back to at :func:`restore_start`; None: not lowered
_start_base: int | None = None


class _Spawner:
    """A thread at the worker's normal priority that starts threads for a lowered one (a new
    thread's nice value is its creator's)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._todo: list[tuple[threading.Thread, list[BaseException | None]]] = []
        self._thread = threading.Thread(target=self._loop, name="twt-spawn", daemon=True)
        self._thread.start()

    def start(self, thread: threading.Thread) -> None:
        """Start ``thread`` on the spawner and wait until it runs; its start's error is raised here."""
        done: list[BaseException | None] = []
        with self._cond:
            self._todo.append((thread, done))
            self._cond.notify_all()
            while not done:
                self._cond.wait()
        if done[0] is not None:
            raise done[0]

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._todo:
                    cond.wait()
                todo, self._todo = self._todo, []
            for thread, done in todo:
                err: BaseException | None = None
                try:
                    thread.start()
                except BaseException as exc:  # noqa: BLE001 - the caller raises it
                    err = exc
                with cond:
                    done.append(err)
                    cond.notify_all()


def name_thread() -> None:
    """Give the calling thread's Python name to the kernel too (its ``comm``, 15 bytes): ``top -H``
    and ``/proc/<pid>/task/*`` then show which thread runs at which priority."""
    set_process_name(threading.current_thread().name)  # (PR_SET_NAME names the calling thread)


def lowered() -> bool:
    """Whether the calling thread lowered its priority (:func:`lower_current_thread`)."""
    return threading.get_native_id() in _lowered


def start_thread(thread: threading.Thread) -> None:
    """Start ``thread`` at the worker's normal priority, also when the calling thread lowered its
    own: for the threads that drive the device or keep time (device, epoch)."""
    spawner = _spawner
    if spawner is None or not lowered():
        thread.start()
    else:
        spawner.start(thread)


def lower_start(steps: int) -> bool:
    """A pool worker's start, first thing in its process (before it starts a thread: each inherits
    the value): the calling thread ``steps`` nice values below its priority, until
    :func:`restore_start`. The caller has made sure the threads may raise theirs back (the
    supervisor asks only where they may: ``shared.prctl.may_raise_priority``). False when
    nothing changed."""
    global _start_base
    if steps <= 0 or not hasattr(os, "setpriority") or _start_base is not None:
        return False
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(NICE_MAX, base + steps))
    except OSError as exc:
        log_event(_log, logging.WARNING, "worker.start_nice_failed", steps=steps, error=repr(exc))
        return False
    _start_base = base
    return True


def restore_start() -> None:
    """Every thread of this process back to the priority it had before :func:`lower_start` (once;
    nothing when it was not lowered): the worker is warmed, or bound to a tenant. Called before a
    bind lowers its guest's thread (:func:`lower_current_thread`). A refusal is logged: the worker
    then serves at the lower priority."""
    global _start_base
    base, _start_base = _start_base, None
    if base is None:
        return
    for tid, exc in set_threads_nice(os.getpid(), base):
        log_event(_log, logging.WARNING, "worker.start_nice_not_restored", thread=tid, error=repr(exc))


def lower_current_thread(steps: int) -> bool:
    """Raise the calling thread's nice value by ``steps`` (at most to 19), for good: the threads it
    starts through :func:`start_thread` keep the priority it had. False when nothing changed
    (``steps`` <= 0, no ``setpriority`` on this platform, or the call failed: logged)."""
    global _spawner
    if steps <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    with _lock:
        if _spawner is None:
            _spawner = _Spawner()  # made by this thread before it lowers itself: the normal priority
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            if now >= NICE_MAX:
                return False
            os.setpriority(os.PRIO_PROCESS, tid, min(NICE_MAX, now + steps))
        except OSError as exc:
            log_event(_log, logging.WARNING, "worker.guest_nice_failed", steps=steps, error=repr(exc))
            return False
        _lowered.add(tid)
    return True
