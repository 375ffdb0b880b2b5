"""The event log: the last lifecycle events, numbered, for clients that poll (ipc and TCP alike).

    EventBus.emit ──► EventLog.append ──► ring: seq -> (kind, tenant, generation, packed record)
                                                 ▲
    client ──[events {after, max, kinds, log}]──►│ Frontend: the capability picks the view
             ◄──[{events, next, missed, more, log}]── EventLog.page(view, args)

Why a log: the PUB socket (``events.ipc``) reaches only processes on the
supervisor's host, and a subscriber that falls behind loses events without a
word. A platform operator on another machine, or a tenant following its own
instances, polls the ``events`` op instead: the reply is computed at once (the
loop never waits for an event), and a client that asked too late is told how
many events it missed instead of skipping them silently.

Cursor: every event gets the next sequence number (1, 2, ...). A page holds
the events after ``after`` that the caller's view shows; ``next`` is the
cursor for the following call (past the events the view hides, so they are
not looked at twice); ``missed`` counts the events between ``after`` and the
oldest one still held (they fell out of the ring: gone for everybody, so the
count includes events the caller's view would not have shown). ``after``
nil asks only for the cursor of now. ``log`` is drawn at random per
supervisor start: a cursor carried across a restart of the supervisor is
recognised (the client sends the ``log`` it got) and served from the new
log's start rather than misread.

Views: the admin capability sees every event. A tenant capability sees the
events of its own tenant, of the kinds in :data:`TENANT_KINDS`, and only
those of its current registration (its generation): never an event without
a tenant (the pool's, the service's), never another tenant's, never the
audit's ``denied`` (its counts cover every tenant), and nothing of an earlier
tenant that had the same name. The sequence numbers are global, so the gaps
between a tenant's events say how many events were published meanwhile - a
volume, never a name or a field.

Bounds (nothing a client does makes the log grow; it holds nothing per
client, a client's position is its cursor):

* entries: ``event_log_size`` (a config key); the oldest leave first;
* bytes: :data:`MAX_LOG_BYTES` for the records and their bookkeeping
  (:data:`ENTRY_OVERHEAD` each); a record packed larger than
  :data:`MAX_EVENT_BYTES` is kept as a stub naming its size (``truncated``);
* the registration each ready worker belongs to (so its exit is tagged with
  it): at most :data:`MAX_TRACKED_WORKERS`, forgotten at its exit;
* a reply: at most :data:`MAX_PAGE_EVENTS` events and :data:`MAX_PAGE_BYTES`
  of records (a small reply, below what the frontend tracks per client),
  from at most :data:`SCAN_BUDGET` entries looked at; ``more`` is true when
  the client should call again at once.

Loop thread only (appends come from ``EventBus.emit``, pages from the frontend).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Final
from collections.abc import Callable, Mapping

import msgpack

from shared.checks import is_int
from shared.protocol import arg_int, arg_opt_int, arg_opt_str
from shared.errors import InvalidArgument
from shared.kinds import TENANT_EVENT_KINDS

__all__ = [
    "ADMIN_VIEW",
    "ENTRY_OVERHEAD",
    "MAX_EVENT_BYTES",
    "MAX_KINDS",
    "MAX_KIND_CHARS",
    "MAX_LOG_BYTES",
    "MAX_PAGE_BYTES",
    "MAX_PAGE_EVENTS",
    "MAX_TRACKED_WORKERS",
    "SCAN_BUDGET",
    "TENANT_KINDS",
    "EventLog",
    "EventView",
]

#: a record packed larger than this is kept as a stub (``truncated``, ``bytes``)
MAX_EVENT_BYTES: Final = 16 << 10
#: what one entry costs besides its record (tuple, bytes object, slot), counted against MAX_LOG_BYTES
ENTRY_OVERHEAD: Final = 160
#: the records the log holds, with their overhead, whatever ``event_log_size`` says
MAX_LOG_BYTES: Final = 32 << 20
#: events in one reply (a larger ``max`` is served as this)
MAX_PAGE_EVENTS: Final = 1000
#: a reply's records, packed, with their sequence numbers: under the 64 KiB from which the
#: frontend tracks reply bytes per client (supervisor.routing.replies), so a page is a small reply
#: like any other, and a client that asks without reading cannot pile up big ones
MAX_PAGE_BYTES: Final = 48 << 10
#: what a record's sequence number adds to it in a reply (the key and a uint64, rounded up)
_SEQ_BYTES: Final = 16
#: entries looked at for one reply: the loop's work per request stays small however far back it asks
SCAN_BUDGET: Final = 4096
#: ready workers whose registration is remembered (far more than a supervisor runs)
MAX_TRACKED_WORKERS: Final = 1 << 16
#: kind filters in one request, and the length of each
MAX_KINDS: Final = 64
MAX_KIND_CHARS: Final = 64
#: the kinds a tenant capability sees (of its own tenant): the ``tenant_visible`` rows of shared.kinds.EVENT_KINDS
TENANT_KINDS: Final = TENANT_EVENT_KINDS

#: one entry: (kind, tenant or None, tenant generation or None, packed record)
_Entry = tuple[str, "str | None", "int | None", bytes]


@dataclass(frozen=True, slots=True)
class EventView:
    """Whose events a page shows: every one (``tenant`` None: the admin capability), or one
    tenant's of its current ``generation`` and of the :data:`TENANT_KINDS`."""

    tenant: str | None = None
    generation: int | None = None

    def sees(self, kind: str, tenant: str | None, generation: int | None) -> bool:
        if self.tenant is None:
            return True
        return tenant == self.tenant and generation == self.generation and kind in TENANT_KINDS


ADMIN_VIEW: Final = EventView()


class EventLog:
    """A bounded ring of the last events, each with its sequence number (see the module docstring).

    ``generation_of(tenant)``: the generation a tenant is registered with now (None: not
    registered), so an event is tagged with the registration it belongs to.
    """

    def __init__(self, size: int, generation_of: Callable[[str], int | None] = lambda _tenant: None,
                 *, max_bytes: int = MAX_LOG_BYTES) -> None:
        if not is_int(size) or size < 1:
            raise ValueError(f"event log size must be a positive int, not {size!r}")
        self.size = size
        self.max_bytes = max_bytes
        self.log_id = secrets.token_hex(8)
        self._generation_of = generation_of
        self._ring: list[_Entry | None] = [None] * size
        #: (tenant, pid) of each ready worker -> the generation it was ready for (until its exit)
        self._workers: dict[tuple[str, int], int | None] = {}
        self.first = 1  # the oldest sequence number held (first > last: none held)
        self.last = 0  # the newest sequence number given
        self.bytes = 0  # records and overhead held
        self.dropped = 0  # entries that fell out of the ring so far

    def __len__(self) -> int:
        return self.last - self.first + 1

    # ------------------------------------------------------------ append

    def append(self, kind: str, record: dict[str, object], body: bytes) -> int:
        """Keep one event (``body``: ``record`` packed); returns its sequence number."""
        tenant = record.get("tenant")
        tenant = tenant if isinstance(tenant, str) else None
        generation = self._generation(kind, tenant, record) if tenant is not None else None
        if len(body) > MAX_EVENT_BYTES:
            body = _stub(kind, record, len(body))
        cost = len(body) + ENTRY_OVERHEAD
        while len(self) and (len(self) >= self.size or self.bytes + cost > self.max_bytes):
            self._drop_oldest()
        self.last += 1
        self._ring[self.last % self.size] = (kind, tenant, generation, body)
        self.bytes += cost
        return self.last

    def _generation(self, kind: str, tenant: str, record: dict[str, object]) -> int | None:
        """The registration a tenant's event belongs to. A register event names its own (the
        runtime comes after it). A worker's exit or kill belongs to the registration it was
        ready for, not the current one: an evicted tenant's worker may exit after its name
        was registered again (to someone else), and the new holder must not see it."""
        own = record.get("generation")
        if is_int(own):
            return own
        pid = record.get("pid")
        if not is_int(pid):
            return self._generation_of(tenant)
        key = (tenant, pid)
        if kind == "ready":
            generation = self._generation_of(tenant)
            if len(self._workers) >= MAX_TRACKED_WORKERS:
                del self._workers[next(iter(self._workers))]  # the oldest: bounded whatever happens
            self._workers[key] = generation
            return generation
        if key in self._workers:
            return self._workers.pop(key) if kind == "exit" else self._workers[key]
        return self._generation_of(tenant)

    def _drop_oldest(self) -> None:
        index = self.first % self.size
        entry = self._ring[index]
        assert entry is not None
        self._ring[index] = None
        self.bytes -= len(entry[3]) + ENTRY_OVERHEAD
        self.first += 1
        self.dropped += 1

    # ------------------------------------------------------------ read

    def page(self, view: EventView, args: Mapping[str, object]) -> dict[str, object]:
        """The ``events`` op: ``{after, max, kinds, log}`` -> ``{events, next, missed, more, log}``.

        InvalidArgument for a bad argument (a cursor ahead of the newest event included).
        """
        after, limit, kinds, log = _page_args(args)
        if log is not None and log != self.log_id and after is not None:
            after = 0  # a cursor of an earlier supervisor run: this log from its start
        if after is None:
            return {"events": [], "next": self.last, "missed": 0, "more": False, "log": self.log_id}
        if after > self.last:
            raise InvalidArgument(
                f"events: cursor {after} is ahead of the newest event ({self.last}); a cursor from another "
                f"supervisor run? pass the log id it came with (log={self.log_id!r} now)")
        missed = max(0, self.first - 1 - after)
        events: list[dict[str, object]] = []
        nbytes = 0
        seq = max(after + 1, self.first)
        end = min(self.last, seq + SCAN_BUDGET - 1)
        while seq <= end:
            entry = self._ring[seq % self.size]
            assert entry is not None
            kind, tenant, generation, body = entry
            if view.sees(kind, tenant, generation) and (kinds is None or kind in kinds):
                if len(events) >= limit or nbytes + len(body) + _SEQ_BYTES > MAX_PAGE_BYTES:
                    break
                record = msgpack.unpackb(body, raw=False)
                record["seq"] = seq
                events.append(record)
                nbytes += len(body) + _SEQ_BYTES
            seq += 1
        return {"events": events, "next": seq - 1, "missed": missed, "more": seq <= self.last, "log": self.log_id}


def _page_args(args: Mapping[str, object]) -> tuple[int | None, int, frozenset[str] | None, str | None]:
    """(after, max, kinds, log) of an ``events`` request, checked (the types are checked by the op table)."""
    after = arg_opt_int(args, "after")
    if after is not None and after < 0:
        raise InvalidArgument(f"events: after must be a sequence number >= 0 (or nil for now), not {after}")
    limit = arg_int(args, "max") if "max" in args else MAX_PAGE_EVENTS
    if limit < 1:
        raise InvalidArgument(f"events: max must be at least 1, not {limit}")
    raw_kinds = args.get("kinds")
    kinds = None
    if raw_kinds:
        if not isinstance(raw_kinds, list) or len(raw_kinds) > MAX_KINDS or not all(isinstance(k, str) and 0 < len(k) <= MAX_KIND_CHARS
                                                 for k in raw_kinds):
            raise InvalidArgument(f"events: kinds must be at most {MAX_KINDS} event names "
                                  f"(strings of 1..{MAX_KIND_CHARS} characters)")
        kinds = frozenset(raw_kinds)
    log = arg_opt_str(args, "log")
    if log is not None and len(log) > 64:
        raise InvalidArgument("events: log must be the log id of an earlier reply (at most 64 characters)")
    return after, min(limit, MAX_PAGE_EVENTS), kinds, log


def _stub(kind: str, record: dict[str, object], size: int) -> bytes:
    """What is kept of a record too large to keep: its kind, time, subject and size."""
    stub: dict[str, object] = {k: record[k] for k in ("ts", "tenant", "instance") if k in record}
    stub.update(event=kind, truncated=True, bytes=size)
    data: bytes = msgpack.packb(stub, use_bin_type=True, default=str)
    return data
