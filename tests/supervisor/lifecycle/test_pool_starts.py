"""How a pool refill's starts are spread: at most ``POOL_STARTS_AT_ONCE`` in flight, the next one as
each is warmed - never every missing worker at one housekeeping tick (fake workers, fake clock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor.lifecycle import workerset
from tests.supervisor.lifecycle.test_lifecycle_inprocess import Harness

pytestmark = pytest.mark.timeout(120)


def test_a_refill_of_many_starts_two_at_once_and_the_next_as_each_is_warmed(tmp_path: Path) -> None:
    h = Harness(tmp_path, pool_size=1, pool_max=8)
    try:
        ws = h.sup.parts.workers
        h.until(lambda: len(ws.pool) == 1 and ws.pool_starting == 0)  # warmed (as above)
        ws._refill_s = 0.5  # a pool worker's spawn-to-ready time, as measured
        for _ in range(10):  # a burst of activations: the target is the pool's most
            ws._note_demand()
        assert ws.pool_target_now(h.clock()) == 8
        held: list[Any] = []

        def hold(worker: Any) -> None:  # its hello waits for the test
            held.append(worker)
            worker.say_hello = lambda: None

        h.spawner.on_spawn.append(hold)
        ws.refill_pool()
        assert len(held) == workerset.POOL_STARTS_AT_ONCE == 2 and ws.pool_starting == 2
        released = 0
        while len(ws.pool) < 8:
            worker = held[released]
            released += 1
            type(worker).say_hello(worker)
            # its hellos and its warmed word in (they cross real sockets: a loaded host delivers them
            # after any fixed number of quiet turns), then its readiness's start is checked
            h.until(lambda: len(ws.pool) == 1 + released)
            assert ws.pool_starting <= 2
            # no tick passed: the warmed worker's readiness started the next one itself
            assert len(held) == min(7, released + 2)
        assert len(held) == 7 and ws.pool_starting == 0
    finally:
        h.close()
