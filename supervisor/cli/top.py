"""``twt top``: the ``twt status`` table, refreshed in place until Ctrl-C.

On a terminal each frame clears the screen (ANSI ``ESC[H ESC[2J``); piped
into a file or a test, frames follow each other separated by a blank line.
``--iterations N`` stops after N frames (scripts, tests).

Each frame reads every tenant: the ``status`` pages one after the other by
cursor, as table rows (``view = "rows"``: the columns shown and nothing else,
:mod:`supervisor.observe.status_rows`), so that a refresh at 10,000 tenants
stays well under a second. Rows come in attention order: tenants that are not
healthy first, then the busiest (requests in flight, GPU share), then by id.
On a terminal the table is cut to the screen's height (``--rows`` sets it; the
summary line still counts every tenant); piped, every row is written.

An outage does not end it: ``twt: supervisor unreachable since HH:MM:SS
(...); retrying`` goes to stderr (``stopped`` when ``supervisor.json`` is
gone), frames resume when the supervisor answers again
(:mod:`supervisor.client.outage`). Started against no supervisor, it exits 3.
"""

from __future__ import annotations

import argparse
import sys
import time

import dataclasses
import io
import shutil
from collections.abc import Sequence

from shared.errors import ProtocolError
from shared.exitcodes import EXIT_UNAVAILABLE
from shared.records import STATUS_PAGE_MAX, StatusRecord, TenantRow
from shared.sizes import format_size
from supervisor.cli._common import add_run_dir, at_least_one, positive_seconds, print_table
from supervisor.cli.status import (
    HEADERS,
    HEALTHY_STATES,
    _limit,
    _pids,
    connect,
    format_duration,
    header_line,
    summary_line,
)
from supervisor.client.api import SupervisorClient
from supervisor.client.outage import Reconnecting
from supervisor.cli.commands._cli import unreachable_on_timeout

__all__ = ["add_parser", "fetch_rows", "render_rows", "row_cells", "run"]

#: lines of a frame that are not table rows (head, header, summary, table header and rule, the "more" line)
_CHROME_LINES = 7

CLEAR = "\x1b[H\x1b[2J"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top",
        help="the status table, refreshed live",
        description="Refresh the `twt status` table every --interval seconds until Ctrl-C (or --iterations "
        "frames). Clears the screen between frames on a terminal.",
    )
    p.add_argument("--interval", type=positive_seconds, default=2.0, metavar="S", help="seconds between frames (default 2)")
    p.add_argument("--iterations", type=at_least_one, default=None, metavar="N", help="stop after N frames (default: run until Ctrl-C)")
    p.add_argument("--rows", type=at_least_one, default=None, metavar="N",
                   help="table rows shown (default: what fits the terminal; every row when piped)")
    add_run_dir(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    frames = 0
    try:
        with Reconnecting(args, lambda: connect(args)) as source:
            while True:
                started = time.monotonic()
                status = source.call(fetch_rows)
                if status is None:  # pragma: no cover - no deadline here: only Ctrl-C ends an outage
                    return EXIT_UNAVAILABLE
                shown = args.rows
                if shown is None and tty:
                    shown = max(1, shutil.get_terminal_size().lines - _CHROME_LINES)
                text = render_rows(status, shown)
                stamp = time.strftime("%H:%M:%S")
                head = f"twt top - {stamp} - every {args.interval:g}s (Ctrl-C to quit)\n"
                if tty:
                    sys.stdout.write(CLEAR + head + text)
                else:
                    sys.stdout.write(("\n" if frames else "") + head + text)
                sys.stdout.flush()
                frames += 1
                if args.iterations is not None and frames >= args.iterations:
                    return 0
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        if tty:
            sys.stdout.write("\n")
        return 0


def fetch_rows(client: SupervisorClient) -> StatusRecord:
    """Every tenant as a table row: the ``status`` pages (``view = "rows"``) read by cursor and
    joined (``rows`` holds them all, ``next`` is None). A supervisor that does not answer in time
    counts as unreachable."""

    def page(after: str | None) -> StatusRecord:
        args: dict[str, object] = {"limit": STATUS_PAGE_MAX, "view": "rows"}
        if after is not None:
            args["after"] = after
        return StatusRecord.from_wire(client.call("status", client.reader, args))

    def every_page() -> StatusRecord:
        first = page(None)
        rows = list(first.rows)
        cursor = first.next
        while cursor is not None:
            more = page(cursor)
            rows.extend(more.rows)
            if more.next is not None and more.next <= cursor:  # never loop on a confused reply
                raise ProtocolError(f"status: the next page starts at {more.next!r}, not after {cursor!r}")
            cursor = more.next
        return dataclasses.replace(first, rows=tuple(rows), next=None)

    return unreachable_on_timeout(client, every_page)


def _attention(row: TenantRow) -> tuple[bool, int, float, str]:
    """Sort key: unhealthy first, then the busiest, then by id."""
    return (row.state in HEALTHY_STATES, -row.in_flight, -(row.gpu_share or 0.0), row.tenant_id)


def row_cells(r: TenantRow) -> list[str]:
    """A row's cells, as ``twt status`` shows the same tenant."""
    cap = r.gpu_time_cap
    return [
        r.tenant_id,
        r.state,
        f"{r.ready}/{r.wanted}",
        _pids(r.pids),
        f"{format_size(r.bytes_in_use)}/{_limit(r.memory_quota_bytes)}",
        f"{format_size(r.gpu_bytes_in_use)}/{_limit(r.gpu_memory_bytes_cap)}",
        f"{format_size(r.cpu_high_water)}/{format_size(r.gpu_high_water)}",
        f"{r.cpu_refusals}/{r.gpu_refusals}",
        str(r.restarts),
        format_duration(r.uptime_s),
        f"{r.gpu_time_weight:g}/{'none' if cap is None else f'{cap:.0%}'}",
        f"{r.gpu_time_s:.2f}s",
        "-" if r.gpu_share is None else f"{r.gpu_share:.0%}",
    ]


def render_rows(status: StatusRecord, shown: int | None = None) -> str:
    """The header line, the summary of every tenant and the table of ``status.rows`` in attention
    order, cut to ``shown`` rows (None: all) with a line saying how many were left out."""
    out = io.StringIO()
    out.write(header_line(status.supervisor) + "\n")
    summary = status.summary
    if summary is not None and summary.tenants:
        out.write(summary_line(summary) + "\n")
    rows: Sequence[TenantRow] = sorted(status.rows, key=_attention)
    if not rows:
        out.write("no tenants registered\n")
        return out.getvalue()
    cut = rows if shown is None else rows[:shown]
    print_table(HEADERS, [row_cells(r) for r in cut], out)
    if len(cut) < len(rows):
        out.write(f"... {len(rows) - len(cut)} more (twt status --all)\n")
    return out.getvalue()
