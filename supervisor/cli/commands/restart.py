"""The command half of ``restart`` / ``twt restart``: new worker processes for a tenant, one instance at a time.

    twt restart acme
"""

from __future__ import annotations

import argparse

from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import SERVICE_TIMEOUT_S, tenant_argument, tenant_line
from supervisor.client.cli_args import print_json

__all__ = ["RestartCommand"]


class RestartCommand(OpCommand):
    name = "restart"
    command = "restart"
    help = "restart a tenant's worker processes, one instance at a time"
    description = ("Replace every instance of a tenant with a new worker process, one at a time: each is "
                   "drained (its in-flight requests finish), stopped and started again before the next. Buffers "
                   "held by the old processes are freed. The capability stays valid; no restart is counted "
                   "against the budget.")
    json_help = "print the tenant's status record as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        tenant_argument(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        with connect(SERVICE_TIMEOUT_S) as client:
            rec = client.restart_tenant(None, args.tenant)
        if args.json:
            print_json(rec.to_wire())
        else:
            print(tenant_line(rec))
        return 0
