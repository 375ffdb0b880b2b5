"""Model check of the gated launch (tests/helpers/gated_launch_model.py): every interleaving of the
holder's hand-over, the grantee's driver and executor, a waiter stealing an idle lease and a SIGKILL
of the grantee at every step. A chunk runs only under its worker's busy lease (a lost CAS runs
nothing), never two workers' at once, never after a refused wait or the grantee's death; the broken
variants are caught. With a stretch's small op gated (``small``), the executor passes the lease back
at the op's end while the driver sleeps: the op runs once, the driver then holds nothing but a later
grant of its own, and no grant stays with it. The drivers and the executor sleep on futexes and a
change of hands wakes only the worker it names: no waiter sleeps while the lease is free or names it
(a lost wake-up), and the checker catches a hand-over that wakes nobody, or the wrong waiters."""

from __future__ import annotations

import pytest

from tests.helpers.gated_launch_model import SMALL_VARIANTS, VARIANTS, WAKE_VARIANTS, Violation, explore

pytestmark = pytest.mark.timeout(120)


def test_every_interleaving_keeps_the_lease_and_the_chunk_together() -> None:
    result = explore("correct")
    assert result.states > 1000 and result.end_states > 10
    # each way the wait can end is reached: the executor's own CAS, the driver's, a refusal, a death
    assert {("hold", "taken"), ("hold", "plain"), ("released", "cancelled")} <= result.outcomes
    assert {o for o in result.outcomes if o[0] == "dead"}
    # and the races that matter happen in some interleaving
    assert {"B exec: CAS won", "B exec: CAS lost, sleeps", "B driver: CAS won", "B driver: CAS lost",
            "B driver: resolve (taken first)", "B driver: resolve (cancelled)", "C: CAS won",
            "reclaim: to 2", "B exec: chunk starts"} <= result.steps


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "correct"])
def test_the_checker_catches_each_broken_variant(variant: str) -> None:
    with pytest.raises(Violation) as info:
        explore(variant)  # type: ignore[arg-type]
    assert info.value.trace and "interleaving:" in str(info.value)


def test_a_small_op_passed_back_by_the_executor_keeps_the_lease_and_the_op_together() -> None:
    result = explore("correct", small=True)
    assert result.states > result.end_states > 10
    # the executor passed the lease back in some interleavings and kept it (the driver resolved first)
    # in others; the refusal and the death still end the wait as before
    assert {("handed", "handed"), ("hold", "taken"), ("hold", "plain"), ("released", "cancelled")} <= result.outcomes
    assert {o for o in result.outcomes if o[0] == "dead"}
    assert {"B exec: passes the lease back", "B exec: hand over to 2", "B exec: hand over cas lost",
            "B exec: keeps the lease (resolved, or none waits)", "B driver: sees its op passed back",
            "B driver: resolve (passed back)", "B driver: resolve (cancel: passed back)",
            "B driver: pass a grant on to 2", "B driver: release the later grant to 2"} <= result.steps


@pytest.mark.parametrize("variant", [v for v in (*VARIANTS, *SMALL_VARIANTS) if v != "correct"])
def test_the_checker_catches_each_broken_hand_back(variant: str) -> None:
    with pytest.raises(Violation) as info:
        explore(variant, small=True)  # type: ignore[arg-type]
    assert info.value.trace and "interleaving:" in str(info.value)


@pytest.mark.parametrize("small", [False, True])
def test_one_wake_per_change_of_hands_loses_no_wake_up(small: bool) -> None:
    result = explore("correct", small=small)
    # the waiters slept, were woken by a grant, and some woke before they slept (the sequence moved)
    assert {"C: sleeps", "B driver: sleeps", "B exec: asleep on the owner word", "C: woken before it slept",
            "G: wake 5", "C: wake 5", "reclaim: B held nothing, the grantee woken"} <= result.steps
    assert any(label.startswith("G: wake") for label in result.steps)
    # waking every waiter at each change of hands (the rule before) is correct too, only costlier
    assert explore("wake_all", small=small).end_states > 10


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("variant", WAKE_VARIANTS)
def test_the_checker_catches_a_lost_wake_up(variant: str, small: bool) -> None:
    with pytest.raises(Violation) as info:
        explore(variant, small=small)  # type: ignore[arg-type]
    assert "lost wake-up" in str(info.value)
