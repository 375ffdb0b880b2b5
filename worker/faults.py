"""Injected faults, as the worker executes them (``inject_fault``; docs/RELIABILITY.md).

The supervisor sends a ``fault`` control message; the worker's control thread
applies it here. Process-ending faults happen at once; the others arm state
that the executor consults on its normal path (an injected OOM goes through
the same rollback as a real driver OOM). The supervisor has no special path
for any of them.

Threads: the control thread arms faults (:meth:`FaultState.apply`), the
executor thread consumes them (``take_*``). Every counter is read-modify-
written under ``_lock``: ``+=`` and ``-=`` on an attribute are not atomic
in Python, and a lost update would arm one fault too few or too many.
``hang`` is a ``threading.Event`` and ``slow_ms`` a single assignment read
whole, so they need no lock.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from shared.checks import is_int
from shared.errors import InvalidArgument
from shared.kinds import WORKER_FAULT_KINDS as FAULT_KINDS

__all__ = ["FAULT_KINDS", "FaultState"]


def _int_param(params: dict[str, object], name: str, default: int, lo: int, hi: int) -> int:
    value = params.get(name, default)
    if not is_int(value) or not lo <= value <= hi:
        raise InvalidArgument(f"fault parameter {name} must be an int in {lo}..{hi}, got {value!r}")
    return value


class FaultState:
    """Armed faults of one worker process (read by the executor, set by the control thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the counters below (see the module docstring)
        self.hang = threading.Event()
        self.slow_ms = 0
        self.oom_remaining = 0
        self.corrupt_next = 0
        self.drop_next = 0
        self.kernel_fault = threading.Event()
        self._leaked: list[bytes] = []

    def apply(self, kind: str, params: dict[str, object]) -> dict[str, object]:
        """Arm or execute one fault; returns what was armed (for the ack)."""
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "segfault":
            # a real invalid memory access, not a signal sent to ourselves
            ctypes.string_at(1, 1)
        elif kind == "exit":
            os._exit(_int_param(params, "code", 1, 0, 255))
        elif kind == "hang":
            self.hang.set()
        elif kind == "slow":
            self.slow_ms = _int_param(params, "ms", 100, 0, 600_000)
        elif kind == "oom":
            n = _int_param(params, "count", 1, 1, 1_000_000)
            with self._lock:
                self.oom_remaining += n
        elif kind == "corrupt":
            n = _int_param(params, "count", 1, 1, 1_000_000)
            with self._lock:
                self.corrupt_next += n
        elif kind == "drop":
            n = _int_param(params, "count", 1, 1, 1_000_000)
            with self._lock:
                self.drop_next += n
        elif kind == "cuda-fault":
            # armed: the executor launches a faulting kernel before its next request (CUDA
            # contexts belong to the executor thread), so that request gets the sticky error
            self.kernel_fault.set()
        elif kind == "leak":
            n = _int_param(params, "bytes", 64 << 20, 1, 1 << 40)
            self._leaked.append(b"\x01" * n)  # written, so resident
        else:
            raise InvalidArgument(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        return {"kind": kind, **params}

    def take_kernel_fault(self) -> bool:
        if self.kernel_fault.is_set():
            self.kernel_fault.clear()
            return True
        return False

    def take_oom(self) -> bool:
        """Executor: consume one armed OOM (True: fail this allocation)."""
        with self._lock:
            if self.oom_remaining > 0:
                self.oom_remaining -= 1
                return True
            return False

    def take_drop(self) -> bool:
        """Executor: consume one armed dropped reply."""
        with self._lock:
            if self.drop_next > 0:
                self.drop_next -= 1
                return True
            return False

    def take_corrupt(self) -> bool:
        """Executor: consume one armed corrupt reply."""
        with self._lock:
            if self.corrupt_next > 0:
                self.corrupt_next -= 1
                return True
            return False

    def block_if_hung(self) -> None:
        """The executor's half of ``hang``: never returns once armed."""
        if self.hang.is_set():
            while True:
                time.sleep(3600)
