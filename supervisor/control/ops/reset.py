"""``reset`` / ``twt reset``: clear a failed tenant and start its instances again (same capability).

    twt reset acme
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shared.protocol import arg_str
from supervisor.client.cli_args import print_json
from supervisor.control.ops._base import Args, Connect, Reply, ServiceOp
from supervisor.control.ops._cli import SERVICE_TIMEOUT_S, tenant_argument, tenant_line

if TYPE_CHECKING:
    from supervisor.control.service import ServiceOps

__all__ = ["Reset"]


class Reset(ServiceOp):
    name = "reset"
    args_doc = "`{tenant}`"
    result_doc = ("the tenant's status record, once it runs: its failed state and restart history cleared, its "
                  "instances started, its capability unchanged")
    error_notes = {
        "UnknownTenant": "also: evicted meanwhile",
        "TenantFailed": "it failed again while starting",
    }
    command = "reset"
    help = "clear a failed tenant and start its instances again (same capability)"
    description = ("A tenant that exceeded its restart intensity is marked failed and stays down. reset clears "
                   "that, forgets its restart history and starts its instances; its capability stays valid. "
                   "Returns once every instance is ready.")
    json_help = "print the tenant's status record as JSON"

    def serve(self, part: ServiceOps, reply: Reply, args: Args) -> None:
        reply.when(part.reset(arg_str(args, "tenant")))

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
