"""The order in which one loop turn serves the client messages it read.

libzmq's ROUTER already takes messages from its peers in turn, but a turn
reads a batch, and a batch from a flood used to be served in arrival order:
forged capabilities (an HMAC each), garbage, ``quota`` requests and pings
past ``max_in_flight``, all before the bystander's one request. Now a turn
serves:

1. requests carrying a capability already verified (a cache hit), one per
   tenant in turn (round robin), so each tenant gets the same share of the
   turn whatever it sends;
2. then everything else - no capability, a forged or not yet verified one, or
   a message that does not decode - one per *peer* in turn, at most
   ``unauthenticated_per_turn`` of them. The rest wait in a backlog (served
   first next turn). Once it holds ``backlog_max`` items the frontend reads
   only a few messages a turn (fewer than a turn serves), so a flood waits in
   its sender (libzmq's high-water marks) rather than in the supervisor;
   past ``backlog_bytes_max`` bytes requests are dropped unanswered (counted).

A client's first request (its token not yet verified) is in the second
group; it gets its peer's share of the turn there.

Pure policy (no sockets): :meth:`FairTurn.order` takes ``(group, key,
item)`` triples and returns the items to serve, in order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

__all__ = ["FairTurn"]

T = TypeVar("T")


def _round_robin(groups: OrderedDict[Hashable, deque[T]], limit: int | None) -> tuple[list[T], int]:
    out: list[T] = []
    while groups and (limit is None or len(out) < limit):
        for key in list(groups):
            queue = groups[key]
            out.append(queue.popleft())
            if not queue:
                del groups[key]
            if limit is not None and len(out) >= limit:
                break
    return out, sum(len(q) for q in groups.values())


@dataclass
class FairTurn(Generic[T]):
    """Round robin per tenant, then per unauthenticated peer under a budget."""

    unauthenticated_per_turn: int = 64
    backlog_max: int = 1024
    backlog_bytes_max: int = 16 << 20
    #: the bytes an item holds (its header and body), for the backlog's byte bound
    size_of: Callable[[T], int] = field(default=lambda item: 0)
    dropped: int = field(default=0, init=False)
    backlog: deque[tuple[Hashable, T]] = field(default_factory=deque, init=False)
    _backlog_bytes: int = field(default=0, init=False)

    @property
    def backlog_full(self) -> bool:
        return len(self.backlog) >= self.backlog_max or self._backlog_bytes >= self.backlog_bytes_max

    def order(self, messages: Iterable[tuple[bool, Hashable, T]]) -> list[T]:
        """``(authenticated, key, item)``: key is the tenant when authenticated, else the peer."""
        messages = list(messages)
        if not self.backlog and messages:
            # the common turn: one verified tenant's requests - already in order
            first_key = messages[0][1]
            if all(authenticated and key == first_key for authenticated, key, _ in messages):
                return [item for _, _, item in messages]
        known: OrderedDict[Hashable, deque[T]] = OrderedDict()
        unknown: OrderedDict[Hashable, deque[T]] = OrderedDict()
        for key, item in self.backlog:  # the oldest unauthenticated first
            unknown.setdefault(key, deque()).append(item)
        self.backlog.clear()
        self._backlog_bytes = 0
        for authenticated, key, item in messages:
            groups = known if authenticated else unknown
            queue = groups.get(key)
            if queue is None:
                queue = groups[key] = deque()
            queue.append(item)
        first, _ = _round_robin(known, None)
        rest, _ = _round_robin(unknown, self.unauthenticated_per_turn)
        # The count bound is what the frontend reads by: past it, only a few messages a turn
        # (fewer than a turn serves), so the backlog cannot outgrow it by more than those
        # and nothing small is dropped. The byte bound is hard: past it, items are dropped.
        for key, queue in unknown.items():
            for item in queue:
                size = self.size_of(item)
                if self._backlog_bytes + size > self.backlog_bytes_max:
                    self.dropped += 1
                else:
                    self.backlog.append((key, item))
                    self._backlog_bytes += size
        return first + rest
