"""How long an op held the device: what GPU time is charged by (``shared.gpu_time``).

A backend's :meth:`~worker.backends.base.Backend.op_timer` returns one of
these. Host-synchronous backends (the stub: its "device" is this process
running numpy while it holds the device lease) use :class:`HostTimer`: the
wall time around the call, which is exactly the time the serial device was held.
The cuda backend uses CUDA events around the op on the tenant's stream
(:mod:`worker.backends.cuda_timing`): the GPU's own measure of the work,
without the launch overhead on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["HostTimer", "OpTimer"]


class OpTimer(Protocol):
    def time(self, fn: Callable[..., Any], *args: Any) -> int:
        """Run ``fn(*args)`` to completion on the device; the ns of device time it took."""
        ...

    def close(self) -> None:
        """Release whatever the timer holds (events); never raises."""
        ...


class HostTimer:
    """Wall time around a host-synchronous op (``time.perf_counter_ns``): the time the serial
    device was held for it.

    The stub's device is this process running the op while its worker holds
    the lease, so the held time is its device time - the analogue of CUDA
    events, which measure the GPU's timeline. On a loaded host it includes
    time the OS gave other processes while the op ran; that inflates every
    tenant's ops alike, so shares stay right while absolute times grow
    (``twt bench share`` reports work counted by the guests next to it).
    Process CPU time was tried as well: it tracks work as closely, but a cap
    of 0.25 then means a quarter of a *core-second* per second, not a
    quarter of the device's time, on a host that gives the device less than
    one core.
    """

    def time(self, fn: Callable[..., Any], *args: Any) -> int:
        t0 = time.perf_counter_ns()
        fn(*args)
        return time.perf_counter_ns() - t0

    def close(self) -> None:
        pass
