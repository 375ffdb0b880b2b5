"""``twt`` / ``tensor-wasm-tenant``: the command line (thin: parse, call library code, print).

Each sub-command lives in its own module with ``add_parser(subparsers)`` and
``run(args) -> int``. Exit codes: 0 ok, 1 the operation failed (typed error
printed), 2 bad usage, 3 no supervisor reachable, 4 a check or benchmark
target failed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shared.errors import SupervisorUnavailable, TensorWasmError

__all__ = ["main"]

#: sub-command name -> module (imported only to build the parser)
COMMANDS = {
    "supervise": "supervisor.cli.supervise",
    "status": "supervisor.cli.status",
    "top": "supervisor.cli.top",
    "events": "supervisor.cli.events",
    "register": "supervisor.cli.admin",
    "evict": "supervisor.cli.admin",
    "set-quota": "supervisor.cli.admin",
    "scale": "supervisor.cli.admin",
    "fault": "supervisor.cli.admin",
    "capability": "supervisor.cli.admin",
    "run": "supervisor.cli.run",
    "demo": "supervisor.cli.demo",
    "chaos": "supervisor.cli.chaos",
    "bench": "supervisor.cli.bench",
    "mps": "supervisor.cli.mps",
    "keys": "supervisor.cli.keys",
    "cluster": "supervisor.cli.cluster",
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_CHECK = 0, 1, 2, 3, 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twt",
        description="tensor-wasm-tenant: run untrusted tenants on shared GPUs with hard quotas.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    seen: set[str] = set()
    for module_name in dict.fromkeys(COMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # a command not built yet
            raise
        if module_name not in seen:
            seen.add(module_name)
            module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except SupervisorUnavailable as exc:
        print(f"twt: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except TensorWasmError as exc:
        print(f"twt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, TypeError, OSError) as exc:
        print(f"twt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ValueError, TypeError)) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130
