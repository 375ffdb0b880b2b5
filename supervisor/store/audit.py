"""The audit of refused capabilities: one ``denied`` event per refusal, rate-limited.

A forged or foreign capability used to leave no trace except a metric. Now
every refusal of a capability is published (events stream and a log line)::

    denied  reason=forged  op=alloc  tenant=None  claimed="acme"  verified=False  dropped=0

* ``reason`` says which check failed (:data:`REASONS`): ``missing``,
  ``truncated``, ``malformed``, ``wrong_kind`` (a tenant token for an admin op
  or the reverse), ``foreign`` (another registry), ``forged`` (bad MAC),
  ``revoked`` (an evicted tenant's generation, or a key replaced by
  ``rotate-key``).
* the tenant a token names is only trusted when its MAC is ours: then it is
  ``tenant`` and ``verified`` is true; otherwise ``tenant`` is empty and the
  claim is reported as ``claimed`` (shortened), marked ``verified=False``.
* a flood of bad tokens must not become a flood of log lines: a token bucket
  (``rate`` per second, ``burst``) admits events; the ones it drops are
  counted and reported as ``dropped`` on the next admitted event, or by
  :meth:`DeniedAudit.flush` once the flood is over.

The classification itself needs the registry's secret and lives in
:meth:`supervisor.store.registry.TenantRegistry.explain_refusal`; this module owns
the record's shape and the limiter. Loop thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["REASONS", "DeniedAudit", "Denial"]

REASONS = ("missing", "truncated", "malformed", "wrong_kind", "foreign", "forged", "revoked", "unknown_tenant", "other")
#: an unverified tenant claim is shortened to this many characters in the record
CLAIM_CHARS = 64


@dataclass(frozen=True)
class Denial:
    """Why one capability was refused (see the module docstring)."""

    reason: str
    tenant: str | None  # verified: the token's MAC is ours
    claimed: str | None  # the tenant an unverified token names

    def fields(self, op: str) -> dict[str, object]:
        out: dict[str, object] = {
            "reason": self.reason,
            "op": op,
            "tenant": self.tenant,
            "verified": self.tenant is not None,
        }
        if self.claimed is not None:
            claim = self.claimed if len(self.claimed) <= CLAIM_CHARS else self.claimed[:CLAIM_CHARS] + "..."
            out["claimed"] = claim
        return out


class DeniedAudit:
    """Rate limiter and record builder for ``denied`` events.

    ``emit(kind, **fields)`` is the event bus's :meth:`~supervisor.observe.events.EventBus.emit`.
    """

    def __init__(
        self,
        emit: Callable[..., None],
        *,
        rate_per_s: float = 10.0,
        burst: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self._emit = emit
        self._rate = float(rate_per_s)
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._last = clock()
        self._dropped = 0  # since the last event that reported them
        self.emitted = 0
        self.dropped_total = 0

    def _refill(self, now: float) -> None:
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def record(self, denial: Denial, op: str) -> bool:
        """Publish one refusal, unless the limiter drops it (then counted). True when published."""
        now = self._clock()
        self._refill(now)
        if self._tokens < 1.0:
            self._dropped += 1
            self.dropped_total += 1
            return False
        self._tokens -= 1.0
        dropped, self._dropped = self._dropped, 0
        self.emitted += 1
        self._emit("denied", **denial.fields(op), dropped=dropped)
        return True

    def flush(self) -> int:
        """Housekeeping: report refusals dropped since the last event, once the bucket has room.

        Publishes ``denied_dropped`` with the count; returns it (0: nothing to report).
        """
        if not self._dropped:
            return 0
        now = self._clock()
        self._refill(now)
        if self._tokens < 1.0:
            return 0
        self._tokens -= 1.0
        dropped, self._dropped = self._dropped, 0
        self._emit("denied_dropped", dropped=dropped)
        return dropped

    @property
    def pending_dropped(self) -> int:
        """Refusals dropped and not yet reported."""
        return self._dropped
