"""The command half of ``events`` / ``twt events``: a page of the event log for either capability; follow it, one line each.

The op: ``events {after, max, kinds, log}`` -> ``{events, next, missed, more, log}``. The
admin capability sees every event, a tenant capability its own tenant's (the frontend
verifies which; :class:`~supervisor.control.ops.events.Events` reads the log for it). The command:

    $ twt events --filter exit --filter restart
    12:01:07.513  exit           acme/0  pid=4250 signal=9(SIGKILL) reason="killed by signal 9" expected=False
    12:01:07.514  restart        acme/0  delay_s=0.1 restarts=1

``--json`` prints each event record as one JSON object per line (JSON Lines).
The same works against a remote supervisor (``--connect tcp://HOST:PORT
--server-key=KEY``): the admin capability (``--admin-cap``, and the
supervisor's ``allow_remote_admin``) sees every event, a tenant's capability
(``--capability FILE``) only that tenant's. Events come from the
supervisor's bounded event log (``event_log_size``); a follower that falls
so far behind that events left it before it read them is told so by a
``missed`` line, never silently (``supervisor.client.event_follow``). ``--replay``
first prints what the log still holds.
"""

from __future__ import annotations

import argparse
import json
import signal as signal_mod
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from shared.capability import MonitorCapability, RegistryAdminCapability, TenantCapability, read_capability_file
from shared.checks import is_int
from shared.kinds import EVENT_KINDS
from shared.sizes import format_size
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.client.cli_args import at_least_one, comma_list, positive_seconds
from supervisor.client.event_follow import MISSED, follow
from supervisor.client.outage import Reconnecting

__all__ = ["EventsCommand", "KINDS", "format_event"]

#: the event kinds the supervisor publishes (the rows of shared.kinds.EVENT_KINDS)
KINDS = tuple(EVENT_KINDS)

#: fields shown first, in this order; the rest follow alphabetically
_ORDER = ("worker", "pid", "exit_code", "signal", "reason", "expected", "kind")

_HIDDEN = {"event", "ts", "tenant", "instance"}


def _follow(args: argparse.Namespace, connect: Connect) -> int:
    kinds = sorted({k for group in args.kinds for k in group})
    tenants = set(args.tenants)
    seen = 0
    cap: TenantCapability | None = None
    if args.capability is not None:
        given = read_capability_file(args.capability)
        if isinstance(given, TenantCapability):
            cap = given
        else:
            raise ValueError(f"--capability {args.capability} holds the admin capability: leave it out "
                             "(or give --admin-cap with --connect) to follow every event")
    if getattr(args, "connect", None) and cap is None and not args.admin_cap:
        raise ValueError("--connect: every event needs the monitor capability (--admin-cap FILE with "
                         "`twt capability --role monitor`'s token) or the admin one (and allow_remote_admin on the "
                         "supervisor); a tenant follows its own with --capability FILE")
    with Reconnecting(args, connect, deadline_s=args.timeout) as source:
        stream = follow(_Resuming(source, cap), cap or source.client.reader, kinds, timeout_s=args.timeout,
                        replay=args.replay)
        try:
            for event in stream:
                if event.get("event") == MISSED:  # a gap is always shown, whatever the filters
                    print(json.dumps(event, sort_keys=True) if args.json else format_event(event),
                          file=sys.stdout, flush=True)
                    continue
                if tenants and event.get("tenant") not in tenants:
                    continue
                line = json.dumps(event, sort_keys=True, default=str) if args.json else format_event(event)
                print(line, flush=True)
                seen += 1
                if args.count is not None and seen >= args.count:
                    return 0
        except KeyboardInterrupt:
            return 0
        except _GaveUp:
            pass
        finally:
            stream.close()
    if args.count is not None:
        print(f"twt: only {seen} of {args.count} event(s) within {args.timeout:g} s of silence", file=sys.stderr)
        return 1
    return 0


class _GaveUp(Exception):
    """Unreachable for --timeout seconds: the follow ends as after that much silence."""


class _Resuming:
    """The follower's page source: each page through :class:`Reconnecting`, so an outage is ridden
    out and the follower resumes at its cursor (the supervisor's event log says what was lost).

    ``cap``: the tenant capability given, else None: each connection's own admin capability (a
    local supervisor restarted from its state has the same one)."""

    def __init__(self, source: Reconnecting, cap: TenantCapability | None) -> None:
        self._source = source
        self._cap = cap

    def events_page(self, cap: TenantCapability | RegistryAdminCapability | MonitorCapability | None,
                    after: int | None = None, *,
                    kinds: Sequence[str] = (), max_events: int | None = None,
                    log: str | None = None) -> dict[str, object]:
        page = self._source.call(lambda c: c.events_page(self._cap, after, kinds=kinds, max_events=max_events,
                                                         log=log))
        if page is None:
            raise _GaveUp
        return page


def _value(key: str, value: object) -> str:
    if key == "signal" and isinstance(value, int):
        try:
            return f"{value}({signal_mod.Signals(value).name})"
        except ValueError:
            return str(value)
    if is_int(value) and (key.endswith("_bytes") or key.startswith("reclaimed_")):
        return format_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "-"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text


def format_event(event: dict[str, object]) -> str:
    """``HH:MM:SS.mmm  kind  tenant/instance  key=value ...`` (``pool`` for unbound workers)."""
    ts = event.get("ts")
    if isinstance(ts, (int, float)):
        stamp = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
    else:
        stamp = "--:--:--.---"
    if event.get("event") == MISSED:
        count = event.get("missed")
        what = "events" if count is None else f"{count} event(s)"
        return f"{stamp}  {MISSED:<13}  {'-':<14}  {what} not shown: {event.get('reason', '')}".rstrip()
    tenant, instance = event.get("tenant"), event.get("instance")
    subject = "pool" if tenant is None else (str(tenant) if instance is None else f"{tenant}/{instance}")
    fields = {k: v for k, v in event.items() if k not in _HIDDEN and v is not None}
    # a zero reclaim says nothing; a clean exit's code 0 does
    for key in ("reclaimed_cpu", "reclaimed_gpu"):
        if fields.get(key) == 0:
            del fields[key]
    keys = [k for k in _ORDER if k in fields] + sorted(k for k in fields if k not in _ORDER)
    parts = [f"{k}={_value(k, fields[k])}" for k in keys]
    return f"{stamp}  {str(event.get('event', '?')):<13}  {subject:<14}  {' '.join(parts)}".rstrip()


class EventsCommand(OpCommand):
    name = "events"
    command = "events"
    help = "follow lifecycle events (spawn, ready, exit, restart, failed, evict, quota refusals ...)"
    description = ("Print the supervisor's lifecycle events as they happen, one line each, until Ctrl-C, "
                   f"--timeout seconds without an event, or --count events. Kinds: {', '.join(KINDS)}.")
    json_help = "one JSON object per event (JSON Lines)"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--filter", dest="kinds", type=comma_list(KINDS, "event kind"), action="append", default=[],
                       metavar="KIND",
                       help="only these kinds (repeat, or comma-separate: --filter exit,restart; default: every kind)")
        p.add_argument("--tenant", dest="tenants", action="append", default=[], metavar="TENANT",
                       help="only events about this tenant (repeatable); default: every tenant")
        p.add_argument("--timeout", type=positive_seconds, default=None, metavar="S",
                       help="stop after S seconds without a (matching) event; default: follow until Ctrl-C")
        p.add_argument("--count", type=at_least_one, default=None, metavar="N",
                       help="stop after N events; exit 1 if fewer arrived before --timeout (default: no limit)")
        p.add_argument("--replay", action="store_true",
                       help="first the events the supervisor's event log still holds (default: from now on)")
        p.add_argument("--capability", type=Path, default=None, metavar="FILE",
                       help="follow one tenant's own events with its capability file (as --cap-out writes it); "
                       "default: every event, with the admin capability")

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        return _follow(args, connect)
