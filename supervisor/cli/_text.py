"""What every ``twt`` command's start needs and nothing more: the help formatter and OS errors in words.

Apart from :mod:`supervisor.cli._common` (the client-side helpers: run dirs, capabilities,
CurveZMQ keys) because :mod:`supervisor.cli` imports this module for every command,
``twt supervise`` included, and every supervisor a test or an embedder launches is a
``twt supervise``: it need not import the command-line client's helpers (the supervisor still
imports the client API and zmq.auth for its own ops and CURVE frontend, elsewhere).
"""

from __future__ import annotations

import argparse
import errno
import os

__all__ = ["DefaultsHelpFormatter", "describe_os_error"]


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
