"""Command-line argument types and JSON output of the client side.

What every command-line front end of a client needs below the ``twt``
program itself: the ``twt`` commands (:mod:`supervisor.cli`) and the
command halves of the admin ops (:mod:`supervisor.control.ops`), which sit
below it and so cannot import it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from shared.config import ENV_PREFIX, default_run_dir

__all__ = ["at_least_one", "comma_list", "non_negative_int", "positive_seconds", "print_json", "print_table", "run_dir_of"]


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def non_negative_int(value: str) -> int:
    """argparse type: an int >= 0."""
    n = _int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {n}")
    return n


def at_least_one(value: str) -> int:
    """argparse type: an int >= 1 (counts, iterations)."""
    n = _int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def positive_seconds(value: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def run_dir_of(args: argparse.Namespace) -> str:
    """The run dir a command names: ``--run-dir``, else ``$TWT_RUN_DIR``, else the default."""
    return str(args.run_dir or os.environ.get(f"{ENV_PREFIX}RUN_DIR") or default_run_dir())


def comma_list(choices: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """argparse type factory: ``a,b,c`` -> a tuple, each item one of ``choices``."""

    def parse(value: str) -> tuple[str, ...]:
        items = tuple(k.strip() for k in value.split(",") if k.strip())
        unknown = [k for k in items if k not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what}(s) {', '.join(unknown) or repr(value)}; known: {', '.join(choices)}"
            )
        return items

    return parse
