"""``twt`` / ``tensor-wasm-tenant``: the command line (thin: parse, call library code, print).

Each sub-command lives in its own module with ``add_parser(subparsers)`` and
``run(args) -> int``; the admin commands live with their op, one class each
(:mod:`supervisor.control.ops`), and :mod:`supervisor.cli.ops` adds every one
of them. Exit codes: 0 ok, 1 the operation failed (typed error
printed), 2 bad usage, 3 no supervisor reachable, 4 a check or benchmark
target failed, 70 an internal error (a bug: the trace is printed), 130
interrupted; all defined in :mod:`shared.exitcodes`. A closed output pipe
(``twt events | head``) ends a command quietly with 141 (128 + SIGPIPE).

A ``ValueError`` from the library is the user's bad input (exit 2); a
``TypeError`` or any other exception is a bug and never passes for a usage
error. Commands that turn user input into typed values (a tenant spec, the
config) raise ``ValueError`` for a wrongly typed input.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from shared.errors import ConfigError, SupervisorUnavailable, TensorWasmError
from shared.exitcodes import (
    EXIT_CHECK,
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from supervisor.cli._text import DefaultsHelpFormatter, describe_os_error

__all__ = ["console", "main", "version"]

#: sub-command name -> module (imported only to build the parser). supervisor.cli.ops adds every op's
#: command (supervisor.control.ops); they are listed for the help's order and so that ``twt CMD`` imports
#: that module only (an op command not listed still works: the whole parser is built for it)
COMMANDS = {
    "supervise": "supervisor.cli.supervise",
    "status": "supervisor.cli.status",
    "top": "supervisor.cli.top",
    "events": "supervisor.cli.ops",
    "register": "supervisor.cli.ops",
    "capability": "supervisor.cli.ops",
    "evict": "supervisor.cli.ops",
    "set-quota": "supervisor.cli.ops",
    "scale": "supervisor.cli.ops",
    "fault": "supervisor.cli.ops",
    "version": "supervisor.cli.ops",
    "reload": "supervisor.cli.ops",
    "reset": "supervisor.cli.ops",
    "restart": "supervisor.cli.ops",
    "rotate-key": "supervisor.cli.ops",
    "run": "supervisor.cli.ops",
    "alloc": "supervisor.cli.ops",
    "free": "supervisor.cli.ops",
    "buffers": "supervisor.cli.ops",
    "write": "supervisor.cli.ops",
    "read": "supervisor.cli.ops",
    "demo": "supervisor.cli.demo",
    "chaos": "supervisor.cli.chaos",
    "bench": "supervisor.cli.bench",
    "mps": "supervisor.cli.mps",
    "keys": "supervisor.cli.keys",
    "cluster": "supervisor.cli.cluster",
    "cleanup": "supervisor.cli.cleanup",
    "build": "supervisor.cli.build",
    "state": "supervisor.cli.state",
    "check-config": "supervisor.cli.check_config",
}

__all__ += ["EXIT_CHECK", "EXIT_FAILED", "EXIT_INTERNAL", "EXIT_OK", "EXIT_UNAVAILABLE", "EXIT_USAGE"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``twt`` parser; with ``command`` (a name in :data:`COMMANDS`), only that command's module
    adds its sub-commands. ``main`` passes the command it was given: a ``twt supervise`` (every
    supervisor a test or an embedder launches) then imports its own module, not the chaos, bench,
    cluster ... modules as well, and parses exactly as with the whole parser."""
    parser = argparse.ArgumentParser(
        prog="twt",
        description="tensor-wasm-tenant: run untrusted tenants on shared GPUs with hard quotas.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module_name in dict.fromkeys(modules):  # each module once, in order
        importlib.import_module(module_name).add_parser(sub)
    for subparser in sub.choices.values():  # add_parser does not pass the formatter on
        if subparser.formatter_class is argparse.HelpFormatter:
            subparser.formatter_class = DefaultsHelpFormatter
    return parser


class _VersionAction(argparse.Action):
    """``--version``: the version is looked up when asked for (importlib.metadata costs a
    supervisor's start ~20 ms of CPU, and the suite starts hundreds)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str = "show the program's version and exit") -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None, option_string: str | None = None) -> None:
        print(f"{parser.prog} {version()}")  # stdout, as argparse's own version action
        parser.exit()


def version() -> str:
    """``twt --version``: the build's version (see :func:`supervisor.observe.metrics.build_version`)."""
    from supervisor.observe.metrics import build_version

    return build_version()


#: the exit status of a command whose output pipe closed (128 + SIGPIPE, as a shell reports a process
#: the signal ended); no message: ``twt events | head`` ends quietly
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor (an embedding host)
        pass


def console() -> NoReturn:
    """The ``twt`` program and ``python -m supervisor``: :func:`main`, then the process ends as the
    interpreter's exit would, less the teardown of its objects (:mod:`supervisor.host.process_exit`:
    ~40 % of a forked supervisor's CPU). An embedder calls :func:`main` and keeps its own exit."""
    from supervisor.host.process_exit import exit_process

    exit_process(main())


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words else None)
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then a BrokenPipeError below
        return code
    except BrokenPipeError:  # `twt events | head`: the reader left; nothing to say, nowhere to say it
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except SupervisorUnavailable as exc:
        print(f"twt: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ConfigError as exc:  # the user's file or environment: usage, as any bad input
        print(f"twt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TensorWasmError as exc:
        print(f"twt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:  # a file or socket the system refused: one sentence, no errno noise
        print(f"twt: error: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as exc:  # bad input: usage
        print(f"twt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - a bug: say so, with the trace, never as a usage error
        traceback.print_exc(file=sys.stderr)
        print(f"twt: internal error: {type(exc).__name__}: {exc} (a bug in twt; the trace is above)",
              file=sys.stderr)
        return EXIT_INTERNAL
