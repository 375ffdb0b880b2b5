"""``evict`` / ``twt evict``: stop a tenant's workers, revoke its capabilities, free its quota block.

    twt evict acme
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shared.protocol import arg_str
from supervisor.client.cli_args import print_json
from supervisor.control.ops._base import AdminOp, Args, Connect, Reply
from supervisor.control.ops._cli import ADMIN_TIMEOUT_S, tenant_argument

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Evict"]


class Evict(AdminOp):
    name = "evict"
    args_doc = "`{tenant}`"
    result_doc = ("`{evicted, pids}`, sent once its workers have exited; capabilities are revoked and the block "
                  "unlinked at once")
    command = "evict"
    help = "stop a tenant's workers, revoke its capabilities, free its quota block"
    description = ("Evict a tenant: its workers are stopped (in-flight requests answered), every capability "
                   "minted for it is revoked, and its shared-memory quota block is unlinked. Returns once the "
                   "workers exited.")
    json_help = "print the supervisor's answer as JSON"

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.when(part.evict(arg_str(args, "tenant")))

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
