"""The command half of ``inject_fault`` / ``twt fault``: break one of a tenant's workers on purpose (testing).

    twt fault acme crash --instance 0
    twt fault acme slow --param ms=500

The order goes to the worker's control thread; the answer waits for its
acknowledgement, or, for the kinds that end the process (crash, segfault,
exit), for the process to be gone.
"""

from __future__ import annotations

import argparse

from shared.protocol import FAULT_KINDS
from shared.sizes import parse_size
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import ADMIN_TIMEOUT_S, tenant_argument
from supervisor.client.cli_args import non_negative_int, print_json

__all__ = ["InjectFaultCommand", "parse_param"]


def parse_param(text: str) -> tuple[str, int | float | bool | str]:
    """``k=v`` -> (k, v) with v an int, a float, a size (``64MiB`` -> bytes), a bool or a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"a parameter is KEY=VALUE, got {text!r}")
    raw = raw.strip()
    value: int | float | bool | str
    try:
        value = int(raw)
    except ValueError:
        try:
            value = float(raw)
        except ValueError:
            try:
                value = parse_size(raw)
            except ValueError:
                value = {"true": True, "false": False}.get(raw.lower(), raw)
    return key, value


class InjectFaultCommand(OpCommand):
    name = "inject_fault"
    command = "fault"
    help = "inject a fault into one of a tenant's workers (testing)"
    description = ("Break one worker on purpose. Kinds: crash (SIGKILL), segfault, exit (param code), "
                   "hang, slow (param ms), oom (param count), corrupt (param count), drop (param count), "
                   "leak (param bytes). Returns once the fault is armed, or once the process is gone for "
                   "crash/segfault/exit.")
    json_help = "print the supervisor's answer as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        tenant_argument(p)
        p.add_argument("kind", choices=FAULT_KINDS, metavar="KIND", help=f"one of {', '.join(FAULT_KINDS)}")
        p.add_argument("--instance", type=non_negative_int, default=None, metavar="I",
                       help="instance index (default: the first ready one)")
        p.add_argument("--param", dest="params", type=parse_param, action="append", default=[], metavar="KEY=VALUE",
                       help="fault parameter, e.g. --param ms=500, --param bytes=64MiB (repeatable; default: none, "
                       "the fault's own defaults)")

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        params = dict(args.params)
        if len(params) != len(args.params):
            raise ValueError("a --param key is given twice")
        with connect(ADMIN_TIMEOUT_S) as client:
            result = client.inject_fault(None, args.tenant, args.kind, instance=args.instance, **params)
        if args.json:
            print_json(result.to_wire())
        else:
            where = f"{result.tenant}/{result.instance}"
            extra = " ".join(f"{k}={v}" for k, v in sorted(result.to_wire().items())
                             if v is not None and k not in ("tenant", "instance", "kind", "pid", "ok", "ref"))
            print(f"fault {args.kind} -> {where} (pid {result.pid}){(' ' + extra) if extra else ''}")
        return 0
