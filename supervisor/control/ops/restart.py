"""``restart`` / ``twt restart``: new worker processes for a tenant, one instance at a time.

    twt restart acme
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

__all__ = ["Restart"]


class Restart(ServiceOp):
    name = "restart"
    args_doc = "`{tenant}`"
    result_doc = ("the tenant's status record, once every instance was replaced by a new worker, one at a time "
                  "(no restart counted)")
    error_notes = {
        "TenantFailed": "reset it first",
    }
    command = "restart"
    help = "restart a tenant's worker processes, one instance at a time"
    description = ("Replace every instance of a tenant with a new worker process, one at a time: each is "
                   "drained (its in-flight requests finish), stopped and started again before the next. Buffers "
                   "held by the old processes are freed. The capability stays valid; no restart is counted "
                   "against the budget.")
    json_help = "print the tenant's status record as JSON"

    def serve(self, part: ServiceOps, reply: Reply, args: Args) -> None:
        reply.when(part.restart(arg_str(args, "tenant")))

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
