"""The command half of ``reset`` / ``twt reset``: clear a failed tenant and start its instances again (same capability).

    twt reset acme
"""

from __future__ import annotations

import argparse

from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import SERVICE_TIMEOUT_S, tenant_argument, tenant_line
from supervisor.client.cli_args import print_json

__all__ = ["ResetCommand"]


class ResetCommand(OpCommand):
    name = "reset"
    command = "reset"
    help = "clear a failed tenant and start its instances again (same capability)"
    description = ("A tenant that exceeded its restart intensity is marked failed and stays down. reset clears "
                   "that, forgets its restart history and starts its instances; its capability stays valid. "
                   "Returns once every instance is ready.")
    json_help = "print the tenant's status record as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        tenant_argument(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        with connect(SERVICE_TIMEOUT_S) as client:
            rec = client.reset(None, args.tenant)
        if args.json:
            print_json(rec.to_wire())
        else:
            print(tenant_line(rec))
        return 0
