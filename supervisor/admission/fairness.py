"""The order in which the loop serves the client messages it read, one bounded turn at a time.

libzmq's ROUTER takes messages from its *peers* in turn, but a tenant may
have many peers, and a turn that served everything it read let one tenant's
burst delay everyone else by the whole burst (a victim's ping was 17x
slower during another tenant's ping flood, 26x over TCP).
Now the frontend only *reads* into this queue, and each loop turn serves one
bounded :meth:`FairTurn.take`:

1. requests carrying a capability already verified (a cache hit), one per
   tenant in turn (round robin), at most ``per_tenant_per_turn`` of each
   tenant - so another tenant's request waits for at most one such turn of
   each busy tenant, whatever they send (a tenant with nothing waiting goes
   to the front of the line when its request arrives). :meth:`FairTurn.run_turn`
   also bounds each tenant's turn by the loop *time* its requests took:
   deficit round robin on measured cost - each waiting tenant gets
   ``quantum_s`` of credit a turn, each request served is charged what it
   cost, and a tenant in debt waits for the next turn (16 ``quota``
   requests answered by the frontend itself took ~1.5 ms, the whole of a
   victim's wait). Credit is not banked past one quantum: a tenant whose
   queue empties keeps none;
2. then everything else - no capability, a forged or not yet verified one,
   or a message that does not decode - one per *peer* in turn, at most
   ``unauthenticated_per_turn`` of them.

The tenants in :attr:`FairTurn.held` are not served while they are held
(:mod:`supervisor.admission.yielding`: over their rate while another
tenant's request is in flight); their items keep their place, and
:attr:`FairTurn.backlog` does not count them (nothing to serve: the loop may
sleep).

What a turn does not serve waits here, oldest first. Once this queue holds
``backlog_max`` items (or ``backlog_bytes_max`` bytes) the frontend reads only
a few messages a turn (:attr:`FairTurn.backlog_full`), so a flood waits in
its sender (libzmq's high-water marks) rather than in the supervisor; an
unauthenticated item that would take the queue past its byte bound is
dropped (counted), unless no other unauthenticated item waits - or its token
verifies once asked there (the frontend asks before dropping: a client's
pipelined first requests are read before the first is served, and a valid
token's are its tenant's; :meth:`FairTurn.promote` moves the ones it queued
before, in order). At that hard
ceiling, while held tenants' items wait, a socket a tenant within its rate
is active on still reads two messages a turn (:meth:`FairTurn.past_ceiling`,
at most ``past_ceiling_max`` items past it): the held tenants' messages read
so are refused, not queued (:mod:`supervisor.admission.yielding`). A client's first request (its token not yet verified) is
in the second group; it gets its peer's share there.

Pure policy (no sockets): :meth:`FairTurn.add` items as ``(authenticated, key,
item)``, :meth:`FairTurn.take` a turn's items in the order to serve them;
:meth:`FairTurn.order` does both for one batch; :meth:`FairTurn.run_turn` serves
a turn through a callback, timing each item on the given clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar
from collections.abc import Callable

__all__ = ["FairTurn"]

T = TypeVar("T")


def _round_robin(groups: OrderedDict[Hashable, deque[T]], per_key: int | None, limit: int | None) -> list[T]:
    """Up to ``per_key`` items of each key (one per key per round), ``limit`` in all; the
    keys served move to the back, so the next turn starts with the others."""
    out: list[T] = []
    taken: dict[Hashable, int] = {}
    while groups and (limit is None or len(out) < limit):
        progressed = False
        for key in list(groups):
            n = taken.get(key, 0)
            if per_key is not None and n >= per_key:
                continue
            queue = groups[key]
            out.append(queue.popleft())
            taken[key] = n + 1
            progressed = True
            if not queue:
                del groups[key]
            if limit is not None and len(out) >= limit:
                break
        if not progressed:
            break
    for key in taken:  # served this turn: to the back of the line
        if key in groups:
            groups.move_to_end(key)
    return out


@dataclass
class FairTurn(Generic[T]):
    """Round robin per tenant (bounded each), then per unauthenticated peer under a budget."""

    unauthenticated_per_turn: int = 16
    backlog_max: int = 1024
    backlog_bytes_max: int = 16 << 20
    per_tenant_per_turn: int = 16
    #: items past the hard ceiling that sockets an active tenant within its rate shares may add (past_ceiling)
    past_ceiling_max: int = 64
    #: loop time (s) one tenant's requests may take per turn in :meth:`run_turn` (debt carries over)
    quantum_s: float = 0.0002
    #: the bytes an item holds (its header and body), for the backlog's byte bound
    size_of: Callable[[T], int] = field(default=lambda item: 0)
    dropped: int = field(default=0, init=False)
    _known: OrderedDict[Hashable, deque[T]] = field(default_factory=OrderedDict, init=False)
    _unknown: OrderedDict[Hashable, deque[T]] = field(default_factory=OrderedDict, init=False)
    _count: int = field(default=0, init=False)
    _bytes: int = field(default=0, init=False)
    _unknown_bytes: int = field(default=0, init=False)
    #: tenant -> its credit (s) in run_turn; only tenants with something waiting have one
    _credit: dict[Hashable, float] = field(default_factory=dict, init=False)
    #: items the last turn served (what a socket may read while the queue is full)
    _served_last: int = field(default=0, init=False)
    #: tenants whose items are not served now (they keep their place): see the module docstring
    held: frozenset[Hashable] = field(default=frozenset(), init=False)

    @property
    def backlog(self) -> int:
        """Items waiting for a turn, less those of :attr:`held` tenants (they wait for the hold's end)."""
        if self.held:
            known = self._known
            return self._count - sum(len(known[k]) for k in self.held if k in known)
        return self._count

    @property
    def queued(self) -> int:
        """Every item waiting here, held ones included."""
        return self._count

    @property
    def backlog_full(self) -> bool:
        return self._count >= self.backlog_max or self._bytes >= self.backlog_bytes_max

    def read_budget(self, normal: int, backlogged: int) -> int:
        """How many messages the frontend may read from one socket now: ``normal`` while the
        queue has room; once it is full, what the last turn served (at least 2, at most
        ``backlogged``: a turn bounded by time may serve fewer than a wake-up reads); and
        nothing at all once it is ``backlogged`` items or its byte bound past full - the hard
        ceiling. Reading on while full matters: libzmq hands out one message per peer in turn,
        so the first two reads of a socket reach a bystander's request behind any flood."""
        if not self.backlog_full:
            return normal
        if self._count >= self.backlog_max + backlogged or self._bytes >= 2 * self.backlog_bytes_max:
            return 0
        return min(backlogged, max(2, self._served_last))

    def past_ceiling(self, backlogged: int) -> int:
        """At the hard ceiling (:meth:`read_budget` 0) with :attr:`held` tenants' items waiting: how
        many messages a socket that a tenant within its rate is active on may read anyway - 2, as
        libzmq hands out one message per peer in turn, so the second reaches that tenant's request
        behind any flood. Without it the request waited for a turn to serve held items: one every
        other budget hold (~250 us each) while a ping flood held the queue full, so the victim's
        round trip fell into two peaks ~500 us apart. The frontend refuses the held tenants'
        messages read so (they are over their rate) and queues the others, at most
        ``past_ceiling_max`` items past the ceiling."""
        if (not self.held or self._count >= self.backlog_max + backlogged + self.past_ceiling_max
                or self._bytes >= 2 * self.backlog_bytes_max):
            return 0
        return 2

    def fits_unauthenticated(self, size: int) -> bool:
        """An unauthenticated item of ``size`` bytes would be queued, not dropped (:meth:`add`)."""
        return not self._unknown_bytes or self._bytes + size <= self.backlog_bytes_max

    def promote(self, peer: Hashable, key: Hashable, moves: Callable[[T], bool]) -> list[T]:
        """The unauthenticated items of ``peer`` that ``moves`` picks are ``key``'s from now on (the
        token they carry was verified after they were queued): they go ahead of ``key``'s queue, in
        their order, so a client's requests are still served in the order it sent them. Returns them."""
        queue = self._unknown.get(peer)
        if not queue:
            return []
        moved: list[T] = []
        kept: deque[T] = deque()
        for item in queue:
            (moved if moves(item) else kept).append(item)
        if not moved:
            return moved
        if kept:
            self._unknown[peer] = kept
        else:
            del self._unknown[peer]
        self._unknown_bytes -= sum(self.size_of(item) for item in moved)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = deque()
            self._known.move_to_end(key, last=False)  # as add: nothing of it waited
        known.extendleft(reversed(moved))
        return moved

    def add(self, authenticated: bool, key: Hashable, item: T) -> bool:
        """Queue one message: ``key`` is its tenant when authenticated, else its peer. False:
        dropped (an unauthenticated one past the backlog's bytes), counted in :attr:`dropped`."""
        size = self.size_of(item)
        if not authenticated:
            # the byte bound is hard for the unauthenticated, but one always fits when none
            # waits (a client's first request may carry a big body: its token is not verified yet)
            if not self.fits_unauthenticated(size):
                self.dropped += 1
                return False
            self._unknown_bytes += size
        groups = self._known if authenticated else self._unknown
        queue = groups.get(key)
        if queue is None:
            queue = groups[key] = deque()
            if authenticated:  # a tenant with nothing waiting goes before those served last turn
                groups.move_to_end(key, last=False)
        queue.append(item)
        self._count += 1
        self._bytes += size
        return True

    def take(self) -> list[T]:
        """One turn: the items to serve now, in order (see the module docstring)."""
        if not self._count:
            return []
        known = self._known
        if self.held and known:  # held tenants keep their place, out of this turn
            known = OrderedDict((k, q) for k, q in known.items() if k not in self.held)
        first = _round_robin(known, self.per_tenant_per_turn, None) if known else []
        if known is not self._known:
            for key in [k for k in self._known if k not in known and k not in self.held]:
                del self._known[key]  # emptied this turn
            for key in known:  # served and not emptied: to the back, as _round_robin left them
                self._known.move_to_end(key)
        rest = _round_robin(self._unknown, None, self.unauthenticated_per_turn) if self._unknown else []
        out = first + rest
        self._served_last = len(out)
        self._count -= len(out)
        size_of = self.size_of
        unknown = sum(size_of(item) for item in rest)
        self._unknown_bytes -= unknown
        self._bytes -= unknown + sum(size_of(item) for item in first)
        return out

    def run_turn(self, serve: Callable[[T], None], clock: Callable[[], float]) -> int:
        """One turn served through ``serve`` (the order of :meth:`take`, but each tenant also
        bounded by ``quantum_s`` of measured time); returns how many items were served. The
        :attr:`held` tenants are skipped (``serve`` may hold them: asked before each item)."""
        if not self._count:
            return 0
        served = 0
        known, credit = self._known, self._credit
        if known:
            size_of, quantum, per_key = self.size_of, self.quantum_s, self.per_tenant_per_turn
            for key in known:  # a new quantum; a debt is kept, unspent credit is not banked
                credit[key] = min(credit.get(key, 0.0), 0.0) + quantum
            taken: dict[Hashable, int] = {}
            progressed = True
            while known and progressed:
                progressed = False
                for key in list(known):
                    n = taken.get(key, 0)
                    if n >= per_key or credit[key] <= 0.0 or key in self.held:
                        continue
                    queue = known[key]
                    item = queue.popleft()
                    if not queue:
                        del known[key]
                    self._count -= 1
                    self._bytes -= size_of(item)
                    taken[key] = n + 1
                    progressed = True
                    t0 = clock()
                    serve(item)
                    credit[key] -= clock() - t0
                    served += 1
            for key in taken:  # served this turn: to the back of the line
                if key in known:
                    known.move_to_end(key)
            for key in [k for k in credit if k not in known]:
                del credit[key]  # nothing waiting: no credit, no debt kept
        if self._unknown:
            rest = _round_robin(self._unknown, None, self.unauthenticated_per_turn)
            self._count -= len(rest)
            size = sum(self.size_of(item) for item in rest)
            self._unknown_bytes -= size
            self._bytes -= size
            for item in rest:
                serve(item)
            served += len(rest)
        self._served_last = served
        return served

    def order(self, messages: Iterable[tuple[bool, Hashable, T]]) -> list[T]:
        """``add`` each ``(authenticated, key, item)``, then ``take`` one turn."""
        for authenticated, key, item in messages:
            self.add(authenticated, key, item)
        return self.take()
