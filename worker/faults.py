"""Injected faults, as the worker executes them (``inject_fault``; docs/RELIABILITY.md).

The supervisor sends a ``fault`` control message; the worker's control thread
applies it here. Process-ending faults happen at once; the others arm state
that the executor consults on its normal path (an injected OOM goes through
the same rollback as a real driver OOM). The supervisor has no special path
for any of them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Any

from shared.errors import InvalidArgument

__all__ = ["FAULT_KINDS", "FaultState"]

FAULT_KINDS = ("crash", "segfault", "exit", "hang", "slow", "oom", "corrupt", "drop", "leak", "cuda-fault")


def _int_param(params: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"fault parameter {name} must be an int in {lo}..{hi}, got {value!r}")
    return value


class FaultState:
    """Armed faults of one worker process (read by the executor, set by the control thread)."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.slow_ms = 0
        self.oom_remaining = 0
        self.corrupt_next = 0
        self.drop_next = 0
        self.kernel_fault = threading.Event()
        self._leaked: list[bytes] = []

    def apply(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
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
            self.oom_remaining += _int_param(params, "count", 1, 1, 1_000_000)
        elif kind == "corrupt":
            self.corrupt_next += _int_param(params, "count", 1, 1, 1_000_000)
        elif kind == "drop":
            self.drop_next += _int_param(params, "count", 1, 1, 1_000_000)
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
        if self.oom_remaining > 0:
            self.oom_remaining -= 1
            return True
        return False

    def block_if_hung(self) -> None:
        """The executor's half of ``hang``: never returns once armed."""
        if self.hang.is_set():
            while True:
                time.sleep(3600)
