"""The fork server's child path to a worker's entry: what runs between the fork and ``worker.main.run``.

``multiprocessing``'s fork server forks a child per start and calls ``forkserver._serve_one`` in
it: the child undoes the fork server's signal set-up, closes the fork server's fds, then
``spawn._main`` reads two pickles from the child's pipe - the preparation data (``prepare``: the
parent's name, authkey, directories, ``__main__``) and the process object - through a buffered
file, with ``current_process()._inheriting`` set for the unpickling, and hands the object a dup
of the pipe as its parent sentinel. A worker's start (``supervisor.runtime.workers.fork_start``)
needs none of that: its preparation data is only a mark (:data:`shared.worker_link.FORKED_START_KEY`)
and its process object a ``ForkedStart``, which carries what a worker needs of the preparation
(the supervisor's ``sys.path`` and working directory) and closes the sentinel unread.

:func:`install` (the fork server's preload, :mod:`worker.preload`) replaces ``_serve_one`` with
:func:`serve_one`: the same reset of signals and fds, then the preparation data read as
``spawn._main`` reads it, and a start with the mark unpickled and run at once (``_bootstrap``),
with no preparation and no parent sentinel. Anything else - a ``multiprocessing`` process started
through the same fork server - takes ``spawn._main``'s steps, as before. A fork server without this
module (another preload) reads the mark as preparation data that prepares nothing: the
supervisor's starts work either way. From the fork to ``worker.main.run``, with ``ForkedStart``'s
own cuts: ~50 copy-on-write faults and ~0.3 ms of CPU less a start on the 2-core host (of ~580 and
1.7-1.8 ms); what is left before our code runs is the interpreter's after-fork work and the
standard library's after-fork hooks (threading, logging, random: ~300 faults).
"""

from __future__ import annotations

import inspect
import os
import pickle
import sys
import _signal  # type: ignore[import-not-found]  # signal's C functions (no stub)
from multiprocessing import forkserver, process, resource_tracker, spawn
from typing import Any

from shared.worker_link import FORKED_START_KEY

__all__ = ["install", "installable", "serve_one"]

def serve_one(child_r: int, fds: list[int], unused_fds: list[int], handlers: dict[int, Any]) -> int:
    """The fork server's child: ``forkserver._serve_one``'s resets, then the start read from
    ``child_r`` and run; its exit status."""
    # as multiprocessing does: the fork server's wake-up fd and handlers (SIGCHLD, SIGINT) undone,
    # its fds closed, the fds the client passed taken over (the alive pipe, the resource tracker's)
    # (``_signal``'s functions: the ``signal`` module's wrappers map numbers and handlers to enums
    # and back, and a handler that is a function fails that map with an exception, each call)
    _signal.set_wakeup_fd(-1)
    for sig, val in handlers.items():
        # the C function takes SIG_DFL / SIG_IGN as its own objects, not the ``Handlers`` enum's
        _signal.signal(int(sig), _signal.SIG_DFL if val == _signal.SIG_DFL
                       else _signal.SIG_IGN if val == _signal.SIG_IGN else val)
    for fd in unused_fds:
        os.close(fd)
    server = forkserver._forkserver
    alive_fd, tracker_fd, *inherited = fds
    server._forkserver_alive_fd = alive_fd  # type: ignore[attr-defined]
    server._inherited_fds = inherited  # type: ignore[attr-defined]
    resource_tracker._resource_tracker._fd = tracker_fd  # type: ignore[attr-defined]
    # the pickles read as multiprocessing reads them, one at a time from a buffered file: a
    # process's starter keeps its end of the pipe open (its parent sentinel), so there is no end
    # to read up to
    with open(child_r, "rb", closefd=True) as from_parent:
        preparation = pickle.load(from_parent)
        if isinstance(preparation, dict) and preparation.get(FORKED_START_KEY) == 1 and len(preparation) == 1:
            start = pickle.load(from_parent)
            parent_sentinel = None
        else:  # multiprocessing's own start (spawn._main): prepared, the pipe its parent sentinel
            parent_sentinel = os.dup(child_r)
            current = process.current_process()
            current._inheriting = True  # type: ignore[attr-defined]
            try:
                spawn.prepare(preparation)
                start = pickle.load(from_parent)
            finally:
                del current._inheriting  # type: ignore[attr-defined]
    return int(start._bootstrap(parent_sentinel))


#: the ``forkserver._serve_one`` that :func:`serve_one` stands in for: its parameters, and the Python
#: versions whose fork server and ``spawn._main`` it was read from
_SERVE_ONE_PARAMS = ("child_r", "fds", "unused_fds", "handlers")
_KNOWN_VERSIONS = ((3, 11), (3, 14))


def installable() -> bool:
    """Whether this interpreter's fork server is the one :func:`serve_one` mirrors: a Python from
    3.11 up to (not including) 3.14, whose ``forkserver._serve_one`` takes the parameters above and
    whose ``spawn._main`` exists. Anywhere else multiprocessing's own child path stays - a worker's
    start then reads the mark as preparation data that prepares nothing, and costs what it did."""
    low, high = _KNOWN_VERSIONS
    if not low <= sys.version_info[:2] < high:
        return False
    original = getattr(forkserver, "_serve_one", None)
    if original is None or not hasattr(spawn, "_main"):
        return False
    try:
        return tuple(inspect.signature(original).parameters) == _SERVE_ONE_PARAMS
    except (TypeError, ValueError):
        return False


def install() -> bool:
    """Make :func:`serve_one` the fork server's child path (``forkserver.main`` looks the name up
    at each fork) where :func:`installable`; whether it did. Only in the fork server (its preload)."""
    if not installable():
        return False
    forkserver._serve_one = serve_one  # type: ignore[attr-defined]
    return True
