"""The end of a ``twt`` process: the interpreter's exit, less the teardown of its objects.

An interpreter that exits normally (``sys.exit``) first joins its non-daemon threads, runs the
``atexit`` callbacks (logging's flush and close, multiprocessing's children and finalizers,
``weakref.finalize`` objects, pyzmq's) and flushes ``sys.stdout`` / ``sys.stderr``; then it tears
down every module and collects every object, only to hand the memory back to the kernel, which
takes it back whole anyway. In a process forked from a parent that had imported the program (a
prefork server, or the test suite's zygote) that teardown writes to every page the parent
shared - each object's reference count - so the kernel copies them first: ~6,000 page faults
and ~19 ms of CPU for a supervisor forked from a preloaded parent, ~40 % of all it costs from
fork to exit; a fresh interpreter's own is smaller (no copies), but not nothing.
:func:`exit_process` does the first three steps as the interpreter does and then ends the
process (``os._exit``): what a program observes at its exit is the same, and the teardown's
CPU is gone.

What it does not do, as the teardown would: call ``__del__`` of objects still alive at exit (an
unclosed file's buffer, say). The ``twt`` commands close what they write (``with``), and the
supervisor's own stop closes its state, sockets and segments before it returns; what must happen at
any exit is an ``atexit`` callback (or ``weakref.finalize``), which runs here too. Only the command
line's entry points call it (``twt``, ``python -m supervisor``), after ``main`` has returned; an
embedder calling :func:`supervisor.cli.main` in its own process keeps its interpreter's exit. An
exception out of ``main`` still ends the process the usual way (its traceback, status 1).

Threads: the main thread, once, at the very end.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_process"]

#: the status of an interpreter whose flush of ``sys.stdout`` / ``sys.stderr`` failed at exit
FLUSH_FAILED = 120


def exit_process(code: int) -> NoReturn:
    """End this process with status ``code`` (0-255) as ``sys.exit(code)`` would, without the
    interpreter's teardown: join the non-daemon threads, run the ``atexit`` callbacks, flush the
    standard streams (status 120 if that fails, as the interpreter's exit has it), then ``os._exit``."""
    # Py_FinalizeEx's first step: threading's own shutdown (joins every non-daemon thread and runs
    # the hooks concurrent.futures registers to wake its idle workers first)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()  # the callbacks, newest first; one that raises is reported and the rest run
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or a closed stream: the interpreter's exit status for it
            code = FLUSH_FAILED
    os._exit(code & 0xFF)
