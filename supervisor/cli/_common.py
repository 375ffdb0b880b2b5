"""Helpers shared by the sub-commands: the run-dir option, JSON output, tables."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from shared.config import ENV_PREFIX, default_run_dir

__all__ = [
    "DefaultsHelpFormatter",
    "add_run_dir",
    "at_least_one",
    "comma_list",
    "describe_os_error",
    "non_negative_int",
    "positive_seconds",
    "print_json",
    "print_table",
    "run_dir_of",
]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (argparse's ArgumentDefaultsHelpFormatter, minus noise).

    Nothing is appended for flags (store_true), for a help text that already
    names its default, or for ``None`` defaults: those options say in words
    where the value comes from (e.g. "default: the config file, else auto").
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS, False, True)
            or not action.option_strings
            or action.nargs == 0
        ):
            return text
        default = action.default
        if isinstance(default, (list, tuple)):
            if not default:
                return text
            default = ",".join(str(d) for d in default)
        return f"{text} (default: {default})" if text else f"default: {default}"


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


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


def describe_os_error(exc: OSError) -> str:
    """One sentence a person can act on, instead of ``[Errno 2] No such file or directory: 'x'``."""
    name = exc.filename if exc.filename is not None else None
    if name is None:
        return str(exc.strerror or exc) if exc.errno is not None else str(exc)
    path = os.fsdecode(name) if isinstance(name, (str, bytes)) else str(name)
    if isinstance(exc, FileNotFoundError):
        return f"{path} does not exist"
    if isinstance(exc, FileExistsError):
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{path} exists and is not a directory; remove it or choose another path"
        return f"{path} already exists"
    if isinstance(exc, PermissionError):
        return f"permission denied for {path}; check its owner and mode (and those of its directory)"
    if isinstance(exc, NotADirectoryError):
        return f"{path}: a part of this path is a file, not a directory"
    if isinstance(exc, IsADirectoryError):
        return f"{path} is a directory; a file is needed here"
    if exc.errno == errno.ENAMETOOLONG:
        return f"{path} is too long a path"
    reason = (exc.strerror or "error").lower()
    return f"{path}: {reason}"


def add_run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        default=None,
        help=f"the supervisor's run directory (default: ${ENV_PREFIX}RUN_DIR or {default_run_dir()})",
    )


def run_dir_of(args: argparse.Namespace) -> str:
    return str(args.run_dir or os.environ.get(f"{ENV_PREFIX}RUN_DIR") or default_run_dir())


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: Any = None) -> None:
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")
