"""Suite-wide fixtures: every test must leave no twt process and no twt-* segment behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import hygiene

hygiene.mark_session()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before = hygiene.baseline()
    yield
    segments, processes = hygiene.leaks(before)
    # Clean up so one leak does not cascade into every later test.
    hygiene.kill_processes(processes)
    hygiene.unlink_segments(segments)
    if segments or processes:
        pytest.fail(
            f"{request.node.nodeid} leaked segments={sorted(segments)} "
            f"processes={sorted(p for p, _ in processes)}",
            pytrace=False,
        )
