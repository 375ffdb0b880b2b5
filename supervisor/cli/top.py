"""``twt top``: the ``twt status`` table, refreshed in place until Ctrl-C.

On a terminal each frame clears the screen (ANSI ``ESC[H ESC[2J``); piped
into a file or a test, frames follow each other separated by a blank line.
``--iterations N`` stops after N frames (scripts, tests).

An outage does not end it: ``twt: supervisor unreachable since HH:MM:SS
(...); retrying`` goes to stderr (``stopped`` when ``supervisor.json`` is
gone), frames resume when the supervisor answers again
(:mod:`supervisor.client.outage`). Started against no supervisor, it exits 3.
"""

from __future__ import annotations

import argparse
import sys
import time

from shared.exitcodes import EXIT_UNAVAILABLE
from supervisor.cli._common import add_run_dir, at_least_one, positive_seconds
from supervisor.client.outage import Reconnecting
from supervisor.cli.status import connect, fetch_status, render

__all__ = ["add_parser", "run"]

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
    add_run_dir(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    frames = 0
    try:
        with Reconnecting(args, lambda: connect(args)) as source:
            while True:
                started = time.monotonic()
                status = source.call(fetch_status)
                if status is None:  # pragma: no cover - no deadline here: only Ctrl-C ends an outage
                    return EXIT_UNAVAILABLE
                text = render(status)
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
