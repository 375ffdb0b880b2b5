"""The restart decision as a table: :func:`after_exit` reads facts about an exit, changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from shared.spec import RestartPolicy
from supervisor.runtime.restart_policy import (
    BACKOFF_MAX_S,
    AbortRegistration,
    Backoff,
    Decision,
    Drop,
    ExitFacts,
    Fail,
    NotRestarted,
    Replace,
    Restart,
    after_exit,
    backoff_s,
)

ALWAYS, ON_FAILURE, NEVER = RestartPolicy.ALWAYS, RestartPolicy.ON_FAILURE, RestartPolicy.NEVER


def _facts(policy: RestartPolicy = ALWAYS, code: int | None = 1, sig: int | None = None, **kw: Any) -> ExitFacts:
    return ExitFacts(policy=policy, exit_code=code, signal=sig, **kw)


@pytest.mark.parametrize(("facts", "want"), [
    # the tenant's policy, for an exit nobody asked for
    (_facts(ALWAYS, 0), Restart()),
    (_facts(ALWAYS, None, 9), Restart()),
    (_facts(ON_FAILURE, 0), NotRestarted(completed=True)),  # its work is done: healthy, terminal
    (_facts(ON_FAILURE, 0, killed=True), Restart()),  # ended by the supervisor: a failure even at exit 0
    (_facts(ON_FAILURE, 3), Restart()),
    (_facts(ON_FAILURE, None, 9), Restart()),
    (_facts(NEVER, 1), NotRestarted()),
    (_facts(NEVER, 0), NotRestarted(completed=True)),
    (_facts(NEVER, None, 9, killed=True), NotRestarted()),
    # what comes before the policy
    (_facts(ALWAYS, 1, draining=True), Drop(trim=True)),  # scaled away: its slot goes
    (_facts(ALWAYS, 1, shutting_down=True), Drop()),  # supervisor stopping or tenant evicted
    (_facts(ALWAYS, 0, expected=True), Drop()),  # stopped on purpose, nothing follows
    (_facts(ALWAYS, 0, expected=True, replace=True), Replace()),  # rolling restart, reset
    (_facts(ALWAYS, 0, expected=True, replace=True, tenant_failed=True), Drop()),  # a failed tenant stays down
    (_facts(NEVER, 0, expected=True, replace=True), Replace()),  # never the policy's business
    (_facts(ALWAYS, 0, expected=True, replace=True, draining=True), Drop(trim=True)),
    (_facts(ALWAYS, 1, registering=True), AbortRegistration()),  # died before its registration completed
    (_facts(NEVER, 1, registering=True), AbortRegistration()),
    # the intensity: max_restarts within window_s, this exit counted
    (_facts(ALWAYS, 1, restart_times=(0.0, 1.0), now=2.0, max_restarts=3, window_s=10.0), Backoff(0.1)),
    (_facts(ALWAYS, 1, restart_times=(0.0, 1.0, 2.0), now=3.0, max_restarts=3, window_s=10.0), Fail(4, 10.0)),
    (_facts(ALWAYS, 1, restart_times=(0.0, 11.0, 22.0), now=33.0, max_restarts=3, window_s=10.0), Restart()),
    (_facts(ALWAYS, 1, restart_times=(0.0, 25.0), now=33.0, max_restarts=3, window_s=10.0), Backoff(0.05)),
    (_facts(ALWAYS, 1, restart_times=(0.0,), now=30.0, max_restarts=3, window_s=10.0), Restart()),  # forgotten
    (_facts(ALWAYS, 1, restart_times=(), now=0.0, max_restarts=0), Fail(1, 60.0)),
], ids=lambda v: type(v).__name__ if not isinstance(v, ExitFacts) else "")
def test_after_exit(facts: ExitFacts, want: Decision) -> None:
    assert after_exit(facts) == want


def test_backoff_is_the_documented_sequence() -> None:
    """0 for the first restart in the window, then 50 ms doubling, capped at 5 s."""
    seq = [backoff_s(recent) for recent in range(1, 13)]
    assert seq[:8] == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2]
    assert seq[8:] == [BACKOFF_MAX_S] * 4


def test_a_run_of_restarts_backs_off_then_fails() -> None:
    """Feeding each decision's restart back in, as the worker set does: immediate, 50 ms, 100 ms,
    then failed past max_restarts - and the failure says how many within which window."""
    times: list[float] = []
    seen: list[Decision] = []
    for now in (0.0, 0.1, 0.2, 0.3):
        decision = after_exit(_facts(ALWAYS, 1, restart_times=tuple(times), now=now, max_restarts=3, window_s=5.0))
        seen.append(decision)
        times.append(now)
    assert seen == [Restart(), Backoff(0.05), Backoff(0.1), Fail(4, 5.0)]
    assert isinstance(seen[-1], Fail) and seen[-1].why == "4 restarts within 5 s"
