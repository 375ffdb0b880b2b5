"""A picklable reference to a function by name, imported only where it is called.

The supervisor starts workers with ``multiprocessing`` and must hand over a
target. Pickling ``worker.main.run`` itself would import the worker package
into the supervisor; ``EntryPoint("worker.main:run")`` names it instead, and
only the child process imports it.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

__all__ = ["EntryPoint", "ForkedStart"]


class EntryPoint:
    """``EntryPoint("pkg.module:function")(*args)`` imports and calls it."""

    __slots__ = ("spec",)

    def __init__(self, spec: str) -> None:
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"entry point must be 'module:function', got {spec!r}")
        self.spec = spec

    def __call__(self, *args: object, **kwargs: object) -> object:
        module, _, attr = self.spec.partition(":")
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    def __reduce__(self) -> tuple[object, ...]:
        return (EntryPoint, (self.spec,))

    def __repr__(self) -> str:
        return f"EntryPoint({self.spec!r})"


class ForkedStart:
    """What a fork server's child runs in place of a ``multiprocessing`` process object: a worker
    forked by the fork server (``--start-method forkserver``) without multiprocessing's start-up.

    The fork server's child unpickles the two objects the supervisor wrote to its pipe (the
    preparation data, then the process object) and calls the second's ``_bootstrap``.
    ``multiprocessing`` sends its whole ``Process`` there, and its bootstrap and preparation set up
    what a worker never uses (the process name and authkey, the start method, a stdin the fork
    server closed already, the child-process table, after-fork hooks, finalizers run at an exit a
    worker makes with ``os._exit``): ~0.9 ms of CPU and ~150 copy-on-write faults of each forked
    worker's start, beside the supervisor's ~0.2 ms to pickle it. Sent with empty preparation data
    instead, this object carries the target's name, its arguments, and the two things of the
    preparation a worker may depend on (the supervisor's ``sys.path`` and working directory), and
    its ``_bootstrap`` runs the target and returns its exit status.
    """

    __slots__ = ("args", "cwd", "spec", "sys_path")

    def __init__(self, spec: str, args: tuple[object, ...], sys_path: list[str], cwd: str) -> None:
        self.spec, self.args, self.sys_path, self.cwd = spec, args, sys_path, cwd

    def __reduce__(self) -> tuple[object, ...]:
        return (ForkedStart, (self.spec, self.args, self.sys_path, self.cwd))

    def _bootstrap(self, parent_sentinel: int | None = None) -> int:
        """Called in the fork server's child (worker.fork_child, or ``multiprocessing.spawn._main``);
        the exit status."""
        if parent_sentinel is not None:
            os.close(parent_sentinel)  # multiprocessing's parent_process() only: a worker watches its parent itself
        # the main thread's native id is still the fork server's (multiprocessing's own bootstrap resets it
        # the same way); a Python without this private method only keeps the stale id in threading's record
        reset = getattr(threading.main_thread(), "_set_native_id", None)
        if reset is not None:
            reset()
        if sys.path != self.sys_path:
            sys.path[:] = self.sys_path
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        module, _, attr = self.spec.partition(":")
        try:
            # the target's module, preloaded by the fork server, found where it is (importlib's
            # import_module runs its own Python: ~50 copy-on-write faults of every forked start)
            loaded = sys.modules.get(module)
            getattr(loaded if loaded is not None else importlib.import_module(module), attr)(*self.args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the child's status says it; the traceback goes to stderr
            import traceback

            traceback.print_exc()
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        return code
