"""How long an op held the device: what GPU time is charged by (``shared.gpu_time``).

A backend's :meth:`~worker.backends.base.Backend.op_timer` returns one of
these. Host-synchronous backends (the stub: its "device" is this process
running numpy while it holds the device lease) use :class:`HostTimer`: the
CPU time the call consumed - the device's work, not the host's other load.
The cuda backend uses CUDA events around the op on the tenant's stream
(:mod:`worker.backends.cuda_timing`): the GPU's own measure of the work,
without the launch overhead on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["HostTimer", "OpTimer", "PendingTimer", "ThreadTimer"]


class OpTimer(Protocol):
    def time(self, fn: Callable[..., object], *args: object) -> int:
        """Run ``fn(*args)`` to completion on the device; the ns of device time it took."""
        ...

    def close(self) -> None:
        """Release whatever the timer holds (events); never raises."""
        ...


@runtime_checkable
class PendingTimer(Protocol):
    """A queue timer whose ``time()`` returns 0 at once - the chunk's device time is *pending* -
    until the gate settles it (the cuda backend's :class:`~worker.backends.cuda_timing.CudaStretchTimer`)."""

    def time(self, fn: Callable[..., object], *args: object) -> int: ...

    def close(self) -> None: ...

    @property
    def pending(self) -> int:
        """Chunks timed and not yet settled."""
        ...

    def full(self) -> bool:
        """No room for another pending chunk: settle first."""
        ...

    def settle(self, until_ns: int | None) -> tuple[list[int], BaseException | None]:
        """Wait for the pending chunks (not past ``until_ns``, monotonic: then it raises a
        ``KernelTimeout``); their ns in order, and the error that ended the settle early (the
        chunk after the last time returned failed) or None."""
        ...


class HostTimer:
    """The CPU time this process spent on a host-synchronous op (``time.process_time_ns``).

    The stub's device is this process running the op while its worker holds
    the lease; the op's CPU time is the device work it did (BLAS threads
    included). Wall time around the call would be the time the serial device
    was held, but on a shared host it also counts the time the OS gave other
    processes meanwhile: measured on a 2-core machine at load 20, one
    tenant of eight equal ones was charged seven times the others' time for
    the same work (a 1.3 s host stall while it held the device). A GPU kernel
    is not slowed down by host load, and CUDA events do not count it; CPU
    time is the stub's equivalent. On an idle core the two agree.
    """

    def time(self, fn: Callable[..., object], *args: object) -> int:
        t0 = time.process_time_ns()
        fn(*args)
        return time.process_time_ns() - t0

    def close(self) -> None:
        pass


class ThreadTimer:
    """The CPU time of the calling thread (``time.thread_time_ns``): the stub's queued ops.

    Queued ops (worker.device_time) run on the worker's device thread while the
    guest's host code runs on another thread of the same process: the
    process's CPU time would charge that host work as device time. The stub
    runs one BLAS thread per op, so the device thread's own CPU time is all of
    the op's work.
    """

    def time(self, fn: Callable[..., object], *args: object) -> int:
        t0 = time.thread_time_ns()
        fn(*args)
        return time.thread_time_ns() - t0

    def close(self) -> None:
        pass
