"""Model check of the gated launch (tests/helpers/gated_launch_model.py): every interleaving of the
holder's hand-over, the grantee's driver and executor, a waiter stealing an idle lease and a SIGKILL
of the grantee at every step. A chunk runs only under its worker's busy lease (a lost CAS runs
nothing), never two workers' at once, never after a refused wait or the grantee's death; the broken
variants are caught."""

from __future__ import annotations

import pytest

from tests.helpers.gated_launch_model import VARIANTS, Violation, explore

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
