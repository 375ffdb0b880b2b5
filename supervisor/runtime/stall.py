"""Stall tolerance of the supervisor loop: its own pauses are not its workers' deaths.

The loop judges workers by time: heartbeats older than ``interval *
liveness`` mean "hung", a request past its deadline means "stuck". Both
judgements assume the loop itself was running. A supervisor stopped with
SIGSTOP for 10 s (or starved on a loaded host) resumes to find every
heartbeat 10 s old and every deadline passed, while the workers were fine
and their beats and replies are waiting, unread, in its sockets.

:class:`StallGuard` notices such a gap between two housekeeping ticks and
then judges by time only what the stall did not distort:

* a worker's silence is counted from the later of its last heartbeat and the
  moment the loop resumed (:meth:`silence`), so the queued heartbeats get read
  before anyone is judged;
* deadline expiries wait a few turns of the loop (:meth:`in_grace`): a reply
  that arrived during the stall is answered, not replaced by a timeout.

A worker that really died is still seen at once (its sentinel fires), so the
grace delays nothing but the judgements that time made unreliable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["StallGuard"]


class StallGuard:
    """Detects loop stalls from housekeeping ticks; loop thread only.

    ``threshold_s``: a gap between ticks longer than this is a stall (the
    loop ticks every 50 ms; the default caller passes the heartbeat
    interval). ``grace_s``: how long judgements wait after a stall.
    """

    def __init__(self, threshold_s: float, grace_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if threshold_s <= 0 or grace_s < 0:
            raise ValueError("threshold_s must be > 0 and grace_s >= 0")
        self.threshold_s = threshold_s
        self.grace_s = grace_s
        self._clock = clock
        self._last_tick: float | None = None
        self._resumed_at = float("-inf")
        self.stalls = 0
        self.last_stall_s = 0.0

    def tick(self, now: float | None = None) -> float | None:
        """Call once per housekeeping pass; returns the stall's length when one just ended."""
        now = self._clock() if now is None else now
        last, self._last_tick = self._last_tick, now
        if last is None or now - last <= self.threshold_s:
            return None
        self._resumed_at = now
        self.stalls += 1
        self.last_stall_s = now - last
        return self.last_stall_s

    def in_grace(self, now: float) -> bool:
        """True within ``grace_s`` after a stall: time-based judgements wait."""
        return now - self._resumed_at < self.grace_s

    def silence(self, last_heard: float, now: float) -> float:
        """How long a peer has been silent, not counting time the loop itself was stalled."""
        return now - max(last_heard, self._resumed_at)
