"""The op commands: one ``twt`` command per op that owns one (:mod:`supervisor.cli.commands`).

Each op's command class holds its help, arguments and rendering; this
module adds what every command that calls a supervisor takes (``--json``,
``--run-dir`` and the remote options) and connects for it.

    twt register acme --memory-quota 2GiB --gpu-cap 512MiB --instances 2 --cap-out acme.cap
    twt capability acme · twt set-quota acme --gpu-cap 1GiB · twt scale acme 3 --wait
    twt fault acme crash --instance 0 · twt evict acme · twt version
    twt reload · twt reset acme · twt restart acme · twt rotate-key --yes
    twt run acme kernel.wat --invoke main · twt alloc acme 1MiB · twt free acme 1:7
    twt buffers acme · twt write acme 1:7 --fill 1 · twt read acme 1:7
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from supervisor.cli._common import add_run_dir
from supervisor.cli.status import connect
from supervisor.client.api import SupervisorClient
from supervisor.cli.commands import OpCommand, commands

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Every op's command: its own arguments, then ``--json`` and the run-dir options; in the order
    of ``supervisor.cli.COMMANDS`` (the help's order), an op's command not listed there last."""
    from supervisor.cli import COMMANDS

    order = list(COMMANDS)
    for op in sorted(commands(), key=lambda op: order.index(op.command) if op.command in order else len(order)):
        p = sub.add_parser(op.command, help=op.help, description=op.description)
        op.arguments(p)
        p.add_argument("--json", action="store_true", help=op.json_help)
        add_run_dir(p)
        p.set_defaults(func=_runner(op))


def _runner(op: OpCommand) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        def connect_here(timeout_s: float | None = None) -> SupervisorClient:
            return connect(args) if timeout_s is None else connect(args, timeout_s)

        return op.run(args, connect_here)

    return run
