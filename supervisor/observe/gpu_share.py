"""Each tenant's share of GPU time over the last window, from its accounted time in shared memory.

The workers charge every op's measured device time to the tenant's quota
block (``QuotaBlock.gpu_time_ns``, see :mod:`shared.gpu_time`). The
supervisor samples those counters once a second (a loop timer) and whenever
status or metrics read them, and reports ``share`` = device seconds per
wall second over the last ``window_s`` (10 s): 0.7 is 70 % of one device.
"""

from __future__ import annotations

from collections import deque

__all__ = ["GpuShareWindow", "SAMPLE_EVERY_S", "WINDOW_S"]

WINDOW_S = 10.0
SAMPLE_EVERY_S = 1.0


class GpuShareWindow:
    """Samples of (time, accounted ns) per tenant; the share over the window from them."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, tenant: str, now: float, gpu_ns: int) -> None:
        """Record the tenant's accounted ns at ``now`` (monotonic seconds); old samples drop out."""
        samples = self._samples.setdefault(tenant, deque())
        if samples and samples[-1][1] > gpu_ns:
            samples.clear()  # a re-registered tenant: a new block counting from 0
        if not samples or now - samples[-1][0] >= 0.2:
            samples.append((now, gpu_ns))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()

    def share(self, tenant: str, now: float, gpu_ns: int) -> float | None:
        """Device seconds per second over the window (None until two samples 0.2 s apart exist)."""
        self.observe(tenant, now, gpu_ns)
        samples = self._samples.get(tenant)
        if not samples:
            return None
        t0, ns0 = samples[0]
        span = now - t0
        if span < 0.2:
            return None
        return max(0.0, (gpu_ns - ns0) / 1e9 / span)

    def forget(self, tenant: str) -> None:
        self._samples.pop(tenant, None)
