"""The quiet gate: work that can wait does, while a woken tenant's requests are out.

    Parking.activate ──► out(tenant) ── bind, restore ──► the waiting requests sent ─┐
                                                          (their ids: ``served``)     │
        the last of them answered (WorkerSet's reply path) ◄─────────────────────────┘
            │ its next request, if it is the next one sent (``next_sent``), and until it
            │ is answered; FOLLOW_S at most for it to come; another tenant's request sent or
            │ activation begun first: none
            ▼
        the activation failed or stopped, the worker died, or OUT_MAX_S passed ──► in(tenant)
                                                              │ nothing else out
                                                              ▼
        held work runs, in the order it was held: pool refills and replacements
        (WorkerSet), parks ahead and idle-timeout parks (Parking) - each also
        at its own bound (``hold(..., max_wait_s)``) with an activation still out

An activation on the 2-core host is a few milliseconds of CPU in each of the
supervisor and the bound worker, and its request's answer waits for both. Work
that runs beside it - a pool worker's start (~11 ms of CPU), a park's export
and its worker's exit (~5 ms) - took a core from it: the slowest activations
were those with starts and parks in their window (docs/PERFORMANCE.md). What
waits here is what no request waits for: a replacement while the pool still
holds a warm worker, a park ahead while a place is still free, an idle
tenant's park. What does not: a pool with no warm worker left refills at once
(one start at a time while an activation is out: :meth:`WorkerSet._start_pool_workers`),
and a park owed for room - an activation that finds no place, or the last
place taken - begins at once (:mod:`supervisor.lifecycle.parking`).

A woken tenant stays out past its waking requests' answers for its next
request: a client that woke its tenant sends the work it woke it for as the
answer comes (a ping, then the first ``run_wasm``), and the replacement
released at the ping's answer started beside that run. The window is bounded
twice - FOLLOW_S for the request to come, and it ends as another tenant's
request is sent or another activation begins, before that one counts as out -
so that under a stream of many tenants' requests the gate opens between
activations as before (a window that ran on into the next activation kept
the gate shut across runs of activations: refills one at a time at their
bound, 95-97 % of activations with a warm worker).

Held work is keyed: holding a key already held keeps the earlier hold (and
its earlier bound), so a burst of takes or ticks is one refill when the gate
opens, not one each. Each held callback looks at the state again when it
runs: it may find nothing left to do.

Owns: which tenants' activations are out, and the held callbacks. Touches
nothing else; the worker set and parking call it. Loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from supervisor.runtime.loop import Timer, Timers

__all__ = ["FOLLOW_S", "OUT_MAX_S", "QuietGate"]

#: an activation counts as out for this long at most: a request that hangs (or a path that ends an
#: activation without telling the gate) does not keep held work waiting beyond its own bound, nor
#: the pool at one start at a time, for longer
OUT_MAX_S: Final = 1.0
#: a woken tenant whose waking requests are answered stays out this long at most for its next
#: request to come (a client's turn from an answer to its next request: well under a millisecond
#: quiet, a few on the loaded 2-core host)
FOLLOW_S: Final = 0.005


class _Held:
    __slots__ = ("key", "fn", "timer")

    def __init__(self, key: str, fn: Callable[[], None], timer: Timer) -> None:
        self.key = key
        self.fn = fn
        self.timer = timer


class QuietGate:
    """Which tenants' activations are out, and the work held until none is (see the module docstring)."""

    def __init__(self, timers: Timers, clock: Callable[[], float]) -> None:
        self.timers = timers
        self.clock = clock
        #: tenants whose activation is out: when it began (counted out until OUT_MAX_S after)
        self._out: dict[str, float] = {}
        #: of those whose waiting requests were sent: the ids not answered yet
        self._rids: dict[str, set[int]] = {}
        #: of those whose waiting requests are answered: waiting for their next request (FOLLOW_S
        #: at most); the worker set looks at it as it sends each request
        self.following: dict[str, Timer] = {}
        #: of those: the next request was sent - in once it is answered
        self._followed: set[str] = set()
        #: held work, in the order it was held, by key
        self._held: dict[str, _Held] = {}
        #: held callbacks run as the gate opened, and at their bound with an activation out (status
        #: and tests read them)
        self.released = 0
        self.forced = 0

    @property
    def quiet(self) -> bool:
        """No activation is out (one out past OUT_MAX_S no longer counts)."""
        out = self._out
        if not out:
            return True
        stale = self.clock() - OUT_MAX_S
        for tid in [t for t, at in out.items() if at <= stale]:
            self._end(tid)
        return not out

    def held(self, key: str) -> bool:
        return key in self._held

    def out(self, tenant: str) -> None:
        """``tenant``'s activation began: held work waits until its requests are answered. A woken
        tenant waiting for its next request is in first (another tenant's request came first):
        the work it held runs now, as it would have at its answer, not after this activation."""
        for other in [t for t in self.following if t != tenant]:
            self.done(other)
        self._out[tenant] = self.clock()
        self._forget(tenant)

    def sent(self, tenant: str, rids: set[int]) -> None:
        """``tenant``'s activation is done and its waiting requests went out as ``rids``: it is
        out until every one of them is answered (none: it is in now)."""
        if tenant not in self._out:
            return
        if not rids:
            self.done(tenant)
            return
        self._rids[tenant] = rids

    def answered(self, tenant: str, rid: int) -> bool:
        """A reply to ``rid`` for ``tenant`` came: True when that was the last one it waited for
        (the caller clears its worker's mark)."""
        rids = self._rids.get(tenant)
        if rids is None:
            return tenant not in self._out
        rids.discard(rid)
        if rids:
            return False
        if tenant in self._followed:
            self.done(tenant)
        else:  # out a little longer, for its next request
            self.following[tenant] = self.timers.after(FOLLOW_S, lambda: self.done(tenant))
        return True

    def next_sent(self, tenant: str, rid: int) -> bool:
        """A request ``rid`` of ``tenant`` was sent while some woken tenant waits for its next
        one: True when it is that request (``tenant`` is out until it is answered; the caller
        marks its worker). Every other tenant waiting so is in now: the supervisor serves
        another tenant's request first."""
        mine = self.following.pop(tenant, None)
        for other in list(self.following):
            self.done(other)
        if mine is None:
            return False
        mine.cancel()
        self._followed.add(tenant)
        self._rids[tenant] = {rid}
        return True

    def done(self, tenant: str) -> None:
        """``tenant``'s activation is no longer out (answered, failed, stopped, its worker dead):
        with nothing else out, the held work runs now."""
        if self._out.pop(tenant, None) is None:
            return
        self._forget(tenant)
        if not self._out:
            self._release()

    def _end(self, tenant: str) -> None:
        self._out.pop(tenant, None)
        self._forget(tenant)

    def _forget(self, tenant: str) -> None:
        self._rids.pop(tenant, None)
        self._followed.discard(tenant)
        timer = self.following.pop(tenant, None)
        if timer is not None:
            timer.cancel()

    def hold(self, key: str, fn: Callable[[], None], max_wait_s: float) -> bool:
        """Run ``fn`` now if no activation is out (True), else once none is or ``max_wait_s`` from
        now, whichever comes first (False). A key already held keeps its earlier hold."""
        if self.quiet:
            return True
        if key in self._held:
            return False
        held = _Held(key, fn, self.timers.after(max_wait_s, lambda: self._due(key)))
        self._held[key] = held
        return False

    def run_now(self, key: str) -> None:
        """The work held under ``key`` (if any) runs now, activation out or not: what it was
        waiting for no longer matters (the pool fell below its floor)."""
        held = self._held.pop(key, None)
        if held is not None:
            held.timer.cancel()
            held.fn()

    def _due(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        self.forced += 1
        held.fn()

    def _release(self) -> None:
        """Nothing is out: every held callback runs, in the order held (one that holds again -
        another activation out meanwhile - waits anew)."""
        while self._held and not self._out:
            key = next(iter(self._held))
            held = self._held.pop(key)
            held.timer.cancel()
            self.released += 1
            held.fn()
