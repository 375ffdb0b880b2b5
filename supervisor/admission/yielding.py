"""Yielding: a flooder is held while another tenant's request is in flight.

Admission (:mod:`supervisor.admission.rates`) holds a tenant to its rate and
the fair queue (:mod:`supervisor.admission.fairness`) serves the tenants in
turn; neither makes a flood cheap for the *host*. A tenant at its rate over
CURVE TCP keeps its client, the supervisor's TCP I/O thread (decrypting),
the loop and its worker runnable, and on a small host another tenant's
round trip waits for a CPU at each hop (on 2 vCPUs a local victim's ping
p99 was 10-20x its quiet p50 during a tcp-ping flood).

A tenant refused for its rate (``Overloaded``, answered or not) is *over its
rate* for ``window_s`` after; the sockets it was refused on are its sources.
While a tenant within its rate is active (served within ``contended_s``),
an over-rate tenant is *held* - its queued requests wait in the fair queue
(:attr:`FairTurn.held`) and its sources are not read, so its messages wait in
libzmq's pipe, the kernel and its sender - in two cases:

* a hold: while a request of a tenant within its rate is in flight at a
  worker, at most ``max_hold_s`` (one that ran that long is followed by as
  long without one); it ends at the loop's turn after the answer;
* its contended budget: past ``contended_share`` of its rate (a burst of
  ``contended_burst``), until the budget is back (at most
  ``max_budget_hold_s`` at a time).

On a socket an active tenant within its rate also sends on (``small.ipc``,
which a local victim shares with a local flooder), the socket is still read -
leaving it unread would delay the other tenant too (a hold of the shared ipc
socket was measured: a write flood's victim p50 rose) - and only the
over-rate tenant's requests read there wait in the fair queue: while they
wait its worker gets no new work, and once the fair queue is full the
socket is read a few messages a turn, so the rest of the flood waits in its
sender (libzmq's ROUTER hands out one message per peer in turn: the other
tenant's request is among the first two read). At the queue's hard ceiling
that socket still reads two messages a turn (``FairTurn.past_ceiling``): the
other tenant's request is queued, the held tenant's messages read with it are
refused for its rate (answered, or past its refusals' answers dropped and
counted) - else the other's request waited for a turn to serve a held one. A
lone flooder is never held (nobody else is active); a busy tenant within its
rate is never over it. Nothing queued is dropped or reordered here: held
requests keep their place, and a socket is only read later.

Pure policy with an injected clock: no sockets, no threads. Loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CONTENDED_SHARE", "MAX_HOLD_S", "OVER_RATE_WINDOW_S", "Yielding"]

#: a tenant refused for its rate this recently is over its rate
OVER_RATE_WINDOW_S = 0.1
#: the longest single hold (the loop's poll counts whole milliseconds: 2-3 ms in practice)
MAX_HOLD_S = 0.002
#: the share of its rate an over-rate tenant keeps while another tenant is active
CONTENDED_SHARE = 0.5


@dataclass
class Yielding:
    """Which tenants are over their rate, on which sockets, and their contended budgets (see the
    module docstring)."""

    window_s: float = OVER_RATE_WINDOW_S
    max_hold_s: float = MAX_HOLD_S
    contended_share: float = CONTENDED_SHARE
    #: a tenant within its rate is active this long after it was served
    contended_s: float = 0.005
    contended_burst: float = 16.0
    #: the longest single hold for a budget (a tenant with a tiny rate would owe seconds): what a
    #: bystander's first request on that socket may wait
    max_budget_hold_s: float = MAX_HOLD_S
    #: holds so far; of those, the ones that ran ``max_hold_s``; holds for a contended budget
    holds: int = field(default=0, init=False)
    full_holds: int = field(default=0, init=False)
    budget_holds: int = field(default=0, init=False)
    #: pauses of ``frontend.ipc`` for a tenant past its rate (supervisor.admission.frontend._paced_by_rate)
    rate_pauses: int = field(default=0, init=False)
    #: source -> tenant -> when it was last refused for its rate from that source
    _over: dict[bytes, dict[str, float]] = field(default_factory=dict, init=False)
    #: tenant -> (its contended budget, when last charged)
    _budget: dict[str, tuple[float, float]] = field(default_factory=dict, init=False)

    @property
    def enabled(self) -> bool:
        return self.max_hold_s > 0.0 or self.contended_share < 1.0

    @property
    def tracking(self) -> bool:
        """Some tenant was refused for its rate and not yet forgotten: only then is
        :meth:`over_rate` worth asking (the frontend asks at every loop turn otherwise)."""
        return bool(self._over)

    def refused(self, source: bytes, tenant: str, now: float) -> bool:
        """``tenant`` was refused for its rate (answered or not) on a request read from ``source``.
        True when that makes it over its rate (it was not already)."""
        if not self.enabled:
            return False
        new = not any(tenant in tenants for tenants in self._over.values())
        tenants = self._over.get(source)
        if tenants is None:
            tenants = self._over[source] = {}
        tenants[tenant] = now
        return new

    def over_rate(self, now: float) -> set[str]:
        """The tenants over their rate now (those refused last before the window are forgotten)."""
        out: set[str] = set()
        if not self._over:
            return out
        since = now - self.window_s
        for source, tenants in list(self._over.items()):
            for t in [t for t, when in tenants.items() if when < since]:
                del tenants[t]
                self._budget.pop(t, None)
            if tenants:
                out.update(tenants)
            else:
                del self._over[source]
        return out

    def sources_of(self, tenant: str) -> list[bytes]:
        """The sockets ``tenant`` was refused on within the window."""
        return [source for source, tenants in self._over.items() if tenant in tenants]

    def charge(self, tenant: str, rate: float, now: float) -> float:
        """One request of over-rate ``tenant`` (whose rate is ``rate``) served while another tenant
        is active: 0.0 within its contended budget, else the seconds to hold it (until the budget
        is back, at most ``max_budget_hold_s``) - then it is still over its rate (on each of its
        sockets), held or not."""
        share = self.contended_share * rate
        if share <= 0.0 or share == float("inf"):
            return 0.0
        credit, stamp = self._budget.get(tenant, (self.contended_burst, now))
        credit = min(self.contended_burst, credit + (now - stamp) * share) - 1.0
        self._budget[tenant] = (credit, now)
        if credit >= 0.0:
            return 0.0
        for tenants in self._over.values():
            if tenant in tenants:
                tenants[tenant] = now
        return min(-credit / share, self.max_budget_hold_s)

    def forget(self, tenant: str) -> None:
        """An evicted tenant: nothing of it is kept."""
        for tenants in self._over.values():
            tenants.pop(tenant, None)
        self._budget.pop(tenant, None)
