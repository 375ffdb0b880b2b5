"""Bytes the supervisor holds on behalf of others, bounded per tenant and in total.

A tenant's quotas bound what its *workers* hold; this bounds what the
*supervisor* holds for it, which no quota sees:

    replies   read bodies reserved at admission (the worker will send that much)
              and then held by libzmq until the client reads them
    parked    request bodies waiting for an instance (a restart under way)
    modules   stored ``put_module`` bytes

Every byte is reserved before it is held and released once it is not, with
the same tenant name; a reservation that would take the tenant past
``per_tenant`` or everyone past ``total`` is refused with the retryable
:class:`~shared.errors.Overloaded` and nothing is reserved. Counting at
admission (not only once replies are queued) is what bounds a client that
pipelines many reads before any reply exists.

Owns only its counters. Loop thread only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final, Literal

from shared.errors import HeldBytesLimit

__all__ = ["HeldBytes", "Kind"]

Kind = Literal["replies", "parked", "modules"]
KINDS: Final[tuple[Kind, ...]] = ("replies", "parked", "modules")


@dataclass
class HeldBytes:
    """Per-tenant and total byte budgets of what the supervisor holds (see the module docstring)."""

    per_tenant: int
    total: int
    _tenant: Counter[str] = field(default_factory=Counter, init=False)
    _kind: Counter[tuple[str, Kind]] = field(default_factory=Counter, init=False)
    _total: int = field(default=0, init=False)
    refused: int = field(default=0, init=False)

    def reserve(self, tenant: str, kind: Kind, n: int, *, in_flight: int, max_in_flight: int) -> None:
        """Hold ``n`` more bytes for ``tenant``; :class:`HeldBytesLimit` (nothing held) past a budget.
        ``in_flight``/``max_in_flight``: the tenant's requests in flight and its limit, which
        every ``Overloaded`` carries."""
        if n <= 0:
            return
        held = self._tenant[tenant]
        if held + n > self.per_tenant or self._total + n > self.total:
            self.refused += 1
            scope, used, limit = (
                ("tenant", held, self.per_tenant) if held + n > self.per_tenant else ("total", self._total, self.total)
            )
            raise HeldBytesLimit(tenant, in_flight, max_in_flight, scope=scope, held=used, requested=n, budget=limit)
        self._tenant[tenant] = held + n
        self._kind[(tenant, kind)] += n
        self._total += n

    def release(self, tenant: str, kind: Kind, n: int) -> None:
        """Give back ``n`` bytes reserved with the same tenant and kind (clamped at what is held)."""
        if n <= 0:
            return
        n = min(n, self._kind[(tenant, kind)])
        if not n:
            return
        self._kind[(tenant, kind)] -= n
        if not self._kind[(tenant, kind)]:
            del self._kind[(tenant, kind)]
        self._tenant[tenant] -= n
        if not self._tenant[tenant]:
            del self._tenant[tenant]
        self._total -= n

    def forget(self, tenant: str) -> int:
        """Release everything held for ``tenant`` (evicted); returns the bytes."""
        n = self._tenant.pop(tenant, 0)
        for kind in KINDS:
            self._kind.pop((tenant, kind), None)
        self._total -= n
        return n

    def held(self, tenant: str | None = None, kind: Kind | None = None) -> int:
        """Bytes held: in total, for a tenant, or for a tenant and kind."""
        if tenant is None:
            return self._total if kind is None else sum(v for (_, k), v in self._kind.items() if k == kind)
        return self._tenant.get(tenant, 0) if kind is None else self._kind.get((tenant, kind), 0)

    def snapshot(self) -> dict[str, int]:
        """For status: total and per kind."""
        out = {"total": self._total, "refused": self.refused}
        for kind in KINDS:
            out[kind] = self.held(kind=kind)
        return out
