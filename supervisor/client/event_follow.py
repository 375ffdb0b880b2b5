"""Following the supervisor's events from a client: the ``events`` op polled with a cursor.

    follow(client, cap)  ──[events {after, kinds, log}]──►  supervisor (EventLog.page)
          │            ◄──[{events, next, missed, more, log}]──
          └─ yields each event, and a ``missed`` record for every gap

One way for local and remote clients alike (``SupervisorClient.events``):
the op is answered at once, so the follower polls - again at once while the
supervisor says ``more``, else after ``poll_s``. It starts at the newest
event (``after=None``) or replays what the log still holds (``replay``).

A gap is never silent. When events fell out of the supervisor's log before
this follower read them (it was too slow, or ``event_log_size`` too small),
or the supervisor was restarted in between (the reply's ``log`` changed), a
synthetic record ``{"event": "missed", "missed": N, "reason": ...}`` comes
first (``missed`` is None when the count is unknown: a restart).

Each page is checked as a :class:`shared.records.EventsPage` (a malformed one is a
``ProtocolError``); the events in it stay maps (free-form per kind, docs/OPERATIONS.md).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Protocol

from shared.capability import MonitorCapability, RegistryAdminCapability, TenantCapability
from shared.records import EventsPage

__all__ = ["MISSED", "POLL_S", "PageSource", "follow"]

#: the kind of the record that reports a gap (never published by the supervisor)
MISSED = "missed"
#: how long a follower waits before asking again when it is up to date
POLL_S = 0.2


class PageSource(Protocol):
    """What the follower needs of a client: one page of the event log
    (``SupervisorClient.events_page``). A Protocol, so this module never imports the client."""

    def events_page(self, cap: TenantCapability | RegistryAdminCapability | MonitorCapability | None,
                    after: int | None = None, *,
                    kinds: Sequence[str] = (), max_events: int | None = None,
                    log: str | None = None) -> dict[str, object]: ...


def follow(
    client: PageSource,
    cap: TenantCapability | RegistryAdminCapability | MonitorCapability,
    kinds: Sequence[str] = (),
    *,
    timeout_s: float | None = None,
    replay: bool = False,
    poll_s: float = POLL_S,
) -> Generator[dict[str, object], None, None]:
    """Events as they are published (``kinds``: only these), with ``missed`` records for gaps.

    The position is taken now, by this call (a refused capability raises here): the
    events published from now on, or with ``replay`` first those the supervisor's log
    still holds. ``timeout_s``: the generator ends quietly after that long without an event.
    """
    first = client.events_page(cap, 0 if replay else None, kinds=kinds)
    return _follow(client, cap, kinds, first, timeout_s, poll_s)


def _follow(client: PageSource, cap: TenantCapability | RegistryAdminCapability | MonitorCapability, kinds: Sequence[str],
            first: dict[str, object], timeout_s: float | None, poll_s: float) -> Generator[dict[str, object], None, None]:
    page = EventsPage.from_wire(first)  # checked: a malformed page is a ProtocolError, not a TypeError here
    log = page.log
    quiet_since = time.monotonic()
    while True:
        if page.log != log:
            yield _gap(None, f"the supervisor was restarted (event log {log} -> {page.log}); "
                       "events of the earlier run that were not read are lost")
            log = page.log
        if page.missed:
            yield _gap(page.missed, "fell out of the supervisor's event log before they were read "
                       "(a slow follower, or a small event_log_size)")
        yield from page.events
        now = time.monotonic()
        if page.events:
            quiet_since = now
        if not page.more:
            if timeout_s is not None and now - quiet_since >= timeout_s:
                return
            wait = poll_s if timeout_s is None else min(poll_s, max(0.0, quiet_since + timeout_s - now))
            time.sleep(wait)  # a follower's polling interval, not a wait for something to happen
        page = EventsPage.from_wire(client.events_page(cap, page.next, kinds=kinds, log=log))


def _gap(count: int | None, reason: str) -> dict[str, object]:
    return {"event": MISSED, "ts": round(time.time(), 6), "missed": count, "reason": reason}
