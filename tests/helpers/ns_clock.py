"""A monotonic nanosecond clock that only the test moves: what ``GpuTimeBoard(clock=...)`` reads.

The lease policy's tests (tests/shared/test_gpu_time*.py) drive every time-dependent decision -
quanta, graces, idle holds - by setting ``t``, so they assert the policy, never the host's speed.
"""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    def __init__(self) -> None:
        self.t = 10**12

    def __call__(self) -> int:
        return self.t
