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


def _step(h: Harness, seconds: float) -> None:
    """Move the clock by ``seconds`` and handle what is due then (timers, housekeeping)."""
    h.clock.advance(seconds)
    h.sup.turn(0.0)
    h.settle(quiet_turns=2)


def test_a_warm_pool_worker_taken_is_replaced_once_its_tenant_is_quiet_not_while_it_is_served(
        tmp_path: Path) -> None:
    """The replacement of a warm pool worker waits while the tenant it went to is served (its
    start's CPU would run across the woken tenant's first requests), the pool keeping a warm
    worker meanwhile; it starts once the tenant's worker has been quiet for POOL_HOLD_QUIET_S."""
    h = Harness(tmp_path, pool_size=2)
    try:
        ws = h.sup.parts.workers
        # the pool warmed (hellos and warmed words cross real sockets: a loaded host delivers them
        # after any fixed number of quiet turns)
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)
        spawned = len(h.spawner.workers)
        cap = h.register("first", instances=1)
        h.settle()
        assert len(h.spawner.workers) == spawned, "no start while the tenant's first requests are served"
        assert len(ws.pool) == 1  # the floor: a warm worker for the next activation
        for _ in range(3):  # the quiet time passes on the clock, and the tenant is served within it
            h.call("ping", {}, cap)
            _step(h, workerset.POOL_HOLD_QUIET_S * 0.9)
            assert len(h.spawner.workers) == spawned
        _step(h, workerset.POOL_HOLD_QUIET_S)  # a quiet time without a request: the replacement starts
        _step(h, workerset.POOL_HOLD_QUIET_S)
        assert len(h.spawner.workers) == spawned + 1
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)
    finally:
        h.close()


def test_a_tenant_kept_busy_holds_its_replacement_no_longer_than_the_most(tmp_path: Path) -> None:
    h = Harness(tmp_path, pool_size=2)
    try:
        ws = h.sup.parts.workers
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)  # warmed (as above)
        spawned = len(h.spawner.workers)
        cap = h.register("first", instances=1)
        steps = 0
        while len(h.spawner.workers) == spawned:
            h.call("ping", {}, cap)
            _step(h, workerset.POOL_HOLD_QUIET_S / 2)
            steps += 1
            assert steps * workerset.POOL_HOLD_QUIET_S / 2 <= workerset.POOL_HOLD_MAX_S + workerset.POOL_HOLD_QUIET_S
        assert steps * workerset.POOL_HOLD_QUIET_S / 2 >= workerset.POOL_HOLD_MAX_S - workerset.POOL_HOLD_QUIET_S
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)
    finally:
        h.close()


def test_a_take_that_leaves_the_pool_below_its_floor_starts_the_replacements_at_once(tmp_path: Path) -> None:
    """Not held: the next activation would find no warm worker. The replacement starts as the
    bind completes (the clock does not move here: no housekeeping tick, no hold's end), and a
    replacement held before starts with it."""
    h = Harness(tmp_path, pool_size=2)
    try:
        ws = h.sup.parts.workers
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)  # warmed (as above)
        spawned = len(h.spawner.workers)
        h.register("first", instances=1)
        h.settle()
        assert len(h.spawner.workers) == spawned and len(ws.pool) == 1  # held: one warm left
        h.register("second", instances=1)  # takes the last warm one
        h.settle()
        assert len(h.spawner.workers) == spawned + 2, "both replacements started"
        h.until(lambda: len(ws.pool) == 2 and ws.pool_starting == 0)
    finally:
        h.close()
