"""The command half of ``evict`` / ``twt evict``: stop a tenant's workers, revoke its capabilities, free its quota block.

    twt evict acme
"""

from __future__ import annotations

import argparse

from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import ADMIN_TIMEOUT_S, tenant_argument
from supervisor.client.cli_args import print_json

__all__ = ["EvictCommand"]


class EvictCommand(OpCommand):
    name = "evict"
    command = "evict"
    help = "stop a tenant's workers, revoke its capabilities, free its quota block"
    description = ("Evict a tenant: its workers are stopped (in-flight requests answered), every capability "
                   "minted for it is revoked, and its shared-memory quota block is unlinked. Returns once the "
                   "workers exited.")
    json_help = "print the supervisor's answer as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        tenant_argument(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        with connect(ADMIN_TIMEOUT_S) as client:
            result = client.evict(None, args.tenant)
        if args.json:
            print_json(result.to_wire())
        else:
            pids = ", ".join(str(p) for p in result.pids) or "none"
            print(f"evicted {result.evicted} (workers stopped: {pids})")
        return 0
