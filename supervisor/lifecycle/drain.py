"""Draining: how a supervisor stops without losing the work it accepted.

    SIGTERM ──► Drain.begin ──► new requests answered Draining(retry_after_s)   (the frontend asks refusal())
                    │             in-flight requests finish and are answered     (the pending table empties)
                    ▼
             Drain.over(now, in_flight) ──► true once nothing is in flight, or drain_timeout_s passed
                    │                       (or a second signal: Drain.hurry)
                    ▼
             the workers stop (stop_timeout_s, then kill_grace_s) and the supervisor exits

A rollout (a DaemonSet update, ``systemctl restart``) sends SIGTERM. Before the
drain, the workers were stopped at once and a request in flight ended
``WorkerLost ... killed by signal 9 (shutdown)`` after ``stop_timeout_s`` (5 s),
while a request may run ``request_timeout_s`` (30 s). Draining answers it instead.
The read-only ops (``shared.protocol.MONITOR_OPS``: status, events, hello) are still
served while draining, so an operator sees the drain.

Owns: the drain's start time and whether it was cut short. May touch: nothing
(the supervisor asks it; it holds no reference to any part). Threads: the loop's only;
:meth:`Drain.hurry` may be called from a signal handler (it sets a flag).
"""

from __future__ import annotations

import math

from shared.errors import Draining

__all__ = ["MIN_RETRY_AFTER_S", "Drain"]

#: the least ``retry_after_s`` a Draining refusal tells: a client should not hammer a stopping node
MIN_RETRY_AFTER_S = 1.0


class Drain:
    """The drain of one stop: begun once, over when nothing is in flight or its time is up."""

    __slots__ = ("timeout_s", "stop_s", "started", "hurried")

    def __init__(self, timeout_s: float, stop_s: float) -> None:
        """``timeout_s``: the longest drain (``drain_timeout_s``; 0: none). ``stop_s``: what stopping
        the workers takes after it (``stop_timeout_s`` plus the kill graces), which a refused
        client is told to wait as well."""
        if not (timeout_s >= 0 and math.isfinite(timeout_s)):
            raise ValueError(f"drain timeout must be a finite number >= 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.stop_s = max(0.0, float(stop_s))
        self.started: float | None = None
        self.hurried = False

    @property
    def active(self) -> bool:
        """Begun (new requests are refused from now on)."""
        return self.started is not None

    def begin(self, now: float) -> bool:
        """Start draining at ``now``; False when it had begun already (the caller's second signal)."""
        if self.started is not None:
            return False
        self.started = now
        return True

    def hurry(self) -> None:
        """End the drain at the next check, whatever is in flight (a second SIGTERM/SIGINT)."""
        self.hurried = True

    def over(self, now: float, in_flight: int) -> bool:
        """Whether to stop the workers now: nothing in flight, the time is up, or hurried."""
        if self.started is None:
            return False
        return self.hurried or in_flight <= 0 or now - self.started >= self.timeout_s

    def remaining_s(self, now: float) -> float:
        """Seconds until the drain ends at the latest (0 once over)."""
        if self.started is None:
            return self.timeout_s
        return max(0.0, self.timeout_s - (now - self.started))

    def refusal(self, now: float) -> Draining:
        """The answer to a new request while draining: retry once this supervisor is gone and its
        replacement serves - the rest of the drain plus the workers' stop, at least a second."""
        return Draining(round(max(MIN_RETRY_AFTER_S, self.remaining_s(now) + self.stop_s), 3), self.timeout_s)
