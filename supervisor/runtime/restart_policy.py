"""What happens to an instance slot after its worker exited: one pure decision.

The worker set's death handling answers the dead worker's requests, reclaims its quota share and
publishes the exit; what comes *next* for the slot - nothing, a successor, a restart now or after
a back-off, or the tenant marked failed - depends only on facts about the exit, the tenant's
policy and its recent restarts. :func:`after_exit` decides that from an :class:`ExitFacts`
without touching anything, so the whole policy is a table in a test
(tests/supervisor/runtime/test_restart_policy.py); :meth:`WorkerSet.on_death` only carries it out.

The policy (Erlang/OTP's supervisor restart intensity, with an exponential back-off):

* a slot being scaled away, a tenant being evicted, or a supervisor stopping: nothing starts;
* an exit the supervisor asked for (rolling restart, reset, a failed tenant's stop) is never
  the restart policy's business and never counted: a successor starts if one was asked for;
* a worker that died before its first registration completed fails that registration;
* otherwise the tenant's ``restart`` policy decides (``always``; ``on-failure``: a signal, a
  non-zero exit, or an end the supervisor caused; ``never``), and a restart is counted against
  ``max_restarts`` within ``restart_window_s``: past it the tenant is failed. The first restart
  in the window is immediate, then 50 ms, 100 ms, ... up to 5 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from shared.spec import RestartPolicy

__all__ = [
    "BACKOFF_BASE_S",
    "BACKOFF_MAX_S",
    "AbortRegistration",
    "Backoff",
    "Decision",
    "Drop",
    "ExitFacts",
    "Fail",
    "NotRestarted",
    "Replace",
    "Restart",
    "after_exit",
    "backoff_s",
    "restarts_in_window",
    "wants_restart",
]

#: the back-off of the second restart within the window; it doubles from there
BACKOFF_BASE_S: Final = 0.05
#: the longest back-off
BACKOFF_MAX_S: Final = 5.0


@dataclass(frozen=True)
class ExitFacts:
    """What the decision reads about one worker's exit, and nothing it could change."""

    policy: RestartPolicy
    exit_code: int | None
    signal: int | None
    #: the supervisor asked it to stop (rolling restart, reset, a failed tenant, scale down)
    expected: bool = False
    #: the supervisor ended it for cause (missed heartbeats, a deadline, a bad reply, its RSS):
    #: a failure even when the worker, asked with SIGTERM, exited 0
    killed: bool = False
    #: an expected stop whose successor was asked for (rolling restart, reset)
    replace: bool = False
    #: the slot is being scaled away
    draining: bool = False
    #: the supervisor is stopping, or the tenant is being evicted
    shutting_down: bool = False
    #: the tenant is marked failed
    tenant_failed: bool = False
    #: a registration waits for this tenant and this worker never became ready
    registering: bool = False
    #: the tenant's restarts so far (times, oldest first; older ones are outside the window)
    restart_times: Sequence[float] = ()
    now: float = 0.0
    max_restarts: int = 5
    window_s: float = 60.0


@dataclass(frozen=True)
class Drop:
    """Nothing starts in the slot. ``trim``: it was being scaled away (the slots may shrink)."""

    trim: bool = False


@dataclass(frozen=True)
class Replace:
    """An expected stop with a successor asked for: start one now, no restart counted."""


@dataclass(frozen=True)
class AbortRegistration:
    """The worker died before the registration that waits for it completed: fail that request."""


@dataclass(frozen=True)
class NotRestarted:
    """The tenant's policy does not restart this exit: the slot stays empty. ``completed``: the
    worker ended cleanly (exit 0, no signal, not ended by the supervisor) - done, not down."""

    completed: bool = False


@dataclass(frozen=True)
class Fail:
    """Past the restart intensity: the tenant is failed (it stays down until ``twt reset``)."""

    restarts: int
    window_s: float

    @property
    def why(self) -> str:
        return f"{self.restarts} restarts within {self.window_s:g} s"


@dataclass(frozen=True)
class Restart:
    """Start a new worker in the slot now (counted as a restart)."""


@dataclass(frozen=True)
class Backoff:
    """Start a new worker in the slot after ``delay_s`` (counted as a restart)."""

    delay_s: float


Decision = Drop | Replace | AbortRegistration | NotRestarted | Fail | Restart | Backoff


def wants_restart(policy: RestartPolicy, exit_code: int | None, signal: int | None, *, killed: bool) -> bool:
    """Does the tenant's ``restart`` policy restart this exit?"""
    if policy is RestartPolicy.ALWAYS:
        return True
    if policy is RestartPolicy.ON_FAILURE:
        return killed or signal is not None or exit_code not in (0, None)
    return False


def restarts_in_window(times: Sequence[float], now: float, window_s: float) -> int:
    """How many of ``times`` lie within ``window_s`` before ``now``."""
    return sum(1 for t in times if now - t <= window_s)


def backoff_s(recent: int) -> float:
    """The delay before a restart that is the ``recent``-th within the window: 0 for the first,
    then 50 ms, 100 ms, ... up to :data:`BACKOFF_MAX_S`."""
    if recent <= 1:
        return 0.0
    return float(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (recent - 2)))


def after_exit(facts: ExitFacts) -> Decision:
    """The slot's next step after its worker exited (see the module's docstring)."""
    if facts.draining or facts.shutting_down:
        return Drop(trim=facts.draining)
    if facts.expected:
        return Replace() if facts.replace and not facts.tenant_failed else Drop()
    if facts.registering:
        return AbortRegistration()
    if not wants_restart(facts.policy, facts.exit_code, facts.signal, killed=facts.killed):
        return NotRestarted(completed=facts.exit_code == 0 and facts.signal is None and not facts.killed)
    recent = restarts_in_window(facts.restart_times, facts.now, facts.window_s) + 1  # this one too
    if recent > facts.max_restarts:
        return Fail(recent, facts.window_s)
    delay = backoff_s(recent)
    return Restart() if delay <= 0 else Backoff(delay)
