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


def test_a_warm_pool_worker_bound_to_a_tenant_is_replaced_when_its_bind_is_done(tmp_path: Path) -> None:
    """Not at the next housekeeping tick (the clock does not move here): the replacement starts
    as the bind completes - after it, so it does not compete with the bind itself."""
    h = Harness(tmp_path, pool_size=2)
    try:
        ws = h.sup.parts.workers
        # the pool warmed (hellos and warmed words cross real sockets: a loaded host delivers them
        # after any fixed number of quiet turns)
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)
        spawned = len(h.spawner.workers)
        ok, payload = h.answer(h.send("register", {"spec": {"tenant_id": "first", "instances": 1}}))
        assert ok, payload
        h.until(lambda: len(h.spawner.workers) == spawned + 1 and len(ws.pool) == 2 and ws.pool_starting == 0)
        h.settle()
        assert len(h.spawner.workers) == spawned + 1  # one replacement, no more
    finally:
        h.close()
